"""The flatten family on torch: the fallback of the Triton kernels, plain torch ops.

Used on the CPU and wherever Triton is not wanted; ``flatten`` and
``unflatten`` take the same arguments as the Triton backend's
(``kernels/_backends.py``). The element math follows the
kernels' rule (fp32, or fp64 when either side is fp64; 16-bit results rounded
from fp32). Python overhead per tensor matters as much as bandwidth here (a
ResNet-50 has 161 gradients), so the work is done by a few ``torch._foreach_*``
calls over all segments at once wherever the dtypes allow (the routes are
listed in ``_scaled_copies``): a copy that rounds as the kernels do is one
``_foreach_copy_`` for every such pair; a scale on an fp32/fp64 destination
adds one ``_foreach_mul_`` (or one ``mul_`` over the whole flat buffer); a
scaled 16-bit destination takes one ``torch.mul(src, scale, out=dst)`` per
pair; only fp64 into 16 bits and fp16<->bf16 with a scale go piece by piece.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

from .._common import SIXTEEN_BIT_DTYPES, compute_dtype, round_into

# elements per piece: 256 KiB of fp32, so the second pass over a piece hits L2
CACHE_PIECE = 1 << 16

_WIDENS_TO = {
    torch.float16: {torch.float32, torch.float64},
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
    torch.float64: set(),
}


def _write_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(src * scale)``; both the same shape, either may be strided."""
    # only the pairs ``_route`` leaves to it come here: an fp64 source into a
    # 16-bit destination, or fp16<->bf16 with a scale
    if scale == 1.0:
        round_into(dst, src)
    else:
        round_into(dst, torch.mul(src.to(compute_dtype(src.dtype, dst.dtype)), scale))


def _add_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(dst + src * scale)`` computed in the compute dtype."""
    compute = compute_dtype(src.dtype, dst.dtype)
    if dst.dtype == src.dtype == compute:
        dst.add_(src, alpha=scale)
    else:
        acc = torch.mul(src.to(compute), scale)
        acc += dst
        round_into(dst, acc)


def _apply(op, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``op(dst, src, scale)`` for same-numel tensors, one flat, cache-sized piece at
    a time when both are contiguous (whole and in their own shapes otherwise)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst, src = dst.view(-1), src.reshape(-1)
        for start in range(0, dst.numel(), CACHE_PIECE):
            op(dst[start:start + CACHE_PIECE], src[start:start + CACHE_PIECE], scale)
    else:
        op(dst.view(src.shape) if dst.dim() == 1 else dst,
           src.view(dst.shape) if src.dim() == 1 else src, scale)


def _exact(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    return dst_dtype == src_dtype or dst_dtype in _WIDENS_TO[src_dtype]


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _segment_views(flat: torch.Tensor, starts, tensors):
    """Each tensor's segment of ``flat`` as a view in the tensor's own shape.

    One view op per tensor (creating a view costs microseconds on the CPU and a
    model has hundreds of gradients): the pairs ``(view, tensor)`` then go to
    ``copy_``/``mul`` as they are, whatever the tensor's strides.
    """
    base = flat.storage_offset()
    views = []
    for off, t in zip(starts, tensors):
        shape = t.shape
        if len(shape) == 1:
            views.append(flat.narrow(0, off, shape[0]))
        else:
            views.append(flat.as_strided(shape, _contiguous_strides(tuple(shape)), base + off))
    return views


def _gap_views(flat: torch.Tensor, starts, numels, extents):
    """Views of every element of ``flat`` that no segment covers."""
    gaps, position = [], 0
    for off, n, ext in zip(starts, numels, extents):
        if off > position:
            gaps.append(flat.narrow(0, position, off - position))
        if ext > n:
            gaps.append(flat.narrow(0, off + n, ext - n))
        position = off + max(n, ext)
    if flat.numel() > position:
        gaps.append(flat.narrow(0, position, flat.numel() - position))
    return gaps


def _one_rounding_mul(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    """Whether ``torch.mul(src, scale, out=dst)`` is ``cast(src * scale)`` computed in
    fp32 with one rounding into a 16-bit ``dst``: true when ``src`` is fp32 (the
    product is fp32, rounded once on the way out) or ``dst``'s own dtype (ATen
    computes 16-bit products in fp32 with an fp32 scalar, rounding once)."""
    return dst_dtype in SIXTEEN_BIT_DTYPES and src_dtype in (torch.float32, dst_dtype)


def _route(dst: torch.dtype, src: torch.dtype, scale: float) -> int:
    """Which of ``_scaled_copies``' four routes a pair of dtypes takes."""
    if scale == 1.0 and (_exact(dst, src) or (dst in SIXTEEN_BIT_DTYPES and src != torch.float64)):
        return 0  # one foreach copy
    if _exact(dst, src) and dst in (torch.float32, torch.float64):
        return 1  # foreach copy, then scale the destination
    if _one_rounding_mul(dst, src):
        return 2  # one torch.mul(out=) per pair
    return 3  # piece by piece


