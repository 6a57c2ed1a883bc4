"""AdaSum across ranks: the fixed combining tree, its exchanges, and its entry points.

For two gradients of one tensor, ``AdaSum(a, b) = (1 - a·b/(2‖a‖²))·a +
(1 - a·b/(2‖b‖²))·b``: orthogonal gradients add, parallel ones average. Ranks
combine along a fixed tree, so any world size works and every rank ends with
bitwise the same result. Unlike an all-reduce this is not one collective but
a chain of point-to-point exchanges (recursive vector halving, then an
all-gather), with the kernels' statistics and combine between them.

Entry points, from the highest level down:

- ``adasum_allreduce(tensors)``: checks, packs into a plan's buckets, new outputs;
- ``adasum_allreduce_plan(plan, tensors, outputs)``: bucket by bucket, no checks;
- ``adasum_allreduce_flat(buffer, segments)``: one flat buffer, in place (what
  ``adasum_hook`` runs on a DDP bucket);
- ``AdaSumReducer`` (``adasum_reducer.py``, a layer up): a
  ``DistributedGradReducer`` whose buckets combine by AdaSum during backward
  (``DistributedOptimizer(reduce_method="adasum")``), built on
  ``adasum_flat_unchecked``;
- ``adasum_halve`` / ``adasum_gather`` with ``adasum_tree_share``: the tree's
  two phases apart, for ``DistributedOptimizer(shard=True)``, which steps the
  slice the halving leaves each rank and gathers the parameters by the
  reverse swaps;
- ``_combine_along_tree``: the tree itself over an explicit list of ranks.

About 500 lines: the tree and its entry points are one concept, and the entry
points' docstrings state the semantics users rely on.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from ._checks import tensor_list
from .buckets import Bucket, BucketPlan
from .node_groups import check_local_size
from .precision import communication_dtype
from .process_group import (consecutive_block, global_ranks, refuse_one_shot_in_capture,
                            require_process_group, verify_same_on_all_ranks)
from .sharded import start_all_gather


def adasum_allreduce(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                     *, local_size: int = 1, bucket_cap_mb: float = 25.0,
                     backend: str = "auto") -> List[torch.Tensor]:
    """AdaSum of every rank's ``tensors``, per tensor; new tensors, the same on all ranks.

    For two gradients of a tensor, ``AdaSum(a, b) = (1 - a·b/(2‖a‖²))·a +
    (1 - a·b/(2‖b‖²))·b``: orthogonal gradients add, parallel ones average.
    Ranks combine along a fixed tree (see ``adasum_allreduce_flat``), so any
    world size works and the result is bitwise identical on every rank.
    Coefficients are per tensor, never per fused buffer: the bucketing does not
    change the result.

    Args:
        tensors: this rank's tensors (fp16, bf16, fp32, fp64; any shapes);
            16-bit ones are combined in fp32. The same shapes and dtypes on
            every rank.
        group: the process group; default: the world.
        local_size: first average inside consecutive blocks of this many ranks
            (a node's GPUs), then AdaSum across the blocks.
        bucket_cap_mb: the byte cap of a fused bucket, in MiB.
        backend: the kernels' backend.

    Returns:
        One new tensor per input, in its dtype and shape (contiguous). fp32
        and fp64 results are views of the fused buckets the tree combined
        (no copy out); 16-bit ones are cast from them into tensors of their own.

    Raises:
        RuntimeError: torch.distributed is not initialised; the ranks' tensor
            lists differ (raised on every rank, naming the first difference);
            called during CUDA graph capture.
        TypeError: a sparse, integer or non-tensor entry (the index is named),
            or a single tensor instead of a list.
        ValueError: ``local_size`` does not divide the world size.

    Examples:
        >>> averaged = adasum_allreduce([p.grad for p in model.parameters()])  # doctest: +SKIP
    """
    tensors = tensor_list(tensors, "tensors")
    refuse_one_shot_in_capture(tensors, "adasum_allreduce")
    world_size = require_process_group(group)
    check_local_size(local_size, world_size)
    plan = BucketPlan(tensors, bucket_cap_mb=bucket_cap_mb, comm_dtype=communication_dtype)
    if world_size > 1:
        names = [f"tensors[{i}] {tuple(s.shape)} {s.dtype}" for i, s in enumerate(plan.specs)]
        verify_same_on_all_ranks(plan.signature(), names, group, what="tensor",
                                 bucket_layout=plan.layout(),
                                 options=[("local_size", local_size)],
                                 bucket_layout_hint="pass the same bucket_cap_mb on every rank")
    outputs: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for bucket, buffer in _combined_buckets(plan, tensors, group, local_size, backend):
        cast = []
        for i, offset in zip(bucket.tensor_indices, bucket.offsets):
            if tensors[i].dtype == bucket.dtype:
                outputs[i] = buffer[offset:offset + tensors[i].numel()].view(tensors[i].shape)
            else:
                outputs[i] = torch.empty(tensors[i].shape, dtype=tensors[i].dtype,
                                         device=tensors[i].device)
                cast.append((i, offset))
        if cast:
            kernels.unflatten_cast_scale(buffer, [outputs[i] for i, _ in cast],
                                         offsets=[o for _, o in cast], backend=backend)
    return outputs


def adasum_allreduce_plan(plan: BucketPlan, tensors: Sequence[torch.Tensor],
                          outputs: Sequence[torch.Tensor], *,
                          group: Optional[dist.ProcessGroup] = None, local_size: int = 1,
                          backend: str = "auto") -> None:
    """The AdaSum of ``tensors`` across ranks into ``outputs``, bucket by bucket.

    ``adasum_allreduce`` without its checks: the caller vouches that every rank
    has the same plan, built with ``comm_dtype=communication_dtype``.
    """
    for bucket, buffer in _combined_buckets(plan, tensors, group, local_size, backend):
        plan.unflatten(bucket, buffer, outputs, backend=backend)


def check_adasum_reduce_dtype(reduce_dtype: torch.dtype) -> torch.dtype:
    """``reduce_dtype`` if AdaSum can combine in it (float32 or float64).

    Raises:
        ValueError: anything else: AdaSum's statistics and combine need fp32
            or fp64 buffers.
    """
    if reduce_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"AdaSum combines in float32 or float64 buffers: reduce_dtype="
                         f"{reduce_dtype} cannot be used with it")
    return reduce_dtype


def adasum_bucket_boundaries(bucket: Bucket) -> List[int]:
    """The bucket's segment boundaries for AdaSum: each tensor's own elements,
    and the padding before and after it as segments of their own (often
    empty), so a tensor's statistics never include padding."""
    boundaries = [0]
    for offset, numel in zip(bucket.offsets, bucket.numels):
        boundaries += [offset, offset + numel]
    return boundaries + [bucket.size]


def _combined_buckets(plan: BucketPlan, tensors: Sequence[torch.Tensor], group,
                      local_size: int, backend: str) -> Iterator[Tuple[Bucket, torch.Tensor]]:
    """``(bucket, buffer)`` per bucket of ``plan``, ``buffer`` a new flat buffer
    holding the bucket's AdaSum across the ranks."""
    for bucket in plan.buckets:
        buffer = plan.flatten(bucket, tensors, scale=1.0 / local_size, backend=backend)
        adasum_flat_unchecked(buffer, adasum_bucket_boundaries(bucket), group, local_size,
                              backend, prescaled=True, exchanges_only=False)
        yield bucket, buffer


def adasum_allreduce_flat(buffer: torch.Tensor, segments: Sequence[int], *,
                          group: Optional[dist.ProcessGroup] = None, local_size: int = 1,
                          backend: str = "auto", prescaled: bool = False,
                          exchanges_only: bool = False) -> None:
    """The AdaSum of every rank's ``buffer``, in place, one coefficient pair per segment.

    ``buffer`` is a flat fp32 or fp64 buffer cut into segments (one per tensor)
    at the boundaries ``segments``. With ``local_size`` k, each block of k
    consecutive ranks is first averaged (``buffer`` times 1/k, unless
    ``prescaled`` says it already was, then summed); the blocks then combine
    along a fixed tree: with P the largest power of two <= n blocks, block
    r >= P is first combined into r - P (r - P on the left); then blocks
    0..P-1 combine level by level at distance d = 1, 2, 4, ... (the lower on
    the left), by recursive vector halving with distance doubling and a final
    all-gather. Each rank sends about 2(P-1)/P of the buffer, plus 24 bytes per
    AdaSum chunk per level. A segment's statistics are those of
    ``kernels.adasum_stats`` on the whole vectors however the halving cut the
    buffer, so the result does not depend on how tensors were bucketed, and
    every rank ends with bitwise the same buffer.

    Every rank must pass the same ``segments``, dtype and size (not verified
    here; ``adasum_allreduce`` verifies).

    Args:
        buffer: this rank's 1-D contiguous fp32/fp64 buffer, overwritten.
        segments: ``n + 1`` non-decreasing boundaries from 0 to ``buffer.numel()``.
        group: the process group; default: the world.
        local_size: average inside consecutive blocks of this many ranks first.
        backend: the kernels' backend.
        prescaled: ``buffer`` already holds this rank's values times ``1/local_size``.
        exchanges_only: run the tree's communication alone (the same messages
            and bytes) without the statistics and the combine, leaving
            ``buffer`` holding no meaningful result: the communication floor
            the benchmarks compare AdaSum against.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: ``buffer`` is not an fp32/fp64 tensor, or a non-int boundary.
        ValueError: ``buffer`` is not 1-D contiguous, bad ``segments``, or
            ``local_size`` does not divide the world size.

    Examples:
        >>> adasum_allreduce_flat(bucket.buffer(), [0, 10, 25])         # doctest: +SKIP
    """
    world_size = require_process_group(group)
    check_local_size(local_size, world_size)
    if not isinstance(buffer, torch.Tensor) or buffer.dtype not in (torch.float32,
                                                                    torch.float64):
        raise TypeError(f"buffer must be a float32 or float64 tensor, got "
                        f"{getattr(buffer, 'dtype', type(buffer).__name__)}")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a 1-D contiguous tensor, got shape "
                         f"{tuple(buffer.shape)}")
    boundaries = kernels.check_segments(segments, buffer.numel())
    adasum_flat_unchecked(buffer, boundaries, group, local_size, backend, prescaled,
                          exchanges_only)


