"""``ShardedGradReducer``: the gradient half of ``DistributedOptimizer(shard=True)``.

During backward each bucket is flattened (cast and prescaled in the same
launch) and reduced as soon as it is ready, by the collective chosen once
for the group (``grad_collectives.sharded_collective``), into the buffers
and parts whose lifetime ``shard_buffers.ShardBuffers`` keeps; when
backward ends, each ``.grad`` holds the reduced gradient on the elements
this rank owns and zeros elsewhere (one write-back launch per bucket), and
one small all-reduce settles, for every rank alike, which parameters got no
gradient anywhere and whether any owned gradient is non-finite
(``nonfinite.OwnedNonfinite``). The bucket engine (``bucket_engine``) holds
what this reducer shares with ``DistributedGradReducer``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from .kernels import refuse_in_capture
from .allreduce import PendingBucket
from .bucket_engine import BucketEngine, ReducerSurface
from .buckets import Bucket, FlatBuffers
from .grad_collectives import sharded_collective
from .nonfinite import OwnedNonfinite
from .shard_buffers import ShardBuffers
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
        engine.overlap.releases_grads = shard_gradients
        self.adasum_local_size = adasum_local_size
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        engine.unused_grads_to_none = True
        self.before_communicating = None  # called before a backward's first collective
        collective = sharded_collective(
            engine.plan, group, engine.world_size, self.rank, backend,
            gradient_collective=gradient_collective, adasum_local_size=adasum_local_size,
            shard_gradients=shard_gradients,
            scales=engine.scales)
        engine.combine_by(collective)
        # AdaSum stops its tree after the halving: each rank owns the slice it
        # holds then (unequal, chunk-aligned), and the parameters come back
        # through the tree's reverse swaps
        self.tree_shares = getattr(collective, "tree_shares", None)  # AdaSum's halving's
        self.owned = collective.owned_by(self.rank)
        self._lifetime = ShardBuffers(self.plan, self.owned, collective, shard_gradients)
        plan, order = self.plan, self._order
        # the tensor elements each part holds and where they start in it:
        # what the part's write-back launch fills
        self._owned_ranges = [ranges_between(b, *self.owned[b.index]) for b in plan.buckets]
        self._owned_offsets = [tuple(r.offset for r in ranges) for ranges in self._owned_ranges]
        # the same, per parameter, as the optimizer's read-only record
        self.layout = ShardLayout(
            plan, self.rank, self.world_size, tuple(self.owned),
            tuple(OwnedRange(r.tensor, r.start, r.end, r.offset, order[r.tensor], b.index)
                  for b in plan.buckets for r in self._owned_ranges[b.index]))
        # the tensor elements outside this rank's part: zeros in its .grad
        self._not_owned = [ranges_between(b, 0, self.owned[b.index][0])
                           + ranges_between(b, self.owned[b.index][1], b.size)
                           for b in plan.buckets]
        self._zeros: Dict[int, torch.Tensor] = {}
        self._nonfinite = OwnedNonfinite(self.parameters, order, plan, self.owned,
                                         shard_gradients)

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

    def _held_buffers(self) -> List[torch.Tensor]:
        # the flat buffers (whole), the parts (slots of them, or with
        # shard_gradients tensors of their own) and the zeros that stand in
        # for frozen parameters' gradients
        return [*self._lifetime.held(), *self._zeros.values()]

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
        self._engine.overlap.attach(passes_per_sync, hold_first_pass=self.shard_gradients,
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
        if self.shard_gradients:
            # the buffer holds them now (the launch that read them is queued
            # before anything that can reuse their memory)
            for slot in bucket.tensor_indices:
                param = engine.parameters[engine.order[slot]]
                if param.requires_grad:
                    param.grad = None
        return pending

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        try:
            self._finish_buckets(pending, outputs)
        finally:
            if self.shard_gradients:
                # written into .grad (or the backward failed; its gradients
                # are gone either way): nothing in the buffers is read again
                self._lifetime.release_all()

    def _finish_buckets(self, pending: Sequence[PendingBucket],
                        outputs: Sequence[torch.Tensor]) -> None:
        engine = self._engine
        parts = self._lifetime.finished_parts(pending)
        if engine.max_grad_norm is not None and pending:
            scales = engine.clip(pending, parts)
        else:
            scales = engine.postscales_of(pending)
        if not self.shard_gradients:
            for p, part, postscale in zip(pending, parts, scales):
                self._write_part_and_zeros(p.bucket, part, outputs, postscale)
        nonfinite = self._nonfinite.flag(parts, scales)
        if engine.parameters:
            refuse_in_capture(engine.parameters[0].device,
                              "a shard=True backward (the ranks' non-finite count is read to "
                              "the host, so that GradScaler skips the step on every rank)",
                              "capture an unsharded step; shard=True runs eagerly")
        ranks = engine.settle_unused(nonfinite)
        if self.shard_gradients:
            self._write_owned(pending, scales)
        found = bool(ranks > 0)
        engine.found_nonfinite = torch.tensor(found)
        if found:
            self._nonfinite.plant_nan()

    def _write_part_and_zeros(self, bucket: Bucket, part: torch.Tensor,
                              outputs: Sequence[torch.Tensor], postscale) -> None:
        """Write this rank's reduced part (postscaled) into its elements of
        the bucket's gradients and zeros into the rest. The collective left
        the part in its slot of the buffer (the whole buffer all-reduced on
        gloo, the part in place on NCCL); the elements outside it are not
        read: zeroing them in the buffer first and unflattening all of it
        read and wrote each of them twice more."""
        members = [outputs[slot] for slot in bucket.tensor_indices]
        if not all(t.is_contiguous() for t in members):
            lo, hi = self.owned[bucket.index]
            flat = self._lifetime.buffers[bucket.index]
            flat[:lo].zero_()
            flat[hi:].zero_()
            self.plan.unflatten(bucket, flat, outputs, scale=postscale, backend=self.backend)
            return
        ranges = self._owned_ranges[bucket.index]
        if ranges:
            kernels.unflatten_cast_scale(
                part, [outputs[r.tensor].view(-1)[r.start:r.end] for r in ranges],
                scale=postscale, backend=self.backend, offsets=self._owned_offsets[bucket.index])
        zeros = [outputs[r.tensor].view(-1)[r.start:r.end] for r in self._not_owned[bucket.index]]
        if zeros:
            torch._foreach_zero_(zeros)

    def _write_owned(self, pending: Sequence[PendingBucket], scales: Sequence) -> None:
        """``shard_gradients``: a ``.grad`` for each used parameter this rank
        owns elements of, from its part (one launch per bucket), each
        part's memory released after its launch."""
        unused = {self._order[slot] for slot in self.unused_slots}
        written = 0
        for p, postscale in zip(pending, scales):
            index = p.bucket.index
            destinations, offsets = [], []
            for r in self._owned_ranges[index]:
                param_index = self._order[r.tensor]
                param = self.parameters[param_index]
                if param_index in unused or not param.requires_grad:
                    continue  # no gradient on any rank, or frozen: .grad stays None
                whole = r.start == 0 and r.end == param.numel()
                grad = (torch.empty if whole else torch.zeros)(
                    param.shape, dtype=param.dtype, device=param.device)
                param.grad = grad
                destinations.append(grad.view(-1)[r.start:r.end])
                offsets.append(r.offset)
            if destinations:
                # the kept tuple when every range is written: the kept launch
                # then knows its offsets unchanged without comparing them
                kept = self._owned_offsets[index]
                kernels.unflatten_cast_scale(
                    self.parts[index], destinations, scale=postscale, backend=self.backend,
                    offsets=kept if len(offsets) == len(kept) else tuple(offsets))
                written += len(destinations)
            # nothing reads this bucket's part again: the next buckets' .grad
            # can take its memory
            self._lifetime.release_part(index)
        if written or self.world_size == 1:
            return
        if any(param.grad is not None for param in self.parameters):
            return
        used = [i for i, param in enumerate(self.parameters)
                if param.requires_grad and i not in unused]
        if used:
            # GradScaler records its check from the .grad it finds; with none
            # this rank would refuse to step while the others step
            keeper = min(used, key=lambda i: self.parameters[i].numel())
            self.parameters[keeper].grad = torch.zeros_like(self.parameters[keeper])
