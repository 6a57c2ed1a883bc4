"""The torch fallback of the kernels: same semantics, plain torch ops.

Used on CPU and wherever Triton is not wanted. The element math follows the
kernels' rule (fp32, or fp64 when either side is fp64; 16-bit results rounded
from fp32). Python overhead per tensor matters as much as bandwidth here (a
ResNet-50 has 161 gradients), so the work is done by a few ``torch._foreach_*``
calls over all segments at once wherever the dtypes allow:

- *exact* pairs (the destination holds every source value: the same dtype, or
  widening): one ``_foreach_copy_``, then, if ``scale != 1``, one in-place
  ``_foreach_mul_`` in the destination dtype, when that is the compute dtype
  (fp32/fp64: foreach ops round the scalar to the tensors' dtype);
- other pairs (16-bit destinations with a scale, narrowing, fp16<->bf16): per
  segment, the product in the compute dtype on a cache-sized piece, then one
  rounding into the destination.
"""
from __future__ import annotations

import torch

# elements per piece: 256 KiB of fp32, so the second pass over a piece hits L2
CHUNK = 1 << 16

_WIDENS_TO = {
    torch.float16: {torch.float32, torch.float64},
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
    torch.float64: set(),
}


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def _round_into(dst: torch.Tensor, value: torch.Tensor) -> None:
    """``dst.copy_(value)`` with the kernels' rounding: fp64 reaches 16 bits via fp32."""
    if dst.element_size() == 2 and value.dtype == torch.float64:
        value = value.to(torch.float32)
    dst.copy_(value)


def _write_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(src * scale)``; both the same shape, either may be strided."""
    if scale == 1.0:
        _round_into(dst, src)
    elif dst.dtype == src.dtype:
        torch.mul(src, scale, out=dst)
    elif dst.dtype in _WIDENS_TO[src.dtype]:
        dst.copy_(src)
        dst.mul_(scale)
    else:
        _round_into(dst, torch.mul(src.to(compute_dtype(src.dtype, dst.dtype)), scale))


def _add_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(dst + src * scale)`` computed in the compute dtype."""
    compute = compute_dtype(src.dtype, dst.dtype)
    if dst.dtype == src.dtype == compute:
        dst.add_(src, alpha=scale)
    else:
        acc = torch.mul(src.to(compute), scale)
        acc += dst
        _round_into(dst, acc)


