"""The sharded reducer's buffers and parts, and how long each has memory.

Each rank's part is its own slot of the bucket's buffer: the reduce-scatter
runs in place (NCCL's in-place form, which Megatron's distributed optimizer
uses too), so a part takes no memory of its own. With ``shard_gradients``
(ZeRO-2) a bucket's whole buffer lives only from its start in backward
until its collective has finished, waited for when the bucket after next
starts (as FSDP2 waits for one reduce-scatter before the next): at most
``ALIVE`` whole buffers at a time, as ZeRO-2's reduce buckets. Those
buckets' parts are tensors of their own, which live until their gradients
are written into ``.grad``. The last two buckets are still in flight when
backward ends, so their parts stay slots (a part of its own would only add
to their buffers). The tensor objects stay (their storage is resized to
nothing and back, as FSDP does, ``buffer_lifetime``), so their views stay
valid and a buffer back at its address is the kept launches' same layout.

The two lifetimes have the same calls (``start``, ``finished_parts``,
``pass_ended``) and are chosen once, where the reducer is built
(``sharded_grads``): ``KeptBuffers`` (``shard_gradients=False``) and
``ReleasedBuffers`` (ZeRO-2).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from .allreduce import PendingBucket, wait_for
from .buckets import BucketPlan, FlatBuffers
from .buffer_lifetime import ALIVE, ReleasedBuffer


class _ShardBuffers:
    """What both lifetimes hold: the flat buffers and this rank's parts of a
    sharded plan's buckets.

    Args:
        plan: the sharded plan.
        owned: per bucket, the ``(start, end)`` elements this rank owns.
        collective: the reducer's gradient collective (``grad_collectives``).
    """

    def __init__(self, plan: BucketPlan, owned: Sequence[Tuple[int, int]], collective) -> None:
        self.plan, self.owned, self.collective = plan, owned, collective
        count = len(plan.buckets)
        self.buffers: List[Optional[torch.Tensor]] = [None] * count
        self.parts: List[Optional[torch.Tensor]] = [None] * count

    def flat_buffers(self) -> FlatBuffers:
        return FlatBuffers(gradients=tuple(self.buffers), parts=tuple(self.parts))

    def held(self) -> List[torch.Tensor]:
        return [b for b in (*self.buffers, *self.parts) if b is not None]


class KeptBuffers(_ShardBuffers):
    """Every bucket's buffer made now and kept, this rank's part a slot of it
    (``shard_gradients=False``)."""

    def __init__(self, plan: BucketPlan, owned: Sequence[Tuple[int, int]], collective) -> None:
        super().__init__(plan, owned, collective)
        for bucket in plan.buckets:
            buffer = self.buffers[bucket.index] = plan.new_buffer(bucket)
            self.parts[bucket.index] = buffer[slice(*owned[bucket.index])]

    def start(self, bucket, tensors: Sequence[torch.Tensor], prescale: float) -> PendingBucket:
        """Flatten ``bucket`` and start the collective that leaves this rank's
        part in ``parts``."""
        index = bucket.index
        return self.collective.start(bucket, tensors, self.buffers[index], self.parts[index],
                                     prescale)

    def pass_ended(self) -> None:
        """A backward's buckets are written back (or it failed): the buffers
        stay."""

    def finished_parts(self, pending: Sequence[PendingBucket]) -> List[torch.Tensor]:
        """Wait for every bucket's collective; this rank's reduced part of
        each (not postscaled yet). The buffers are then whole, zeros outside
        the part (or the whole sum), for the unflatten."""
        for p in pending:
            wait_for(p)
        return [self.parts[p.bucket.index] for p in pending]


class ReleasedBuffers(_ShardBuffers):
    """Buffers and parts released between uses (``shard_gradients=True``,
    ZeRO-2): see the module's docstring."""

    def __init__(self, plan: BucketPlan, owned: Sequence[Tuple[int, int]], collective) -> None:
        super().__init__(plan, owned, collective)
        count = len(plan.buckets)
        self.part_in_place = [collective.asynchronous and index >= count - ALIVE
                              for index in range(count)]
        # each bucket's buffer, and its part where the part has memory of its own
        self._held = [ReleasedBuffer(functools.partial(plan.new_buffer, bucket))
                      for bucket in plan.buckets]
        self._held_parts = [ReleasedBuffer(functools.partial(
            torch.empty, hi - lo, dtype=bucket.dtype, device=bucket.device))
            for bucket, (lo, hi) in zip(plan.buckets, owned)]
        # each buffer's owned slot, what a part of its own is copied from when
        # the collective left it there; the buckets started in this backward
        # whose buffers still have memory, oldest first
        self.owned_slots: List[Optional[torch.Tensor]] = [None] * count
        self.in_flight: List[PendingBucket] = []

    def buffer_for(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s flat buffer, its memory allocated again if it was
        released, and this rank's part of it in ``parts`` if the part is in
        place."""
        made = self.buffers[index] is not None
        buffer = self.buffers[index] = self._held[index].take()
        if not made:
            owned = buffer[slice(*self.owned[index])]
            if self.part_in_place[index]:
                self.parts[index] = owned
            else:
                self.owned_slots[index] = owned
        return buffer

    def part_for(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s part (made, or its memory allocated again, if
        need be): a slot of its buffer, or a tensor of its own."""
        if self.part_in_place[index]:
            self.buffer_for(index)
            return self.parts[index]
        part = self.parts[index] = self._held_parts[index].take()
        return part

    def start(self, bucket, tensors: Sequence[torch.Tensor], prescale: float) -> PendingBucket:
        """Flatten ``bucket`` and start the collective that leaves this rank's
        part in ``parts``, the buffers of earlier buckets retired in turn."""
        index = bucket.index
        self.retire_before(index)
        part = self.part_for(index)
        if not self.collective.buffered:  # the flatten is the whole reduction
            return self.collective.start(bucket, tensors, None, part, prescale)
        pending = self.collective.start(bucket, tensors, self.buffer_for(index), part, prescale)
        if not self.collective.asynchronous:  # finished: take the part now
            part.copy_(self.owned_slots[index])
            self.release_buffer(index)
            return PendingBucket(bucket, part, None)
        self.in_flight.append(pending)
        return pending

    def release_buffer(self, index: int) -> None:
        if self.buffers[index] is not None:
            self._held[index].done()

    def pass_ended(self) -> None:
        """A backward's buckets are written back (or it failed): the buffers
        and parts give their memory back."""
        for index in range(len(self.buffers)):
            self.release_part(index)
        self.in_flight = []

    def release_part(self, index: int) -> None:
        """Give back bucket ``index``'s part and buffer (``owned_writeback``
        does after writing the part into ``.grad``)."""
        self.release_buffer(index)
        if not self.part_in_place[index] and self.parts[index] is not None:
            self._held_parts[index].done()

    def retire(self, pending: PendingBucket) -> None:
        """Wait for ``pending``'s collective, copy this rank's part out of the
        buffer if the collective left it there, and release the buffer's
        memory."""
        wait_for(pending)
        pending.work = None
        index = pending.bucket.index
        if self.part_in_place[index]:
            return  # the buffer holds the part until .grad is written
        if self.collective.whole:
            self.parts[index].copy_(self.owned_slots[index])
        self.release_buffer(index)

    def retire_before(self, index: int) -> None:
        """As bucket ``index`` starts: retire the buckets started ``ALIVE`` or
        more before it, and any left by a backward that raised (buckets start
        in order, so those are the ones not before it)."""
        while self.in_flight:
            started = self.in_flight[0].bucket.index
            if 0 < index - started < ALIVE:
                return
            pending = self.in_flight.pop(0)
            if started < index:
                self.retire(pending)
            else:  # its backward raised: its gradients are gone
                wait_for(pending)
                self.release_part(started)

    def finished_parts(self, pending: Sequence[PendingBucket]) -> List[torch.Tensor]:
        """Wait for every bucket's collective; this rank's reduced part of
        each (not postscaled yet)."""
        while self.in_flight:
            self.retire(self.in_flight.pop(0))
        return [self.parts[p.bucket.index] for p in pending]
