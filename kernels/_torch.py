"""The torch fallback of the kernels: same semantics, plain torch ops.

Used on CPU and wherever Triton is not wanted. The element math follows the
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
import math
import threading

from typing import Optional, Tuple

import torch

# elements per piece: 256 KiB of fp32, so the second pass over a piece hits L2
CHUNK = 1 << 16

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

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
    # only the pairs ``_route`` leaves to it come here: an fp64 source into a
    # 16-bit destination, or fp16<->bf16 with a scale
    if scale == 1.0:
        _round_into(dst, src)
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


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _segment_views(flat: torch.Tensor, offsets, tensors):
    """Each tensor's segment of ``flat`` as a view in the tensor's own shape.

    One view op per tensor (creating a view costs microseconds on the CPU and a
    model has hundreds of gradients): the pairs ``(view, tensor)`` then go to
    ``copy_``/``mul`` as they are, whatever the tensor's strides.
    """
    base = flat.storage_offset()
    views = []
    for off, t in zip(offsets, tensors):
        shape = t.shape
        if len(shape) == 1:
            views.append(flat.narrow(0, off, shape[0]))
        else:
            views.append(flat.as_strided(shape, _contiguous_strides(tuple(shape)), base + off))
    return views


def _gap_views(flat: torch.Tensor, offsets, numels, extents):
    """Views of every element of ``flat`` that no segment covers."""
    gaps, position = [], 0
    for off, n, ext in zip(offsets, numels, extents):
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
    return dst_dtype in _SIXTEEN_BIT and src_dtype in (torch.float32, dst_dtype)


def _route(dst: torch.dtype, src: torch.dtype, scale: float) -> int:
    """Which of ``_scaled_copies``' four routes a pair of dtypes takes."""
    if scale == 1.0 and (_exact(dst, src) or (dst in _SIXTEEN_BIT and src != torch.float64)):
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


def flatten(tensors, offsets, extents, out, scale, check_finite):
    """Fill ``out`` (validated by the caller); return the non-finite flag or None."""
    with torch.no_grad():
        segments = _segment_views(out, offsets, tensors)
        gaps = _gap_views(out, offsets, [t.numel() for t in tensors], extents)
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


def unflatten(flat, tensors, offsets, scale, accumulate):
    """Write (or add) each segment of ``flat`` into its tensor, in place."""
    with torch.no_grad():
        _scaled_copies(tensors, _segment_views(flat, offsets, tensors), scale, accumulate)


# ------------------------------------------------------------------ AdaSum
#
# The statistics of a segment are defined over fixed chunks of ADASUM_CHUNK
# elements counted from the segment's start (the last one may be shorter): each
# chunk's partial sums, then the fp64 sum of those partials in chunk order. A
# chunk's partial depends only on the chunk's values, never on where it sits in
# a buffer, so a tensor's statistics come out bitwise the same whether it is
# reduced whole, inside any fused bucket, or cut at chunk boundaries across ranks.

#: elements per AdaSum chunk (a power of two, a multiple of every vector width)
ADASUM_CHUNK = 1 << 14
#: fp32 (and 16-bit) data is combined with fp32 coefficients while both are at
#: most this in magnitude, and in fp64 otherwise (fp32 cannot hold such coefficients)
ADASUM_FP32_LIMIT = 2.0 ** 64
# whole chunks per batched Gram product: 2 fp64 rows each, 2 MiB of scratch
_GRAM_ROWS = 8
# elements of one pass over short chunks: 5 fp64 arrays of this size (x, y, three products)
_STATS_PASS = 2 * ADASUM_CHUNK
# elements of one combine pass: its fp32 products stay in cache between the ops
_COMBINE_PASS = 1 << 17

_scratch = threading.local()


