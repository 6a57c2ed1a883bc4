"""The machinery of ``DistributedOptimizer(..., shard=True)``: ZeRO on the fused buckets.

- ``ShardedGradReducer``: during backward each bucket is flattened (cast and
  prescaled in the same launch) and reduce-scattered as soon as it is ready;
  when backward ends, each ``.grad`` holds the reduced gradient on the
  elements this rank owns and zeros elsewhere (one write-back launch per
  bucket), and one small all-reduce settles, for every rank alike, which
  parameters got no gradient anywhere and whether any owned gradient is
  non-finite.
- ``ShardedParameters`` (``sharded_params``, its checkpoint transport in
  ``shard_transport``): this rank's part of every bucket as optimizer
  parameters: a parameter wholly owned is stepped as itself (or as its
  master copy), a parameter cut by a part boundary as a 1-D slice (a view,
  or a master copy); after the step the parts are all-gathered (one
  collective per bucket, in the parameters' own dtype) and written back into
  the parameters with one unflatten launch per bucket.

The layout is ``BucketPlan(..., shards=world_size)``: padding at bucket ends
only, part ``r`` of every bucket owned by group rank ``r``. With AdaSum a
rank owns instead the slice the tree's halving leaves it (``TreeShare``),
and the parameters come back through the tree's reverse swaps.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import kernels
from .kernels import refuse_in_capture
from .adasum import TreeShare, adasum_bucket_boundaries, adasum_halve, adasum_tree_share
from .allreduce import PendingBucket, start_bucket_all_reduce, wait_for
from .buckets import Bucket, BucketPlan, FlatBuffers
from .buffer_lifetime import ALIVE as _ALIVE, materialise, release
from ._checks import check_choice
from .clipping import max_over_ranks, norm_powers
from .precision import master_dtype_of
from .reducer import DistributedGradReducer
from .sharded import DIRECT_MEAN_NUMEL as _DIRECT_MEAN_NUMEL
from .sharded import (OwnedRange, ShardLayout, ranges_between, start_bucket_exchange,
                      start_bucket_reduce_scatter)
from .shard_transport import GATHER_CHUNK_BYTES
from .sharded_params import ShardedParameters

#: optimizers whose step updates every element from that element's gradient
#: and state alone (and per-parameter scalars such as a step count), so a
#: slice of a parameter steps exactly as the whole would
ELEMENTWISE_OPTIMIZERS: Tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
     "Rprop", "ASGD") if hasattr(torch.optim, name))


def check_shardable(optimizer: torch.optim.Optimizer, assume_elementwise: bool) -> None:
    """Refuse an optimizer whose step is not known to be elementwise.

    Raises:
        ValueError: ``optimizer``'s class is not one of
            ``ELEMENTWISE_OPTIMIZERS`` (exactly: a subclass may change the
            step) and ``assume_elementwise`` is false.
    """
    if assume_elementwise or type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"shard=True steps each rank's slice of a parameter on its own, which is exact only "
        f"for an optimizer whose step is elementwise; {type(optimizer).__name__} is not known "
        f"to be (known: {names}). An optimizer that needs whole tensors (LBFGS, Adafactor's "
        f"factored statistics, orthogonalising ones) would step wrongly. If its step is "
        f"elementwise, pass assume_elementwise=True")


def check_master_dtype(master_dtype) -> torch.dtype:
    """``master_dtype`` if it is a floating dtype the kernels handle.

    Raises:
        TypeError: not a ``torch.dtype``, or not floating.
    """
    if not isinstance(master_dtype, torch.dtype) or master_dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"master_dtype must be torch.float16, bfloat16, float32 or float64, "
                        f"got {master_dtype!r}")
    return master_dtype


#: ``gradient_collective=`` values: how the sharded reduction leaves each
#: rank its part of a bucket
GRADIENT_COLLECTIVES = ("reduce_scatter", "all_reduce", "exchange")
#: ``parameter_gather=`` values: how the stepped parts come back into the
#: parameters of every rank
PARAMETER_GATHERS = ("all_gather", "broadcast", "broadcast_direct")


def check_collectives(gradient_collective: Optional[str], parameter_gather: Optional[str], *,
                      shard: bool, adasum: bool) -> None:
    """Refuse a collective choice that is not one of the sharded step's.

    Raises:
        TypeError: ``gradient_collective`` or ``parameter_gather`` is neither
            None nor a string.
        ValueError: not one of ``GRADIENT_COLLECTIVES`` / ``PARAMETER_GATHERS``;
            given without ``shard``, or with AdaSum (whose tree is its own
            collective both ways).
    """
    for name, value, known in (("gradient_collective", gradient_collective,
                                GRADIENT_COLLECTIVES),
                               ("parameter_gather", parameter_gather, PARAMETER_GATHERS)):
        if check_choice(value, name, known, optional=True) is None:
            continue
        if not shard:
            raise ValueError(f"{name}={value!r} applies to shard=True only (unsharded, every "
                             f"bucket is all-reduced)")
        if adasum:
            raise ValueError(f"{name}={value!r} does not combine with reduce_method='adasum': "
                             f"AdaSum's tree reduces the gradients and gathers the parameters")


def _overflow_at(grad_dtype: torch.dtype, bucket_dtype: torch.dtype) -> float:
    """The magnitude from which a ``bucket_dtype`` value rounds to inf when cast
    to ``grad_dtype`` (half an ulp above its largest finite value; inf when
    the cast cannot overflow)."""
    narrow, wide = torch.finfo(grad_dtype), torch.finfo(bucket_dtype)
    if narrow.max >= wide.max:
        return math.inf
    return narrow.max + math.ldexp(narrow.eps, math.frexp(narrow.max)[1] - 1) / 2


class ShardedGradReducer(DistributedGradReducer):
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
        super().__init__(parameters, mean=mean and adasum_local_size is None, group=group,
                         bucket_cap_mb=bucket_cap_mb, reduce_dtype=reduce_dtype,
                         backend=backend, **clipping)
        self.shard_gradients = shard_gradients
        self._overlap.releases_grads = shard_gradients
        self.adasum_local_size = adasum_local_size
        if adasum_local_size is not None:
            # AdaSum's flatten prescales by 1/local_size, as adasum_allreduce does
            self._scales = [(1.0 / adasum_local_size, 1.0)] * len(self.plan.buckets)
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        self.unused_grads_to_none = True
        self.before_communicating = None  # called before a backward's first collective
        # AdaSum stops its tree after the halving: each rank owns the slice it
        # holds then (unequal, chunk-aligned), and the parameters come back
        # through the tree's reverse swaps
        self.tree_shares: Optional[List[TreeShare]] = None
        if adasum_local_size is not None and self.world_size > 1:
            self.tree_shares = [adasum_tree_share(adasum_bucket_boundaries(b), b.size, group,
                                                  adasum_local_size)
                                for b in self.plan.buckets]
            self.owned = [share.owned for share in self.tree_shares]
        else:
            self.owned = [(self.rank * b.part_size, (self.rank + 1) * b.part_size)
                          for b in self.plan.buckets]
        # each rank's part is its own slot of the bucket's buffer: the
        # reduce-scatter runs in place (NCCL's in-place form, which Megatron's
        # distributed optimizer uses too), so a part takes no memory of its own.
        # With shard_gradients a bucket's whole buffer lives only from its
        # start in backward until its collective has finished, waited for
        # when the bucket after next starts (as FSDP2 waits for one
        # reduce-scatter before the next): at most two whole buffers at a
        # time, as ZeRO-2's reduce buckets. Those buckets' parts are tensors
        # of their own, which live until their gradients are written into
        # .grad. The last two buckets are still in flight when backward ends,
        # so their parts stay slots (a part of its own would only add to
        # their buffers). The tensor objects stay (their storage is resized
        # to nothing and back, as FSDP does), so their views stay valid and a
        # buffer back at its address is the kept launches' same layout
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self.plan.buckets)
        self.parts: List[Optional[torch.Tensor]] = [None] * len(self.plan.buckets)
        count = len(self.plan.buckets)
        self._part_in_place = [not shard_gradients or
                               (self.world_size > 1 and adasum_local_size is None
                                and index >= count - _ALIVE)
                               for index in range(count)]
        # shard_gradients: each buffer's owned slot, what a part of its own is
        # copied from when the collective left it there; the buckets started
        # in this backward whose buffers still have memory, oldest first
        self._owned_slots: List[Optional[torch.Tensor]] = [None] * count
        self._in_flight: List[PendingBucket] = []
        if not shard_gradients:
            for bucket in self.plan.buckets:
                self._buffer_for(bucket.index)
        # with shard_gradients, the tensor elements each part holds and where
        # they start in it: what the part's write-back launch fills
        self._owned_ranges = [ranges_between(b, *self.owned[b.index]) for b in self.plan.buckets]
        self._owned_offsets = [tuple(r.offset for r in ranges) for ranges in self._owned_ranges]
        # the same, per parameter, as the optimizer's read-only record
        self.layout = ShardLayout(
            self.plan, self.rank, self.world_size, tuple(self.owned),
            tuple(OwnedRange(r.tensor, r.start, r.end, r.offset, self._order[r.tensor], b.index)
                  for b in self.plan.buckets for r in self._owned_ranges[b.index]))
        # the tensor elements outside this rank's part: zeros in its .grad
        self._not_owned = [ranges_between(b, 0, self.owned[b.index][0])
                           + ranges_between(b, self.owned[b.index][1], b.size)
                           for b in self.plan.buckets]
        self._zeros: Dict[int, torch.Tensor] = {}
        # torch's gloo backend reduce-scatters by all-reducing the whole input
        # and copying the part out (measured slower than the all-reduce alone:
        # docs/guides/optimizer.md): there, all-reduce and keep the part
        # on 2 ranks on the host, a bucket that is neither prescaled nor cast
        # can be reduce-scattered by one exchange instead (start_bucket_exchange:
        # half the bytes, the same bits), sent from the peer's slot of the
        # buffer and received into this rank's: gloo's choice for a bucket of
        # few large tensors, every such bucket with gradient_collective="exchange"
        exchange_from = None
        if gradient_collective is None and self.world_size > 1:
            gloo = dist.get_backend(group) == dist.Backend.GLOO
            gradient_collective = "all_reduce" if gloo else "reduce_scatter"
            exchange_from = _DIRECT_MEAN_NUMEL if gloo else None
        elif gradient_collective == "exchange":
            exchange_from = 0
        self._all_reduce_instead = self.world_size > 1 and gradient_collective != "reduce_scatter"
        self._exchange_from = exchange_from
        self._peer_slots: List[Optional[torch.Tensor]] = [
            self._buffers[b.index][(1 - self.rank) * b.part_size:(2 - self.rank) * b.part_size]
            if self._exchanges(b) else None for b in self.plan.buckets]
        self._plant_sites = self._sites_not_owned()
        self._overflow = [min((_overflow_at(self.plan.specs[slot].dtype, b.dtype)
                               for slot in b.tensor_indices), default=math.inf)
                          for b in self.plan.buckets]
        self._bounds: Optional[torch.Tensor] = None

    def _exchanges(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` can be reduce-scattered by ``start_bucket_exchange``
        (its tensors' contiguity aside, checked as it starts)."""
        slots = bucket.tensor_indices
        return self._exchange_from is not None and self._all_reduce_instead \
            and self.world_size == 2 and not self.shard_gradients \
            and self.adasum_local_size is None and bucket.device.type == "cpu" \
            and self._scales[bucket.index][0] == 1.0 and bool(slots) \
            and all(self.plan.specs[slot].dtype == bucket.dtype for slot in slots) \
            and sum(bucket.numels) >= self._exchange_from * len(slots)

    def _plan_shards(self) -> int:
        return self.world_size

    def _verify_once(self) -> None:
        # a reducing backward writes the buffers deferred all-gathers fill
        if self.before_communicating is not None:
            self.before_communicating()
        super()._verify_once()

    @property
    def buffers(self) -> List[Optional[torch.Tensor]]:
        """The flat buffers (scratch between the collectives: the all-gather
        reuses their memory); with ``shard_gradients``, None until a backward
        first starts the bucket (always, on a world of one rank), and with
        memory only from that start until the bucket's collective has
        finished (the last two buckets': until ``.grad`` is written)."""
        return self._buffers

    @property
    def flat_buffers(self) -> FlatBuffers:
        """``buffers`` and ``parts``, by role (``buckets.FlatBuffers``)."""
        return FlatBuffers(gradients=tuple(self._buffers), parts=tuple(self.parts))

    def _buffer_for(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s flat buffer, its memory allocated again if it was
        released, and this rank's part of it in ``parts`` if the part is in
        place."""
        buffer = self._buffers[index]
        if buffer is None:
            buffer = self._buffers[index] = self.plan.new_buffer(self.plan.buckets[index])
            owned = buffer[slice(*self.owned[index])]
            if self._part_in_place[index]:
                self.parts[index] = owned
            else:
                self._owned_slots[index] = owned
        elif self.shard_gradients:  # only these are ever released
            materialise(buffer)
        return buffer

    def _part_for(self, index: int) -> torch.Tensor:
        """``shard_gradients``: bucket ``index``'s part (made, or its memory
        allocated again, if need be): a slot of its buffer, or a tensor of its
        own."""
        if self._part_in_place[index]:
            self._buffer_for(index)
            return self.parts[index]
        part = self.parts[index]
        if part is None:
            lo, hi = self.owned[index]
            bucket = self.plan.buckets[index]
            part = self.parts[index] = torch.empty(hi - lo, dtype=bucket.dtype,
                                                   device=bucket.device)
        else:
            materialise(part)
        return part

    def _release_buffer(self, index: int) -> None:
        buffer = self._buffers[index]
        if buffer is not None:
            release(buffer)

    def _release_buffers(self) -> None:
        for index in range(len(self._buffers)):
            self._release_part(index)
        self._in_flight = []

    def _release_part(self, index: int) -> None:
        """``shard_gradients``: release bucket ``index``'s part and buffer."""
        self._release_buffer(index)
        if not self._part_in_place[index] and self.parts[index] is not None:
            release(self.parts[index])

    def _retire(self, pending: PendingBucket) -> None:
        """``shard_gradients``: wait for ``pending``'s collective, copy this
        rank's part out of the buffer if the collective left it there, and
        release the buffer's memory."""
        wait_for(pending)
        pending.work = None
        index = pending.bucket.index
        if self._part_in_place[index]:
            return  # the buffer holds the part until .grad is written
        if self._all_reduce_instead:
            self.parts[index].copy_(self._owned_slots[index])
        self._release_buffer(index)

    def _retire_before(self, index: int) -> None:
        """``shard_gradients``, as bucket ``index`` starts: retire the buckets
        started ``_ALIVE`` or more before it, and any left by a backward
        that raised (buckets start in order, so those are the ones not before
        it)."""
        while self._in_flight:
            started = self._in_flight[0].bucket.index
            if 0 < index - started < _ALIVE:
                return
            pending = self._in_flight.pop(0)
            if started < index:
                self._retire(pending)
            else:  # its backward raised: its gradients are gone
                wait_for(pending)
                self._release_part(started)

    def _held_buffers(self) -> List[torch.Tensor]:
        # the flat buffers (whole), the parts (slots of them, or with
        # shard_gradients tensors of their own) and the zeros that stand in
        # for frozen parameters' gradients
        return [*(b for b in (*self._buffers, *self.parts) if b is not None),
                *self._zeros.values()]

    def _sites_not_owned(self) -> List[Tuple[int, tuple]]:
        """(parameter index, element index) of one element per tensor that this
        rank does not own, in plan order: where a NaN can tell GradScaler of
        another rank's non-finite gradient without touching this rank's step."""
        sites = []
        for bucket in self.plan.buckets:
            lo, hi = self.owned[bucket.index]
            for slot, offset, numel in zip(bucket.tensor_indices, bucket.offsets,
                                           bucket.numels):
                element = 0 if offset < lo or offset >= hi else hi - offset
                if numel and element < numel:
                    index = self._order[slot]
                    shape = self.parameters[index].shape
                    sites.append((index, tuple(int(i) for i in np.unravel_index(element, shape))
                                  if shape else ()))
        return sites

    def register_hooks(self, passes_per_sync: int = 1, *,
                       gradient_as_bucket_view: bool = False) -> "ShardedGradReducer":
        if gradient_as_bucket_view:
            raise ValueError("gradient_as_bucket_view does not apply with shard=True")
        if self._overlap.attached:
            raise ValueError("hooks are already registered on this reducer")
        self._attach(passes_per_sync)
        return self

    def _attach(self, passes_per_sync: int) -> None:
        # released gradients cannot be read again: a bucket is held to the end
        # of backward while it is not known whether one of its gradients is
        # accumulated twice per pass (found in the first pass, as with bucket views)
        self._overlap.attach(passes_per_sync, hold_first_pass=self.shard_gradients,
                             held_by="shard_gradients=True")

    def rehook(self) -> None:
        """Hook exactly the parameters that require grad now."""
        passes = self._overlap._passes_per_sync
        self._overlap.detach()
        self._attach(passes)

    def _zeros_for(self, slot: int) -> torch.Tensor:
        zeros = self._zeros.get(slot)
        if zeros is None:
            zeros = self._zeros[slot] = torch.zeros_like(self.parameters[self._order[slot]])
        return zeros

    def plan_tensors(self) -> List[torch.Tensor]:
        return [self.parameters[i] for i in self._order]

    def _start(self, index: int, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        bucket = self.plan.buckets[index]
        if any(tensors[slot] is None for slot in bucket.tensor_indices):
            # a frozen parameter (no hook, no gradient) in a bucket started early
            tensors = list(tensors)
            for slot in bucket.tensor_indices:
                if tensors[slot] is None:
                    tensors[slot] = self._zeros_for(slot)
        if self.shard_gradients:
            self._retire_before(index)
            pending = self._start_sharded(bucket, tensors)
            # the buffer holds them now (the launch that read them is queued
            # before anything that can reuse their memory)
            for slot in bucket.tensor_indices:
                param = self.parameters[self._order[slot]]
                if param.requires_grad:
                    param.grad = None
            return pending
        buffer = self._buffer_for(index)
        prescale, _ = self._scales[index]
        if self.adasum_local_size is not None:
            self._flatten_and_halve(bucket, tensors, buffer)
            return PendingBucket(bucket, buffer, None)
        sent = self._peer_slots[index]
        if self._all_reduce_instead and sent is not None \
                and all(tensors[slot].is_contiguous() for slot in bucket.tensor_indices):
            return start_bucket_exchange(bucket, tensors, self.parts[index], sent,
                                         group=self.group, rank=self.rank, backend=self.backend)
        if self._all_reduce_instead:
            return start_bucket_all_reduce(self.plan, bucket, tensors, buffer,
                                           group=self.group, world_size=self.world_size,
                                           prescale=prescale, backend=self.backend)
        return start_bucket_reduce_scatter(self.plan, bucket, tensors, buffer,
                                           self.parts[index], group=self.group,
                                           world_size=self.world_size, prescale=prescale,
                                           backend=self.backend)

    def _flatten_and_halve(self, bucket: Bucket, tensors: Sequence[torch.Tensor],
                           buffer: torch.Tensor) -> None:
        """AdaSum: flatten ``bucket`` into ``buffer`` (prescaled) and run the
        tree's halving on it, which has finished when this returns."""
        prescale, _ = self._scales[bucket.index]
        self.plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=self.backend)
        if self.world_size > 1:
            adasum_halve(buffer, adasum_bucket_boundaries(bucket), self.group,
                         self.adasum_local_size, self.backend, prescaled=True)

    def _start_sharded(self, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> PendingBucket:
        """``shard_gradients``: flatten ``bucket`` and start the collective
        that leaves this rank's part in ``parts`` (a world of one rank
        flattens straight into the part, which is the whole bucket)."""
        index = bucket.index
        part, (prescale, _) = self._part_for(index), self._scales[index]
        if self.world_size == 1:
            self.plan.flatten(bucket, tensors, out=part, scale=prescale, backend=self.backend)
            return PendingBucket(bucket, part, None)
        buffer = self._buffer_for(index)
        if self.adasum_local_size is not None:
            self._flatten_and_halve(bucket, tensors, buffer)
            part.copy_(self._owned_slots[index])
            self._release_buffer(index)
            return PendingBucket(bucket, part, None)
        if self._all_reduce_instead:
            pending = start_bucket_all_reduce(self.plan, bucket, tensors, buffer,
                                              group=self.group, world_size=self.world_size,
                                              prescale=prescale, backend=self.backend)
        else:  # out of place for a part of its own: the buffer can go sooner
            pending = start_bucket_reduce_scatter(self.plan, bucket, tensors, buffer, part,
                                                  group=self.group, world_size=self.world_size,
                                                  prescale=prescale, backend=self.backend)
        self._in_flight.append(pending)
        return pending

    def _clipped_part_postscales(self, pending: Sequence[PendingBucket],
                                 parts: Sequence[torch.Tensor]) -> list:
        """Each bucket's postscale times the clip coefficient: the norm from
        every rank's owned parts (each element is owned once) and one small
        all-reduce of the per-bucket sums of powers (maxima for the max
        norm), so every rank computes the same bits."""
        powers = norm_powers(parts, self.norm_type, backend=self.backend)
        if self.world_size > 1 and self.norm_type == math.inf:
            powers = max_over_ranks(powers, self.group, self.world_size)
        elif self.world_size > 1:
            dist.all_reduce(powers, group=self.group)
        return self._clip(pending, powers)

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        try:
            self._finish_buckets(pending, outputs)
        finally:
            if self.shard_gradients:
                # written into .grad (or the backward failed; its gradients
                # are gone either way): nothing in the buffers is read again
                self._release_buffers()

    def _owned_parts(self, pending: Sequence[PendingBucket]) -> List[torch.Tensor]:
        """Wait for every bucket's collective; this rank's reduced part of
        each (not postscaled yet). Without ``shard_gradients`` the buffers
        are then whole, zeros outside the part, for the unflatten."""
        if self.shard_gradients:
            while self._in_flight:
                self._retire(self._in_flight.pop(0))
            return [self.parts[p.bucket.index] for p in pending]
        for p in pending:
            wait_for(p)
        return [self.parts[p.bucket.index] for p in pending]

    def _finish_buckets(self, pending: Sequence[PendingBucket],
                        outputs: Sequence[torch.Tensor]) -> None:
        parts = self._owned_parts(pending)
        if self.max_grad_norm is not None and pending:
            scales = self._clipped_part_postscales(pending, parts)
        else:
            scales = [self._scales[p.bucket.index][1] for p in pending]
        extremes: List[torch.Tensor] = []
        for p, part, postscale in zip(pending, parts, scales):
            bucket = p.bucket
            if not self.shard_gradients:
                self._write_part_and_zeros(bucket, part, outputs, postscale)
            if part.numel():
                # what GradScaler will read: the part's extremes as written
                # (postscaled; a finite sum can still overflow a 16-bit .grad)
                extremes.append(torch.stack(torch.aminmax(part)).double() * postscale)
        if extremes:
            values = torch.cat(extremes)
            if self._bounds is None:
                self._bounds = torch.tensor(
                    [self._overflow[b.index] for b in self.plan.buckets
                     if self.owned[b.index][1] > self.owned[b.index][0]],
                    dtype=torch.float64, device=values.device).repeat_interleave(2)
            nonfinite = (~torch.isfinite(values) | (values.abs() >= self._bounds)).any()
            nonfinite = nonfinite.to(torch.int32)
        else:
            nonfinite = torch.zeros((), dtype=torch.int32)
        if self.parameters:
            refuse_in_capture(self.parameters[0].device,
                              "a shard=True backward (the ranks' non-finite count is read to "
                              "the host, so that GradScaler skips the step on every rank)",
                              "capture an unsharded step; shard=True runs eagerly")
        ranks = self._settle_unused(nonfinite)
        if self.shard_gradients:
            self._write_owned(pending, scales)
        found = bool(ranks > 0)
        self.found_nonfinite = torch.tensor(found)
        if found:
            self._plant_nan()

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
            flat = self._buffers[bucket.index]
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

    def _plant_nan(self) -> None:
        """A NaN in one element of a ``.grad`` that this rank does not own: it
        tells GradScaler of another rank's non-finite gradient without
        changing this rank's step."""
        for index, element in self._plant_sites:
            grad = self.parameters[index].grad
            if grad is not None:
                grad[element] = float("nan")
                return
        if self.shard_gradients and self._plant_sites:
            # the parameters this rank does not own keep no .grad: make a zero one
            index, element = min(self._plant_sites,
                                 key=lambda site: self.parameters[site[0]].numel())
            grad = self.parameters[index].grad = torch.zeros_like(self.parameters[index])
            grad[element] = float("nan")

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
            self._release_part(index)
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
