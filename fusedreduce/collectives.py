"""Collectives over a BucketPlan: the one place that talks to torch.distributed.

Every API of fusedreduce reduces through here: flatten a bucket (cast and
prescale in the same pass), one collective per bucket, unflatten (cast back
and postscale in the same pass). Collectives are issued asynchronously, so the
flatten of bucket k+1 overlaps bucket k's communication.
"""
from __future__ import annotations

import bisect
import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from .buckets import Bucket, BucketPlan
from .kernels._torch import scratch_buffer


def require_process_group(group=None) -> int:
    """The world size of ``group``; a clear error if torch.distributed is not up.

    Raises:
        RuntimeError: no default process group has been initialised, or this
            process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('nccl' or 'gloo') first (torchrun sets "
            "the environment it reads)")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """Where tensors must live to go through ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_same_on_all_ranks(description: Sequence[Any], names: Sequence[str], group=None,
                             what: str = "parameter", layout: Any = None,
                             layout_hint: str = "") -> None:
    """Raise on every rank unless all ranks hold the same ``description`` and ``layout``.

    ``description`` has one entry per tensor (``names[i]`` names entry ``i`` in
    the error); ``layout`` is compared after it (the bucket boundaries, say),
    so a differing tensor is always reported as such, not as a layout change.
    Costs one all-reduce of two int64s when the ranks agree; only on a mismatch
    are the descriptions gathered, to name the first entry that differs.

    Raises:
        RuntimeError: the ranks disagree; names the first differing ``what``
            (``names[i]``) and what each rank has there, or, when every entry
            agrees, says the layouts differ (with ``layout_hint``).
    """
    mine = (list(description), layout)
    digest = hashlib.sha256(pickle.dumps(mine)).digest()
    value = int.from_bytes(digest[:7], "little")  # 56 bits: exact in int64 arithmetic
    device = comm_device(group)
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):
        return
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, list(names)), group=group)
    longest = max(len(d) for (d, _), _ in everyone)
    for i in range(longest):
        entries = [d[i] if i < len(d) else "<missing>" for (d, _), _ in everyone]
        if any(e != entries[0] for e in entries):
            name = next(n[i] for (d, _), n in everyone if i < len(n))
            per_rank = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            raise RuntimeError(f"ranks disagree on {what} {i} ({name}): {per_rank}. Every "
                               f"rank must pass the same {what}s in the same order")
    per_rank = "; ".join(f"rank {r}: {lay}" for r, ((_, lay), _) in enumerate(everyone))
    raise RuntimeError(f"ranks agree on every {what} but not on the bucket layout"
                       f"{' (' + layout_hint + ')' if layout_hint else ''}: {per_rank}")


@dataclass
class PendingBucket:
    """A bucket whose collective is in flight: finish it with ``finish_bucket``."""

    bucket: Bucket
    buffer: torch.Tensor
    work: Optional[Any]


def start_bucket_all_reduce(plan: BucketPlan, bucket: Bucket, tensors: Sequence[torch.Tensor],
                            buffer: torch.Tensor, *, group=None, prescale: float = 1.0,
                            world_size: int = 2, backend: str = "auto",
                            count_nonfinite: bool = False) -> PendingBucket:
    """Flatten ``bucket`` into ``buffer`` (times ``prescale``) and start its all-reduce.

    With ``count_nonfinite``, ``buffer`` has one element more than the bucket:
    it carries 1 where this rank's inputs held an inf/NaN (else 0), so after
    the sum it counts the ranks that did, at no extra collective.
    """
    if count_nonfinite:
        data = buffer[:bucket.size]
        _, flag = plan.flatten(bucket, tensors, out=data, scale=prescale, check_finite=True,
                               backend=backend)
        buffer[bucket.size:].copy_(flag)
    else:
        data = plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=backend)
    work = dist.all_reduce(buffer, group=group, async_op=True) if world_size > 1 else None
    return PendingBucket(bucket, data, work)


def finish_bucket(plan: BucketPlan, pending: PendingBucket, outputs: Sequence[torch.Tensor], *,
                  postscale: float = 1.0, backend: str = "auto") -> None:
    """Wait for ``pending``'s collective and write its buffer into ``outputs``."""
    if pending.work is not None:
        pending.work.wait()
    plan.unflatten(pending.bucket, pending.buffer, outputs, scale=postscale, backend=backend)


