"""DistributedGradReducer: fused gradient all-reduce, called directly or
overlapped with backward through gradient hooks.

PyTorch counterpart of MindSpore's ``nn.DistributedGradReducer``: gradients
are averaged (``mean=True``, divided by ``degree``) or summed across the
process group, low-precision gradients are reduced in fp32 and cast back
(``precision.communication_dtype``), all through a ``BucketPlan`` and the
fused all-reduce pipeline (``allreduce.py``): flatten/cast/prescale -> one
all-reduce per bucket -> unflatten/cast/postscale. This module is the call
API; how the hooks' path writes back (unflatten, or bucket views) is the
write-back ``register_hooks`` chooses (``replicated_writeback``); what it
shares with the sharded reducer (the options, the plan, the overlap with
backward, the rank check, the clip norm, the unused parameters) is
``bucket_engine.BucketEngine``, and how a bucket is combined is its
collective (``grad_collectives``).
"""
from __future__ import annotations

import operator
from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .kernels import metadata_guard, refuse_in_capture
from ._checks import check_int
from .allreduce import PendingBucket
from .bucket_engine import INITIAL_PARAMETERS, BucketEngine, ReducerSurface
from .buckets import FlatBuffers
from .replicated_writeback import Unflatten, start_flat, write_back

__all__ = ["DistributedGradReducer", "INITIAL_PARAMETERS"]


