"""The sharded pipelines over a ``BucketPlan(..., shards=world_size)``.

- reduce-scatter: flatten (cast and prescale in the same pass) → one
  reduce-scatter per bucket → this rank's part of the sum, postscaled;
- all-gather: this rank's part → one all-gather per bucket → unflatten into
  the tensors (cast and scaled in the same pass).

A sharded plan pads each bucket at its end only, so the bucket splits into
``shards`` equal contiguous parts, each starting on a 16-byte boundary; rank
``r`` of the group owns part ``r``, whatever parameter bounds it cuts
(Megatron's distributed optimizer splits its buckets the same way, where FSDP2
pads every parameter). ``part_ranges`` maps a part back to the elements of the
tensors it holds: the one table a sharded optimizer reads.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from ._checks import check_instance, tensor_list
from .allreduce import PendingBucket, check_buffers, wait_for
from .buckets import Bucket, BucketPlan
from .process_group import require_process_group



def _check_part_of_buffer(part, buffer, group) -> None:
    """``buffer`` must be the group's size times ``part``, of its dtype and
    device (gloo's own check names neither, after the collective was issued)."""
    check_instance(part, "part", torch.Tensor, "a tensor")
    check_instance(buffer, "buffer", torch.Tensor, "a tensor")
    if buffer.dtype != part.dtype or buffer.device != part.device \
            or buffer.numel() != part.numel() * dist.get_world_size(group):
        raise ValueError(f"buffer must hold the group's size ({dist.get_world_size(group)}) "
                         f"times part's {part.numel()} elements, of part's dtype "
                         f"({part.dtype}) on its device ({part.device}); got "
                         f"{buffer.numel()} of {buffer.dtype} on {buffer.device}")


def start_reduce_scatter(part: torch.Tensor, buffer: torch.Tensor, group):
    """Start the reduce-scatter of ``buffer`` over ``group`` into this rank's
    ``part`` (in place where ``part`` is its slot of ``buffer``); returns the
    collective's handle.

    Raises:
        TypeError: ``part`` or ``buffer`` is not a tensor.
        ValueError: ``buffer`` is not the group's size times ``part``'s
            elements, of its dtype on its device (checked here, naming the
            arguments: gloo's own check names neither, after the collective
            was issued).

    Examples:
        >>> work = start_reduce_scatter(buffer[:n], buffer, None)  # doctest: +SKIP
        >>> work.wait()                                            # doctest: +SKIP
    """
    _check_part_of_buffer(part, buffer, group)
    # the *_single names replace the *_tensor ones (which warn) where they exist
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(part, buffer, group=group, async_op=True)


def start_all_gather(buffer: torch.Tensor, part: torch.Tensor, group):
    """Start gathering every rank's ``part`` of ``group``, in rank order, into
    ``buffer`` (``world_size`` parts long); returns the collective's handle.
    The sharded all-gathers and AdaSum's gather share this one call.

    Raises:
        TypeError, ValueError: as ``start_reduce_scatter``'s, before the
            collective starts.
    """
    _check_part_of_buffer(part, buffer, group)
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(buffer, part, group=group, async_op=True)


class _Works:
    """Several collectives' handles, waited for as one."""

    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def broadcast_from(pieces: Sequence[Tuple[int, torch.Tensor]], group) -> _Works:
    """One broadcast per ``(src, tensor)`` of ``pieces``, in place, in that
    order (``src`` a rank of ``group``); every rank passes the same sources
    and sizes."""
    group = group or dist.group.WORLD
    return _Works([dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group,
                                  async_op=True)
                   for src, tensor in pieces])


def broadcast_slots(buffer: torch.Tensor, group, world_size: int) -> _Works:
    """The all-gather of ``buffer``'s equal slots, each rank's already in its
    own slot, as one broadcast per rank from that slot, in place. For gloo:
    torch's gloo all-gather allocates a temporary of the whole buffer and
    copies out of it, and took 2.0–3.0 times as long as these broadcasts
    (4M fp32 elements on 2 and 4 ranks, docs/guides/sharded.md, "On gloo")."""
    size = buffer.numel() // world_size
    return broadcast_from([(r, buffer[r * size:(r + 1) * size]) for r in range(world_size)],
                          group)


