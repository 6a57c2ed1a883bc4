"""Slow, obviously-correct float64 references: every test's expected values come from here.

They follow the documented semantics step by step and share no code with
``fusedreduce``. Two families:

Flatten (``reference_flatten``, ``reference_unflatten``): every value is
worked out in float64 and each rounding the semantics name is done
explicitly, once:

- the compute dtype is fp64 when the source or the destination is fp64, else
  fp32; in fp32 the scale is first rounded to fp32 ("x and scale in fp32");
- ``x * scale`` is rounded to the compute dtype. In float64 the product of two
  fp32-representable numbers is exact (24 + 24 significant bits < 53), so
  rounding it to fp32 gives exactly the fp32 product;
- the result is rounded to the destination dtype, 16-bit ones via fp32.

AdaSum (``adasum_stats``, ``adasum_pair``, ``adasum_tree``,
``adasum_of_blocks``): statistics as exactly rounded sums of float64 products
(``math.fsum``), coefficients and combines in float64, along the documented
tree of ranks.

Nothing here mutates its arguments; results are new tensors.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, List, Sequence, Tuple, TypeVar

import torch

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def communication_dtype(grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """The documented communication dtype: a 16-bit ``reduce_dtype`` compresses
    every gradient; otherwise fp64 gradients stay fp64 and the rest travel in
    ``reduce_dtype``."""
    if reduce_dtype in SIXTEEN_BIT:
        return reduce_dtype
    return torch.float64 if grad_dtype == torch.float64 else reduce_dtype


def subnormal_spacing(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s subnormals: the absolute error of rounding near 0."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


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


# ------------------------------------------------------------------ AdaSum

#: below this squared norm an AdaSum coefficient is 1: sqrt(float64 tiny),
#: written out here rather than read from the library
NORM_FLOOR = math.sqrt(sys.float_info.min)


def adasum_coefficient(dot: float, norm2: float) -> float:
    """``1 - dot / (2 norm2)``, or 1 where ``norm2`` is below the floor."""
    return 1.0 if norm2 < NORM_FLOOR else 1.0 - dot / (2.0 * norm2)


def adasum_stats(a: torch.Tensor, b: torch.Tensor, boundaries: Sequence[int]) -> torch.Tensor:
    """Per segment ``(a·b, ‖a‖², ‖b‖²)``, each an exactly rounded sum of float64
    products, as a float64 ``[n, 3]`` tensor."""
    x, y = a.double().reshape(-1).tolist(), b.double().reshape(-1).tolist()
    rows = []
    for lo, hi in zip(boundaries[:-1], boundaries[1:]):
        xs, ys = x[lo:hi], y[lo:hi]
        rows.append([math.fsum(p * q for p, q in zip(xs, ys)), math.fsum(p * p for p in xs),
                     math.fsum(q * q for q in ys)])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """AdaSum of two tensors as one segment, in float64: ``ca·a + cb·b``."""
    dot, norm_a, norm_b = adasum_stats(a, b, [0, a.numel()])[0].tolist()
    return adasum_coefficient(dot, norm_a) * a.double() \
        + adasum_coefficient(dot, norm_b) * b.double()


Leaf = TypeVar("Leaf")


def adasum_tree_order(n: int) -> List[Tuple[int, int]]:
    """The pairs ``(left, right)`` of ranks 0..n-1 that the documented tree
    combines, in order; each result replaces ``left``.

    With P the largest power of two <= n, rank r >= P is first combined into
    r - P (r - P on the left); then at distance d = 1, 2, 4, ... < P, rank r
    (a multiple of 2d) takes ``AdaSum(v[r], v[r + d])``. The result is rank 0's.
    """
    top = 1 << (n.bit_length() - 1)
    order = [(r - top, r) for r in range(top, n)]
    distance = 1
    while distance < top:
        order += [(r, r + distance) for r in range(0, top, 2 * distance)]
        distance *= 2
    return order


def adasum_tree(leaves: Sequence[Leaf],
                pair: Callable[[Leaf, Leaf], Leaf] = adasum_pair) -> Leaf:
    """The documented tree (``adasum_tree_order``) over one leaf per rank;
    ``pair`` combines two leaves (default: float64 ``adasum_pair``)."""
    v = list(leaves)
    for left, right in adasum_tree_order(len(v)):
        v[left] = pair(v[left], v[right])
    return v[0]


def adasum_of_blocks(per_rank: Sequence[torch.Tensor], local_size: int) -> torch.Tensor:
    """AdaSum over the means of blocks of ``local_size`` consecutive ranks, in float64."""
    vectors = [t.double() for t in per_rank]
    blocks = [sum(vectors[i:i + local_size]) / local_size
              for i in range(0, len(vectors), local_size)]
    return adasum_tree(blocks)


def reference_clip(grads: Sequence[torch.Tensor], max_norm: float,
                   norm_type: float) -> Tuple[float, List[torch.Tensor]]:
    """``torch.nn.utils.clip_grad_norm_``'s semantics in float64: the total
    norm of order ``norm_type`` over every element (an exactly rounded sum of
    the p-th powers; the largest magnitude for ``math.inf``), the coefficient
    ``min(1, max_norm / (norm + 1e-6))`` and the clipped gradients (new
    float64 tensors)."""
    values = [abs(v) for g in grads for v in g.double().flatten().tolist()]
    if norm_type == math.inf:
        norm = max(values, default=0.0)
    else:
        norm = math.fsum(v ** norm_type for v in values) ** (1.0 / norm_type)
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    return norm, [g.double() * coefficient for g in grads]