def adasum_flat_unchecked(buffer: torch.Tensor, boundaries: Sequence[int], group,
                          local_size: int, backend: str, prescaled: bool,
                          exchanges_only: bool) -> None:
    """``adasum_allreduce_flat`` on arguments its caller has checked or built
    (the plan's buckets, ``adasum_hook``'s DDP buckets)."""
    _average_in_blocks(buffer, group, local_size, prescaled)
    column, me = _column(group, local_size)
    _combine_along_tree(buffer, boundaries, column, me, group, backend, exchanges_only)


def _average_in_blocks(buffer: torch.Tensor, group, local_size: int, prescaled: bool) -> None:
    if local_size > 1:
        if not prescaled:
            buffer.mul_(1.0 / local_size)
        dist.all_reduce(buffer, group=consecutive_block(group, local_size))


def _column(group, local_size: int) -> Tuple[List[int], int]:
    """The global ranks that run the tree with this one (the same position
    in every block of ``local_size``), and this rank's index among them."""
    rank = dist.get_rank(group)
    return global_ranks(group)[rank % local_size::local_size], rank // local_size


@dataclass(frozen=True)
class TreeShare:
    """Where AdaSum's tree leaves this rank's part of one buffer when it stops
    after the halving (``adasum_halve``), and how ``adasum_gather`` rebuilds
    the whole from every rank's part.

    Attributes:
        levels: the halving's swaps (kept slice, given slice, peer's global rank).
        held: the element range the halving leaves combined here (empty on a
            rank folded into the tree's power-of-two part, whose block's
            data another rank carries).
        owned: this rank's share of ``held``: all of it, or with
            ``local_size`` k (k ranks of a block hold the same slice) one of
            k consecutive pieces. Across the group the owned ranges are
            disjoint and cover the buffer.
    """

    levels: tuple
    held: Tuple[int, int]
    owned: Tuple[int, int]


