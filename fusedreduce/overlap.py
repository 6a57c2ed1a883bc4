"""The backward-overlap engine: reduce ``.grad`` during backward, bucket by bucket.

Each parameter gets a post-accumulate-grad hook; a bucket's all-reduce starts
as soon as all its gradients are accumulated, strictly in bucket order (so
every rank issues the same collectives in the same sequence whatever order
its gradients arrive in). When backward ends, the remaining buckets start and
every result is written into ``.grad``. ``DistributedGradReducer.register_hooks``
attaches it; the reducer supplies how a bucket starts and finishes.

A backward pass may run other backward passes inside it: a reentrant
activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``)
recomputes its segment and runs a backward of its own from inside the outer
one, and the hooks of the parameters in that segment fire there. Each graph
task that fires a hook gets an end callback; a task that ends inside another
task's node (``torch._C._current_autograd_node()`` is set) hands the end of
the pass on to that outer task through a post-hook on the node, so the pass
ends, and the buckets are finished, once, when the outermost backward ends.
A parameter used both inside and outside such a segment accumulates its
gradient twice in one pass: its bucket is started again at the end (and,
from then on, held until the end).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from .allreduce import PendingBucket, wait_for
from .kernels import refuse_in_capture
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
        # the graph tasks of this pass that have an end callback, and those
        # callbacks while their tasks live (autograd drops a task's callbacks,
        # and with them the last reference, when its backward raises)
        self._tasks: set = set()
        self._live_ends: "weakref.WeakSet[_TaskEnd]" = weakref.WeakSet()
        self._syncing = False
        self._hold_first_pass = False
        self._learned = False
        self._fired: List[bool] = []
        self._twice: set = set()  # slots whose gradient was accumulated twice in a pass
        self._restart: set = set()  # started buckets a second accumulation made stale
        self._ready: List[int] = []
        self._hooked: set = set()  # slots with a hook (parameters that required grad then)
        self._unhooked: List[List[int]] = []
        self.missing: List[int] = []  # slots without a gradient when the last pass ended
        # the reducer sets .grad to None once a started bucket has read it
        # (shard_gradients): a slot whose hook fired had a gradient then
        self.releases_grads = False
        self._held_by = "gradient_as_bucket_view=True"
        self._next_launch = 0
        self._pending: List[PendingBucket] = []
        self.reduced = False
        # a pass began while .grad held reduced gradients no step took (more
        # backward passes than passes_per_sync before the step)
        self.reduced_again = False
        #: called at the start of every communicating pass, before any of its
        #: collectives: a ``Join`` participant tells the ranks that ran out of
        #: data that another pass is coming (``uneven_inputs``)
        self.announce: Optional[Callable[[], None]] = None

    @property
    def passes_since_sync(self) -> int:
        return self._passes_since_sync

    @property
    def passes_per_sync(self) -> int:
        """The backward passes per communicating one (``attach``'s)."""
        return self._passes_per_sync

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass is running (its end not reached yet)."""
        return self._in_backward

    @property
    def sync_enabled(self) -> bool:
        return self._sync_enabled

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, passes_per_sync: int, hold_first_pass: bool = False,
               held_by: str = "gradient_as_bucket_view=True") -> None:
        """Hook every parameter; communicate on every ``passes_per_sync``-th backward.

        ``hold_first_pass``: start no bucket before the end of the first
        communicating pass, which finds the parameters accumulated twice per
        pass; for buckets whose buffer is the gradients themselves (bucket
        views), or whose gradients are released once read (``held_by`` names
        the option in the error), where a second accumulation into a started
        bucket could not be repaired."""
        self._passes_per_sync = passes_per_sync
        self._hold_first_pass = hold_first_pass
        self._held_by = held_by
        # a frozen parameter takes no hook (torch refuses one); it is followed
        # at each pass instead (see _begin_backward)
        self._hooked = {slot for slot, p in enumerate(self.parameters) if p.requires_grad}
        # per bucket, its parameters without a hook (almost always none)
        self._unhooked = [[slot for slot in b.tensor_indices if slot not in self._hooked]
                          for b in self.plan.buckets]
        for slot in sorted(self._hooked):
            self._handles.append(self.parameters[slot].register_post_accumulate_grad_hook(
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
        # runs once per parameter per backward: kept to the fewest Python steps
        task = _graph_task_id()
        if not self._in_backward or task not in self._tasks:
            self._enter(task)
        if not self._syncing:
            return
        bucket_index = self.plan.location[slot][0]
        fired = self._fired
        if fired[slot]:
            # accumulated again in this pass (a reentrant checkpoint's segment
            # and the outer graph both use it): a started bucket is stale
            self._twice.add(slot)
            if bucket_index < self._next_launch:
                self._restart.add(bucket_index)
            return
        fired[slot] = True
        ready = self._ready
        ready[bucket_index] -= 1
        # buckets start in order: nothing can start unless the next one is ready
        following = self._next_launch
        if following < len(ready) and not ready[following]:
            self._launch_ready()

    def _enter(self, task: Optional[int]) -> None:
        """The first hook of graph task ``task`` in this pass, or of a pass."""
        if self._in_backward and not self._live_ends:
            # a task this pass has not seen, and none of its tasks runs: the
            # backward these hooks belonged to raised before its end
            self._abandon_backward()
        if not self._in_backward:
            self._begin_backward()
        self._watch(task)

    def _watch(self, task: Optional[int]) -> None:
        """Give ``task`` (the running graph task) an end callback, once."""
        if task in self._tasks:
            return
        self._tasks.add(task)
        end = _TaskEnd(self)
        self._live_ends.add(end)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _task_ended(self) -> None:
        if not self._in_backward:
            return
        node = _current_node()
        if node is not None:
            # this backward ran inside a node of an outer one: the pass ends
            # with the outer task, which the node's post-hook reaches
            resumed = []

            def outer_resumes(grad_inputs, grad_outputs):
                if not resumed and self._in_backward:
                    resumed.append(True)
                    self._watch(_graph_task_id())
            try:
                node.register_hook(outer_resumes)
                return
            except (AttributeError, RuntimeError):
                pass  # a node that takes no hooks: end here, as without nesting
        self._end_backward()

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

    def _begin_backward(self) -> None:
        if self._passes_per_sync > 1 and self.parameters:
            refuse_in_capture(
                self.parameters[0].device,
                f"a backward with passes_per_sync={self._passes_per_sync} "
                f"(backward_passes_per_step): which passes reduce is counted on the host, so "
                f"every replay would repeat the captured pass's choice",
                "capture with passes_per_sync=1 (backward_passes_per_step=1); to accumulate, "
                "capture the local passes inside no_sync() and the reducing pass as two graphs")
        self._tasks = set()
        self._live_ends = weakref.WeakSet()
        self._in_backward = True
        self.reduced_again = self.reduced_again or self.reduced
        self._syncing = self._sync_enabled and \
            (self._passes_since_sync + 1) % self._passes_per_sync == 0
        self.reduced = False
        if self._syncing:
            if self.announce is not None:
                self.announce()
            self._before_sync()
            hold_all = self._hold_first_pass and not self._learned
            # a held bucket never becomes ready: it starts when backward ends.
            # A parameter without a hook that is frozen does not hold its
            # bucket; one unfrozen since the hooks were set does (its gradient
            # is read when backward ends)
            self._ready = [
                len(b.tensor_indices)
                - sum(not self.parameters[slot].requires_grad for slot in unhooked)
                + int(hold_all or not self._twice.isdisjoint(b.tensor_indices))
                for b, unhooked in zip(self.plan.buckets, self._unhooked)]
            self._fired = [False] * len(self.parameters)
            self._restart = set()
            self._next_launch = 0
            self._pending = []

    def shadow_pass(self) -> None:
        """A communicating pass in which this rank has no gradient: every
        ``.grad`` is dropped first, so each parameter contributes zeros and
        counts as unused, and the pass issues the collectives of the other
        ranks' backward (whatever this rank's ``no_sync`` state or pass
        count). What a rank that ran out of data runs under ``Join``; the
        reduced gradients end up in ``.grad`` as after any pass."""
        if self._in_backward:
            raise RuntimeError("a shadow pass cannot run inside a backward pass")
        for p in self.parameters:
            p.grad = None
        announce, enabled = self.announce, self._sync_enabled
        self.announce, self._sync_enabled = None, True
        self._passes_since_sync = self._passes_per_sync - 1
        try:
            self._begin_backward()
            self._end_backward()
        finally:
            self.announce, self._sync_enabled = announce, enabled

    def _grads_of(self, bucket) -> List[Optional[torch.Tensor]]:
        grads: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        for slot in bucket.tensor_indices:
            grads[slot] = self.parameters[slot].grad
        return grads

    def _launch_ready(self, all_grads: Optional[List[torch.Tensor]] = None) -> None:
        """Start the ready buckets; with ``all_grads`` (every gradient, plan
        order), every bucket not started yet."""
        # strictly in bucket order, so every rank issues the same collectives
        # in the same sequence whatever order its gradients arrive in
        everything = all_grads is not None
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
        grads = []  # what each bucket sends and receives, plan order
        released = self._fired if self.releases_grads else [False] * len(self.parameters)
        self.missing = [slot for slot, p in enumerate(self.parameters)
                        if p.grad is None and not released[slot]]
        for slot, p in enumerate(self.parameters):
            if p.grad is None and released[slot]:
                grads.append(None)  # read by its started bucket, and released
                continue
            if p.grad is None:
                if not p.requires_grad:
                    # frozen since the hooks were set: it contributes zeros and
                    # keeps no gradient, so optimizers skip it as they would
                    grads.append(torch.zeros_like(p))
                    continue
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self._launch_ready(grads)
        if self._restart:
            self._restart_stale(grads)
        self._learned = True
        self._finish(self._pending, grads)
        self._pending = []
        self._passes_since_sync = 0
        self.reduced = True

    def _restart_stale(self, grads: List[torch.Tensor]) -> None:
        """Start again, in bucket order, the buckets started before a second
        accumulation into one of their gradients (found only in a pass that
        did not hold them)."""
        if self._hold_first_pass:
            for pending in self._pending:  # their buffers serve the next pass
                wait_for(pending)
            self._pending = []
            shapes = [tuple(self.parameters[slot].shape) for slot in sorted(self._twice)]
            raise RuntimeError(
                f"the gradients of the parameters of shapes {shapes} were accumulated twice "
                f"in one backward pass after their buckets had started (a parameter used inside "
                f"and outside a reentrant activation checkpoint, first seen after the first "
                f"step); with {self._held_by} this pass cannot be reduced exactly. "
                f"Later passes hold those buckets until backward ends")
        for i, pending in enumerate(self._pending):
            if pending.bucket.index in self._restart:
                wait_for(pending)  # its buffer is filled again
                self._pending[i] = self._start(pending.bucket.index, grads)


class _TaskEnd:
    """The end callback of one graph task of a pass; only autograd holds it,
    so it lives exactly as long as its task."""

    __slots__ = ("overlap", "__weakref__")

    def __init__(self, overlap: BackwardOverlap) -> None:
        self.overlap = overlap

    def __call__(self) -> None:
        self.overlap._task_ended()


def _current_node():
    """The autograd node this thread is evaluating (None outside one, or where
    torch does not expose it)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def _no_graph_task_id() -> None:
    return None


#: the running backward's id (None where torch does not expose one)
_graph_task_id: Callable[[], Optional[int]] = getattr(torch._C, "_current_graph_task_id",
                                                      _no_graph_task_id)
