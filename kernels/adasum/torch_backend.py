"""The AdaSum family on torch: the fallback of the Triton statistics and combine.

Used on the CPU and wherever Triton is not wanted; ``chunk_stats``,
``reduce_chunks`` and ``combine`` take the same arguments as the Triton
backend's (``kernels/_backends.py``).

A segment's statistics are defined over fixed chunks of ``ADASUM_CHUNK``
elements counted from the segment's start (the last one may be shorter): each
chunk's partial sums, then the fp64 sum of those partials in chunk order. A
chunk's partial depends only on the chunk's values, never on where it sits in
a buffer, so a tensor's statistics come out bitwise the same whether it is
reduced whole, inside any fused bucket, or cut at chunk boundaries across ranks.

On the CPU the partials come from batched Gram products and row sums, whose
BLAS and reduction paths give a chunk the same bits wherever it sits. On other
devices they do not (cuBLAS and CUDA's reductions choose their order by batch
size and alignment), so there each partial is a fixed pairwise tree of
elementwise adds (``_tree_chunk_stats``); ``sums_in_fixed_order`` decides.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .._common import (ADASUM_CHUNK, ADASUM_FP32_LIMIT, ADASUM_NORM_FLOOR, compute_dtype,
                       round_into, scratch_buffer)

#: whole chunks per batched Gram product: 2 fp64 rows each, 2 MiB of scratch
GRAM_BATCH = 8
#: chunks per pass of the fixed-order sums: 5 fp64 rows each, 40 MiB of scratch
TREE_BATCH = 64
# elements of one pass over short chunks: 5 fp64 arrays of this size (x, y, three products)
_STATS_PASS = 2 * ADASUM_CHUNK
# elements of one combine pass: its fp32 products stay in cache between the ops
_COMBINE_PASS = 1 << 17


def _chunk_runs(boundaries):
    """The chunks of all segments as ``(whole, short)``: ``whole`` lists runs
    ``(start, rows, row)`` of ``rows`` whole chunks from element ``start``,
    ``short`` each shorter last chunk as ``(start, length, row)``; ``row`` is
    the first chunk's index in chunk order."""
    whole, short, row = [], [], 0
    for lo, hi in zip(boundaries[:-1], boundaries[1:]):
        rows, rest = divmod(hi - lo, ADASUM_CHUNK)
        if rows:
            whole.append((lo, rows, row))
            row += rows
        if rest:
            short.append((lo + rows * ADASUM_CHUNK, rest, row))
            row += 1
    return whole, short


def _batches(runs, size):
    """``runs`` of ``(start, rows, row)`` cut into batches of at most ``size``
    rows, each a list of ``(start, rows, row, slot)`` (``slot``: its first row
    in the batch)."""
    batch, used = [], 0
    for start, rows, row in runs:
        while rows:
            take = min(rows, size - used)
            batch.append((start, take, row, used))
            start, rows, row, used = start + take * ADASUM_CHUNK, rows - take, row + take, \
                used + take
            if used == size:
                yield batch
                batch, used = [], 0
    if batch:
        yield batch


# the three statistics in a chunk's flattened 2 x 2 Gram matrix [[x·x, x·y], [y·x, y·y]]
_GRAM_TO_STATS = (1, 0, 3)


def _whole_chunk_stats(a, b, runs, out):
    """Whole chunks' partials: each chunk's rows ``x``, ``y`` (exact in fp64)
    side by side in fp64 scratch, and its Gram matrix ``[x; y] @ [x; y]ᵀ`` by
    one ``torch.bmm`` per ``GRAM_BATCH`` chunks. The scratch is the same
    allocation at every call (fixed alignment) and every chunk has one length,
    so BLAS takes the same path for every chunk wherever it came from: a
    chunk's partial depends on its values only (checked against placement,
    batch position and thread count in tests/test_adasum_kernels.py)."""
    if not runs:
        return
    pairs = scratch_buffer("gram", (GRAM_BATCH, 2, ADASUM_CHUNK), torch.float64, a.device)
    index = torch.tensor(_GRAM_TO_STATS, device=a.device)
    for batch in _batches(runs, GRAM_BATCH):
        for start, rows, _, slot in batch:
            span = slice(start, start + rows * ADASUM_CHUNK)
            pairs[slot:slot + rows, 0].copy_(a[span].view(rows, ADASUM_CHUNK))
            pairs[slot:slot + rows, 1].copy_(b[span].view(rows, ADASUM_CHUNK))
        used = batch[-1][3] + batch[-1][1]
        gram = torch.bmm(pairs[:used], pairs[:used].transpose(1, 2)).view(used, 4)
        for _, rows, row, slot in batch:
            torch.index_select(gram[slot:slot + rows], 1, index, out=out[row:row + rows])