def adasum_tree_share(boundaries: Sequence[int], size: int, group, local_size: int) -> TreeShare:
    """This rank's ``TreeShare`` of a buffer of ``size`` elements cut at ``boundaries``."""
    column, me = _column(group, local_size)
    levels = tuple(_tree_levels(boundaries, size, column, me))
    top = _power_of_two_part(len(column))
    lo, hi = (0, 0) if me >= top else levels[-1][0] if levels else (0, size)
    # equal pieces but the last, so the block can all-gather them
    piece, size_of_piece = dist.get_rank(group) % local_size, -(-(hi - lo) // local_size)
    owned = (min(lo + piece * size_of_piece, hi), min(lo + (piece + 1) * size_of_piece, hi))
    return TreeShare(levels, (lo, hi), owned)


def adasum_halve(buffer: torch.Tensor, boundaries: Sequence[int], group, local_size: int,
                 backend: str, prescaled: bool) -> None:
    """AdaSum's tree up to the end of its halving: ``buffer[share.held]``
    then holds that slice of ``adasum_flat_unchecked``'s result, bitwise (the
    rest of ``buffer`` is scratch)."""
    _average_in_blocks(buffer, group, local_size, prescaled)
    column, me = _column(group, local_size)
    _halve_along_tree(buffer, boundaries, column, me, group, backend, False)


def adasum_gather(buffer: torch.Tensor, share: TreeShare, group, local_size: int) -> None:
    """The whole ``buffer`` on every rank from each rank's ``buffer[share.owned]``
    (any dtype): a block's ranks all-gather their pieces of ``held`` (through
    kept scratch buffers: the last piece is short), then the tree's reverse
    swaps run."""
    lo, hi = share.held
    if local_size > 1 and hi > lo:
        start, end = share.owned
        piece = -(-(hi - lo) // local_size)
        send = kernels.scratch_buffer("adasum_piece", (piece,), buffer.dtype, buffer.device)
        pieces = kernels.scratch_buffer("adasum_pieces", (piece * local_size,), buffer.dtype,
                                        buffer.device)
        send[:end - start].copy_(buffer[start:end])
        start_all_gather(pieces, send, consecutive_block(group, local_size)).wait()
        buffer[lo:hi].copy_(pieces[:hi - lo])
    column, me = _column(group, local_size)
    _gather_along_tree(buffer, share.levels, column, me, group)


# ------------------------------------------------------------------ the tree

def _through_host(tensor: torch.Tensor, group) -> bool:
    """Whether the tree's point-to-point messages of ``tensor`` must travel
    through host memory: gloo moves CUDA tensors in all_reduce and broadcast
    only, and its send/recv of them fails (seen on an H100: the receiving
    rank's connection closed)."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def _host_copy(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A kept CPU buffer of ``tensor``'s shape and dtype (its contents: not yet)."""
    return kernels.scratch_buffer(name, tuple(tensor.shape), tensor.dtype, torch.device("cpu"))


def _send(tensor: torch.Tensor, peer: int, group) -> None:
    if _through_host(tensor, group):
        tensor = _host_copy(tensor, "adasum_host_send").copy_(tensor)
    dist.send(tensor, peer, group)


def _recv(tensor: torch.Tensor, peer: int, group) -> None:
    if _through_host(tensor, group):
        staged = _host_copy(tensor, "adasum_host_recv")
        dist.recv(staged, peer, group)
        tensor.copy_(staged)
    else:
        dist.recv(tensor, peer, group)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to and receive ``recv`` from global rank ``peer``, concurrently."""
    staged = _through_host(send, group)
    if staged:
        send = _host_copy(send, "adasum_host_send").copy_(send)
        target, recv = recv, _host_copy(recv, "adasum_host_recv")
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    if staged:
        target.copy_(recv)


def _clip(boundaries: Sequence[int], lo: int, hi: int) -> List[int]:
    """Segment boundaries seen from the slice ``[lo, hi)`` of the buffer."""
    return [min(max(b, lo), hi) - lo for b in boundaries]


def _split_point(boundaries: Sequence[int], lo: int, hi: int) -> int:
    """Where the halving cuts ``[lo, hi)``: the point nearest its middle that is
    a chunk boundary of the segment it falls in (``kernels.ADASUM_CHUNK``
    elements from the segment's start) or a segment's end, so that no chunk is
    ever split between ranks. The halves differ by at most one chunk."""
    mid = lo + (hi - lo) // 2
    i = bisect.bisect_right(boundaries, mid) - 1
    if i >= len(boundaries) - 1:  # mid is the buffer's end: an empty slice
        return hi
    start, end = boundaries[i], boundaries[i + 1]
    chunk = kernels.ADASUM_CHUNK
    below = start + (mid - start) // chunk * chunk
    above = min(end, below + chunk)
    point = below if mid - below <= above - mid else above
    return min(max(point, lo), hi)  # lo and hi are such points themselves


def _chunks_before(boundaries: Sequence[int], point: int) -> int:
    """How many chunks of the segments lie before ``point`` (a split point)."""
    return sum(kernels.adasum_chunk_counts(_clip(boundaries, 0, point)))


def _level_stats(left: torch.Tensor, right: torch.Tensor, boundaries: Sequence[int], keep,
                 n_chunks: int, ranks: Sequence[int], me: int, distance: int, group,
                 backend: str, exchanges_only: bool) -> Optional[torch.Tensor]:
    """Every segment's statistics of the level's two vectors, which the
    ``2 * distance`` ranks hold in disjoint slices (``keep`` is this rank's).

    Each rank writes the partials of the chunks in its slice into its rows of
    a ``[n_chunks, 3]`` array of -0.0 (every chunk lies in exactly one slice);
    a butterfly exchange sums the arrays, which adds only -0.0 to each row, so
    every rank ends with every chunk's exact partial, bitwise, and reduces
    them in chunk order: the statistics ``kernels.adasum_stats`` gives for the
    whole vectors, whatever the slices.
    """
    partials = torch.full((n_chunks, 3), -0.0, dtype=torch.float64, device=left.device)
    if not exchanges_only:
        mine = kernels.adasum_chunk_stats(left, right, _clip(boundaries, *keep),
                                          backend=backend)
        first = _chunks_before(boundaries, keep[0])
        partials[first:first + mine.shape[0]] = mine
    step = 1
    while step <= distance:  # butterfly sum over the 2 * distance ranks
        theirs = torch.empty_like(partials)
        _exchange(partials, theirs, ranks[me ^ step], group)
        partials = partials + theirs
        step <<= 1
    if exchanges_only:
        return None
    return kernels.adasum_reduce_chunks(partials, boundaries, backend=backend)


def _power_of_two_part(n: int) -> int:
    """How many of the tree's ``n`` ranks halve and swap: the largest power
    of two <= n; rank r >= it is folded into r minus it first."""
    return 1 << (n.bit_length() - 1)


def _tree_levels(boundaries: Sequence[int], size: int, ranks: Sequence[int],
                 me: int) -> List[Tuple[Tuple[int, int], Tuple[int, int], int]]:
    """The halving levels of the tree for ``ranks[me]``: per level, the slice
    it keeps, the slice it gives and the global rank it swaps them with (none
    off the tree's power-of-two part). The last kept slice is where the
    halving leaves this rank's share of the combined buffer."""
    n = len(ranks)
    top = _power_of_two_part(n)
    if me >= top:
        return []
    lo, hi, distance, levels = 0, size, 1, []
    while distance < top:
        mid = _split_point(boundaries, lo, hi)
        keep, give = ((lo, mid), (mid, hi)) if not me & distance else ((mid, hi), (lo, mid))
        levels.append((keep, give, ranks[me ^ distance]))
        lo, hi = keep
        distance <<= 1
    return levels


def _halve_along_tree(buffer: torch.Tensor, boundaries: Sequence[int], ranks: Sequence[int],
                      me: int, group, backend: str, exchanges_only: bool) -> None:
    """The tree's first half: after it, the slice ``_tree_levels`` ends on
    holds its part of the AdaSum of the ``ranks``' buffers (a rank off the
    power-of-two part has sent its buffer and holds nothing).

    At each level a rank swaps half of its slice with ``me ^ d`` (cut on a
    chunk boundary, ``_split_point``), the 2d ranks sharing the level's
    vectors sum their per-chunk partial statistics by a butterfly exchange
    (``_level_stats``; ``3 * 8`` bytes per chunk of the buffer), and the
    halves are combined. The received vectors go into a kept scratch buffer
    (``kernels.scratch_buffer``).
    """
    n = len(ranks)
    if n == 1:
        return
    top = _power_of_two_part(n)
    if me >= top:
        _send(buffer, ranks[me - top], group)
        return
    if me + top < n:
        other = kernels.scratch_buffer("adasum_received", (buffer.numel(),), buffer.dtype,
                                       buffer.device)
        _recv(other, ranks[me + top], group)
        if not exchanges_only:
            stats = kernels.adasum_stats(buffer, other, boundaries, backend=backend)
            kernels.adasum_combine(buffer, other, boundaries, stats, out=buffer, backend=backend)
    n_chunks = sum(kernels.adasum_chunk_counts(boundaries))
    distance = 1
    for keep, give, peer in _tree_levels(boundaries, buffer.numel(), ranks, me):
        lower = not me & distance
        received = kernels.scratch_buffer("adasum_received", (keep[1] - keep[0],),
                                          buffer.dtype, buffer.device)
        _exchange(buffer[give[0]:give[1]], received, peer, group)
        mine = buffer[keep[0]:keep[1]]
        left, right = (mine, received) if lower else (received, mine)
        stats = _level_stats(left, right, boundaries, keep, n_chunks, ranks, me, distance, group,
                             backend, exchanges_only)
        if not exchanges_only:
            kernels.adasum_combine(left, right, _clip(boundaries, *keep), stats, out=mine,
                                   backend=backend)
        distance <<= 1


def _gather_along_tree(buffer: torch.Tensor, levels, ranks: Sequence[int], me: int,
                       group) -> None:
    """The tree's second half: from each rank's last kept slice of ``levels``
    (``_tree_levels``), the whole ``buffer`` on every rank of ``ranks`` (any
    dtype: the slices are element ranges), by the levels' swaps in reverse
    and a send to the rank folded in first, if any."""
    n = len(ranks)
    if n == 1:
        return
    top = _power_of_two_part(n)
    if me >= top:
        _recv(buffer, ranks[me - top], group)
        return
    for keep, give, peer in reversed(levels):
        _exchange(buffer[keep[0]:keep[1]], buffer[give[0]:give[1]], peer, group)
    if me + top < n:
        _send(buffer, ranks[me + top], group)


def _combine_along_tree(buffer: torch.Tensor, boundaries: Sequence[int], ranks: Sequence[int],
                        me: int, group, backend: str, exchanges_only: bool) -> None:
    """AdaSum of the ``buffer``s of ``ranks`` (global ranks; this one is
    ``ranks[me]``), in place, along the tree ``adasum_allreduce_flat``
    describes: recursive vector halving with distance doubling
    (``_halve_along_tree``), then the reverse all-gather
    (``_gather_along_tree``)."""
    _halve_along_tree(buffer, boundaries, ranks, me, group, backend, exchanges_only)
    _gather_along_tree(buffer, _tree_levels(boundaries, buffer.numel(), ranks, me), ranks, me,
                       group)