#: on gloo, a bucket of one dtype whose tensors hold this many elements on
#: average is gathered by one broadcast per tensor range straight into the
#: parameters (``broadcast_from``): each saves two copies of its elements (into
#: the buffer this rank sends, out of the gathered buffer) and costs one more
#: broadcast, about 0.1-0.2 ms on 2 gloo ranks; 2**17 fp32 elements copied
#: twice take about as long (docs/benchmarks/sharded.md, "Few large tensors")
DIRECT_MEAN_NUMEL = 1 << 17


class _Exchange:
    """A two-rank reduce-scatter in flight (``start_bucket_exchange``):
    waiting for it adds this rank's elements into the peer's, received in
    this rank's part, once."""

    def __init__(self, work, sums: List[torch.Tensor], own: List[torch.Tensor]) -> None:
        self.work = work
        self.sums, self.own = sums, own

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            torch._foreach_add_(self.sums, self.own)
        return True


@dataclass(frozen=True)
class PartRange:
    """The elements of one tensor that one part of a bucket holds.

    Attributes:
        tensor: the tensor's index in the plan.
        start: its first element held (in the tensor's flattened order).
        end: one past its last element held.
        offset: where ``start`` sits in the part.
    """

    tensor: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class OwnedRange(PartRange):
    """The elements of one parameter that this rank owns, in a ``ShardLayout``:
    a ``PartRange`` of this rank's part (``start``/``end`` in the parameter's
    flattened order, ``offset`` in the part, ``tensor`` its index in the
    plan), with the parameter and bucket it belongs to.

    Attributes:
        param: the parameter's index in the optimizer's parameter order
            (``param_groups``, in order).
        bucket: the index of its bucket in ``ShardLayout.plan.buckets``.
    """

    param: int
    bucket: int


@dataclass(frozen=True)
class ShardLayout:
    """Which elements of which bucket and parameter one rank owns, as data:
    what ``DistributedOptimizer(..., shard=True).layout`` returns. The
    layout is fixed at construction (``add_param_group`` makes a new one);
    frozen parameters keep their elements.

    Attributes:
        plan: the bucket plan the parts are cut from (``shards`` parts per
            bucket, padding at bucket ends only).
        rank: the owner's rank in the optimizer's process group.
        world_size: the number of ranks the buckets are shared among.
        parts: per bucket, the ``(first, last)`` elements of the bucket this
            rank owns (``bucket[first:last]``; part ``rank`` of each bucket,
            with ``local_size`` > 1 over several nodes part ``(rank %
            local_size) * nodes + rank // local_size``, or with AdaSum the
            slice its tree's halving leaves the rank, unequal and
            chunk-aligned).
        ranges: the parameter elements this rank owns, in plan order; a
            parameter appears at most once (its elements are contiguous in
            one bucket), and not at all when it owns none of them.

    Examples:
        >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
        ...                            shard=True)
        >>> [(r.param, r.start, r.end) for r in opt.layout.ranges]          # doctest: +SKIP
        [(2, 0, 65), (3, 0, 5), (0, 40, 91)]
        >>> opt.layout.range_of(1) is None   # none of parameter 1 on this rank  # doctest: +SKIP
        True
    """

    plan: BucketPlan
    rank: int
    world_size: int
    parts: Tuple[Tuple[int, int], ...]
    ranges: Tuple[OwnedRange, ...]

    def range_of(self, param: int) -> Optional[OwnedRange]:
        """The elements of parameter ``param`` (its index in the optimizer's
        parameter order) this rank owns; None where it owns none."""
        return next((r for r in self.ranges if r.param == param), None)


