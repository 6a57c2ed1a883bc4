"""The gradient collectives: how a bucket's flat buffer is combined across the ranks.

Each reducer holds one, chosen once when it is built: ``all_reduce_collective``
for ``DistributedGradReducer``, ``AdaSumTree`` for ``AdaSumReducer``,
``sharded_collective`` for the sharded reducer, which decide there (and
nowhere else) what the process group's backend, the world's size and
AdaSum change. Every collective has the same call,
``start(bucket, tensors, buffer, part, prescale) -> PendingBucket``:
flatten ``bucket``'s ``tensors`` into ``buffer`` (times ``prescale``) and
start combining it; ``part`` is this rank's slot of a sharded bucket (None
unsharded). What it says about itself:

- ``sums``: every element of the buffer is summed, so a count can ride in a
  spare element (``allreduce.flatten_bucket``);
- ``whole``: the sum is left in the whole buffer, this rank's part in its
  slot of it (a part of its own is copied from there);
- ``signature``: what else the ranks must agree on (AdaSum's local size);
- ``communicates``: the world has other ranks (False on one rank, where
  nothing is sent and each rank's gradients are the result: no collective,
  no rank check, no count to settle);
- ``asynchronous``: the collective may still run when ``start`` returns
  (else it has finished); ``buffered``: it needs the whole flat buffer;
- ``residual_sizes()``: per bucket, the size of the error-feedback residual
  it keeps between reductions, or None where it keeps none.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .adasum import (TreeShare, adasum_bucket_boundaries, adasum_flat_unchecked, adasum_halve,
                     adasum_tree_share)
from .allreduce import PendingBucket, flatten_bucket
from .buckets import Bucket, BucketPlan
from .sharded import DIRECT_MEAN_NUMEL, start_bucket_exchange, start_bucket_reduce_scatter



class AllReduce:
    """The sum of the whole buffer: one ``all_reduce`` (on a world of one
    rank, ``OneRankSum``: none).

    Sharded, on gloo (whose reduce-scatter all-reduces the whole input and
    copies the part out, measured slower than the all-reduce alone:
    docs/guides/optimizer.md), this is the all-reduce that keeps the part."""

    sums = True
    whole = True
    signature = 1
    asynchronous = True
    buffered = True
    communicates = True

    def __init__(self, plan: BucketPlan, group, world_size: int, backend: str) -> None:
        self.plan, self.group, self.world_size, self.backend = plan, group, world_size, backend

    def start(self, bucket: Bucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor,
              part: Optional[torch.Tensor] = None, prescale: float = 1.0, *,
              count_nonfinite: bool = False, mark_spare: Optional[int] = None) -> PendingBucket:
        spare = flatten_bucket(self.plan, bucket, tensors, buffer, prescale=prescale,
                               backend=self.backend, count_nonfinite=count_nonfinite,
                               mark_spare=mark_spare)
        return self.communicate(bucket, buffer, spare)

    def owned_by(self, rank: int) -> List[Tuple[int, int]]:
        """Per bucket of a sharded plan, the elements ``rank`` owns: part ``rank``."""
        return [(rank * b.part_size, (rank + 1) * b.part_size) for b in self.plan.buckets]

    def prescales(self, scales: List[tuple]) -> List[tuple]:
        """The buckets' ``(prescale, postscale)``, from the reducer's ``scales``."""
        return scales

    def held(self) -> List[torch.Tensor]:
        """The buffers this collective keeps between reductions (none)."""
        return []

    def residual_sizes(self) -> Optional[List[int]]:
        """No error feedback: no residual."""
        return None

    def communicate(self, bucket: Bucket, buffer: torch.Tensor,
                    spare: Optional[torch.Tensor]) -> PendingBucket:
        """Start combining ``bucket``'s already filled ``buffer`` (bucket views)."""
        return PendingBucket(bucket, buffer, dist.all_reduce(buffer, group=self.group,
                                                             async_op=True), spare)


