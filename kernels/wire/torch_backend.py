"""The wire family on torch: the fallback of the Triton kernels, plain torch ops.

``prepare_quantize`` fills an fp32 buffer with the flatten family's kept
launch (the same ``v`` as ``flatten_cast_scale``, bit for bit), then encodes
it piece by piece: ``PIECE`` elements at a time, so the passes of the
encoding (absmax, divide, round, dequantize, residual) run over a piece that
is still in cache. ``dequantize_sum`` works in pieces too. The element rules
are in ``wire/__init__.py``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .._common import WIRE_LEVELS
from ..flatten import torch_backend as _flatten

# elements per piece: 256 KiB of fp32, a multiple of every block size
PIECE = 1 << 16


def prepare_quantize(tensors: Sequence[torch.Tensor], starts: Sequence[int],
                     extents: Sequence[int], codes: torch.Tensor, block: int) -> Callable:
    """The launch ``(tensors, codes, block_scales, residual, scale, check_finite)
    -> flag or None`` that writes ``codes`` (and the block scales, and the
    residual) for tensors of the prepared layout: segment ``i`` at
    ``starts[i]``, ``extents[i]`` elements long; the 0-d bool flag, true if any
    ``v`` is inf or NaN, with ``check_finite``."""
    with torch.no_grad():
        # fp32 codes are the values themselves; other codes need an fp32 copy,
        # kept with the launch (a fresh one every call costs page faults)
        values = codes.detach() if codes.dtype == torch.float32 else \
            torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    fill = _flatten.prepare_flatten(tensors, starts, extents, values)

    def launch(tensors, codes, block_scales, residual, scale, check_finite):
        with torch.no_grad():
            fill(tensors, values, scale, False)
            if residual is not None:
                values.add_(residual)
            found = []
            for lo in range(0, values.numel(), PIECE):
                hi = min(lo + PIECE, values.numel())
                piece_scales = None if block_scales is None else \
                    block_scales[lo // block:hi // block]
                piece_residual = None if residual is None else residual[lo:hi]
                found.append(_encode(values[lo:hi], codes[lo:hi], piece_scales, piece_residual,
                                     block, check_finite))
            if not check_finite:
                return None
            if not found:
                return torch.zeros((), dtype=torch.bool, device=codes.device)
            return torch.stack(found).any()
    launch.rebind, launch.binding, launch.bind = fill.rebind, fill.binding, fill.bind
    return launch


def _encode(v: torch.Tensor, codes: torch.Tensor, scales: Optional[torch.Tensor],
            residual: Optional[torch.Tensor], block: int, check_finite: bool):
    """Encode one piece ``v`` (fp32) into ``codes`` (and ``scales``), leave
    ``v - dequantized`` in ``residual``; whether ``v`` holds an inf or NaN
    (0-d bool) with ``check_finite``, else None."""
    level = WIRE_LEVELS.get(codes.dtype)
    if level is None:
        if codes.data_ptr() != v.data_ptr():
            codes.copy_(v)  # bf16: rounded to nearest even
        if residual is not None:
            if codes.dtype == torch.float32:
                residual.zero_()  # v itself travels: nothing is lost
            else:
                torch.sub(v, codes.float(), out=residual)
                residual.nan_to_num_(0.0, 0.0, 0.0)
        return ~torch.isfinite(v).all() if check_finite else None
    rows = v.view(-1, block)
    # torch's amax propagates NaN, and inf stays inf: the absmax is finite
    # exactly for the blocks without an inf or NaN
    absmax = rows.abs().amax(1)
    finite = torch.isfinite(absmax)
    s = torch.where(finite, absmax / level, float("nan"))
    # an all-zero block (s = 0) divides by 1: codes 0, not 0/0
    q = rows / torch.where(s > 0, s, 1.0).unsqueeze(1)
    if codes.dtype == torch.int8:
        q.round_()  # to nearest even
    q.clamp_(-level, level).masked_fill_(~finite.unsqueeze(1), 0.0)
    code_rows = codes.view(-1, block)
    code_rows.copy_(q)
    scales.copy_(s)
    if residual is not None:
        torch.sub(rows, code_rows.float() * s.unsqueeze(1), out=residual.view(-1, block))
        residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite block leaves no error behind
    return ~finite.all() if check_finite else None


def dequantize_sum(codes: torch.Tensor, block_scales: Optional[torch.Tensor],
                   out: torch.Tensor, block: int) -> None:
    """``out`` = the sum of the ``R`` rows of ``codes`` dequantized, in the
    fixed bottom-up pairwise order, in ``out``'s dtype (fp32 or fp64)."""
    ranks, n = codes.shape
    with torch.no_grad():
        for lo in range(0, n, PIECE):
            hi = min(lo + PIECE, n)
            rows = [_dequantize(codes[r, lo:hi],
                                None if block_scales is None
                                else block_scales[r, lo // block:hi // block],
                                out.dtype, block) for r in range(ranks)]
            while len(rows) > 1:
                rows = [rows[i] + rows[i + 1] if i + 1 < len(rows) else rows[i]
                        for i in range(0, len(rows), 2)]
            out[lo:hi].copy_(rows[0])


def _dequantize(codes: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype,
                block: int) -> torch.Tensor:
    """One row's values in ``dtype``: the codes, times their block's scale."""
    values = codes.to(dtype)
    if scales is None:
        return values
    return (values.view(-1, block) * scales.to(dtype).unsqueeze(1)).view(-1)