def _short_chunk_stats(a, b, chunks, out):
    """Short last chunks' partials: torch's sum over each chunk's fp64
    products (``sum(dim=-1)`` over one row, which depends on its values and
    length only), many chunks per pass through fp64 scratch; chunks that are
    neighbours in the buffers (a layer's small tensors) are copied in one op."""
    if not chunks:
        return
    scratch = scratch_buffer("stats", (5, _STATS_PASS), torch.float64, a.device)
    x, y, products = scratch[0], scratch[1], scratch[2:]
    for group in _short_passes(chunks):
        for start, length, position in _contiguous_spans(group):
            x.narrow(0, position, length).copy_(a.narrow(0, start, length))
            y.narrow(0, position, length).copy_(b.narrow(0, start, length))
        used = group[-1][3] + group[-1][1]
        torch.mul(x[:used], y[:used], out=products[0, :used])
        torch.square(scratch[:2, :used], out=products[1:, :used])
        for _, length, row, position in group:
            torch.sum(products.narrow(1, position, length), 1, out=out[row])


def _short_passes(chunks):
    """``chunks`` (``(start, length, row)``) in passes that fit ``_STATS_PASS``,
    each chunk with its ``position`` in the pass's scratch."""
    group, used = [], 0
    for start, length, row in chunks:
        if used + length > _STATS_PASS:
            yield group
            group, used = [], 0
        group.append((start, length, row, used))
        used += length
    if group:
        yield group


def _contiguous_spans(group):
    """``(start, length, position)`` copies for a pass: chunks that follow each
    other in the buffers and in the scratch merged into one span."""
    spans = []
    for start, length, _, position in group:
        if spans and spans[-1][0] + spans[-1][1] == start:
            spans[-1][1] += length
        else:
            spans.append([start, length, position])
    return spans


def sums_in_fixed_order(device: torch.device) -> bool:
    """Whether chunk partials on ``device`` are summed by ``_tree_chunk_stats``.

    On the CPU torch's BLAS and row sums give a chunk the same bits wherever it
    sits (checked in the tests). On CUDA they do not: cuBLAS picks its batched
    product's algorithm by batch size, and the row sum's vectorisation follows
    the address's alignment, so a chunk's bits would change with its place in a
    buffer (seen on an H100). There the sums are formed from elementwise adds
    alone, whose order is fixed by the code.
    """
    return device.type != "cpu"


def _chunk_list(boundaries):
    """Every chunk as ``(start, length)``, in chunk order."""
    chunks = []
    for lo, hi in zip(boundaries[:-1], boundaries[1:]):
        chunks.extend((start, min(ADASUM_CHUNK, hi - start))
                      for start in range(lo, hi, ADASUM_CHUNK))
    return chunks


def _row_runs(group):
    """``group``'s chunks as copies ``(slot, start, rows, length)``: whole chunks
    that follow each other in the buffers go in one copy of ``rows`` rows."""
    runs = []
    for slot, (start, length) in enumerate(group):
        if runs and length == ADASUM_CHUNK and runs[-1][3] == ADASUM_CHUNK \
                and runs[-1][1] + runs[-1][2] * ADASUM_CHUNK == start:
            runs[-1][2] += 1
        else:
            runs.append([slot, start, 1, length])
    return runs