class OneRankSum(AllReduce):
    """A world of one rank: the flatten (its spare elements set) is the whole
    sum, finished when ``start`` returns; nothing is sent."""

    whole = False
    asynchronous = False
    communicates = False

    def __init__(self, plan: BucketPlan, backend: str) -> None:
        super().__init__(plan, None, 1, backend)

    def communicate(self, bucket: Bucket, buffer: torch.Tensor,
                    spare: Optional[torch.Tensor]) -> PendingBucket:
        return PendingBucket(bucket, buffer, None, spare)


def all_reduce_collective(plan: BucketPlan, group, world_size: int, backend: str,
                          node=None):
    """``DistributedGradReducer``'s collective: the all-reduce, or on a world
    of one rank none; ``node`` (``node_collectives.NodeOptions``) other than
    the flat all-reduce: its collective, where more than one node holds the
    group."""
    if world_size == 1:
        return OneRankSum(plan, backend)
    from .node_collectives import node_collective  # its collectives build on AllReduce
    return (node_collective(plan, group, world_size, backend, node)
            if node is not None and not node.flat else None) \
        or AllReduce(plan, group, world_size, backend)


class AdaSumTree:
    """AdaSum's whole tree (``adasum_flat_unchecked``), run when the bucket
    starts: the result is bitwise ``adasum_allreduce`` of the gradients."""

    sums = False  # AdaSum combines: no count can ride in the buffers
    whole = True
    asynchronous = False
    buffered = True

    def __init__(self, plan: BucketPlan, group, local_size: int, backend: str) -> None:
        self.plan, self.group, self.local_size, self.backend = plan, group, local_size, backend
        self.signature = local_size
        # one rank's tree has no level: the gradients are the result
        self.communicates = dist.get_world_size(group) > 1

    def prescales(self, scales: List[tuple]) -> List[tuple]:
        """1/local_size in the flatten, as ``adasum_allreduce`` does; no postscale."""
        return [(1.0 / self.local_size, 1.0)] * len(scales)

    def held(self) -> List[torch.Tensor]:
        """The buffers this collective keeps between reductions (none)."""
        return []

    def residual_sizes(self) -> Optional[List[int]]:
        """No error feedback: no residual."""
        return None

    def start(self, bucket: Bucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor,
              part: Optional[torch.Tensor] = None, prescale: float = 1.0,
              **spares) -> PendingBucket:
        self.plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=self.backend)
        return self.communicate(bucket, buffer, None)

    def communicate(self, bucket: Bucket, buffer: torch.Tensor, spare) -> PendingBucket:
        adasum_flat_unchecked(buffer, adasum_bucket_boundaries(bucket), self.group,
                              self.local_size, self.backend, prescaled=True,
                              exchanges_only=False)
        return PendingBucket(bucket, buffer, None)


class AdaSumHalving(AdaSumTree):
    """AdaSum's tree up to the end of its halving (sharded): each rank then
    holds the slice it owns (``tree_shares``), finished when ``start``
    returns; the parameters come back through the tree's reverse swaps."""

    def __init__(self, plan: BucketPlan, group, local_size: int, backend: str) -> None:
        super().__init__(plan, group, local_size, backend)
        self.signature = 1  # the prescales the ranks compare carry local_size
        self.tree_shares: List[TreeShare] = [
            adasum_tree_share(adasum_bucket_boundaries(b), b.size, group, local_size)
            for b in plan.buckets]

    def owned_by(self, rank: int) -> List[Tuple[int, int]]:
        """The slice of each bucket the halving leaves this rank (unequal,
        chunk-aligned); ``rank`` is this rank."""
        return [share.owned for share in self.tree_shares]

    def start(self, bucket, tensors, buffer, part=None, prescale: float = 1.0,
              **spares) -> PendingBucket:
        self.plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=self.backend)
        adasum_halve(buffer, adasum_bucket_boundaries(bucket), self.group, self.local_size,
                     self.backend, prescaled=True)
        return PendingBucket(bucket, buffer, None)


class ReduceScatter(AllReduce):
    """One reduce-scatter leaving this rank's part of the sum in ``part``
    (in place when ``part`` is the buffer's slot, NCCL's in-place form)."""

    whole = False

    def start(self, bucket, tensors, buffer, part=None, prescale: float = 1.0,
              **spares) -> PendingBucket:
        return start_bucket_reduce_scatter(self.plan, bucket, tensors, buffer, part,
                                           group=self.group, world_size=self.world_size,
                                           prescale=prescale, backend=self.backend)


