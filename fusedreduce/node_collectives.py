"""Node-aware gradient collectives: the sum of a bucket over nodes of ``local_size`` ranks.

``NodeOptions`` holds the options ``local_size``, ``wire_dtype``,
``deterministic`` and ``error_feedback`` (checked by ``check_node_options``,
the same on ``DistributedGradReducer`` and ``DistributedOptimizer``), and
``node_collective`` builds the collective they ask for:

- ``TwoLevel`` (``local_size`` > 1, full precision): the sum inside the node,
  then the all-reduce across nodes of this rank's ``1/local_size`` part of
  the bucket only, then the all-gather of the parts inside the node. Each
  bucket's buffer splits into ``local_size`` equal parts (the plan's
  ``shards``). The cross-node link carries ``1/local_size`` of what a flat
  all-reduce sends over it.

Where a buffer carries spare elements (the counts of ``check_finite`` and
``find_unused_parameters``: ``allreduce.flatten_bucket``), they are summed
over the whole group by one small all-reduce of their own, started with the
bucket: the counts stay exact whatever the bucket's elements travel in, so
these collectives keep ``sums = True``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .allreduce import PendingBucket
from .buckets import Bucket, BucketPlan
from .grad_collectives import AllReduce
from .node_groups import NodeGroups, check_node_local_size, node_groups
from .sharded import start_all_gather


@dataclass(frozen=True)
class NodeOptions:
    """The node-aware options of a reducer (see ``DistributedGradReducer``).

    ``local_size=1`` with no ``wire_dtype`` and ``deterministic=False`` is
    today's flat all-reduce (``flat``)."""

    local_size: int = 1
    wire_dtype: Optional[torch.dtype] = None
    deterministic: bool = False
    error_feedback: bool = False

    @property
    def flat(self) -> bool:
        """Whether these options leave the flat all-reduce (and its bits)."""
        return self.local_size == 1 and self.wire_dtype is None and not self.deterministic

    def shards(self, world_size: int) -> int:
        """How many equal parts each bucket's buffer splits into."""
        return 1 if self.flat else self.local_size

    def signature(self) -> tuple:
        """What the ranks must agree on (``rank_agreement``)."""
        return (self.local_size, str(self.wire_dtype), self.deterministic, self.error_feedback)


def check_node_options(local_size, wire_dtype, deterministic, error_feedback, *,
                       world_size: int, reduce_dtype: torch.dtype) -> NodeOptions:
    """The node-aware options checked, as one record.

    Raises:
        TypeError: ``deterministic`` or ``error_feedback`` is not a bool.
        ValueError: ``local_size`` does not divide the group's size;
            ``wire_dtype`` or ``deterministic`` given (not supported yet).
    """
    for name, value in (("deterministic", deterministic), ("error_feedback", error_feedback)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    check_node_local_size(local_size, world_size)
    if wire_dtype is not None or deterministic or error_feedback:
        raise ValueError("wire_dtype, deterministic and error_feedback are not supported yet "
                         "(docs/guides/across-nodes.md)")
    return NodeOptions(local_size, wire_dtype, deterministic, error_feedback)


def node_collective(plan: BucketPlan, group, world_size: int, backend: str,
                    options: NodeOptions):
    """The collective ``options`` ask for (not ``flat``), or None where one
    node holds the whole group (the flat all-reduce is then the sum)."""
    groups = node_groups(group, options.local_size)
    if groups.nodes == 1:
        return None
    return TwoLevel(plan, group, world_size, backend, groups)


class _Phases:
    """A bucket's later phases, run by ``wait`` (``PendingBucket.work``):
    ``first`` is waited for, then each of ``later`` is called."""

    def __init__(self, first, later: Sequence) -> None:
        self.first, self.later = first, [call for call in later if call is not None]

    def wait(self) -> None:
        if self.first is not None:
            self.first.wait()
            self.first = None
        while self.later:
            self.later.pop(0)()


class TwoLevel(AllReduce):
    """The sum inside the node, this rank's part across nodes, the parts
    gathered inside the node (see the module).

    On NCCL every phase is issued by ``start`` (``work.wait()`` only orders
    the streams): a reduce-scatter inside the node into this rank's part,
    the part's all-reduce across nodes, the all-gather inside the node. On
    gloo, whose waits block the host and whose reduce-scatter all-reduces
    the whole input anyway, ``start`` starts the node's all-reduce of the
    whole buffer and the finish of the bucket runs the two later phases."""

    def __init__(self, plan: BucketPlan, group, world_size: int, backend: str,
                 groups: NodeGroups) -> None:
        super().__init__(plan, group, world_size, backend)
        self.groups = groups
        self.signature = ("two-level", groups.local_size)
        self.blocking = dist.get_backend(group) == dist.Backend.GLOO

    def communicate(self, bucket: Bucket, buffer: torch.Tensor,
                    spare: Optional[torch.Tensor]) -> PendingBucket:
        groups = self.groups
        whole = buffer[:bucket.size]
        mine = whole[groups.local_rank * bucket.part_size:
                     (groups.local_rank + 1) * bucket.part_size]
        spares = _spares_sum(bucket, buffer, self.group)

        def across():
            dist.all_reduce(mine, group=groups.cross)

        def gather():
            start_all_gather(whole, mine, groups.intra).wait()

        if self.blocking:
            first = dist.all_reduce(whole, group=groups.intra, async_op=True)
            return PendingBucket(bucket, buffer, _Phases(first, [across, gather, spares]), spare)
        dist.reduce_scatter_tensor(mine, whole, group=groups.intra)
        across()
        work = start_all_gather(whole, mine, groups.intra)
        return PendingBucket(bucket, buffer, _Phases(work, [spares]), spare)


def _spares_sum(bucket: Bucket, buffer: torch.Tensor, group):
    """The sum of ``buffer``'s spare elements over ``group``, started now (a
    call that waits for it), or None when it has none."""
    if buffer.numel() == bucket.size:
        return None
    work = dist.all_reduce(buffer[bucket.size:], group=group, async_op=True)
    return work.wait