def _tree_chunk_stats(a, b, boundaries, out):
    """Every chunk's partials by a fixed pairwise tree of elementwise fp64 adds.

    A batch of chunks goes into rows of ``ADASUM_CHUNK`` fp64 elements; each
    row's three products are exact, the tail of a short chunk's row is -0.0
    (which adds exactly: ``x + -0.0 == x`` for every x, -0.0 included), and
    halving the row ``log2(ADASUM_CHUNK)`` times (``p[:h] += p[h:]``) leaves
    its sums. Every add is an elementwise IEEE fp64 add at a position fixed
    by the code, so a chunk's partial is a function of its values alone, on
    any device.
    """
    chunks = _chunk_list(boundaries)
    if not chunks:
        return
    batch = min(TREE_BATCH, len(chunks))
    pairs = torch.empty(batch, 2, ADASUM_CHUNK, dtype=torch.float64, device=a.device)
    products = torch.empty(batch, 3, ADASUM_CHUNK, dtype=torch.float64, device=a.device)
    for first in range(0, len(chunks), batch):
        group = chunks[first:first + batch]
        used = len(group)
        for slot, start, rows, length in _row_runs(group):
            span = slice(start, start + rows * length)
            pairs[slot:slot + rows, 0, :length].copy_(a[span].view(rows, length))
            pairs[slot:slot + rows, 1, :length].copy_(b[span].view(rows, length))
        x, y = pairs[:used, 0], pairs[:used, 1]
        torch.mul(x, y, out=products[:used, 0])
        torch.mul(x, x, out=products[:used, 1])
        torch.mul(y, y, out=products[:used, 2])
        for slot, (_, length) in enumerate(group):
            if length < ADASUM_CHUNK:
                products[slot, :, length:].fill_(-0.0)
        rows = products[:used]
        width = ADASUM_CHUNK
        while width > 1:
            width //= 2
            rows[..., :width].add_(rows[..., width:2 * width])
        out[first:first + used].copy_(rows[..., 0])


def chunk_stats(a: torch.Tensor, b: torch.Tensor, boundaries: Sequence[int],
                out: torch.Tensor) -> None:
    """Each chunk's ``(Σxy, Σx², Σy²)`` into ``out`` (float64 ``[n_chunks, 3]``).

    Chunks in order: segment by segment, each segment's chunks from its start.
    Products are exact (fp64 holds any product of two fp32s), and a chunk's
    partial is a fixed function of its values: whole chunks through a batched
    fp64 Gram product (``_whole_chunk_stats``), a segment's shorter last chunk
    through a row sum (``_short_chunk_stats``). So a chunk gives the same bits
    wherever it sits, whatever else is reduced in the same call and whatever
    the thread count (tests/test_adasum_kernels.py checks all three).
    """
    with torch.no_grad():
        if sums_in_fixed_order(a.device):
            _tree_chunk_stats(a, b, boundaries, out)
            return
        whole, short = _chunk_runs(boundaries)
        _whole_chunk_stats(a, b, whole, out)
        _short_chunk_stats(a, b, short, out)


def reduce_chunks(partials: torch.Tensor, counts: Sequence[int], out: torch.Tensor) -> None:
    """``out[i]``: segment ``i``'s chunk partials added in chunk order,
    ``((p0 + p1) + p2) + …`` in fp64 (0 for a segment without chunks)."""
    if partials.device.type == "cpu":
        # exact IEEE double additions, one after the other: Python floats are
        # fp64. One flat list of floats: a list per row would hand the garbage
        # collector thousands of containers per call, and its full passes over
        # a training process's heap cost 20 ms a call (measured)
        values, sums, position = partials.reshape(-1).tolist(), [], 0
        for count in counts:
            end = position + 3 * count
            dot = a2 = b2 = -0.0  # -0.0 + x is x for every x, -0.0 included
            for k in range(position, end, 3):
                dot += values[k]
                a2 += values[k + 1]
                b2 += values[k + 2]
            sums += (dot, a2, b2) if count else (0.0, 0.0, 0.0)
            position = end
        if sums:
            out.copy_(torch.tensor(sums, dtype=torch.float64).view(-1, 3))
        return
    # elsewhere: one column of a padded [segments, longest, 3] gather at a time;
    # the padding is -0.0, which adds exactly
    longest = max(counts, default=0)
    out.zero_()
    if longest == 0:
        return
    counts_t = torch.tensor(counts, dtype=torch.int64)
    first = torch.cumsum(counts_t, 0) - counts_t
    index = first[:, None] + torch.arange(longest)[None, :]
    index = torch.where(torch.arange(longest)[None, :] < counts_t[:, None], index,
                        partials.shape[0]).to(partials.device)
    padded = torch.cat([partials, torch.full((1, 3), -0.0, dtype=torch.float64,
                                             device=partials.device)])[index]
    total = padded[:, 0].clone()
    for j in range(1, longest):
        total += padded[:, j]
    nonempty = (counts_t > 0).to(partials.device)
    out.copy_(torch.where(nonempty[:, None], total, 0.0))