def new_buffers(plan: BucketPlan) -> List[torch.Tensor]:
    return [plan.new_buffer(b) for b in plan.buckets]


def check_buffers(plan: BucketPlan, buffers: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``buffers`` fit the plan's buckets one by one."""
    if len(buffers) != len(plan.buckets):
        raise ValueError(f"buffers has {len(buffers)} entries for {len(plan.buckets)} buckets")
    for bucket, buffer in zip(plan.buckets, buffers):
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != bucket.dtype \
                or buffer.device != bucket.device or buffer.shape != (bucket.size,) \
                or not buffer.is_contiguous():
            raise ValueError(
                f"buffers[{bucket.index}] must be a contiguous {bucket.dtype} tensor of shape "
                f"({bucket.size},) on {bucket.device}")


def all_reduce_plan(
    plan: BucketPlan,
    tensors: Sequence[torch.Tensor],
    *,
    outputs: Optional[Sequence[torch.Tensor]] = None,
    group=None,
    prescale: float = 1.0,
    postscale: float = 1.0,
    buffers: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> List[torch.Tensor]:
    """Sum ``tensors`` over ``group`` through the plan's fused buckets.

    Each bucket is flattened (cast to its communication dtype, times
    ``prescale``), summed with one ``all_reduce``, and written into
    ``outputs`` (cast back, times ``postscale``). A mean is
    ``postscale=1/world_size``; ``prescale`` guards low-precision overflow.

    Args:
        plan: a plan made from tensors shaped like ``tensors``, the same on
            every rank.
        tensors: this rank's tensors, in plan order; not modified unless they
            are also the ``outputs``.
        outputs: where the sums go (default: ``tensors``, in place).
        group: the process group (default: the world).
        prescale, postscale: finite factors applied before and after the sum.
        buffers: persistent flat buffers, one per bucket (default: fresh ones).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        The flat buffers holding the reduced (not yet postscaled) buckets.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: tensors, outputs or buffers do not match the
            plan, or a bad scale; raised before any collective starts.

    Example:
        >>> plan = BucketPlan(grads, comm_dtype=torch.float32)      # doctest: +SKIP
        >>> all_reduce_plan(plan, grads, postscale=1 / dist.get_world_size())  # doctest: +SKIP
    """
    world_size = require_process_group(group)
    plan.check(tensors, "tensors")
    outputs = tensors if outputs is None else outputs
    plan.check(outputs, "outputs")
    for name, value in (("prescale", prescale), ("postscale", postscale)):
        kernels.check_scale(value, name)
    buffers = new_buffers(plan) if buffers is None else list(buffers)
    check_buffers(plan, buffers)
    pending = [start_bucket_all_reduce(plan, bucket, tensors, buffer, group=group,
                                       prescale=prescale, world_size=world_size,
                                       backend=backend)
               for bucket, buffer in zip(plan.buckets, buffers)]
    for p in pending:
        finish_bucket(plan, p, outputs, postscale=postscale, backend=backend)
    return buffers


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, *, group=None,
                      bucket_cap_mb: float = 25.0, backend: str = "auto",
                      verify: bool = True, names: Optional[Sequence[str]] = None) -> None:
    """Make every rank's ``tensors`` bitwise equal to rank ``src``'s, in place.

    Floating tensors go through fused buckets of their own dtype (one
    ``broadcast`` per bucket, no cast, so the copy is exact); other dtypes
    (integer and bool buffers, say) are packed per dtype with torch and
    broadcast once per dtype. Tensors on a device the backend cannot use
    (CPU tensors under NCCL) travel through a staging copy.

    ``src`` is a global rank, as in ``torch.distributed.broadcast``. With
    ``verify`` (the default), one small all-reduce first checks that every
    rank passes the same shapes and dtypes and the same bucket cap; ``names``
    (one per tensor) label the first mismatch in the error.

    Raises:
        RuntimeError: with ``verify``: the ranks' tensor lists or bucket
            layouts differ (raised on every rank before any broadcast).
    """
    tensors = list(tensors)
    device = comm_device(group)
    floating = [t for t in tensors if t.dtype in kernels.SUPPORTED_DTYPES]
    others = [t for t in tensors if t.dtype not in kernels.SUPPORTED_DTYPES]
    staged = [t if t.device == device else t.to(device) for t in floating]
    plan = BucketPlan(staged, bucket_cap_mb=bucket_cap_mb)
    if verify and dist.get_world_size(group) > 1:
        labels = list(names) if names is not None else [f"tensors[{i}]"
                                                         for i in range(len(tensors))]
        verify_same_on_all_ranks(
            [(tuple(t.shape), str(t.dtype)) for t in tensors],
            [f"{label} {tuple(t.shape)} {t.dtype}" for label, t in zip(labels, tensors)],
            group, what="tensor", layout=plan.layout(),
            layout_hint="pass the same bucket_cap_mb on every rank")
    with torch.no_grad():
        for bucket in plan.buckets:
            buffer = plan.flatten(bucket, staged, backend=backend)
            dist.broadcast(buffer, src, group=group)
            plan.unflatten(bucket, buffer, staged, backend=backend)
        for t, s in zip(floating, staged):
            if s is not t:
                t.copy_(s)
        for dtype in sorted({t.dtype for t in others}, key=str):
            same = [t for t in others if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1).to(device) for t in same])
            dist.broadcast(flat, src, group=group)
            start = 0
            for t in same:
                t.copy_(flat[start:start + t.numel()].view(t.shape))
                start += t.numel()


