"""How ``DistributedGradReducer`` writes its reduced buckets back.

Every rank holds each whole reduced bucket; two write-backs for the hooks'
path, chosen once, when ``register_hooks`` decides ``gradient_as_bucket_view``:

- ``Unflatten`` (the default): each bucket's gradients are flattened into a
  kept flat buffer (made at the first reduction), and the sum is unflattened
  into ``.grad``;
- ``IntoViews`` (bucket views): the gradients are views of the buffers
  (``bucket_views.BucketViews``), so a viewed bucket is reduced where
  backward accumulated it and scaled there; a bucket with a non-contiguous
  parameter keeps the default path.

The call path (``reducer(grads)``) always unflattens into new tensors
(``start_flat``, ``write_back``), through the hooks' buffers by default or,
while those hold the ``.grad`` views, through buffers of its own.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .allreduce import PendingBucket, finish_bucket, wait_for
from .bucket_views import BucketViews
from .buckets import Bucket, FlatBuffers
from .nonfinite import record_nonfinite


def start_flat(engine, bucket: Bucket, tensors: Sequence[Optional[torch.Tensor]],
               buffer: torch.Tensor) -> PendingBucket:
    """Flatten ``bucket``'s tensors into ``buffer`` and start its collective
    (``engine``: the reducer's ``BucketEngine``)."""
    prescale, _ = engine.scales[bucket.index]
    # the flatten zeroes the spare elements; a rank missing a gradient
    # marks its one before the collective
    spare = engine.missing_spare
    mark = spare if spare is not None and buffer.numel() > bucket.size + spare \
        and engine.missing_in(bucket) else None
    return engine.collective.start(bucket, tensors, buffer, None, prescale,
                                   count_nonfinite=engine.check_finite, mark_spare=mark)


def unflatten_bucket(engine, pending: PendingBucket, outputs: Sequence[torch.Tensor],
                     scale=None) -> None:
    """Write ``pending``'s reduced bucket into ``outputs`` (plan order), times
    its postscale, or ``scale`` (the clip's, once the collective has finished)."""
    if scale is None:
        finish_bucket(engine.plan, pending, outputs,
                      postscale=engine.scales[pending.bucket.index][1], backend=engine.backend)
    else:
        engine.plan.unflatten(pending.bucket, pending.flat, outputs, scale=scale,
                              backend=engine.backend)


def write_back(engine, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor],
               write=unflatten_bucket) -> None:
    """Write the reduced buckets into ``outputs`` (plan order) by ``write``
    (``unflatten_bucket``'s call), postscaled or clipped, and record whether a
    rank's gradient was non-finite."""
    scales = None
    if engine.max_grad_norm is not None:
        for p in pending:
            wait_for(p)
        scales = engine.clip(pending, [p.flat[:p.bucket.size] for p in pending])
    for i, p in enumerate(pending):
        write(engine, p, outputs, None if scales is None else scales[i])
    record_nonfinite(engine, pending)


