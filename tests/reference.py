"""Slow, obviously-correct float64 references for the flatten kernels.

They follow the documented semantics step by step and share no code with
``fusedreduce``: every value is worked out in float64 and each rounding the
semantics name is done explicitly, once:

- the compute dtype is fp64 when the source or the destination is fp64, else
  fp32; in fp32 the scale is first rounded to fp32 ("x and scale in fp32");
- ``x * scale`` is rounded to the compute dtype. In float64 the product of two
  fp32-representable numbers is exact (24 + 24 significant bits < 53), so
  rounding it to fp32 gives exactly the fp32 product;
- the result is rounded to the destination dtype, 16-bit ones via fp32.

Nothing here mutates its arguments; results are new tensors.
"""
from __future__ import annotations

import math

import torch

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute ``x * scale`` in for a copy between ``a`` and ``b``."""
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``values`` rounded to ``dtype``, returned as float64; 16-bit via fp32."""
    if dtype in SIXTEEN_BIT:
        values = values.to(torch.float32)
    return values.to(dtype).to(torch.float64)


def scaled(values: torch.Tensor, scale: float, src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """``values * scale`` rounded to the compute dtype of a ``src`` -> ``dst`` copy, as float64."""
    compute = compute_dtype(src, dst)
    scale_in_compute = round_to(torch.tensor(scale, dtype=torch.float64), compute).item()
    return round_to(values.to(torch.float64) * scale_in_compute, compute)


def packed_starts(tensors) -> list:
    """Dense packing: each tensor starts where the previous one ends."""
    starts, position = [], 0
    for t in tensors:
        starts.append(position)
        position += t.numel()
    return starts


def reference_flatten(tensors, dtype, scale, offsets=None, size=None) -> torch.Tensor:
    """The buffer ``flatten_cast_scale`` must produce: ``size`` elements of ``dtype``
    (default: the end of the last segment), segments as documented, everything
    else +0.0."""
    starts = packed_starts(tensors) if offsets is None else list(offsets)
    end = max([s + t.numel() for s, t in zip(starts, tensors)], default=0)
    size = end if size is None else size
    flat = torch.zeros(size, dtype=torch.float64)
    for t, start in zip(tensors, starts):
        row_major = t.reshape(-1)
        flat[start:start + t.numel()] = round_to(scaled(row_major, scale, t.dtype, dtype), dtype)
    return flat.to(dtype)


def reference_unflatten(flat, tensors, scale, accumulate, offsets=None) -> list:
    """New tensors holding what ``unflatten_cast_scale`` must leave in ``tensors``.

    With ``accumulate`` the product is rounded to the compute dtype and then
    added to the destination in that dtype (an unfused multiply-add; the
    tests allow for contraction into an FMA where they use this).
    """
    starts = packed_starts(tensors) if offsets is None else list(offsets)
    results = []
    for t, start in zip(tensors, starts):
        segment = flat[start:start + t.numel()].reshape(t.shape)
        compute = compute_dtype(flat.dtype, t.dtype)
        value = scaled(segment, scale, flat.dtype, t.dtype)
        if accumulate:
            # in fp32, rounding the float64 sum of two fp32 numbers to fp32 is
            # the same as rounding the exact sum (53 >= 2 * 24 + 2 bits)
            value = round_to(value + t.to(torch.float64), compute)
        results.append(round_to(value, t.dtype).to(t.dtype))
    return results


def reference_nonfinite(tensors) -> bool:
    """Whether any element of any tensor is inf or NaN."""
    return any(not math.isfinite(v)
               for t in tensors for v in t.to(torch.float64).reshape(-1).tolist())