def part_ranges(bucket: Bucket, part: int) -> List[PartRange]:
    """The tensor elements held by part ``part`` of ``bucket``, in bucket order.

    Padding (alignment gaps and the bucket's end) belongs to no tensor and is
    left out; a tensor cut by a part boundary appears in both parts.

    Raises:
        TypeError: ``bucket`` is not a ``Bucket`` (a plan: pass one of
            ``plan.buckets``).
        ValueError: ``part`` is not one of the bucket's ``shards`` parts.

    Examples:
        >>> plan = BucketPlan([torch.zeros(10), torch.zeros(3)], shards=2)
        >>> part_ranges(plan.buckets[0], 1)
        [PartRange(tensor=0, start=8, end=10, offset=0), PartRange(tensor=1, start=0, end=3, offset=4)]
    """
    hint = ": pass one of plan.buckets" if isinstance(bucket, BucketPlan) else ""
    check_instance(bucket, "bucket", Bucket, "a Bucket", hint)
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < bucket.shards:
        raise ValueError(f"part={part!r} is not a part of a bucket in {bucket.shards} parts")
    return ranges_between(bucket, part * bucket.part_size, (part + 1) * bucket.part_size)


def ranges_between(bucket: Bucket, first: int, last: int) -> List[PartRange]:
    """The tensor elements in ``bucket[first:last]``, in bucket order
    (``part_ranges`` for any contiguous range; offsets from ``first``)."""
    ranges = []
    for tensor, offset, numel in zip(bucket.tensor_indices, bucket.offsets, bucket.numels):
        start, end = max(offset, first), min(offset + numel, last)
        if start < end:
            ranges.append(PartRange(tensor, start - offset, end - offset, start - first))
    return ranges


def new_part(bucket: Bucket) -> torch.Tensor:
    """An uninitialised buffer for one part of ``bucket``."""
    return torch.empty(bucket.part_size, dtype=bucket.dtype, device=bucket.device)


def start_bucket_reduce_scatter(plan: BucketPlan, bucket: Bucket, tensors: Sequence[torch.Tensor],
                                buffer: torch.Tensor, part: torch.Tensor, *, group,
                                world_size: int, prescale: float = 1.0,
                                backend: str = "auto") -> PendingBucket:
    """Flatten ``bucket`` into ``buffer`` (times ``prescale``) and start the
    reduce-scatter that leaves this rank's part of the sum in ``part``; a
    world of one rank flattens straight into ``part``."""
    if world_size == 1:
        plan.flatten(bucket, tensors, out=part, scale=prescale, backend=backend)
        return PendingBucket(bucket, part, None)
    plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=backend)
    work = start_reduce_scatter(part, buffer, group) if bucket.size else None
    return PendingBucket(bucket, part, work)


def start_bucket_exchange(bucket: Bucket, tensors: Sequence[torch.Tensor], part: torch.Tensor,
                          sent: torch.Tensor, *, group, rank: int,
                          backend: str = "auto") -> PendingBucket:
    """``start_bucket_reduce_scatter`` on two ranks, without a prescale, as
    one exchange: this rank flattens the peer's elements of ``bucket`` into
    ``sent`` (the peer's slot of the bucket's buffer) and one all-to-all
    sends it and receives the peer's elements of this rank's part into
    ``part``; waiting adds this rank's own elements into it, straight from
    ``tensors`` (contiguous, of the bucket's dtype, not written until the
    exchange is waited for). For gloo on the host, whose reduce-scatter
    all-reduces the whole buffer: an all-reduce sends each rank's elements
    across and back (on a 10 MiB fp32 buffer this all-to-all took 0.36
    times its time on 2 gloo ranks), and half the bucket is flattened. The
    sum of two is one addition, so the part has the all-reduce's bits; the
    peer's padding (zeros) arrives in the part's."""
    theirs = part_ranges(bucket, 1 - rank)
    kernels.flatten_cast_scale([tensors[r.tensor].view(-1)[r.start:r.end] for r in theirs],
                               sent, offsets=[r.offset for r in theirs], backend=backend)
    sizes = [0, 0]
    sizes[1 - rank] = bucket.part_size
    work = dist.all_to_all_single(part, sent, output_split_sizes=sizes, input_split_sizes=sizes,
                                  group=group, async_op=True)
    own = part_ranges(bucket, rank)
    return PendingBucket(bucket, part, _Exchange(
        work, [part[r.offset:r.offset + r.numel] for r in own],
        [tensors[r.tensor].view(-1)[r.start:r.end] for r in own]))


