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
- ``wire_collectives.WireSum`` (``wire_dtype`` or ``deterministic``): the
  all-to-all sum, dequantized and summed in fp32 in a fixed order, flat or
  on two levels (fp32 inside the node, the wire format across). Each
  bucket's buffer splits into one chunk per rank of whole
  ``kernels.WIRE_BLOCK`` blocks.

Where a buffer carries spare elements (the counts of ``check_finite`` and
``find_unused_parameters``: ``allreduce.flatten_bucket``), they are summed
over the whole group by one small all-reduce of their own, started with the
bucket: the counts stay exact whatever the bucket's elements travel in, so
these collectives keep ``sums = True``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from . import kernels
from ._checks import check_instance
from .allreduce import PendingBucket
from .buckets import Bucket, BucketPlan
from .grad_collectives import AllReduce
from .node_groups import NodeGroups, check_local_size, node_groups
from .sharded import start_all_gather
from .wire_collectives import Level, Phases, WireSum, spares_sum


#: the compressing wire formats (the others, fp32, only fix the order of the sum)
COMPRESSING = (torch.bfloat16, torch.float8_e4m3fn, torch.int8)


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
    def exchanges(self) -> bool:
        """Whether the sum is the all-to-all one (``wire_collectives``)."""
        return self.wire_dtype is not None or self.deterministic

    @property
    def flat(self) -> bool:
        """Whether these options leave the flat all-reduce (and its bits)."""
        return self.local_size == 1 and not self.exchanges

    def shards(self, world_size: int) -> int:
        """How many equal parts each bucket's buffer splits into: a chunk
        per rank for the all-to-all sum, a part per local rank for the
        two-level all-reduce."""
        if self.exchanges:
            return world_size
        return 1 if self.flat else self.local_size

    def part_multiple(self) -> int:
        """Each part's element count is a multiple of this: whole blocks of
        the blockwise formats (every chunk of the all-to-all sum, for one
        layout whatever the format)."""
        return kernels.WIRE_BLOCK if self.exchanges else 1

    def signature(self) -> tuple:
        """What the ranks must agree on (``rank_agreement``)."""
        return (self.local_size, str(self.wire_dtype), self.deterministic, self.error_feedback)


def check_node_options(local_size, wire_dtype, deterministic, error_feedback, *,
                       world_size: int, reduce_dtype: torch.dtype) -> NodeOptions:
    """The node-aware options checked, as one record.

    Raises:
        TypeError: ``deterministic`` or ``error_feedback`` is not a bool;
            ``wire_dtype`` is neither None nor a torch.dtype.
        ValueError: ``local_size`` does not divide the group's size;
            ``wire_dtype`` not one of ``kernels.WIRE_DTYPES``; ``wire_dtype``
            or ``deterministic`` with a ``reduce_dtype`` other than float32;
            ``error_feedback`` without a compressing ``wire_dtype``.
    """
    for name, value in (("deterministic", deterministic), ("error_feedback", error_feedback)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    check_local_size(local_size, world_size)
    if wire_dtype is not None and not isinstance(wire_dtype, torch.dtype):
        raise TypeError(f"wire_dtype must be None or a torch.dtype, got {wire_dtype!r}")
    if wire_dtype is not None and wire_dtype not in kernels.WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of "
                         f"{', '.join(map(str, kernels.WIRE_DTYPES))}, got {wire_dtype}")
    if (wire_dtype is not None or deterministic) and reduce_dtype != torch.float32:
        raise ValueError(f"wire_dtype and deterministic sum in float32: reduce_dtype must be "
                         f"torch.float32 (the default), got {reduce_dtype}")
    if error_feedback and wire_dtype not in COMPRESSING:
        raise ValueError(f"error_feedback=True keeps the quantization error of a compressing "
                         f"wire_dtype (torch.bfloat16, torch.float8_e4m3fn, torch.int8); got "
                         f"wire_dtype={wire_dtype}")
    return NodeOptions(local_size, wire_dtype, deterministic, error_feedback)


def check_exchanged_dtypes(plan: BucketPlan, options: NodeOptions) -> None:
    """The all-to-all sum runs on float32 buckets only.

    Raises:
        ValueError: with ``wire_dtype`` or ``deterministic``, a gradient
            travelling in another dtype (float64 parameters).
    """
    if options.exchanges:
        for bucket in plan.buckets:
            if bucket.dtype != torch.float32:
                raise ValueError(
                    f"wire_dtype and deterministic sum float32 buckets; parameters of "
                    f"{plan.specs[bucket.tensor_indices[0]].dtype} travel in {bucket.dtype}: "
                    f"reduce them with another reducer, or in float32")


def node_collective(plan: BucketPlan, group, world_size: int, backend: str,
                    options: NodeOptions):
    """The collective ``options`` ask for (not ``flat``), or None where that
    is the flat all-reduce (one node holding the whole group, full
    precision)."""
    if options.exchanges:
        return WireSum(plan, group, world_size, backend,
                       node_levels(group, world_size, options), options.error_feedback)
    groups = node_groups(group, options.local_size)
    if groups.nodes == 1:
        return None
    return TwoLevel(plan, group, world_size, backend, groups)


def node_levels(group, world_size: int, options: NodeOptions) -> List[Level]:
    """The all-to-all sum's levels: the node's (fp32), then across nodes
    (the wire format); one of them where the other would hold one rank.

    Raises:
        TypeError: ``options`` is not a ``NodeOptions`` (``check_node_options``
            makes one).
        ValueError: ``world_size`` is not ``group``'s size.

    Examples:
        >>> levels = node_levels(None, 4, check_node_options(  # doctest: +SKIP
        ...     2, torch.int8, False, False, world_size=4, reduce_dtype=torch.float32))
        >>> [(level.ranks, level.dtype) for level in levels]   # doctest: +SKIP
        [(2, torch.float32), (2, torch.int8)]
    """
    check_instance(options, "options", NodeOptions,
                   "a NodeOptions (from check_node_options)")
    if world_size != dist.get_world_size(group):
        raise ValueError(f"world_size must be the group's size "
                         f"({dist.get_world_size(group)}), got {world_size!r}")
    wire = options.wire_dtype or torch.float32
    if options.local_size == 1:
        return [Level(group, world_size, dist.get_rank(group), wire)]
    groups = node_groups(group, options.local_size)
    if groups.nodes == 1:  # nothing crosses a node
        return [Level(group, world_size, dist.get_rank(group), torch.float32)]
    return [Level(groups.intra, options.local_size, dist.get_rank(groups.intra), torch.float32),
            Level(groups.cross, groups.nodes, dist.get_rank(groups.cross), wire)]


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
        spares = spares_sum(bucket, buffer, self.group)

        def across():
            dist.all_reduce(mine, group=groups.cross)

        def gather():
            start_all_gather(whole, mine, groups.intra).wait()

        if self.blocking:
            first = dist.all_reduce(whole, group=groups.intra, async_op=True)
            return PendingBucket(bucket, buffer, Phases([first], [across, gather, spares]), spare)
        dist.reduce_scatter_tensor(mine, whole, group=groups.intra)
        across()
        work = start_all_gather(whole, mine, groups.intra)
        return PendingBucket(bucket, buffer, Phases([work], [spares]), spare)