def _apply(op, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``op(dst, src, scale)`` for same-numel tensors, one flat, cache-sized piece at
    a time when both are contiguous (whole and in their own shapes otherwise)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst, src = dst.view(-1), src.reshape(-1)
        for start in range(0, dst.numel(), CHUNK):
            op(dst[start:start + CHUNK], src[start:start + CHUNK], scale)
    else:
        op(dst.view(src.shape) if dst.dim() == 1 else dst,
           src.view(dst.shape) if src.dim() == 1 else src, scale)


def _exact(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    return dst_dtype == src_dtype or dst_dtype in _WIDENS_TO[src_dtype]


def _pair(segment: torch.Tensor, t: torch.Tensor):
    """``(segment, t)`` as two tensors of one shape (flat when ``t`` is contiguous)."""
    return (segment, t.view(-1)) if t.is_contiguous() else (segment.view(t.shape), t)


def _segments(flat: torch.Tensor, offsets, numels, extents=None):
    """Views of ``flat``: each segment, and (with ``extents``) every element that no
    segment covers, from one ``split_with_sizes`` call."""
    sizes, kinds, position = [], [], 0
    for off, n, ext in zip(offsets, numels, extents or numels):
        if off > position:
            sizes.append(off - position)
            kinds.append(False)
        sizes.append(n)
        kinds.append(True)
        if ext > n:
            sizes.append(ext - n)
            kinds.append(False)
        position = off + max(n, ext)
    if flat.numel() > position:
        sizes.append(flat.numel() - position)
        kinds.append(False)
    views = flat.split_with_sizes(sizes) if sizes else []
    return ([v for v, k in zip(views, kinds) if k], [v for v, k in zip(views, kinds) if not k])


def _scaled_copies(dsts, srcs, scale: float, accumulate: bool = False) -> None:
    """``dst = cast(src * scale)`` (or ``dst = cast(dst + src * scale)``) per pair."""
    # foreach ops round the scalar to the tensors' dtype: only fp32/fp64
    # destinations (the compute dtype itself) may take the scaled foreach path
    exact = [i for i, (d, s) in enumerate(zip(dsts, srcs))
             if _exact(d.dtype, s.dtype) and d.numel()
             and (scale == 1.0 or d.dtype in (torch.float32, torch.float64))]
    if exact:
        d_exact, s_exact = [dsts[i] for i in exact], [srcs[i] for i in exact]
        if not accumulate:
            torch._foreach_copy_(d_exact, s_exact)
            if scale != 1.0:
                torch._foreach_mul_(d_exact, scale)
        elif all(d.dtype == s.dtype == compute_dtype(d.dtype, s.dtype)
                 for d, s in zip(d_exact, s_exact)):
            torch._foreach_add_(d_exact, s_exact, alpha=scale)
        else:
            exact = []
    done = set(exact)
    op = _add_scaled if accumulate else _write_scaled
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if i not in done and d.numel():
            _apply(op, d, s, scale)


def flatten(tensors, offsets, extents, out, scale, check_finite):
    """Fill ``out`` (validated by the caller); return the non-finite flag or None."""
    with torch.no_grad():
        segments, gaps = _segments(out, offsets, [t.numel() for t in tensors], extents)
        pairs = [_pair(seg, t) for seg, t in zip(segments, tensors)]
        _scaled_copies([d for d, _ in pairs], [s for _, s in pairs], scale)
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


def unflatten(flat, tensors, offsets, scale, accumulate):
    """Write (or add) each segment of ``flat`` into its tensor, in place."""
    with torch.no_grad():
        segments, _ = _segments(flat, offsets, [t.numel() for t in tensors])
        pairs = [_pair(seg, t) for seg, t in zip(segments, tensors)]
        _scaled_copies([t for _, t in pairs], [seg for seg, _ in pairs], scale, accumulate)


# ------------------------------------------------------------------ AdaSum

ADASUM_BLOCK = 1 << 16


def adasum_stats(a, b, boundaries, out):
    """Each segment's ``(a·b, ‖a‖², ‖b‖²)`` into ``out`` (float64 [n, 3]).

    In fp64, block by block in a fixed order (AdaSum's norms of fp32 data can
    leave fp32's range; fp64 products cannot).
    """
    rows = []
    with torch.no_grad():
        for lo, hi in zip(boundaries[:-1], boundaries[1:]):
            dot = a2 = b2 = torch.zeros((), dtype=torch.float64, device=a.device)
            for start in range(lo, hi, ADASUM_BLOCK):
                end = min(hi, start + ADASUM_BLOCK)
                x = a[start:end].to(torch.float64)
                y = b[start:end].to(torch.float64)
                dot, a2, b2 = dot + torch.dot(x, y), a2 + torch.dot(x, x), b2 + torch.dot(y, y)
            rows.append(torch.stack([dot, a2, b2]))
        if rows:
            out.copy_(torch.stack(rows))


def adasum_coefficients(segment_stats, floor):
    """``(ca, cb)``, float64 [n] each: 1 where the squared norm is below ``floor``."""
    dot, a2, b2 = segment_stats.unbind(1)

    def coefficient(norm2):
        small = norm2 < floor
        return torch.where(small, 1.0, 1.0 - dot / (2.0 * torch.where(small, 1.0, norm2)))

    return coefficient(a2), coefficient(b2)


def adasum_combine(a, b, boundaries, segment_stats, out, floor):
    """``out = ca·a + cb·b`` per segment, in fp32 (fp64 for fp64 buffers)."""
    ca, cb = adasum_coefficients(segment_stats, floor)
    compute = compute_dtype(a.dtype, a.dtype)
    with torch.no_grad():
        for i, (lo, hi) in enumerate(zip(boundaries[:-1], boundaries[1:])):
            if hi == lo:
                continue
            # new tensors throughout: ``out`` may be ``a`` or ``b``
            mixed = a[lo:hi].to(compute) * ca[i].to(compute)
            mixed += b[lo:hi].to(compute) * cb[i].to(compute)
            _round_into(out[lo:hi], mixed)