class OneRank(OneRankSum):
    """A sharded plan on a world of one rank: the flatten into the part (the
    whole bucket) is the whole reduction; no buffer."""

    buffered = False

    def start(self, bucket, tensors, buffer, part=None, prescale: float = 1.0,
              **spares) -> PendingBucket:
        self.plan.flatten(bucket, tensors, out=part, scale=prescale, backend=self.backend)
        return PendingBucket(bucket, part, None)


class Exchange(AllReduce):
    """Two ranks on the host: a bucket that is neither prescaled nor cast is
    reduce-scattered by one exchange (``start_bucket_exchange``: half the
    bytes, the same bits), sent from the peer's slot of the buffer and
    received into this rank's; other buckets are all-reduced, part kept."""

    def __init__(self, plan: BucketPlan, group, rank: int, backend: str,
                 exchanged: Sequence[bool]) -> None:
        super().__init__(plan, group, 2, backend)
        self.rank, self.exchanged = rank, list(exchanged)
        # the peer's slot of each exchanged bucket's buffer, kept from its first start
        self.sent: List[Optional[torch.Tensor]] = [None] * len(plan.buckets)

    def start(self, bucket, tensors, buffer, part=None, prescale: float = 1.0,
              **spares) -> PendingBucket:
        index = bucket.index
        if self.exchanged[index] and all(tensors[slot].is_contiguous()
                                         for slot in bucket.tensor_indices):
            sent = self.sent[index]
            if sent is None:
                sent = self.sent[index] = buffer[(1 - self.rank) * bucket.part_size:
                                                 (2 - self.rank) * bucket.part_size]
            return start_bucket_exchange(bucket, tensors, part, sent, group=self.group,
                                         rank=self.rank, backend=self.backend)
        return super().start(bucket, tensors, buffer, part, prescale)


def sharded_collective(plan: BucketPlan, group, world_size: int, rank: int, backend: str, *,
                       gradient_collective: Optional[str], adasum_local_size: Optional[int],
                       shard_gradients: bool, scales: Sequence[tuple], node=None):
    """The sharded reducer's collective, from the options and the group:
    AdaSum's halving; ``node`` (``node_collectives.NodeOptions``) other than
    the flat reduction: its reduce-scatter (``node_scatter``); on gloo the
    all-reduce that keeps the part, or on 2 ranks the exchange for buckets
    of few large tensors; the reduce-scatter elsewhere
    (``gradient_collective`` overrides the choice)."""
    if world_size == 1:
        # AdaSum's kept buffers are flattened whole, as its halving would
        kept_whole = adasum_local_size is not None and not shard_gradients
        return (OneRankSum if kept_whole else OneRank)(plan, backend)
    if node is not None and not node.flat:
        from .node_scatter import node_sharded_collective  # its collectives build on these
        chosen = node_sharded_collective(plan, group, world_size, backend, node,
                                         gradient_collective)
        if chosen is not None:
            return chosen
    if adasum_local_size is not None:
        return AdaSumHalving(plan, group, adasum_local_size, backend)
    exchange_from = None
    if gradient_collective is None:
        gloo = dist.get_backend(group) == dist.Backend.GLOO
        gradient_collective = "all_reduce" if gloo else "reduce_scatter"
        exchange_from = DIRECT_MEAN_NUMEL if gloo else None
    elif gradient_collective == "exchange":
        exchange_from = 0
    if gradient_collective == "reduce_scatter":
        return ReduceScatter(plan, group, world_size, backend)
    if exchange_from is None or world_size != 2 or shard_gradients:
        return AllReduce(plan, group, world_size, backend)

    def exchanges(bucket: Bucket) -> bool:
        slots = bucket.tensor_indices
        return bucket.device.type == "cpu" and scales[bucket.index][0] == 1.0 \
            and bool(slots) and all(plan.specs[slot].dtype == bucket.dtype for slot in slots) \
            and sum(bucket.numels) >= exchange_from * len(slots)

    return Exchange(plan, group, rank, backend, [exchanges(b) for b in plan.buckets])
