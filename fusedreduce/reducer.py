"""DistributedGradReducer: fused gradient all-reduce, called directly or
overlapped with backward through gradient hooks.

PyTorch counterpart of MindSpore's ``nn.DistributedGradReducer``: gradients
are averaged (``mean=True``, divided by ``degree``) or summed across the
process group, low-precision gradients are reduced in fp32 (the seed's
``construct`` note) and cast back, all through the foundation's BucketPlan and
fused kernels: flatten/cast/prescale -> one all-reduce per bucket ->
unflatten/cast/postscale.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import torch

from . import kernels
from .buckets import BucketPlan
from .collectives import (PendingBucket, finish_bucket, require_process_group,
                          start_bucket_all_reduce, verify_same_on_all_ranks)

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def communication_dtype(grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient travels in: a 16-bit ``reduce_dtype`` compresses every
    gradient to it; fp32/fp64 never narrows a gradient (fp64 stays fp64)."""
    if reduce_dtype in _SIXTEEN_BIT:
        return reduce_dtype
    if grad_dtype == torch.float64:
        return torch.float64
    return reduce_dtype


class DistributedGradReducer:
    """All-reduce gradients across a process group through fused buckets.

    Call it on a gradient tuple (MindSpore style) or let it reduce ``.grad``
    during backward (``register_hooks``), overlapping communication with the
    rest of the backward pass.

    Args:
        parameters: the parameters whose gradients are reduced, in the same
            order on every rank.
        mean: divide the sum by ``degree``.
        degree: the divisor of the mean; default: the group's world size.
        fusion_type: an int (every gradient in one fusion group) or one int
            per parameter; gradients of different ids never share a bucket.
        group: the process group; default: the world.
        bucket_cap_mb: the byte cap of a fused bucket, in MiB.
        reduce_dtype: the communication dtype: fp32 (default) reduces 16-bit
            gradients in fp32 and casts back; fp16/bf16 compress everything
            (halving the bytes sent); fp64 gradients never travel narrower
            unless ``reduce_dtype`` is 16-bit.
        prescale: the factor applied before the sum (the rest of the mean after
            it). Default: ``1/degree`` up front for 16-bit communication (guards
            fp16 overflow), everything after the sum otherwise.
        check_finite: also compute ``found_nonfinite`` on each reduction: a 0-d
            bool tensor, true on every rank if any rank's gradient had an inf or
            NaN.
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: a parameter is not a dense floating tensor, or a bad
            ``reduce_dtype``/``fusion_type`` type.
        ValueError: ``degree`` is not a positive int (as the seed), a bad
            ``fusion_type`` length, ``bucket_cap_mb`` or ``prescale``.

    Example:
        >>> reducer = DistributedGradReducer(model.parameters())          # doctest: +SKIP
        >>> loss.backward()                                                # doctest: +SKIP
        >>> grads = reducer([p.grad for p in model.parameters()])          # doctest: +SKIP
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        mean: bool = True,
        degree: Optional[int] = None,
        fusion_type: Union[int, Sequence[int]] = 1,
        group=None,
        *,
        bucket_cap_mb: float = 25.0,
        reduce_dtype: torch.dtype = torch.float32,
        prescale: Optional[float] = None,
        check_finite: bool = False,
        backend: str = "auto",
    ) -> None:
        self.parameters: List[torch.Tensor] = list(parameters)
        for i, p in enumerate(self.parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{i}] must be a tensor, got {type(p).__name__}")
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)
                                   or degree <= 0):
            raise ValueError(f"degree must be a positive int, got {degree!r}")
        if reduce_dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"reduce_dtype must be a floating dtype, got {reduce_dtype}")
        if prescale is not None:
            kernels.check_scale(prescale, "prescale")
            if prescale == 0:
                raise ValueError("prescale must not be 0: the sum would be lost")
        # where the gradients live decides whether the backend can run: say so now
        for device in sorted({p.device for p in self.parameters}, key=str):
            kernels.resolve_backend(backend, device)
        self.group = group
        self.world_size = require_process_group(group)
        self.mean = bool(mean)
        self.degree = self.world_size if degree is None else degree
        self.reduce_dtype = reduce_dtype
        self.check_finite = check_finite
        self.backend = backend
        self.found_nonfinite: Optional[torch.Tensor] = None
        n = len(self.parameters)
        fusion_ids = _fusion_ids(fusion_type, n)
        # buckets follow the reverse parameter order: backward produces the last
        # layers' gradients first, so the first buckets fill (and launch) first
        self._order = list(range(n - 1, -1, -1))
        self.plan = BucketPlan([self.parameters[i] for i in self._order],
                               bucket_cap_mb=bucket_cap_mb,
                               comm_dtype=lambda d: communication_dtype(d, reduce_dtype),
                               fusion_ids=[fusion_ids[i] for i in self._order])
        total = 1.0 / self.degree if self.mean else 1.0
        self._scales = [_split_scale(total, prescale, b.dtype) for b in self.plan.buckets]
        self._buffers: Optional[List[torch.Tensor]] = None
        self._verified = self.world_size == 1
        # hook state
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
        self._reduced_in_backward = False

    # ------------------------------------------------------------------ checks
    def _verify_once(self) -> None:
        """On first use: every rank must have the same plan (one collective)."""
        if self._verified:
            return
        # compared in parameter order, so the error names the first mismatching
        # parameter as the caller numbers them; the bucket boundaries come after
        signature = self.plan.signature()
        slot_of = {i: slot for slot, i in enumerate(self._order)}
        description = [signature[slot_of[i]] for i in range(len(self.parameters))]
        names = [f"parameters[{i}] {tuple(p.shape)} {p.dtype}"
                 for i, p in enumerate(self.parameters)]
        verify_same_on_all_ranks(description, names, self.group, what="parameter",
                                 layout=self.plan.layout(),
                                 layout_hint="pass the same bucket_cap_mb and fusion_type "
                                             "on every rank")
        self._verified = True

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        if len(grads) != len(self.parameters):
            raise ValueError(f"got {len(grads)} gradients for {len(self.parameters)} parameters")
        for i, (g, p) in enumerate(zip(grads, self.parameters)):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"grads[{i}] must be a tensor, got {type(g).__name__}")
            if g.layout != torch.strided:
                raise TypeError(f"grads[{i}] is a {g.layout} tensor; densify sparse gradients "
                                f"before reducing them")
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(f"grads[{i}] is {tuple(g.shape)} {g.dtype} on {g.device} but "
                                 f"parameters[{i}] is {tuple(p.shape)} {p.dtype} on {p.device}")

    def _buffers_for_plan(self) -> List[torch.Tensor]:
        if self._buffers is None:
            # one spare element per bucket carries the non-finite count
            self._buffers = [torch.empty(b.size + 1, dtype=b.dtype, device=b.device)
                             for b in self.plan.buckets]
        return self._buffers

    # ---------------------------------------------------------- one reduction
    def _start(self, index: int, tensors: Sequence[torch.Tensor]) -> PendingBucket:
        bucket = self.plan.buckets[index]
        storage = self._buffers_for_plan()[index]
        prescale, _ = self._scales[index]
        # with check_finite the spare last element carries the non-finite count
        return start_bucket_all_reduce(
            self.plan, bucket, tensors, storage if self.check_finite else storage[:bucket.size],
            group=self.group, prescale=prescale, world_size=self.world_size,
            backend=self.backend, count_nonfinite=self.check_finite)

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        flags = []
        for p in pending:
            _, postscale = self._scales[p.bucket.index]
            finish_bucket(self.plan, p, outputs, postscale=postscale, backend=self.backend)
            if self.check_finite:
                flags.append(self._buffers_for_plan()[p.bucket.index][p.bucket.size])
        if self.check_finite:
            self.found_nonfinite = (torch.stack(flags) != 0).any() if flags else \
                torch.zeros((), dtype=torch.bool)

    def __call__(self, grads: Union[torch.Tensor, Sequence[torch.Tensor]]):
        """Reduce ``grads`` (aligned with ``parameters``); return new tensors.

        Returns the same structure as given (one tensor, or a tuple/list),
        each result in its gradient's dtype; the inputs are not modified.

        Raises:
            TypeError: a non-tensor or sparse gradient (the index is named).
            ValueError: the count, or a shape/dtype/device, does not match the
                parameters (the index is named).
            RuntimeError: the ranks' parameter lists differ (first call only).
        """
        single = isinstance(grads, torch.Tensor)
        grad_list = [grads] if single else list(grads)
        self._check_grads(grad_list)
        self._verify_once()
        ordered = [grad_list[i] for i in self._order]
        outputs = [torch.empty_like(g) for g in ordered]
        pending = [self._start(k, ordered) for k in range(len(self.plan.buckets))]
        self._finish(pending, outputs)
        result = [None] * len(grad_list)
        for slot, i in enumerate(self._order):
            result[i] = outputs[slot]
        if single:
            return result[0]
        return tuple(result) if isinstance(grads, tuple) else result

    # ----------------------------------------------------- overlap with backward
    def register_hooks(self, passes_per_sync: int = 1) -> "DistributedGradReducer":
        """Reduce ``.grad`` of every parameter during backward, overlapped.

        Each parameter gets a post-accumulate-grad hook; a bucket's all-reduce
        starts as soon as all its gradients are accumulated (buckets start in a
        fixed order, the same on every rank). When backward ends, the
        remaining buckets start and every result is written into ``.grad``
        (mean or sum, the parameter's dtype): after ``loss.backward()``
        returns, the gradients are reduced and bitwise identical on all ranks.

        A parameter that gets no gradient in an iteration contributes zeros
        and receives the reduced gradient of the others (a zero tensor if no
        rank produced one). Gradient accumulation: inside ``no_sync()`` or on
        all but every ``passes_per_sync``-th backward, nothing is
        communicated and gradients accumulate locally.

        Raises:
            ValueError: a parameter does not require grad (it would never be
                ready), ``passes_per_sync`` is not a positive int, or hooks are
                already registered.
        """
        if self._handles:
            raise ValueError("hooks are already registered on this reducer")
        if isinstance(passes_per_sync, bool) or not isinstance(passes_per_sync, int) \
                or passes_per_sync < 1:
            raise ValueError(f"passes_per_sync must be a positive int, got {passes_per_sync!r}")
        for i, p in enumerate(self.parameters):
            if not p.requires_grad:
                raise ValueError(f"parameters[{i}] does not require grad: its gradient would "
                                 f"never be ready; leave it out of the reducer")
        self._passes_per_sync = passes_per_sync
        for slot, i in enumerate(self._order):
            self._handles.append(self.parameters[i].register_post_accumulate_grad_hook(
                lambda param, slot=slot: self._on_grad_ready(slot)))
        return self

    def remove_hooks(self) -> None:
        """Undo ``register_hooks``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside this block."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def reduced(self) -> bool:
        """Whether ``.grad`` holds reduced gradients not yet ``consume``d."""
        return self._reduced_in_backward

    def consume(self) -> None:
        """Mark the reduced gradients as used (an optimizer step took them)."""
        self._reduced_in_backward = False

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
            if pending.work is not None:
                pending.work.wait()
        self._pending = []
        self._in_backward = False

    def _begin_backward(self, task: Optional[int] = None) -> None:
        self._backward_task = task
        self._in_backward = True
        self._syncing = self._sync_enabled and \
            (self._passes_since_sync + 1) % self._passes_per_sync == 0
        self._reduced_in_backward = False
        if self._syncing:
            self._verify_once()
            self._ready = [len(b.tensor_indices) for b in self.plan.buckets]
            self._next_launch = 0
            self._pending = []
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _grads_in_plan_order(self) -> List[torch.Tensor]:
        grads = []
        for i in self._order:
            p = self.parameters[i]
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        return grads

    def _launch_ready(self, everything: bool = False) -> None:
        # strictly in bucket order, so every rank issues the same collectives
        # in the same sequence whatever order its gradients arrive in
        all_grads = self._grads_in_plan_order() if everything else None
        while self._next_launch < len(self.plan.buckets) and \
                (everything or self._ready[self._next_launch] == 0):
            bucket = self.plan.buckets[self._next_launch]
            grads = all_grads if everything else self._grads_of(bucket)
            self._pending.append(self._start(self._next_launch, grads))
            self._next_launch += 1

    def _grads_of(self, bucket) -> List[Optional[torch.Tensor]]:
        grads: List[Optional[torch.Tensor]] = [None] * len(self._order)
        for slot in bucket.tensor_indices:
            grads[slot] = self.parameters[self._order[slot]].grad
        return grads

    def _end_backward(self) -> None:
        self._in_backward = False
        if not self._syncing:
            self._passes_since_sync += 1
            return
        self._launch_ready(everything=True)
        outputs = []
        for i in self._order:
            p = self.parameters[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            outputs.append(p.grad)
        self._finish(self._pending, outputs)
        self._pending = []
        self._passes_since_sync = 0
        self._reduced_in_backward = True


def _graph_task_id() -> Optional[int]:
    """The running backward's id (None where torch does not expose one)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def _fusion_ids(fusion_type, n: int) -> List[int]:
    if isinstance(fusion_type, bool):
        raise TypeError("fusion_type must be an int or a sequence of ints, got a bool")
    if isinstance(fusion_type, int):
        return [fusion_type] * n
    ids = list(fusion_type)
    if len(ids) != n:
        raise ValueError(f"fusion_type has {len(ids)} entries for {n} parameters")
    return ids


def _split_scale(total: float, prescale: Optional[float], dtype: torch.dtype):
    """(prescale, postscale) with prescale * postscale == total."""
    if prescale is None:
        prescale = total if dtype in _SIXTEEN_BIT else 1.0
    return prescale, total / prescale
