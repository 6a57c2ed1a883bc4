"""How the sharded reducer writes its reduced parts back into ``.grad``.

Two write-backs, chosen once by ``shard_gradients``:

- ``PartsAndZeros`` (the gradients kept): every ``.grad`` stays whole; this
  rank's part goes into its elements and zeros into the rest, one launch
  per bucket, before the pass is settled;
- ``OwnedGradients`` (ZeRO-2): each bucket's ``.grad`` tensors are released
  as soon as the bucket has read them; once the pass is settled, only the
  used parameters this rank owns elements of get a ``.grad``, written from
  the part in one launch per bucket, each part's memory released after it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import kernels
from .allreduce import PendingBucket
from .buckets import Bucket
from .sharded import ranges_between


class _OwnedParts:
    """What both write-backs read.

    Args:
        engine: the reducer's ``BucketEngine`` (parameters, plan order, the
            unused parameters of the pass).
        owned: per bucket, the ``(start, end)`` elements this rank owns.
        lifetime: the reducer's buffers (``shard_buffers``).
        owned_ranges: per bucket, the tensor elements its part holds
            (``sharded.ranges_between``); ``offsets``: where they start in it.
    """

    def __init__(self, engine, owned, lifetime, owned_ranges, offsets) -> None:
        self.engine, self.owned, self.lifetime = engine, owned, lifetime
        self.owned_ranges, self.offsets = owned_ranges, offsets


class PartsAndZeros(_OwnedParts):
    """The write-back into whole gradients (``shard_gradients=False``)."""

    #: whether a started bucket's gradients are released (``.grad = None``)
    releases_grads = False

    def __init__(self, engine, owned, lifetime, owned_ranges, offsets) -> None:
        super().__init__(engine, owned, lifetime, owned_ranges, offsets)
        # the tensor elements outside this rank's part: zeros in its .grad
        self._not_owned = [ranges_between(b, 0, owned[b.index][0])
                           + ranges_between(b, owned[b.index][1], b.size)
                           for b in engine.plan.buckets]

    def started(self, bucket: Bucket) -> None:
        """``bucket``'s collective has started."""

    def before_settling(self, pending: Sequence[PendingBucket], parts: Sequence[torch.Tensor],
                        outputs: Sequence[torch.Tensor], scales: Sequence) -> None:
        for p, part, postscale in zip(pending, parts, scales):
            self._write(p.bucket, part, outputs, postscale)

    def after_settling(self, pending: Sequence[PendingBucket], scales: Sequence) -> None:
        """The pass is settled (unused parameters known)."""

    def _write(self, bucket: Bucket, part: torch.Tensor, outputs: Sequence[torch.Tensor],
               postscale) -> None:
        """Write this rank's reduced part (postscaled) into its elements of
        the bucket's gradients and zeros into the rest. The collective left
        the part in its slot of the buffer (the whole buffer all-reduced on
        gloo, the part in place on NCCL); the elements outside it are not
        read: zeroing them in the buffer first and unflattening all of it
        read and wrote each of them twice more."""
        engine = self.engine
        members = [outputs[slot] for slot in bucket.tensor_indices]
        if not all(t.is_contiguous() for t in members):
            lo, hi = self.owned[bucket.index]
            flat = self.lifetime.buffers[bucket.index]
            flat[:lo].zero_()
            flat[hi:].zero_()
            engine.plan.unflatten(bucket, flat, outputs, scale=postscale, backend=engine.backend)
            return
        ranges = self.owned_ranges[bucket.index]
        if ranges:
            kernels.unflatten_cast_scale(
                part, [outputs[r.tensor].view(-1)[r.start:r.end] for r in ranges],
                scale=postscale, backend=engine.backend, offsets=self.offsets[bucket.index])
        zeros = [outputs[r.tensor].view(-1)[r.start:r.end] for r in self._not_owned[bucket.index]]
        if zeros:
            torch._foreach_zero_(zeros)


class OwnedGradients(_OwnedParts):
    """The write-back of owned gradients only (``shard_gradients=True``)."""

    releases_grads = True

    def __init__(self, engine, owned, lifetime, owned_ranges, offsets) -> None:
        super().__init__(engine, owned, lifetime, owned_ranges, offsets)
        # alone, a rank steps with no other: it needs no .grad kept for GradScaler
        self._keep_a_grad = _keep_a_grad if engine.world_size > 1 else _alone

    def started(self, bucket: Bucket) -> None:
        # the buffer holds them now (the launch that read them is queued
        # before anything that can reuse their memory)
        parameters, order = self.engine.parameters, self.engine.order
        for slot in bucket.tensor_indices:
            param = parameters[order[slot]]
            if param.requires_grad:
                param.grad = None

    def before_settling(self, pending, parts, outputs, scales) -> None:
        """The gradients were released: nothing to write into yet."""

    def after_settling(self, pending: Sequence[PendingBucket], scales: Sequence) -> None:
        """A ``.grad`` for each used parameter this rank owns elements of,
        from its part (one launch per bucket), each part's memory released
        after its launch."""
        engine = self.engine
        parameters, order = engine.parameters, engine.order
        unused = {order[slot] for slot in engine.unused_slots}
        written = 0
        for p, postscale in zip(pending, scales):
            index = p.bucket.index
            destinations, offsets = [], []
            for r in self.owned_ranges[index]:
                param_index = order[r.tensor]
                param = parameters[param_index]
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
                kept = self.offsets[index]
                kernels.unflatten_cast_scale(
                    self.lifetime.parts[index], destinations, scale=postscale,
                    backend=engine.backend,
                    offsets=kept if len(offsets) == len(kept) else tuple(offsets))
                written += len(destinations)
            # nothing reads this bucket's part again: the next buckets' .grad
            # can take its memory
            self.lifetime.release_part(index)
        if not written:
            self._keep_a_grad(parameters, unused)


def _keep_a_grad(parameters: Sequence[torch.Tensor], unused) -> None:
    """A rank left with no ``.grad`` at all keeps a zero one on its smallest
    used parameter: GradScaler records its check from the ``.grad`` it
    finds; with none this rank would refuse to step while the others step."""
    if any(param.grad is not None for param in parameters):
        return
    used = [i for i, param in enumerate(parameters)
            if param.requires_grad and i not in unused]
    if used:
        keeper = min(used, key=lambda i: parameters[i].numel())
        parameters[keeper].grad = torch.zeros_like(parameters[keeper])


def _alone(parameters: Sequence[torch.Tensor], unused) -> None:
    """A world of one rank: no other rank's step to keep in line with."""