class DistributedGradReducer(ReducerSurface):
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
        max_grad_norm: clip the reduced gradients to this total norm, as
            ``torch.nn.utils.clip_grad_norm_`` would, in the pass that writes
            them back (``fusedreduce.clipping``): the norm comes from the
            reduced flat buffers and the coefficient stays on the device.
            ``grad_norm`` then holds the total norm before clipping (0-d,
            fp32, or fp64 when a gradient is fp64: ``clipping.norm_dtype_of``;
            0 where there are no gradients, as torch's), the same bits on
            every rank. None (default): no clipping; ``math.inf``: the norm
            measured, the gradients unchanged (bitwise). An empty generator
            of parameters (an exhausted ``model.parameters()``) warns, as
            torch's ``clip_grad_norm_`` does.
        norm_type: the norm's order (``math.inf`` or ``'inf'``: the max
            norm), positive: ``clipping.check_norm_type``.
        error_if_nonfinite: raise if the total norm is inf or NaN (reads it on
            the host), before any gradient is written back.
        split_norm: with ``max_grad_norm`` on more than one rank, each rank
            reads its own ``1 / world_size`` of the reduced buffers for the
            norm, and one all-reduce of the row sums (8 bytes per 16,384
            elements on a GPU, per 2,048 on the CPU) gives every rank all of
            them: the same bits as every rank reading all of it, for one more
            small collective. None (default): split where that spares each
            rank at least ``clipping.SPLIT_NORM_MIN_SPARED`` elements (8M on
            the CPU, 64M on a GPU).
        initial_parameters: the replicas must start equal, as under DDP.
            ``"verify"`` (default): the first reduction checks that every
            rank holds group rank 0's values (a checksum of each parameter's
            bits rides in the layout check that reduction makes anyway: no
            extra collective, nothing later) and raises on every rank,
            before any gradient is written, if not. ``"broadcast"``: copy
            group rank 0's parameters to every rank now, in place, as DDP's
            constructor does. ``"unchecked"``: neither (``parameters`` are
            not replicas: placeholders whose values mean nothing, or tensors
            whose gradients are averaged although they differ by rank).
        local_size: ranks per node (contiguous in the group's rank order, as
            torchrun numbers them: ``int(os.environ["LOCAL_WORLD_SIZE"])``).
            1 (default): the flat all-reduce, today's bits. More: each
            bucket is summed inside the node, then this rank's
            ``1/local_size`` part is all-reduced across nodes, then the parts
            are all-gathered inside the node (``node_collectives.TwoLevel``):
            the link between nodes carries ``1/local_size`` of the bytes of
            a flat all-reduce. The process groups are made once per set of
            ranks and shared (``node_groups``); equal to the group's size,
            one node: the flat all-reduce. docs/guides/across-nodes.md.
        wire_dtype: None (default): the sum travels in the bucket's dtype.
            ``torch.bfloat16``, ``torch.float8_e4m3fn`` or ``torch.int8``
            (the last two blockwise, one fp32 scale per
            ``kernels.WIRE_BLOCK`` elements): each bucket is quantized in the
            flatten pass, exchanged by all-to-all, dequantized and summed in
            fp32 in a fixed order, re-quantized and all-gathered
            (``wire_collectives.WireSum``); with ``local_size`` > 1 only the
            cross-node hop is compressed, the node's sum is fp32. Needs
            ``reduce_dtype=torch.float32`` and float32/16-bit parameters.
            Results: bitwise identical on every rank and run to run, within
            the format's error (docs/guides/across-nodes.md).
        deterministic: sum by the same all-to-all in fp32: the result is a
            pure function of the gradients, the same bits for any
            ``bucket_cap_mb``, transport and (``local_size`` a power of two)
            flat or on two levels.
        error_feedback: with a compressing ``wire_dtype``: keep each
            bucket's quantization error (fp32, 4 bytes per element
            quantized) and add it to the next reduction's values, in the
            same pass; ``error_feedback_state()`` saves it for a resume.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: a parameter is not a dense floating tensor, ``parameters``
            is a single tensor, a bad ``reduce_dtype``/``fusion_type`` type,
            or ``mean``/``check_finite`` is not a bool.
        ValueError: ``degree`` is not a positive int (as in MindSpore), a
            parameter passed twice, a bad ``fusion_type`` length,
            ``bucket_cap_mb`` or ``prescale``; ``initial_parameters`` is not
            one of ``INITIAL_PARAMETERS`` (a TypeError if not a string);
            ``local_size`` is not a positive int dividing the group's size;
            ``wire_dtype`` not one of ``kernels.WIRE_DTYPES`` (a TypeError if
            not a dtype); ``wire_dtype`` or ``deterministic`` with a
            ``reduce_dtype`` other than float32 or with float64 parameters;
            ``error_feedback`` without a compressing ``wire_dtype`` (a
            TypeError if it or ``deterministic`` is not a bool).
        RuntimeError: (at construction, on every rank) the ranks passed
            different ``local_size`` values.
        RuntimeError: (at the first reduction, on every rank, with
            ``initial_parameters="verify"``) a rank's parameters differ from
            group rank 0's.

    Examples:
        >>> reducer = DistributedGradReducer(model.parameters())          # doctest: +SKIP
        >>> loss.backward()                                                # doctest: +SKIP
        >>> grads = reducer([p.grad for p in model.parameters()])          # doctest: +SKIP
        >>> across = DistributedGradReducer(model.parameters(),            # doctest: +SKIP
        ...     local_size=int(os.environ["LOCAL_WORLD_SIZE"]), wire_dtype=torch.int8)
    """

    def __init__(
        self,
        parameters: Iterable[torch.Tensor],
        mean: bool = True,
        degree: Optional[int] = None,
        fusion_type: Union[int, Sequence[int]] = 1,
        group: Optional[dist.ProcessGroup] = None,
        *,
        bucket_cap_mb: float = 25.0,
        reduce_dtype: torch.dtype = torch.float32,
        prescale: Optional[float] = None,
        check_finite: bool = False,
        backend: str = "auto",
        max_grad_norm: Optional[float] = None,
        norm_type: Union[float, str] = 2.0,
        error_if_nonfinite: bool = False,
        split_norm: Optional[bool] = None,
        initial_parameters: str = "verify",
        local_size: int = 1,
        wire_dtype: Optional[torch.dtype] = None,
        deterministic: bool = False,
        error_feedback: bool = False,
    ) -> None:
        self._engine = BucketEngine(
            parameters, mean, degree, fusion_type, group, bucket_cap_mb=bucket_cap_mb,
            reduce_dtype=reduce_dtype, prescale=prescale, check_finite=check_finite,
            backend=backend, max_grad_norm=max_grad_norm, norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite, split_norm=split_norm,
            initial_parameters=initial_parameters, local_size=local_size,
            wire_dtype=wire_dtype, deterministic=deterministic, error_feedback=error_feedback,
            kind=type(self).__name__, shards=False,
            start=self._start, finish=self._finish)
        # how the hooks' path writes back: chosen by register_hooks
        self._write_back: Unflatten = Unflatten(self._engine)
        # what every call's gradients must match, compared one property at a time
        params = self.parameters
        self._expected = (list(map(_size, params)), list(map(_dtype, params)),
                          list(map(_device, params)), [torch.strided] * len(params))
        # the same in one C++ call, made from the first gradients accepted
        # (False: not made yet; None: not available here)
        self._grads_guard = False

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        if len(grads) != len(self.parameters):
            raise ValueError(f"got {len(grads)} gradients for {len(self.parameters)} parameters")
        # a training loop passes matching gradients every step: one guard call
        # or four C-level passes accept them (a guard's False is only "not
        # sure", see metadata_guard); anything else goes through the loop
        # that names it
        guard = self._grads_guard
        if guard and guard.check(*grads):
            return
        try:
            if (list(map(_size, grads)), list(map(_dtype, grads)), list(map(_device, grads)),
                    list(map(_layout, grads))) == self._expected:
                if guard is False:
                    self._grads_guard = metadata_guard(grads)
                return
        except (TypeError, AttributeError, RuntimeError):
            pass  # not all tensors (``Tensor.size`` refuses other objects)
        for i, (g, p) in enumerate(zip(grads, self.parameters)):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"grads[{i}] must be a tensor, got {type(g).__name__}")
            if g.layout != torch.strided:
                raise TypeError(f"grads[{i}] is a {g.layout} tensor; densify sparse gradients "
                                f"before reducing them")
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(f"grads[{i}] is {tuple(g.shape)} {g.dtype} on {g.device} but "
                                 f"parameters[{i}] is {tuple(p.shape)} {p.dtype} on {p.device}")

    # ---------------------------------------------------------- one reduction
    def _start(self, index: int, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        """Start bucket ``index`` of a backward pass (the hooks' path)."""
        return self._write_back.start(self.plan.buckets[index], tensors)

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        """Finish a backward pass's buckets (the hooks' path)."""
        self._write_back.finish(pending, outputs)
        self._engine.settle_unused(pending=pending)

    def __call__(self, grads: Union[torch.Tensor, Sequence[torch.Tensor]]):
        """Reduce ``grads`` (aligned with ``parameters``); return new tensors.

        Returns the same structure as given (one tensor, or a tuple/list),
        each result in its gradient's dtype; the inputs are not modified.

        Raises:
            TypeError: a non-tensor or sparse gradient (the index is named).
            ValueError: the count, or a shape/dtype/device, does not match the
                parameters (the index is named).
            RuntimeError: the ranks' parameter lists differ (first call only);
                called during CUDA graph capture.
        """
        single = isinstance(grads, torch.Tensor)
        grad_list = [grads] if single else list(grads)
        if self.parameters:
            refuse_in_capture(
                self.parameters[0].device,
                "calling a DistributedGradReducer on gradients (it returns new tensors at "
                "every call, so its write-back is prepared again)",
                "register_hooks() reduces .grad in place, in launches an eager step prepared, "
                "and can be captured")
        self._check_grads(grad_list)
        engine = self._engine
        engine.verify_once()
        ordered = [grad_list[i] for i in engine.order]
        outputs = [torch.empty_like(g) for g in ordered]
        buffers = self._write_back.buffers_for_calls()
        pending = [start_flat(engine, bucket, ordered, buffer)
                   for bucket, buffer in zip(engine.plan.buckets, buffers)]
        write_back(engine, pending, outputs)
        result = [None] * len(grad_list)
        for slot, i in enumerate(engine.order):
            result[i] = outputs[slot]
        if single:
            return result[0]
        return tuple(result) if isinstance(grads, tuple) else result

    # ----------------------------------------------------- overlap with backward
    def register_hooks(self, passes_per_sync: int = 1, *,
                       gradient_as_bucket_view: bool = False) -> "DistributedGradReducer":
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

        ``gradient_as_bucket_view=True`` (DDP's option, same meaning): from
        the first reduction on, each ``.grad`` is a view of its bucket's
        flat buffer (``bucket_views.BucketViews``), so backward accumulates
        in place and a gradient in its bucket's communication dtype is never
        copied; other dtypes take one contiguous cast per run of segments.
        Results are bitwise those of the default mode; memory holds one
        gradient copy less. ``zero_grad(set_to_none=True)`` works: the
        fresh gradients of the next backward are copied into the views once.
        Buckets with a non-contiguous parameter (e.g. channels-last) keep the
        default path.

        Raises:
            ValueError: a parameter does not require grad (it would never be
                ready), ``passes_per_sync`` is not a positive int, or hooks are
                already registered.
            RuntimeError: (from ``backward()``) a backward captured in a CUDA
                graph with ``passes_per_sync`` > 1, whose count lives on the
                host (docs/guides/cuda-graphs.md).

        Examples:
            >>> reducer = DistributedGradReducer(params).register_hooks()  # doctest: +SKIP
            >>> loss.backward()  # .grad now holds the mean over the ranks  # doctest: +SKIP
        """
        overlap = self._engine.overlap
        if overlap.attached:
            raise ValueError("hooks are already registered on this reducer")
        check_int(passes_per_sync, "passes_per_sync")
        for i, p in enumerate(self.parameters):
            if not p.requires_grad:
                raise ValueError(f"parameters[{i}] does not require grad: its gradient would "
                                 f"never be ready; leave it out of the reducer")
        if gradient_as_bucket_view:
            self._write_back = self._write_back.with_views(overlap.parameters)
        # bucket views: a gradient accumulated twice in a pass (a reentrant
        # checkpoint) would land in a bucket already on the wire, so the first
        # pass finds such gradients before any bucket starts early
        overlap.attach(passes_per_sync, hold_first_pass=gradient_as_bucket_view)
        return self

    def remove_hooks(self) -> None:
        """Undo ``register_hooks``. Gradients that were bucket views keep their
        memory; the reducer takes fresh buffers."""
        self._engine.overlap.detach()
        self._write_back = self._write_back.without_views()

    def held_tensors(self) -> List[torch.Tensor]:
        """The tensors whose memory this reducer keeps between calls for its
        own use (its flat buffers, the collective's codes and residuals):
        what ``buffer_bytes`` counts, each storage once.

        Examples:
            >>> reducer = DistributedGradReducer(model.parameters())  # doctest: +SKIP
            >>> sum(t.numel() for t in reducer.held_tensors())        # doctest: +SKIP
            0     # nothing before the first reduction
        """
        return self._write_back.held()

    @property
    def flat_buffers(self) -> FlatBuffers:
        """The flat buffers this reducer keeps, by role (``gradients``: the
        reduction's, for the hooks' path and the call path alike; ``calls``:
        the call path's own, made only while bucket views hold the
        ``gradients`` ones; ``views``: the buffers of bucket views of other
        dtypes), None for a bucket's buffer not made yet; read-only, for
        memory accounting, tests and benchmarks (``buckets.FlatBuffers``).

        Examples:
            >>> reducer = DistributedGradReducer([torch.zeros(10)])  # doctest: +SKIP
            >>> _ = reducer([torch.ones(10)])                        # doctest: +SKIP
            >>> held = reducer.flat_buffers                          # doctest: +SKIP
            >>> [b is None for b in held.gradients], held.calls      # doctest: +SKIP
            ([False], (None,))
        """
        return self._write_back.flat_buffers()


_size = torch.Tensor.size
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_layout = operator.attrgetter("layout")
