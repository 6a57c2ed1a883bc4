"""``allreduce_hook``'s node-aware sum: a DDP bucket through the reducers' collectives.

With ``HookState(local_size=..., wire_dtype=..., deterministic=...,
error_feedback=...)`` other than the flat all-reduce, each DDP bucket is
flattened into a kept flat buffer of its own one-bucket plan (padded into
the parts the collective needs), summed by the collective
``grad_collectives.all_reduce_collective`` chooses (``TwoLevel`` or
``WireSum``, as for ``DistributedGradReducer``) and written back into DDP's
buffer. Each DDP bucket buffer has its own plan, buffer and collective (its
kept codes, and error feedback's residual): DDP may have several buckets in
flight, and it rebuilds its buckets after the first iteration, so a way not
used in the last iteration is dropped, as ``HookState.wire_for`` drops its
buffers.

The bucket's sum runs to its end inside the hook: on NCCL that only issues
the phases (their waits order the streams), on gloo the hook returns when
the bucket is summed.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from .allreduce import wait_for
from .buckets import BucketPlan, TensorSpec
from .grad_collectives import all_reduce_collective
from .node_collectives import NodeOptions, check_exchanged_dtypes


class NodeWays:
    """Per DDP bucket buffer: its plan, flat buffer and collective."""

    def __init__(self) -> None:
        self._ways: Dict[tuple, List] = {}
        self._iteration = 0

    def way_for(self, state, bucket: dist.GradBucket, dtype: torch.dtype, node: NodeOptions):
        """``(plan, flat buffer, collective)`` for ``bucket`` summed in ``dtype``."""
        buffer = bucket.buffer()
        if bucket.index() == 0:
            self._iteration += 1
            self._ways = {key: way for key, way in self._ways.items()
                          if way[3] >= self._iteration - 1}
        key = (buffer.data_ptr(), buffer.numel(), buffer.dtype, buffer.device, dtype)
        way = self._ways.get(key)
        if way is None:
            world_size = state.world_size
            plan = BucketPlan([TensorSpec.of(buffer)], bucket_cap_mb=float("1e9"),
                              comm_dtype=dtype, shards=node.shards(world_size),
                              part_multiple=node.part_multiple())
            check_exchanged_dtypes(plan, node)
            collective = all_reduce_collective(plan, state.group, world_size, state.backend,
                                               node)
            way = self._ways[key] = [plan, plan.new_buffer(plan.buckets[0]), collective, 0]
        way[3] = self._iteration
        return way[0], way[1], way[2]


def reduce_by_node(state, bucket: dist.GradBucket, dtype: torch.dtype,
                   node: NodeOptions) -> torch.futures.Future:
    """Sum ``bucket`` by ``node``'s collective (``state``: the ``HookState``);
    the future DDP waits on, clipped as ``HookState.clipped`` does."""
    buffer = bucket.buffer()
    plan, flat, collective = state.node_ways.way_for(state, bucket, dtype, node)
    only = plan.buckets[0]
    before, after = state.scales()
    wait_for(collective.start(only, [buffer], flat, None, before))

    def write_back(scale):
        plan.unflatten(only, flat, [buffer], scale=scale, backend=state.backend)
        return buffer

    if state.max_grad_norm is not None:
        return state.clipped(bucket, _done(flat), lambda: flat, after, write_back)
    return _done(write_back(after))


def _done(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future
