"""Node-aware reduce-scatters: the sharded optimizer's gradients summed over nodes, and its parameters gathered back.

``DistributedOptimizer(shard=True)`` with ``local_size`` > 1, ``wire_dtype``
or ``deterministic`` shards the optimizer state over the whole world (each
rank keeps ``1/world_size`` of it, as with the flat sharded step), not
HSDP-style over the node only (``1/local_size``, a copy per node): both put
the same bytes on the cross-node links (``(nodes - 1)/nodes`` of the
node's ``1/local_size`` piece each way, the gradients' reduce-scatter and
the parameters' all-gather), and the world-sharded state is ``nodes`` times
smaller; see docs/guides/across-nodes.md#sharded-shardtrue.

The sum runs on levels (``node_collectives.node_levels``): the node's
``local_size`` ranks, then the ``nodes`` ranks across nodes with this local
rank. Each level keeps its rank's chunk of what the level before kept, so
rank (node ``n``, local rank ``j``) holds part ``j * nodes + n`` of every
bucket (``wire_collectives.owned_chunk``), not part ``rank``: the node's
reduce-scatter leaves local rank ``j`` the node's sum of the bucket's
``j``-th ``1/local_size`` piece, and the reduce-scatter across the nodes
that hold that piece splits it by node. The parameters come back the other
way (``start_level_gathers``): across nodes into the piece, then inside the
node into the whole bucket.

- ``WireScatter``: the all-to-all sum of ``wire_collectives.WireSum``
  (codes exchanged, dequantized and summed in fp32 in a fixed order), each
  rank keeping its own chunk: the wire formats, the deterministic sum, and
  gloo's full-precision default (gloo's reduce-scatter all-reduces the whole
  input, so an all-to-all sends half its bytes).
- ``TwoLevelScatter``: the backend's own reduce-scatter on each level, in
  place (NCCL's default at full precision, or ``gradient_collective=
  "reduce_scatter"``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .allreduce import PendingBucket
from .buckets import Bucket, BucketPlan
from .grad_collectives import AllReduce
from .node_collectives import NodeOptions, node_levels
from .sharded import start_all_gather, start_reduce_scatter
from .wire_collectives import Level, Phases, WireSum, level_regions, owned_chunk, spares_sum


class _LevelOwnership:
    """What both node-aware reduce-scatters say about the chunk each rank keeps."""

    levels: List[Level]
    plan: BucketPlan

    def owned_by(self, rank: int) -> List[Tuple[int, int]]:
        """Per bucket, the elements this rank holds the sum of after the
        levels (``rank`` is this rank: the levels know its position)."""
        return [owned_chunk(self.levels, b.size) for b in self.plan.buckets]

    @property
    def gather_levels(self) -> Optional[List[Level]]:
        """The levels the parameters are gathered back over, where the parts
        are not in rank order (more than one level); None: rank order."""
        return self.levels if len(self.levels) > 1 else None


class WireScatter(_LevelOwnership, WireSum):
    """``WireSum`` without its gathers back: each rank keeps its chunk of the
    sum in its slot of the buffer."""

    gathers_back = False


class TwoLevelScatter(_LevelOwnership, AllReduce):
    """One reduce-scatter per level, each in place in the buffer (see the
    module); on gloo, whose waits block the host, the first level starts
    with the bucket and the later ones run when it is waited for."""

    def __init__(self, plan: BucketPlan, group, world_size: int, backend: str,
                 levels: Sequence[Level]) -> None:
        super().__init__(plan, group, world_size, backend)
        self.levels = list(levels)
        self.signature = ("two-level reduce-scatter", tuple(lv.ranks for lv in levels))
        self.blocking = dist.get_backend(group) == dist.Backend.GLOO

    def communicate(self, bucket: Bucket, buffer: torch.Tensor,
                    spare: Optional[torch.Tensor]) -> PendingBucket:
        regions = level_regions(self.levels, buffer[:bucket.size])
        spares = spares_sum(bucket, buffer, self.group)

        def scatter(k: int):
            whole, mine = regions[k]
            return start_reduce_scatter(mine, whole, self.levels[k].group)

        if self.blocking:
            later = [lambda k=k: scatter(k).wait() for k in range(1, len(regions))]
            return PendingBucket(bucket, buffer, Phases([scatter(0)], [*later, spares]), spare)
        # every level is issued now; each level's group has a stream of its
        # own, so a level's wait (which only orders the current stream after
        # it) must come before the next level reads what it wrote
        for k in range(len(regions) - 1):
            scatter(k).wait()
        return PendingBucket(bucket, buffer, Phases([scatter(len(regions) - 1)], [spares]),
                             spare)


def start_level_gathers(flat: torch.Tensor, levels: Sequence[Level]) -> Phases:
    """Start gathering every rank's chunk of ``flat`` (this rank's at its
    ``owned_chunk``) into the whole of it, innermost level first: a
    ``PendingBucket.work``. The first all-gather is started now; the others
    run when it is waited for (each needs the one before)."""
    regions = list(reversed(level_regions(levels, flat)))
    groups = [level.group for level in reversed(levels)]
    first = start_all_gather(regions[0][0], regions[0][1], groups[0])
    later = [lambda k=k: start_all_gather(regions[k][0], regions[k][1], groups[k]).wait()
             for k in range(1, len(regions))]
    return Phases([first], later)


def node_sharded_collective(plan: BucketPlan, group, world_size: int, backend: str,
                            options: NodeOptions, gradient_collective: Optional[str]):
    """The sharded reducer's collective for ``options`` (not ``flat``), or
    None where the flat sharded collective does the same (one node, full
    precision): the all-to-all sum for the wire formats, the deterministic
    sum and, on gloo by default, full precision; the backend's reduce-scatter
    per level elsewhere, or where ``gradient_collective="reduce_scatter"``."""
    levels = node_levels(group, world_size, options)
    gloo = dist.get_backend(group) == dist.Backend.GLOO
    if options.exchanges or (gloo and gradient_collective is None and len(levels) > 1):
        return WireScatter(plan, group, world_size, backend, levels, options.error_feedback)
    if len(levels) == 1:
        return None
    return TwoLevelScatter(plan, group, world_size, backend, levels)
