"""The backward-overlap engine: reduce ``.grad`` during backward, bucket by bucket.

Each parameter gets a post-accumulate-grad hook; a bucket's all-reduce starts
as soon as all its gradients are accumulated, strictly in bucket order (so
every rank issues the same collectives in the same sequence whatever order
its gradients arrive in). When backward ends, the remaining buckets start and
every result is written into ``.grad``. ``DistributedGradReducer.register_hooks``
attaches it; the reducer supplies how a bucket starts and finishes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from .allreduce import PendingBucket, wait_for
from .buckets import BucketPlan

StartBucket = Callable[[int, Sequence[Optional[torch.Tensor]]], PendingBucket]
FinishBuckets = Callable[[Sequence[PendingBucket], Sequence[torch.Tensor]], None]


class BackwardOverlap:
    """The state of overlapping a reducer's buckets with backward passes.

    Args:
        parameters: the parameters in plan order (``plan.specs`` order).
        plan: the reducer's bucket plan.
        start: ``start(bucket_index, grads_in_plan_order)``: flatten and start
            that bucket's collective (entries outside the bucket may be None).
        finish: ``finish(pending, outputs)``: wait for and write out the
            started buckets into ``outputs`` (plan order).
        before_first_sync: called at the start of every syncing backward,
            before any collective (the reducer's one-time rank check).
    """

    def __init__(self, parameters: Sequence[torch.Tensor], plan: BucketPlan,
                 start: StartBucket, finish: FinishBuckets,
                 before_first_sync: Callable[[], None]) -> None:
        self.parameters = list(parameters)
        self.plan = plan
        self._start, self._finish, self._before_sync = start, finish, before_first_sync
        self._handles: list = []
        self._sync_enabled = True
        self._passes_per_sync = 1
        self._passes_since_sync = 0
        self._in_backward = False
        self._backward_task: Optional[int] = None
        self._syncing = False
        self._ready: List[int] = []
        self._next_launch = 0
        self._pending: List[PendingBucket] = []
        self.reduced = False

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, passes_per_sync: int) -> None:
        """Hook every parameter; communicate on every ``passes_per_sync``-th backward."""
        self._passes_per_sync = passes_per_sync
        for slot, p in enumerate(self.parameters):
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda param, slot=slot: self._on_grad_ready(slot)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, slot: int) -> None:
        task = _graph_task_id()
        if self._in_backward and task != self._backward_task:
            # the backward these hooks belonged to raised before its end
            self._abandon_backward()
        if not self._in_backward:
            self._begin_backward(task)
        if not self._syncing:
            return
        bucket_index, _ = self.plan.location[slot]
        self._ready[bucket_index] -= 1
        self._launch_ready()

    def _abandon_backward(self) -> None:
        """Forget a backward pass that raised after some buckets started.

        Autograd drops the end-of-backward callback when a backward raises,
        so the next backward finds the last one's state. Its collectives were
        issued (on every rank alike when every rank failed the same way): wait
        for them, since the next pass reuses their buffers, and discard them.
        The failed pass does not count towards ``passes_per_sync``.
        """
        for pending in self._pending:
            wait_for(pending)
        self._pending = []
        self._in_backward = False

    def _begin_backward(self, task: Optional[int] = None) -> None:
        self._backward_task = task
        self._in_backward = True
        self._syncing = self._sync_enabled and \
            (self._passes_since_sync + 1) % self._passes_per_sync == 0
        self.reduced = False
        if self._syncing:
            self._before_sync()
            self._ready = [len(b.tensor_indices) for b in self.plan.buckets]
            self._next_launch = 0
            self._pending = []
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _all_grads(self) -> List[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]

    def _grads_of(self, bucket) -> List[Optional[torch.Tensor]]:
        grads: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        for slot in bucket.tensor_indices:
            grads[slot] = self.parameters[slot].grad
        return grads

    def _launch_ready(self, everything: bool = False) -> None:
        # strictly in bucket order, so every rank issues the same collectives
        # in the same sequence whatever order its gradients arrive in
        all_grads = self._all_grads() if everything else None
        while self._next_launch < len(self.plan.buckets) and \
                (everything or self._ready[self._next_launch] == 0):
            bucket = self.plan.buckets[self._next_launch]
            grads = all_grads if everything else self._grads_of(bucket)
            self._pending.append(self._start(self._next_launch, grads))
            self._next_launch += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        if not self._syncing:
            self._passes_since_sync += 1
            return
        self._launch_ready(everything=True)
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._finish(self._pending, [p.grad for p in self.parameters])
        self._pending = []
        self._passes_since_sync = 0
        self.reduced = True


def _graph_task_id() -> Optional[int]:
    """The running backward's id (None where torch does not expose one)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None
