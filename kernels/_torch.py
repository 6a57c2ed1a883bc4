"""The torch fallback of the flatten kernels: same semantics, plain torch ops.

Used on CPU and wherever Triton is not wanted. Each segment is written in as
few passes as its dtype pair allows; the element math follows the kernels'
rule (fp32, or fp64 when either side is fp64):

- ``scale == 1``: one ``copy_`` (the cast is the only rounding);
- same dtype: one ``torch.mul(..., out=)`` (torch computes 16-bit math in fp32);
- widening (the destination holds every source value exactly and is the
  compute dtype): ``copy_`` then an in-place ``mul_`` on chunks small enough to
  still be in cache;
- anything else (narrowing, fp16<->bf16): the product in the compute dtype in a
  cache-sized scratch chunk, then one cast into the destination.
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


def flatten(tensors, offsets, extents, out, scale, check_finite):
    """Fill ``out`` (validated by the caller); return the non-finite flag or None."""
    with torch.no_grad():
        written = 0
        for t, off, ext in zip(tensors, offsets, extents):
            if off > written:
                out[written:off].zero_()
            n = t.numel()
            _apply(_write_scaled, out[off:off + n], t, scale)
            if ext > n:
                out[off + n:off + ext].zero_()
            written = max(written, off + max(n, ext))
        if written < out.numel():
            out[written:].zero_()
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
    op = _add_scaled if accumulate else _write_scaled
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            _apply(op, t, flat[off:off + t.numel()], scale)


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