class Unflatten:
    """The default write-back: flatten into kept buffers, unflatten the sums.

    Args:
        engine: the reducer's ``BucketEngine``.
        buffers: the hooks' path's flat buffers, one per bucket (also the
            call path's); None: made at the first reduction.
        call_buffers: the call path's own buffers, left by a bucket-views
            write-back before this one (``without_views``): still held, not
            used again.
    """

    def __init__(self, engine, buffers: Optional[List[torch.Tensor]] = None,
                 call_buffers: Optional[List[torch.Tensor]] = None) -> None:
        self.engine, self.buffers, self.call_buffers = engine, buffers, call_buffers

    def kept_buffers(self) -> List[torch.Tensor]:
        """The hooks' buffers, made now if not yet."""
        if self.buffers is None:
            self.buffers = self.engine.new_buffers()
        return self.buffers

    def buffers_for_calls(self) -> List[torch.Tensor]:
        """The buffers the call path flattens into."""
        return self.kept_buffers()

    def start(self, bucket: Bucket, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        """Start ``bucket`` of a backward pass (the hooks' path)."""
        return start_flat(self.engine, bucket, tensors, self.kept_buffers()[bucket.index])

    def finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        """Write a backward pass's reduced buckets into ``outputs`` (the ``.grad``)."""
        write_back(self.engine, pending, outputs)

    def with_views(self, parameters: Sequence[torch.Tensor]) -> "IntoViews":
        """The bucket-views write-back over these buffers (``parameters``: plan order)."""
        return IntoViews(self.engine, parameters, self.kept_buffers(), self.call_buffers)

    def without_views(self) -> "Unflatten":
        """The write-back once the hooks are removed."""
        return self

    def held(self) -> List[torch.Tensor]:
        """What the reducer keeps between reductions for its own use (its
        collective's kept buffers too)."""
        return [*(self.buffers or ()), *(self.call_buffers or ()), *self.engine.collective.held()]

    def flat_buffers(self) -> FlatBuffers:
        """The held buffers by role (``DistributedGradReducer.flat_buffers``)."""
        unmade = (None,) * len(self.engine.plan.buckets)
        return FlatBuffers(
            gradients=unmade if self.buffers is None else tuple(self.buffers),
            calls=unmade if self.call_buffers is None else tuple(self.call_buffers),
            views=self.view_buffers())

    def view_buffers(self) -> tuple:
        """The buffers of ``.grad`` views of other dtypes than their bucket's."""
        return ()


class IntoViews(Unflatten):
    """The bucket-views write-back (``gradient_as_bucket_view=True``): the
    hooks' buffers hold the ``.grad`` views (``BucketViews`` zeroes them), so
    the call path takes buffers of its own."""

    def __init__(self, engine, parameters: Sequence[torch.Tensor], buffers: List[torch.Tensor],
                 call_buffers: Optional[List[torch.Tensor]]) -> None:
        super().__init__(engine, buffers, call_buffers)
        self.views = BucketViews(parameters, engine.plan, buffers, engine.backend)

    def buffers_for_calls(self) -> List[torch.Tensor]:
        if self.call_buffers is None:
            self.call_buffers = self.engine.new_buffers()
        return self.call_buffers

    def start(self, bucket: Bucket, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        views = self.views
        if not views.viewed(bucket):
            return super().start(bucket, tensors)
        # the gradients are the buffer already: no flatten
        engine, buffer = self.engine, self.buffers[bucket.index]
        prescale, _ = engine.scales[bucket.index]
        views.adopt(bucket)
        flag = views.gather(bucket, prescale, engine.check_finite)
        spare = None
        if flag is not None:
            spare = buffer[bucket.size]
            spare.copy_(flag)
        if engine.missing_spare is not None:
            # the views' buffer keeps the last sum there: rewritten unless
            # the last check found every sum zero (a stale non-zero only
            # sends that check to the exact count, which clears it)
            if engine.missing_in(bucket):
                buffer[bucket.size + engine.missing_spare] = 1
            elif not engine.spares_clear:
                buffer[bucket.size + engine.missing_spare] = 0
        return engine.collective.communicate(bucket, buffer, spare)

    def finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        write_back(self.engine, pending, outputs, self.write)

    def write(self, engine, pending: PendingBucket, outputs: Sequence[torch.Tensor],
              scale=None) -> None:
        """``unflatten_bucket``, or for a viewed bucket the scale in place: the
        views are the outputs."""
        if not self.views.viewed(pending.bucket):
            unflatten_bucket(engine, pending, outputs, scale)
            return
        wait_for(pending)
        postscale = engine.scales[pending.bucket.index][1] if scale is None else scale
        self.views.scatter(pending.bucket, postscale)

    def without_views(self) -> Unflatten:
        # the gradients that were views keep the hooks' buffers' memory: the
        # reducer takes fresh ones
        return Unflatten(self.engine, None, self.call_buffers)

    def held(self) -> List[torch.Tensor]:
        return [*super().held(), *self.views.grad_buffers.values()]

    def view_buffers(self) -> tuple:
        return tuple(self.views.grad_buffers.values())