def _scaled_copies(dsts, srcs, scale: float, accumulate: bool = False,
                   whole: Optional[torch.Tensor] = None) -> None:
    """``dst = cast(src * scale)`` (or ``dst = cast(dst + src * scale)``) per pair.

    The cheapest exact route per pair (measured on a 2-core CPU against one
    big ``copy_``; see the README's kernel figures):

    - scale 1 and no fp64 source into a 16-bit destination: everything
      ``copy_`` rounds exactly as the kernels do (one rounding from a value
      fp32 holds exactly) goes through one ``_foreach_copy_``;
    - exact pairs with an fp32/fp64 destination and a scale: ``_foreach_copy_``
      then ``_foreach_mul_`` (foreach ops round the scalar to the tensors'
      dtype, so only the compute dtype itself may take this path);
    - a 16-bit destination from fp32 or its own dtype with a scale: one
      ``torch.mul(src, scale, out=dst)`` per pair, one rounding;
    - anything else (fp64 into 16 bits, fp16<->bf16 with a scale): per
      segment, the product in the compute dtype on a cache-sized piece.

    ``whole``: a flat buffer holding every ``dst`` whose other elements the
    caller overwrites afterwards; when all pairs take the second route it is
    scaled in one pass.
    """
    if accumulate:
        same = [d.dtype == s.dtype == compute_dtype(d.dtype, s.dtype) for d, s in zip(dsts, srcs)]
        if any(same):
            torch._foreach_add_([d for d, x in zip(dsts, same) if x],
                                [s for s, x in zip(srcs, same) if x], alpha=scale)
        for d, s, x in zip(dsts, srcs, same):
            if not x and d.numel():
                _apply(_add_scaled, d, s, scale)
        return
    groups = copies, scaled, products, rest = [], [], [], []
    route_of = {}  # (dst dtype, src dtype) -> its group: decided once per pair of dtypes
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        key = (d.dtype, s.dtype)
        group = route_of.get(key)
        if group is None:
            group = route_of[key] = groups[_route(d.dtype, s.dtype, scale)]
        group.append(i)
    for group in (copies, scaled):
        if group:
            torch._foreach_copy_([dsts[i] for i in group], [srcs[i] for i in group])
    if scaled and whole is not None and len(scaled) == len(dsts):
        whole.mul_(scale)  # one pass over the buffer beats one per segment
    elif scaled:
        torch._foreach_mul_([dsts[i] for i in scaled], scale)
    for i in products:
        torch.mul(srcs[i], scale, out=dsts[i])
    for i in rest:
        if dsts[i].numel():
            _apply(_write_scaled, dsts[i], srcs[i], scale)


def flatten(tensors: Sequence[torch.Tensor], starts: Sequence[int], extents: Sequence[int],
            out: torch.Tensor, scale: float, check_finite: bool) -> Optional[torch.Tensor]:
    """Fill ``out``: segment ``i`` at ``starts[i]``, ``extents[i]`` elements long
    (the part past the tensor zeroed), every other element zeroed; the 0-d bool
    non-finite flag, or None without ``check_finite``."""
    with torch.no_grad():
        segments = _segment_views(out, starts, tensors)
        gaps = _gap_views(out, starts, [t.numel() for t in tensors], extents)
        # the gaps are zeroed after: the whole buffer may be scaled at once
        _scaled_copies(segments, tensors, scale, whole=out)
        if gaps:
            torch._foreach_zero_(gaps)
        if not check_finite:
            return None
        return _found_nonfinite(tensors, out)


def _found_nonfinite(tensors, out) -> torch.Tensor:
    """True if any *input* element is inf or NaN, as a 0-d bool tensor.

    A non-finite input always gives a non-finite output (inf*0 is NaN), so on
    the CPU one pass over ``out`` rules out the common all-finite case; only
    when it finds something (maybe an overflow of ``x * scale``) are the inputs
    checked. On an accelerator the inputs are checked without a host sync.
    """
    device = out.device
    if device.type == "cpu" and bool(torch.isfinite(out).all()):
        return torch.zeros((), dtype=torch.bool)
    flags = [~torch.isfinite(t).all() for t in tensors if t.numel() > 0]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor], starts: Sequence[int],
              scale: float, accumulate: bool) -> None:
    """Write (or add) each segment of ``flat`` into its tensor, in place."""
    with torch.no_grad():
        _scaled_copies(tensors, _segment_views(flat, starts, tensors), scale, accumulate)
