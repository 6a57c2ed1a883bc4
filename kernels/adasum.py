"""Triton kernels for AdaSum's per-segment statistics and combination.

For flat buffers ``a`` and ``b`` cut into segments (one per parameter tensor),
``stats`` gives each segment's ``(a·b, ‖a‖², ‖b‖²)`` and ``combine`` writes
``ca·a + cb·b`` with ``ca = 1 - a·b / (2‖a‖²)``, ``cb = 1 - a·b / (2‖b‖²)``
(a coefficient is 1 where its squared norm is below ``sqrt(float64 tiny)``).

The launch table holds ``[ start | length ]`` per segment, then one
``segment << 32 | block`` word per program, so one launch covers any number of
segments of any sizes. Products and their block sums are fp64: AdaSum must stay
right from fp32's tiny to ``sqrt`` of its max, whose squares fp32 cannot hold.
Each program writes its block's three sums; a second kernel adds a segment's
block sums in program order, so the result is deterministic (no atomics).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .flatten import _downcast, _upcast

BLOCK = 1024
FINAL_CHUNK = 256
NUM_WARPS = 4
# below this squared norm a coefficient is 1 (AdaSum(g, 0) = g)
NORM_FLOOR = float(np.sqrt(np.finfo(np.float64).tiny))


@triton.constexpr_function
def _compute_dtype(dtype):
    return tl.float64 if dtype == tl.float64 else tl.float32


@triton.jit
def _program_segment(table, n_segments, BLOCK: tl.constexpr):
    work = tl.load(table + 2 * n_segments + tl.program_id(0))
    seg = work >> 32
    start = (work - (seg << 32)) * BLOCK
    return seg, start


@triton.jit
def _stats_kernel(a, b, table, partials, n_segments, BLOCK: tl.constexpr):
    seg, start = _program_segment(table, n_segments, BLOCK)
    seg_start = tl.load(table + seg)
    length = tl.load(table + n_segments + seg)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < length
    x = _upcast(tl.load(a + seg_start + offs, mask=mask, other=0.0), tl.float64)
    y = _upcast(tl.load(b + seg_start + offs, mask=mask, other=0.0), tl.float64)
    out = partials + tl.program_id(0) * 3
    tl.store(out, tl.sum(x * y, axis=0))
    tl.store(out + 1, tl.sum(x * x, axis=0))
    tl.store(out + 2, tl.sum(y * y, axis=0))


@triton.jit
def _stats_finish_kernel(partials, first_program, stats, CHUNK: tl.constexpr):
    seg = tl.program_id(0)
    first = tl.load(first_program + seg)
    count = tl.load(first_program + seg + 1) - first
    lanes = tl.arange(0, CHUNK)
    dot = tl.zeros([CHUNK], tl.float64)
    a2 = tl.zeros([CHUNK], tl.float64)
    b2 = tl.zeros([CHUNK], tl.float64)
    # a fixed walk over the segment's block sums: the same order every call
    for i in range(0, count, CHUNK):
        mask = i + lanes < count
        row = partials + (first + i + lanes) * 3
        dot += tl.load(row, mask=mask, other=0.0)
        a2 += tl.load(row + 1, mask=mask, other=0.0)
        b2 += tl.load(row + 2, mask=mask, other=0.0)
    tl.store(stats + seg * 3, tl.sum(dot, axis=0))
    tl.store(stats + seg * 3 + 1, tl.sum(a2, axis=0))
    tl.store(stats + seg * 3 + 2, tl.sum(b2, axis=0))


@triton.jit
def _coefficient(dot, norm2, FLOOR: tl.constexpr):
    safe = tl.where(norm2 < FLOOR, 1.0, norm2)
    return tl.where(norm2 < FLOOR, 1.0, 1.0 - dot / (2.0 * safe))


@triton.jit
def _combine_kernel(a, b, out, table, stats, n_segments, FLOOR: tl.constexpr,
                    BLOCK: tl.constexpr):
    seg, start = _program_segment(table, n_segments, BLOCK)
    seg_start = tl.load(table + seg)
    length = tl.load(table + n_segments + seg)
    COMPUTE: tl.constexpr = _compute_dtype(a.dtype.element_ty)
    dot = tl.load(stats + seg * 3)
    ca = _coefficient(dot, tl.load(stats + seg * 3 + 1), FLOOR).to(COMPUTE)
    cb = _coefficient(dot, tl.load(stats + seg * 3 + 2), FLOOR).to(COMPUTE)
    offs = seg_start + start + tl.arange(0, BLOCK)
    mask = start + tl.arange(0, BLOCK) < length
    x = _upcast(tl.load(a + offs, mask=mask, other=0.0), COMPUTE)
    y = _upcast(tl.load(b + offs, mask=mask, other=0.0), COMPUTE)
    tl.store(out + offs, _downcast(ca * x + cb * y, out.dtype.element_ty), mask=mask)


def _segment_table(boundaries, device):
    """The launch table, the program count and each segment's first program."""
    bounds = np.asarray(boundaries, dtype=np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    n = len(starts)
    blocks = -(-lengths // BLOCK)
    programs = int(blocks.sum())
    first = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)
    seg_of = np.repeat(np.arange(n, dtype=np.int64), blocks)
    work = (seg_of << 32) | (np.arange(programs, dtype=np.int64) - np.repeat(first[:-1], blocks))
    table = torch.from_numpy(np.concatenate([starts, lengths, work])).to(device, non_blocking=True)
    return table, programs, torch.from_numpy(first).to(device, non_blocking=True)


def stats(a, b, boundaries, out):
    """Fill ``out`` (float64 ``[n_segments, 3]``) with each segment's statistics."""
    n = len(boundaries) - 1
    table, programs, first = _segment_table(boundaries, a.device)
    partials = torch.empty(max(programs, 1) * 3, dtype=torch.float64, device=a.device)
    if programs:
        _stats_kernel[(programs,)](a, b, table, partials, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    if n:
        _stats_finish_kernel[(n,)](partials, first, out, CHUNK=FINAL_CHUNK, num_warps=NUM_WARPS)


def combine(a, b, boundaries, segment_stats, out):
    """``out = ca·a + cb·b`` per segment (``out`` may be ``a`` or ``b``)."""
    table, programs, _ = _segment_table(boundaries, a.device)
    if programs:
        _combine_kernel[(programs,)](a, b, out, table, segment_stats, len(boundaries) - 1,
                                     FLOOR=NORM_FLOOR, BLOCK=BLOCK, num_warps=NUM_WARPS)
