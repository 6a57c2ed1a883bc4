"""The AdaSum family on Triton: per-segment statistics and the combine.

For flat buffers ``a`` and ``b`` cut into segments (one per parameter tensor),
the statistics are each segment's ``(a·b, ‖a‖², ‖b‖²)`` and ``combine`` writes
``ca·a + cb·b`` with ``ca = 1 - a·b / (2‖a‖²)``, ``cb = 1 - a·b / (2‖b‖²)``
(a coefficient is 1 where its squared norm is below ``ADASUM_NORM_FLOOR``).

Statistics are defined over chunks of ``ADASUM_CHUNK`` elements counted from each
segment's start (the last one may be shorter). ``_chunk_stats_kernel`` runs one
program per chunk: lane ``j`` of a ``BLOCK``-wide fp64 accumulator adds the
chunk's elements ``j, j + BLOCK, …`` in order, then the lanes are summed. That
walk is relative to the chunk's start, so a chunk gives the same partial
wherever it sits in a buffer. ``_reduce_chunks_kernel`` then adds a segment's
chunk partials one after the other, in chunk order. Products and sums are fp64:
AdaSum must stay right from fp32's tiny to ``sqrt`` of its max, whose squares
fp32 cannot hold. No atomics: every result has one writer.

``_combine_kernel`` combines fp64 buffers in fp64; fp32 and 16-bit ones in fp32
while ``|ca|, |cb| <= ADASUM_FP32_LIMIT`` (2^64), and in fp64 otherwise (a tiny and a
huge gradient give coefficients beyond fp32's range, ~1e56). The branch is
taken per program on the segment's coefficients, which every program of the
segment (and every rank) computes identically.

The launch table holds ``[ start | length ]`` per segment, then one
``segment << 32 | index`` word per program (the chunk or block of the segment),
so one launch covers any number of segments of any sizes.

``chunk_stats``, ``reduce_chunks`` and ``combine`` are this backend's side of
the kernels' backend protocol (``kernels/_backends.py``): the same arguments as
the torch fallback's, already validated by the façade.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .._common import ADASUM_CHUNK, ADASUM_FP32_LIMIT, ADASUM_NORM_FLOOR
from .._launcher import launch_for
from .._triton_common import downcast, upcast

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _program_work(table, n_segments):
    work = tl.load(table + 2 * n_segments + tl.program_id(0))
    seg = work >> 32
    return seg, work - (seg << 32)


@triton.jit
def _chunk_stats_kernel(a, b, table, partials, n_segments, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    seg, chunk = _program_work(table, n_segments)
    seg_start = tl.load(table + seg)
    length = tl.load(table + n_segments + seg)
    start = chunk * CHUNK
    end = tl.minimum(length, start + CHUNK)
    dot = tl.zeros([BLOCK], tl.float64)
    a2 = tl.zeros([BLOCK], tl.float64)
    b2 = tl.zeros([BLOCK], tl.float64)
    # a fixed walk relative to the chunk's start: the same sums wherever it sits.
    # A while loop, not range(start, end, BLOCK): Triton's interpreter before 3.7
    # cannot take loaded values as range bounds under numpy 2 (it calls int() on
    # a 1-element array); the compiled loop is the same either way.
    i = start
    while i < end:
        offs = i + tl.arange(0, BLOCK)
        mask = offs < end
        x = upcast(tl.load(a + seg_start + offs, mask=mask, other=0.0), tl.float64)
        y = upcast(tl.load(b + seg_start + offs, mask=mask, other=0.0), tl.float64)
        dot += x * y
        a2 += x * x
        b2 += y * y
        i += BLOCK
    out = partials + tl.program_id(0) * 3
    tl.store(out, tl.sum(dot, axis=0))
    tl.store(out + 1, tl.sum(a2, axis=0))
    tl.store(out + 2, tl.sum(b2, axis=0))


@triton.jit
def _reduce_chunks_kernel(partials, first_chunk, stats):
    seg = tl.program_id(0)
    first = tl.load(first_chunk + seg)
    last = tl.load(first_chunk + seg + 1)
    cols = tl.arange(0, 4)
    keep = cols < 3
    # -0.0 + x is x for every x: the sum is ((p0 + p1) + p2) + ..., one after the other
    # -0.0 from its bits: Triton 3.2's tl.full(-0.0) gives +0.0 (-0.0 == 0 takes
    # its zero path), and +0.0 + -0.0 would turn a segment of -0.0s positive
    total = tl.full([4], -(2 ** 63), tl.int64).to(tl.float64, bitcast=True)
    i = first
    while i < last:  # not range(first, last): see _chunk_stats_kernel
        total += tl.load(partials + i * 3 + cols, mask=keep, other=-0.0)
        i += 1
    total = tl.where(last > first, total, 0.0)
    tl.store(stats + seg * 3 + cols, total, mask=keep)


@triton.jit
def _coefficient(dot, norm2, FLOOR: tl.constexpr):
    safe = tl.where(norm2 < FLOOR, 1.0, norm2)
    return tl.where(norm2 < FLOOR, 1.0, 1.0 - dot / (2.0 * safe))


@triton.jit
def _mix(a, b, out, offs, mask, ca, cb, COMPUTE: tl.constexpr):
    x = upcast(tl.load(a + offs, mask=mask, other=0.0), COMPUTE)
    y = upcast(tl.load(b + offs, mask=mask, other=0.0), COMPUTE)
    mixed = ca.to(COMPUTE) * x + cb.to(COMPUTE) * y
    tl.store(out + offs, downcast(mixed, out.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(a, b, out, table, stats, n_segments, FLOOR: tl.constexpr,
                    LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    seg, block = _program_work(table, n_segments)
    seg_start = tl.load(table + seg)
    length = tl.load(table + n_segments + seg)
    dot = tl.load(stats + seg * 3)
    ca = _coefficient(dot, tl.load(stats + seg * 3 + 1), FLOOR)
    cb = _coefficient(dot, tl.load(stats + seg * 3 + 2), FLOOR)
    start = block * BLOCK
    offs = seg_start + start + tl.arange(0, BLOCK)
    mask = start + tl.arange(0, BLOCK) < length
    if a.dtype.element_ty == tl.float64:
        _mix(a, b, out, offs, mask, ca, cb, tl.float64)
    else:
        # the coefficients are the segment's: all its programs branch alike
        if (tl.abs(ca) <= LIMIT) & (tl.abs(cb) <= LIMIT):
            _mix(a, b, out, offs, mask, ca, cb, tl.float32)
        else:
            _mix(a, b, out, offs, mask, ca, cb, tl.float64)


def segment_table(boundaries: Sequence[int], device: torch.device, unit: int):
    """The launch table (one program per ``unit`` elements of each segment) and
    the program count.

    A bucket's segments are the same every step, so tables are kept per
    ``(boundaries, device, unit)`` (the last ``TABLES_KEPT``): a repeated call
    costs a lookup instead of numpy work and a host-to-device copy. Kernels
    only read them, and the copy that made them completed before they were
    first used, so any stream may read them.
    """
    return _kept_segment_table(tuple(boundaries), device, unit)


TABLES_KEPT = 64


@functools.lru_cache(maxsize=TABLES_KEPT)
def _kept_segment_table(boundaries, device, unit):
    edges = np.asarray(boundaries, dtype=np.int64)
    starts, lengths = edges[:-1], np.diff(edges)
    n = len(starts)
    pieces = -(-lengths // unit)
    programs = int(pieces.sum())
    first = np.cumsum(pieces) - pieces  # each segment's first program
    seg_of = np.repeat(np.arange(n, dtype=np.int64), pieces)
    work = (seg_of << 32) | (np.arange(programs, dtype=np.int64) - np.repeat(first, pieces))
    # a blocking copy (once per layout): a kept table may be read from any stream
    table = torch.from_numpy(np.concatenate([starts, lengths, work])).to(device)
    return table, programs


@functools.lru_cache(maxsize=TABLES_KEPT)
def _first_chunks(counts, device):
    """Each segment's first row in the chunk partials (``n + 1`` entries), on ``device``."""
    first = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
    return torch.from_numpy(first.astype(np.int64)).to(device)


