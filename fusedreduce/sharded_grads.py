"""``ShardedGradReducer``: the gradient half of ``DistributedOptimizer(shard=True)``.

During backward each bucket is flattened (cast and prescaled in the same
launch) and reduced as soon as it is ready, by the collective chosen once
for the group (``grad_collectives.sharded_collective``), into the buffers
and parts whose lifetime ``shard_buffers`` keeps; when
backward ends, each ``.grad`` holds the reduced gradient on the elements
this rank owns and zeros elsewhere (one write-back launch per bucket; with
``shard_gradients`` only the owned gradients: ``owned_writeback``), and
one small all-reduce settles, for every rank alike, which parameters got no
gradient anywhere and whether any owned gradient is non-finite
(``nonfinite.OwnedNonfinite``). The bucket engine (``bucket_engine``) holds
what this reducer shares with ``DistributedGradReducer``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ._checks import refuse_join
from .kernels import refuse_in_capture
from .allreduce import PendingBucket
from .bucket_engine import BucketEngine, ReducerSurface
from .buckets import FlatBuffers
from .grad_collectives import sharded_collective
from .nonfinite import OwnedNonfinite
from .owned_writeback import OwnedGradients, PartsAndZeros
from .shard_buffers import KeptBuffers, ReleasedBuffers
from .sharded import OwnedRange, ShardLayout, ranges_between


class ShardedGradReducer(ReducerSurface):
    """Reduce-scatter gradients during backward into a sharded plan.

    Internal to ``DistributedOptimizer(shard=True)``. ``parameters`` are all
    the optimizer's parameters, frozen ones included (the layout must not
    move when a parameter is frozen: the optimizer state sits on it); hooks
    go on those that require grad, and a frozen one contributes zeros.

    After a reducing backward, ``.grad`` of each parameter holds the reduced
    gradient (mean or sum) on the elements this rank owns and zeros on the
    others; a parameter no rank had a gradient for keeps ``None``; if an owned
    gradient is non-finite on any rank, every rank sees a NaN in an element it
    does not own (so ``GradScaler`` skips the step everywhere, and no rank's
    step reads that element). ``found_nonfinite`` says the same as a 0-d
    bool tensor.

    ``shard_gradients`` (ZeRO-2): each bucket's ``.grad`` tensors are
    released (set to None) as soon as the bucket has read them into its
    buffer, during backward; when backward ends only the parameters this
    rank owns elements of get a ``.grad`` (the whole reduced gradient for
    one it owns wholly; zeros outside its elements for one a part boundary
    cuts), written from the rank's part in one launch per bucket. Others
    keep ``None``, except: a rank left with no ``.grad`` at all keeps a zero
    one on its smallest used parameter (``GradScaler`` needs one to record
    its check), and the NaN that signals another rank's non-finite gradient
    goes into an element this rank does not own, in a zero ``.grad`` made
    for it if need be. A bucket's whole buffer is released as soon as its
    collective has finished, which is waited for when the bucket after next
    starts; the rank's part lives until its ``.grad`` is written.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], *, group, mean: bool,
                 bucket_cap_mb: float, reduce_dtype: torch.dtype,
                 adasum_local_size: Optional[int] = None, backend: str = "auto",
                 shard_gradients: bool = False, gradient_collective: Optional[str] = None,
                 **clipping) -> None:
        engine = self._engine = BucketEngine(
            parameters, mean=mean and adasum_local_size is None, group=group,
            bucket_cap_mb=bucket_cap_mb, reduce_dtype=reduce_dtype, backend=backend,
            kind=type(self).__name__, shards=True, start=self._start, finish=self._finish,
            before_sync=self._before_sync, **clipping)
        self.shard_gradients = shard_gradients
        self.adasum_local_size = adasum_local_size
        if adasum_local_size is not None:
            engine.stacks_exactly = False  # a combine of combined gradients
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        engine.unused_grads_to_none = True
        self.before_communicating = None  # called before a backward's first collective
        collective = sharded_collective(
            engine.plan, group, engine.world_size, self.rank, backend,
            gradient_collective=gradient_collective, adasum_local_size=adasum_local_size,
            shard_gradients=shard_gradients, scales=engine.scales, node=engine.node)
        engine.combine_by(collective)
        # AdaSum stops its tree after the halving: each rank owns the slice it
        # holds then (unequal, chunk-aligned), and the parameters come back
        # through the tree's reverse swaps
        self.tree_shares = getattr(collective, "tree_shares", None)  # AdaSum's halving's
        # the node-aware reduce-scatters leave parts out of rank order: the
        # parameters come back over the same levels
        self.gather_levels = getattr(collective, "gather_levels", None)
        self.owned = collective.owned_by(self.rank)
        self._lifetime = (ReleasedBuffers if shard_gradients else KeptBuffers)(
            self.plan, self.owned, collective)
        plan, order = self.plan, self._order
        # the tensor elements each part holds and where they start in it:
        # what the part's write-back launch fills
        owned_ranges = [ranges_between(b, *self.owned[b.index]) for b in plan.buckets]
        # the same, per parameter, as the optimizer's read-only record
        self.layout = ShardLayout(
            plan, self.rank, self.world_size, tuple(self.owned),
            tuple(OwnedRange(r.tensor, r.start, r.end, r.offset, order[r.tensor], b.index)
                  for b in plan.buckets for r in owned_ranges[b.index]))
        self._write_back = (OwnedGradients if shard_gradients else PartsAndZeros)(
            engine, self.owned, self._lifetime, owned_ranges,
            [tuple(r.offset for r in ranges) for ranges in owned_ranges])
        engine.overlap.releases_grads = self._write_back.releases_grads
        self._zeros: Dict[int, torch.Tensor] = {}
        self._nonfinite = OwnedNonfinite(self.parameters, order, plan, self.owned,
                                         shard_gradients)

    def join_hook(self, **kwargs):
        """Refused: ``Join([optimizer])`` with the
        ``DistributedOptimizer(shard=True)`` that owns this reducer, whose
        step a rank that ran out of data takes too.

        Raises:
            TypeError: always.
        """
        refuse_join(type(self).__name__)

    def _before_sync(self) -> None:
        # a reducing backward writes the buffers deferred all-gathers fill
        if self.before_communicating is not None:
            self.before_communicating()
        self._engine.verify_once()

    @property
    def buffers(self) -> List[Optional[torch.Tensor]]:
        """The flat buffers (scratch between the collectives: the all-gather
        reuses their memory); with ``shard_gradients``, None until a backward
        first starts the bucket (always, on a world of one rank), and with
        memory only from that start until the bucket's collective has
        finished (the last two buckets': until ``.grad`` is written)."""
        return self._lifetime.buffers

    @property
    def parts(self) -> List[Optional[torch.Tensor]]:
        """This rank's part of each bucket (a slot of its buffer, or with
        ``shard_gradients`` a tensor of its own)."""
        return self._lifetime.parts

    @property
    def flat_buffers(self) -> FlatBuffers:
        """``buffers`` and ``parts``, by role (``buckets.FlatBuffers``)."""
        return self._lifetime.flat_buffers()

    def held_tensors(self) -> List[torch.Tensor]:
        """The tensors whose memory this reducer keeps: the flat buffers
        (whole), the parts (slots of them, or with ``shard_gradients``
        tensors of their own), the collective's codes and residuals, and the
        zeros that stand in for frozen parameters' gradients."""
        return [*self._lifetime.held(), *self._engine.collective.held(),
                *self._zeros.values()]

    def register_hooks(self, passes_per_sync: int = 1, *,
                       gradient_as_bucket_view: bool = False) -> "ShardedGradReducer":
        if gradient_as_bucket_view:
            raise ValueError("gradient_as_bucket_view does not apply with shard=True")
        if self._engine.overlap.attached:
            raise ValueError("hooks are already registered on this reducer")
        self._attach(passes_per_sync)
        return self

    def _attach(self, passes_per_sync: int) -> None:
        # released gradients cannot be read again: a bucket is held to the end
        # of backward while it is not known whether one of its gradients is
        # accumulated twice per pass (found in the first pass, as with bucket views)
        self._engine.overlap.attach(passes_per_sync,
                                    hold_first_pass=self._write_back.releases_grads,
                                    held_by="shard_gradients=True")

    def rehook(self) -> None:
        """Hook exactly the parameters that require grad now."""
        overlap = self._engine.overlap
        passes = overlap.passes_per_sync
        overlap.detach()
        self._attach(passes)

    def remove_hooks(self) -> None:
        self._engine.overlap.detach()

    def plan_tensors(self) -> List[torch.Tensor]:
        return [self.parameters[i] for i in self._order]

    def _zeros_for(self, slot: int) -> torch.Tensor:
        zeros = self._zeros.get(slot)
        if zeros is None:
            zeros = self._zeros[slot] = torch.zeros_like(self.parameters[self._order[slot]])
        return zeros

    def _start(self, index: int, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        engine = self._engine
        bucket = engine.plan.buckets[index]
        if any(tensors[slot] is None for slot in bucket.tensor_indices):
            # a frozen parameter (no hook, no gradient) in a bucket started early
            tensors = list(tensors)
            for slot in bucket.tensor_indices:
                if tensors[slot] is None:
                    tensors[slot] = self._zeros_for(slot)
        pending = self._lifetime.start(bucket, tensors, engine.scales[index][0])
        self._write_back.started(bucket)
        return pending

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        try:
            self._finish_buckets(pending, outputs)
        finally:
            # written into .grad (or the backward failed; its gradients are
            # gone either way): nothing in the buffers is read again
            self._lifetime.pass_ended()

    def _finish_buckets(self, pending: Sequence[PendingBucket],
                        outputs: Sequence[torch.Tensor]) -> None:
        engine = self._engine
        parts = self._lifetime.finished_parts(pending)
        if engine.max_grad_norm is not None and pending:
            scales = engine.clip(pending, parts)
        else:
            scales = engine.postscales_of(pending)
        self._write_back.before_settling(pending, parts, outputs, scales)
        nonfinite = self._nonfinite.flag(parts, scales)
        if engine.parameters:
            refuse_in_capture(engine.parameters[0].device,
                              "a shard=True backward (sharded steps run eagerly: with "
                              "shard_gradients the ranks' non-finite count can be read to the "
                              "host, and no sharded capture is tested)",
                              "capture an unsharded step; shard=True runs eagerly")
        ranks = engine.settle_unused(nonfinite)
        self._write_back.after_settling(pending, scales)
        found = ranks > 0
        engine.found_nonfinite = found
        self._nonfinite.plant_nan(found)
