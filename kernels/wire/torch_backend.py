"""The wire family on torch: the fallback of the Triton kernels, plain torch ops.

``prepare_quantize`` fills fp32 values with the flatten family's kept
launches (the same ``v`` as ``flatten_cast_scale``, bit for bit) and encodes
them ``PIECE`` elements at a time, so the passes of the encoding (absmax,
divide, round, dequantize, residual) run over a piece that is still in
cache. ``dequantize_sum`` works in pieces too. The element rules
are in ``wire/__init__.py``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .._checks import extents as extents_of
from .._common import WIRE_LEVELS
from ..flatten import torch_backend as _flatten

# elements per piece, a multiple of every block size: 4 MiB of fp32. On the
# 2-core VM, int8 of ResNet-50's gradients took 52 ms in pieces of 2^16, 35 ms
# of 2^18, 30 ms of 2^20 and 31 ms of 2^22 (110 ms with a residual): the
# per-op overhead of small pieces against the cache misses of large ones
PIECE = 1 << 20
_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def prepare_quantize(tensors: Sequence[torch.Tensor], starts: Sequence[int],
                     extents: Sequence[int], codes: torch.Tensor, block: int) -> Callable:
    """The launch ``(tensors, codes, block_scales, residual, scale, check_finite)
    -> flag or None`` that writes ``codes`` (and the block scales, and the
    residual) for tensors of the prepared layout: segment ``i`` at
    ``starts[i]``, ``extents[i]`` elements long; the 0-d bool flag, true if any
    ``v`` is inf or NaN, with ``check_finite``.

    A buffer of several pieces of contiguous tensors is filled a piece at a
    time into a kept fp32 piece (each piece's flatten prepared once, over the
    tensors, or the slices of them, it holds), and each piece is encoded while
    it is still in cache: the fp32 values never go to memory (ResNet-50's
    fp16 gradients into int8: 13 ms against 18 ms filling a whole fp32 copy
    first, the plain flatten 6.5 ms). fp32 codes are the values themselves,
    and a strided tensor cannot be sliced in memory order: those fill the
    whole buffer first."""
    numel = codes.numel()
    row = codes.shape[-1] if codes.dim() == 2 else numel
    whole = codes.dtype == torch.float32 or numel <= PIECE \
        or not all(t.is_contiguous() for t in tensors)
    with torch.no_grad():
        values = codes.detach() if codes.dtype == torch.float32 and codes.dim() == 1 else \
            torch.empty(numel if whole else PIECE, dtype=torch.float32, device=codes.device)
    # pieces never cross a chunk's bound: each one's codes and scales are contiguous
    bounds = [(lo, min(lo + PIECE, chunk + row)) for chunk in range(0, numel, max(row, 1))
              for lo in range(chunk, chunk + row, PIECE)]
    pieces = []  # (lo, hi, fill, picks): a piece's flatten and its (tensor, slice) picks
    if whole:
        fill = _flatten.prepare_flatten(tensors, starts, extents, values)
        pieces = [(lo, hi, None, None) for lo, hi in bounds]
    for lo, hi in bounds if not whole else ():
        picks, local = [], []
        for i, (t, start) in enumerate(zip(tensors, starts)):
            first, end = max(start, lo) - start, min(start + t.numel(), hi) - start
            if first < end:
                picks.append((i, None, None) if (first, end) == (0, t.numel())
                             else (i, first, end))
                local.append(start + first - lo)
        members = [tensors[i] if a is None else tensors[i].view(-1)[a:b] for i, a, b in picks]
        fill = _flatten.prepare_flatten(members, local, extents_of(local, hi - lo),
                                        values[:hi - lo])
        pieces.append((lo, hi, fill, picks))

    def launch(tensors, codes, block_scales, residual, scale, check_finite):
        with torch.no_grad():
            if whole:
                fill(tensors, values, scale, False)
            found = []
            for lo, hi, piece_fill, picks in pieces:
                if piece_fill is None:
                    v = values[lo:hi]
                else:
                    v = values[:hi - lo]
                    piece_fill([tensors[i] if a is None else tensors[i].view(-1)[a:b]
                                for i, a, b in picks], v, scale, False)
                if residual is not None:
                    v.add_(residual[lo:hi])
                found.append(_encode(v, _piece(codes, lo, hi, row),
                                     None if block_scales is None else
                                     _piece(block_scales, lo // block, hi // block, row // block),
                                     None if residual is None else residual[lo:hi],
                                     block, check_finite))
            if not check_finite:
                return None
            if not found:
                return torch.zeros((), dtype=torch.bool, device=codes.device)
            return torch.stack(found).any()
    # the flatten's launches read the tensors at each call: nothing to re-point
    launch.rebind, launch.binding, launch.bind = fill.rebind, fill.binding, fill.bind
    return launch


def _piece(t: torch.Tensor, lo: int, hi: int, row: int) -> torch.Tensor:
    """Flat elements ``[lo, hi)`` of ``t`` (1-D, or chunks of ``row``
    elements: then within one chunk)."""
    if t.dim() == 1:
        return t[lo:hi]
    chunk, at = divmod(lo, row)
    return t[chunk, at:at + hi - lo]


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
        # inf * 0 and NaN * 0 are NaN, finite * 0 is 0: one product and one
        # sum, several times faster than isfinite().all() on the CPU
        return (v * 0.0).sum().isnan() if check_finite else None
    rows = v.view(-1, block)
    # torch's amax propagates NaN, and inf stays inf: the absmax is finite
    # exactly for the blocks without an inf or NaN
    absmax = rows.abs().amax(1)
    finite = torch.isfinite(absmax)
    # a Python number as divisor makes CUDA's division a product with its
    # rounded reciprocal, off the exact quotient by an ulp; a device tensor
    # divides exactly, as the CPU and the Triton kernel do
    divisor = level if v.device.type == "cpu" else absmax.new_full((), level)
    s = torch.where(finite, absmax / divisor, float("nan"))
    # an all-zero block (s = 0) divides by 1: codes 0, not 0/0
    q = rows / torch.where(s > 0, s, 1.0).unsqueeze(1)
    if codes.dtype == torch.int8:
        q.round_()  # to nearest even
    # |v / s| <= level (1 + 2^-23) for a normal s, which rounds to level: the
    # clamp only acts where s is an fp32 subnormal, and non-finite blocks need
    # their codes zeroed. A host read on the CPU (cheap) skips both passes
    # when neither happens; elsewhere they always run.
    cpu = v.device.type == "cpu"
    all_finite = cpu and bool(finite.all())
    if not cpu or bool(((s > 0) & (s < _SMALLEST_NORMAL)).any()):
        q.clamp_(-level, level)
    if not all_finite:
        q.masked_fill_(~finite.unsqueeze(1), 0.0)
    code_rows = codes.view(-1, block)
    code_rows.copy_(q)
    scales.copy_(s)
    if residual is not None:
        torch.sub(rows, code_rows.float() * s.unsqueeze(1), out=residual.view(-1, block))
        if not all_finite:
            residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite block leaves no error behind
    return ~finite.all() if check_finite else None


def dequantize_sum(codes: torch.Tensor, block_scales: Optional[torch.Tensor],
                   out: torch.Tensor, block: int) -> None:
    """``out`` = the sum of the ``R`` rows of ``codes`` dequantized, in the
    fixed bottom-up pairwise order, in ``out``'s dtype (fp32 or fp64); each
    chunk apart for ``(R, C, n)`` codes."""
    if codes.dim() == 3:
        n = codes.shape[2]
        for c in range(codes.shape[1]):
            dequantize_sum(codes[:, c], None if block_scales is None else block_scales[:, c],
                           out[c * n:(c + 1) * n], block)
        return
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