def _coefficients(segment_stats):
    """``(ca, cb)``, float64 [n] each: 1 where the squared norm is below
    ``ADASUM_NORM_FLOOR``."""
    dot, a2, b2 = segment_stats.unbind(1)

    def coefficient(norm2):
        small = norm2 < ADASUM_NORM_FLOOR
        return torch.where(small, 1.0, 1.0 - dot / (2.0 * torch.where(small, 1.0, norm2)))

    return coefficient(a2), coefficient(b2)


def _pieces(spans, size):
    """``spans`` (``(segment, lo, hi)``) cut into pieces of at most ``size``
    elements, grouped into passes of at most ``size`` elements."""
    group, used = [], 0
    for i, lo, hi in spans:
        while lo < hi:
            if used == size:
                yield group
                group, used = [], 0
            end = min(hi, lo + size - used)
            group.append((i, lo, end))
            used += end - lo
            lo = end
    if group:
        yield group


def _combine_in_compute_dtype(a, b, out, spans, ca, cb):
    """``out = fl(fl(a·ca) + fl(b·cb))`` on ``spans`` of fp32 or fp64 buffers, the
    coefficients rounded to the buffers' dtype, a cache-sized pass at a time."""
    if out is b:  # IEEE addition commutes: the same bits with the roles swapped
        a, b, ca, cb = b, a, cb, ca
    for group in _pieces(spans, _COMBINE_PASS):
        # foreach ops round a Python scalar to the tensors' dtype, as the kernel does
        others = torch._foreach_mul([b[lo:hi] for _, lo, hi in group],
                                    [cb[i] for i, _, _ in group])
        targets = [out[lo:hi] for _, lo, hi in group]
        if out is not a:
            torch._foreach_copy_(targets, [a[lo:hi] for _, lo, hi in group])
        torch._foreach_mul_(targets, [ca[i] for i, _, _ in group])
        torch._foreach_add_(targets, others)


def combine(a: torch.Tensor, b: torch.Tensor, boundaries: Sequence[int],
            segment_stats: torch.Tensor, out: torch.Tensor) -> None:
    """``out = ca·a + cb·b`` per segment: in fp64 for fp64 buffers; otherwise in
    fp32 while ``|ca|, |cb| <= ADASUM_FP32_LIMIT`` and in fp64 (rounded once)
    beyond it.

    The coefficients are read on the host (free for CPU tensors, one small copy
    elsewhere).
    """
    ca, cb = (c.tolist() for c in _coefficients(segment_stats))
    compute = compute_dtype(a.dtype, a.dtype)
    narrow, wide = [], []
    for i, (lo, hi) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        if hi > lo:
            fits = compute == torch.float64 or (abs(ca[i]) <= ADASUM_FP32_LIMIT
                                                and abs(cb[i]) <= ADASUM_FP32_LIMIT)
            (narrow if fits else wide).append((i, lo, hi))
    with torch.no_grad():
        if a.dtype == compute:
            _combine_in_compute_dtype(a, b, out, narrow, ca, cb)
        else:  # 16-bit buffers: fp32 math, one rounding into the buffer
            for i, lo, hi in narrow:
                mixed = a[lo:hi].to(compute) * ca[i]
                mixed += b[lo:hi].to(compute) * cb[i]
                round_into(out[lo:hi], mixed)
        for i, lo, hi in wide:
            # new tensors throughout: ``out`` may be ``a`` or ``b``
            mixed = a[lo:hi].to(torch.float64) * ca[i]
            mixed += b[lo:hi].to(torch.float64) * cb[i]
            round_into(out[lo:hi], mixed)