def chunk_stats(a: torch.Tensor, b: torch.Tensor, boundaries: Sequence[int],
                out: torch.Tensor) -> None:
    """Fill ``out`` (float64 ``[n_chunks, 3]``) with every chunk's partial sums, in order."""
    table, programs = segment_table(boundaries, a.device, ADASUM_CHUNK)
    if programs:
        launch_for(_chunk_stats_kernel, (programs,), num_warps=NUM_WARPS)(
            a, b, table, out, len(boundaries) - 1, ADASUM_CHUNK, BLOCK)


def reduce_chunks(partials: torch.Tensor, counts: Sequence[int], out: torch.Tensor) -> None:
    """``out[i]`` (float64 ``[n, 3]``): segment ``i``'s ``counts[i]`` chunk partials
    added in chunk order."""
    if len(counts):
        first = _first_chunks(tuple(int(c) for c in counts), partials.device)
        launch_for(_reduce_chunks_kernel, (len(counts),), num_warps=1)(partials, first, out)


def combine(a: torch.Tensor, b: torch.Tensor, boundaries: Sequence[int],
            segment_stats: torch.Tensor, out: torch.Tensor) -> None:
    """``out = ca·a + cb·b`` per segment (``out`` may be ``a`` or ``b``)."""
    table, programs = segment_table(boundaries, a.device, BLOCK)
    if programs:
        launch_for(_combine_kernel, (programs,), num_warps=NUM_WARPS)(
            a, b, out, table, segment_stats, len(boundaries) - 1, ADASUM_NORM_FLOOR,
            ADASUM_FP32_LIMIT, BLOCK)