def scratch_buffer(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch tensor kept between calls (per thread, per ``name`` and dtype,
    grow-only) on the CPU, where a fresh multi-MiB allocation costs page faults
    each time (a fresh 25 MiB buffer filled took 6x as long as a reused one);
    a new one elsewhere, where the caching allocator already reuses memory.
    Two users of one ``name`` in the same thread share the memory."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    kept = getattr(_scratch, "buffers", None)
    if kept is None:
        kept = _scratch.buffers = {}
    numel = math.prod(shape)
    buffer = kept.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = kept[name, dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


def adasum_chunk_counts(boundaries):
    """The number of chunks of each segment."""
    return [-(-(hi - lo) // ADASUM_CHUNK) for lo, hi in zip(boundaries[:-1], boundaries[1:])]


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
    one ``torch.bmm`` per ``_GRAM_ROWS`` chunks. The scratch is the same
    allocation at every call (fixed alignment) and every chunk has one length,
    so BLAS takes the same path for every chunk wherever it came from: a
    chunk's partial depends on its values only (checked against placement,
    batch position and thread count in tests/test_adasum_kernels.py)."""
    if not runs:
        return
    pairs = scratch_buffer("gram", (_GRAM_ROWS, 2, ADASUM_CHUNK), torch.float64, a.device)
    index = torch.tensor(_GRAM_TO_STATS, device=a.device)
    for batch in _batches(runs, _GRAM_ROWS):
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


def adasum_chunk_stats(a, b, boundaries, out):
    """Each chunk's ``(Σxy, Σx², Σy²)`` into ``out`` (float64 ``[n_chunks, 3]``).

    Chunks in order: segment by segment, each segment's chunks from its start.
    Products are exact (fp64 holds any product of two fp32s), and a chunk's
    partial is a fixed function of its values: whole chunks through a batched
    fp64 Gram product (``_whole_chunk_stats``), a segment's shorter last chunk
    through a row sum (``_short_chunk_stats``). So a chunk gives the same bits
    wherever it sits, whatever else is reduced in the same call and whatever
    the thread count (tests/test_adasum_kernels.py checks all three).
    """
    whole, short = _chunk_runs(boundaries)
    with torch.no_grad():
        _whole_chunk_stats(a, b, whole, out)
        _short_chunk_stats(a, b, short, out)


def adasum_reduce_chunks(partials, counts, out):
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


def adasum_coefficients(segment_stats, floor):
    """``(ca, cb)``, float64 [n] each: 1 where the squared norm is below ``floor``."""
    dot, a2, b2 = segment_stats.unbind(1)

    def coefficient(norm2):
        small = norm2 < floor
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


def adasum_combine(a, b, boundaries, segment_stats, out, floor, limit=ADASUM_FP32_LIMIT):
    """``out = ca·a + cb·b`` per segment: in fp64 for fp64 buffers; otherwise in
    fp32 while ``|ca|, |cb| <= limit`` and in fp64 (rounded once) beyond it.

    The coefficients are read on the host (free for CPU tensors, one small copy
    elsewhere).
    """
    ca, cb = (c.tolist() for c in adasum_coefficients(segment_stats, floor))
    compute = compute_dtype(a.dtype, a.dtype)
    narrow, wide = [], []
    for i, (lo, hi) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        if hi > lo:
            fits = compute == torch.float64 or (abs(ca[i]) <= limit and abs(cb[i]) <= limit)
            (narrow if fits else wide).append((i, lo, hi))
    with torch.no_grad():
        if a.dtype == compute:
            _combine_in_compute_dtype(a, b, out, narrow, ca, cb)
        else:  # 16-bit buffers: fp32 math, one rounding into the buffer
            for i, lo, hi in narrow:
                mixed = a[lo:hi].to(compute) * ca[i]
                mixed += b[lo:hi].to(compute) * cb[i]
                _round_into(out[lo:hi], mixed)
        for i, lo, hi in wide:
            # new tensors throughout: ``out`` may be ``a`` or ``b``
            mixed = a[lo:hi].to(torch.float64) * ca[i]
            mixed += b[lo:hi].to(torch.float64) * cb[i]
            _round_into(out[lo:hi], mixed)