def start_bucket_all_gather(bucket: Bucket, part: torch.Tensor, buffer: torch.Tensor, *, group,
                            world_size: int) -> PendingBucket:
    """Start gathering every rank's ``part`` of ``bucket`` into ``buffer``."""
    if world_size == 1:
        return PendingBucket(bucket, part, None)
    work = start_all_gather(buffer, part, group) if bucket.size else None
    return PendingBucket(bucket, buffer, work)


def reduce_scatter_plan(
    plan: BucketPlan,
    tensors: Sequence[torch.Tensor],
    *,
    group: Optional[dist.ProcessGroup] = None,
    prescale: float = 1.0,
    postscale: float = 1.0,
    parts: Optional[Sequence[torch.Tensor]] = None,
    buffers: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> List[torch.Tensor]:
    """Sum ``tensors`` over ``group`` and keep this rank's part of each bucket.

    Each bucket is flattened into a flat buffer (cast to the bucket's
    communication dtype and times ``prescale`` in the same pass), one
    reduce-scatter per bucket leaves part ``r`` of the sum on group rank
    ``r``, and the part is multiplied by ``postscale``. A mean is
    ``postscale=1/world_size`` (or ``prescale``, for 16-bit communication).
    ``part_ranges(bucket, rank)`` says which tensor elements a part holds.

    Args:
        plan: a plan made with ``shards`` equal to the group's world size
            from tensors shaped like ``tensors``, the same on every rank.
        tensors: this rank's tensors, in plan order; not modified.
        group: the process group (default: the world).
        prescale: a finite factor applied before the sum.
        postscale: a finite factor applied to the part after the sum.
        parts: where the parts go, one per bucket (``bucket.part_size``
            elements of the bucket's dtype); default: new tensors.
        buffers: persistent flat buffers, one per bucket (default: fresh ones).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        This rank's part of each bucket, in the bucket's dtype.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the plan's ``shards`` is not the group's world size;
            ``tensors``, ``parts`` or ``buffers`` do not match the plan (checked
            at every world size), or one of ``tensors`` shares memory with its
            bucket's part or buffer (checked before anything is written); a
            scale is not finite.
        TypeError: an entry of ``tensors`` is not a dense tensor.

    Examples:
        >>> plan = BucketPlan(grads, shards=dist.get_world_size(),              # doctest: +SKIP
        ...                   comm_dtype=torch.float32)
        >>> parts = reduce_scatter_plan(plan, grads, postscale=1 / dist.get_world_size())  # doctest: +SKIP
    """
    tensors = tensor_list(tensors, "tensors")
    world_size = _check_sharded(plan, tensors, "tensors", group, prescale=prescale,
                                postscale=postscale)
    parts = [new_part(b) for b in plan.buckets] if parts is None else list(parts)
    _check_parts(plan, parts)
    buffers = _buffers(plan, buffers, world_size)
    _check_disjoint(plan, tensors, "tensors", parts, buffers)
    pending = [start_bucket_reduce_scatter(plan, bucket, tensors, buffer, part, group=group,
                                           world_size=world_size, prescale=prescale,
                                           backend=backend)
               for bucket, buffer, part in zip(plan.buckets, buffers, parts)]
    for p in pending:
        wait_for(p)
        if postscale != 1.0:
            p.flat.mul_(postscale)
    return list(parts)


def all_gather_plan(
    plan: BucketPlan,
    parts: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    group: Optional[dist.ProcessGroup] = None,
    scale: float = 1.0,
    buffers: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> None:
    """Gather every rank's part of each bucket and write the buckets into ``outputs``.

    The inverse of ``reduce_scatter_plan``'s split: group rank ``r`` passes
    part ``r`` of each bucket; one all-gather per bucket assembles the flat
    buffer on every rank, and one unflatten writes it into ``outputs`` (cast
    to each output's dtype and times ``scale`` in the same pass). Every
    rank's ``outputs`` end bitwise equal.

    Args:
        plan: a plan made with ``shards`` equal to the group's world size.
        parts: this rank's part of each bucket (``bucket.part_size`` elements
            of the bucket's dtype).
        outputs: the tensors to write, shaped like the plan's tensors.
        group: the process group (default: the world).
        scale: a finite factor applied in the unflatten.
        buffers: persistent flat buffers, one per bucket (default: fresh ones).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the plan's ``shards`` is not the group's world size;
            ``outputs``, ``parts`` or ``buffers`` do not match the plan (checked
            at every world size), or one of ``outputs`` shares memory with its
            bucket's part or buffer (checked before anything is written); a
            non-finite ``scale``.
        TypeError: an entry of ``outputs`` is not a dense tensor.

    Examples:
        >>> all_gather_plan(plan, parts, list(model.parameters()))        # doctest: +SKIP
    """
    outputs = tensor_list(outputs, "outputs")
    world_size = _check_sharded(plan, outputs, "outputs", group, scale=scale)
    parts = list(parts)
    _check_parts(plan, parts)
    buffers = _buffers(plan, buffers, world_size)
    _check_disjoint(plan, outputs, "outputs", parts, buffers)
    pending = [start_bucket_all_gather(bucket, part, buffer, group=group, world_size=world_size)
               for bucket, part, buffer in zip(plan.buckets, parts, buffers)]
    with torch.no_grad():
        for p in pending:
            wait_for(p)
            plan.unflatten(p.bucket, p.flat, outputs, scale=scale, backend=backend)


def _check_sharded(plan: BucketPlan, tensors: List[torch.Tensor], name: str, group,
                   **scales: float) -> int:
    """The group's world size, once the plan, the tensors and the scales are checked."""
    check_instance(plan, "plan", BucketPlan, "a BucketPlan")
    world_size = require_process_group(group)
    if plan.shards != world_size:
        raise ValueError(f"plan has shards={plan.shards} but the group has {world_size} ranks: "
                         f"make the plan with BucketPlan(..., shards={world_size})")
    for scale_name, value in scales.items():
        kernels.check_scale(value, scale_name)
    plan.check(tensors, name)
    return world_size


def _buffers(plan: BucketPlan, buffers: Optional[Sequence[torch.Tensor]],
             world_size: int) -> List[Optional[torch.Tensor]]:
    """The flat buffers the collectives use, checked; none on a world of one
    rank, where the parts are the buckets."""
    if buffers is not None:
        buffers = list(buffers)
        check_buffers(plan, buffers)  # on a world of one too: a wrong one is a caller's bug
    if world_size == 1:
        return [None] * len(plan.buckets)
    return [plan.new_buffer(b) for b in plan.buckets] if buffers is None else buffers


def _check_disjoint(plan: BucketPlan, tensors: List[torch.Tensor], name: str,
                    parts: List[torch.Tensor], buffers: List[Optional[torch.Tensor]]) -> None:
    """No tensor of a bucket shares memory with that bucket's part or buffer,
    checked before any bucket is written, naming the caller's arguments (the
    kernels would name their own, after earlier buckets were written)."""
    for bucket, part, buffer in zip(plan.buckets, parts, buffers):
        members = [tensors[i] for i in bucket.tensor_indices]
        for flat, flat_name in ((part, "parts"), (buffer, "buffers")):
            if flat is not None:
                kernels.check_disjoint(flat, f"{flat_name}[{bucket.index}]", members, name,
                                       indices=bucket.tensor_indices)


def _check_parts(plan: BucketPlan, parts: Sequence[torch.Tensor]) -> None:
    check_buffers(plan, parts, "parts", numel=operator.attrgetter("part_size"))