# ------------------------------------------------------------------ AdaSum

_subgroups: dict = {}


def _global_ranks(group) -> List[int]:
    size = dist.get_world_size(group)
    return list(range(size)) if group is None else \
        [dist.get_global_rank(group, r) for r in range(size)]


def _local_group(group, local_size: int):
    """This rank's block of ``local_size`` consecutive ranks, as a process group.

    ``new_group`` is collective over the whole world, so every rank creates
    every block, once per (group, local_size), in the same order.
    """
    key = (group, local_size)
    if key not in _subgroups:
        ranks = _global_ranks(group)
        _subgroups[key] = [dist.new_group(ranks[i:i + local_size])
                           for i in range(0, len(ranks), local_size)]
    return _subgroups[key][dist.get_rank(group) // local_size]


def check_local_size(local_size, world_size: int) -> int:
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or world_size % local_size:
        raise ValueError(f"local_size must be a positive int dividing the world size "
                         f"({world_size}), got {local_size!r}")
    return local_size


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to and receive ``recv`` from global rank ``peer``, concurrently."""
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _clip(bounds: Sequence[int], lo: int, hi: int) -> List[int]:
    """Segment boundaries seen from the slice ``[lo, hi)`` of the buffer."""
    return [min(max(b, lo), hi) - lo for b in bounds]


def _split_point(bounds: Sequence[int], lo: int, hi: int) -> int:
    """Where the halving cuts ``[lo, hi)``: the point nearest its middle that is
    a chunk boundary of the segment it falls in (``kernels.ADASUM_CHUNK``
    elements from the segment's start) or a segment's end, so that no chunk is
    ever split between ranks. The halves differ by at most one chunk."""
    mid = lo + (hi - lo) // 2
    i = bisect.bisect_right(bounds, mid) - 1
    if i >= len(bounds) - 1:  # mid is the buffer's end: an empty slice
        return hi
    start, end = bounds[i], bounds[i + 1]
    chunk = kernels.ADASUM_CHUNK
    below = start + (mid - start) // chunk * chunk
    above = min(end, below + chunk)
    point = below if mid - below <= above - mid else above
    return min(max(point, lo), hi)  # lo and hi are such points themselves


def _chunks_before(bounds: Sequence[int], point: int) -> int:
    """How many chunks of the segments lie before ``point`` (a split point)."""
    return sum(kernels.adasum_chunk_counts(_clip(bounds, 0, point)))


def _level_stats(left: torch.Tensor, right: torch.Tensor, bounds: Sequence[int], keep,
                 n_chunks: int, ranks: Sequence[int], me: int, distance: int, group,
                 backend: str) -> torch.Tensor:
    """Every segment's statistics of the level's two vectors, which the
    ``2 * distance`` ranks hold in disjoint slices (``keep`` is this rank's).

    Each rank writes the partials of the chunks in its slice into its rows of
    a ``[n_chunks, 3]`` array of -0.0 (every chunk lies in exactly one slice);
    a butterfly exchange sums the arrays, which adds only -0.0 to each row, so
    every rank ends with every chunk's exact partial, bitwise, and reduces
    them in chunk order: the statistics ``kernels.adasum_stats`` gives for the
    whole vectors, whatever the slices.
    """
    local = _clip(bounds, *keep)
    mine = kernels.adasum_chunk_stats(left, right, local, backend=backend)
    partials = torch.full((n_chunks, 3), -0.0, dtype=torch.float64, device=left.device)
    first = _chunks_before(bounds, keep[0])
    partials[first:first + mine.shape[0]] = mine
    step = 1
    while step <= distance:  # butterfly sum over the 2 * distance ranks
        theirs = torch.empty_like(partials)
        _exchange(partials, theirs, ranks[me ^ step], group)
        partials = partials + theirs
        step <<= 1
    return kernels.adasum_reduce_chunks(partials, bounds, backend=backend)


def adasum_tree(buffer: torch.Tensor, bounds: Sequence[int], ranks: Sequence[int], me: int,
                group=None, backend: str = "auto") -> None:
    """AdaSum of the ``buffer``s of ``ranks`` (global ranks), in place, per segment.

    The tree is fixed, so the result is defined for any number of ranks n:
    with P the largest power of two <= n, each rank r >= P is first combined
    into r - P (r - P on the left); then ranks 0..P-1 combine level by level at
    distance d = 1, 2, 4, ... (the lower rank on the left). The power-of-two
    part runs as recursive vector halving with distance doubling: at each level
    a rank swaps half of its slice with ``me ^ d`` (cut on a chunk boundary,
    ``_split_point``), the 2d ranks sharing the level's vectors sum their
    per-chunk partial statistics by a butterfly exchange (``_level_stats``;
    ``3 * 8`` bytes per chunk of the buffer), and the halves are combined; a
    reverse all-gather then rebuilds the result. A segment's statistics are
    those of ``kernels.adasum_stats`` on the whole vectors, whichever way the
    buffer is cut, so the result does not depend on the bucket layout. Every
    rank ends with bitwise the same buffer; each sends about 2(P-1)/P of it
    (plus n > P's extra vector). The received vectors go into a scratch
    buffer (``scratch_buffer``: kept between calls on the CPU).
    """
    n = len(ranks)
    if n == 1:
        return
    top = 1 << (n.bit_length() - 1)
    if me >= top:
        dist.send(buffer, ranks[me - top], group)
        dist.recv(buffer, ranks[me - top], group)
        return
    if me + top < n:
        other = scratch_buffer("adasum_received", (buffer.numel(),), buffer.dtype,
                               buffer.device)
        dist.recv(other, ranks[me + top], group)
        stats = kernels.adasum_stats(buffer, other, bounds, backend=backend)
        kernels.adasum_combine(buffer, other, bounds, stats, out=buffer, backend=backend)
    n_chunks = sum(kernels.adasum_chunk_counts(bounds))
    lo, hi, distance, levels = 0, buffer.numel(), 1, []
    while distance < top:
        peer = ranks[me ^ distance]
        mid = _split_point(bounds, lo, hi)
        lower = not me & distance
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        received = scratch_buffer("adasum_received", (keep[1] - keep[0],), buffer.dtype,
                                  buffer.device)
        _exchange(buffer[give[0]:give[1]], received, peer, group)
        mine = buffer[keep[0]:keep[1]]
        left, right = (mine, received) if lower else (received, mine)
        stats = _level_stats(left, right, bounds, keep, n_chunks, ranks, me, distance, group,
                             backend)
        kernels.adasum_combine(left, right, _clip(bounds, *keep), stats, out=mine,
                               backend=backend)
        levels.append((lo, hi, keep, give, peer))
        lo, hi = keep
        distance <<= 1
    for lo, hi, keep, give, peer in reversed(levels):
        _exchange(buffer[keep[0]:keep[1]], buffer[give[0]:give[1]], peer, group)
    if me + top < n:
        dist.send(buffer, ranks[me + top], group)


def adasum_comm_dtype(dtype: torch.dtype) -> torch.dtype:
    """AdaSum combines 16-bit inputs in fp32, fp64 in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def adasum_allreduce(tensors: Sequence[torch.Tensor], group=None, *, local_size: int = 1,
                     bucket_cap_mb: float = 25.0, backend: str = "auto") -> List[torch.Tensor]:
    """AdaSum of every rank's ``tensors``, per tensor; new tensors, the same on all ranks.

    For two gradients of a tensor, ``AdaSum(a, b) = (1 - a·b/(2‖a‖²))·a +
    (1 - a·b/(2‖b‖²))·b``: orthogonal gradients add, parallel ones average.
    Ranks combine along a fixed tree (``adasum_tree``), so any world size works
    and the result is bitwise identical on every rank. Coefficients are per
    tensor, never per fused buffer: the bucketing does not change the result.

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
            lists differ (raised on every rank, naming the first difference).
        TypeError: a sparse, integer or non-tensor entry (the index is named).
        ValueError: ``local_size`` does not divide the world size.

    Example:
        >>> averaged = adasum_allreduce([p.grad for p in model.parameters()])  # doctest: +SKIP
    """
    world_size = require_process_group(group)
    check_local_size(local_size, world_size)
    tensors = list(tensors)
    plan = BucketPlan(tensors, bucket_cap_mb=bucket_cap_mb, comm_dtype=adasum_comm_dtype)
    if world_size > 1:
        names = [f"tensors[{i}] {tuple(s.shape)} {s.dtype}" for i, s in enumerate(plan.specs)]
        verify_same_on_all_ranks(plan.signature() + [("local_size", local_size)],
                                 names + ["local_size"], group, what="tensor",
                                 layout=plan.layout(),
                                 layout_hint="pass the same bucket_cap_mb on every rank")
    outputs: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for bucket, buffer in _adasum_buckets(plan, tensors, group, local_size, backend):
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


def adasum_segments(bucket: Bucket) -> List[int]:
    """The bucket's AdaSum segments: each tensor's own elements, and the padding
    before and after it as segments of their own (often empty), so a tensor's
    statistics never include padding and are those of the tensor alone."""
    bounds = [0]
    for offset, numel in zip(bucket.offsets, bucket.numels):
        bounds += [offset, offset + numel]
    return bounds + [bucket.size]


def adasum_plan(plan: BucketPlan, tensors: Sequence[torch.Tensor],
                outputs: Sequence[torch.Tensor], *, group=None, local_size: int = 1,
                backend: str = "auto") -> None:
    """The AdaSum of ``tensors`` across ranks into ``outputs``, bucket by bucket.

    ``adasum_allreduce`` without its checks: the caller vouches that every rank
    has the same plan (``plan`` built with ``comm_dtype=adasum_comm_dtype``).
    """
    for bucket, buffer in _adasum_buckets(plan, tensors, group, local_size, backend):
        plan.unflatten(bucket, buffer, outputs, backend=backend)


def _adasum_buckets(plan: BucketPlan, tensors: Sequence[torch.Tensor], group, local_size: int,
                    backend: str):
    """``(bucket, buffer)`` per bucket of ``plan``, ``buffer`` a new flat buffer
    holding the bucket's AdaSum across the ranks."""
    for bucket in plan.buckets:
        buffer = plan.flatten(bucket, tensors, scale=1.0 / local_size, backend=backend)
        adasum_buffer(buffer, adasum_segments(bucket), group=group, local_size=local_size,
                      backend=backend, scaled=True)
        yield bucket, buffer


def adasum_buffer(buffer: torch.Tensor, bounds: Sequence[int], *, group=None,
                  local_size: int = 1, backend: str = "auto", scaled: bool = False) -> None:
    """The AdaSum of every rank's ``buffer`` (fp32 or fp64, cut into segments
    at ``bounds``), in place: with ``local_size`` k, each block of k ranks is
    first averaged (``buffer`` times 1/k unless ``scaled`` says it already
    was, then summed), then the blocks combine along ``adasum_tree``."""
    rank = dist.get_rank(group)
    if local_size > 1:
        if not scaled:
            buffer.mul_(1.0 / local_size)
        dist.all_reduce(buffer, group=_local_group(group, local_size))
    column = _global_ranks(group)[rank % local_size::local_size]
    adasum_tree(buffer, bounds, column, rank // local_size, group, backend)
