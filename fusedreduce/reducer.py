"""DistributedGradReducer: fused gradient all-reduce, called directly or
overlapped with backward through gradient hooks.

PyTorch counterpart of MindSpore's ``nn.DistributedGradReducer``: gradients
are averaged (``mean=True``, divided by ``degree``) or summed across the
process group, low-precision gradients are reduced in fp32 and cast back
(``precision.communication_dtype``), all through a ``BucketPlan`` and the
fused all-reduce pipeline (``allreduce.py``): flatten/cast/prescale -> one
all-reduce per bucket -> unflatten/cast/postscale. This module is the call
API; the overlap with backward is ``overlap.BackwardOverlap``.
"""
from __future__ import annotations

import operator
import warnings
from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import kernels
from .kernels import metadata_guard, refuse_in_capture
from ._checks import (check_bool, check_choice, check_distinct, check_int, check_loss_scale,
                      check_prescale, tensor_list)
from .allreduce import (PendingBucket, finish_bucket, start_all_reduce, start_bucket_all_reduce,
                        wait_for)
from .bucket_views import BucketViews
from .buckets import BucketPlan, FlatBuffers, storage_bytes
from .clipping import (NormSplit, check_clipping, check_split_norm, clip_buffers, clip_scales,
                       norm_dtype_of, norm_split_for, raise_if_nonfinite, warn_if_exhausted)
from .overlap import BackwardOverlap
from .precision import communication_dtype, split_scale
from .broadcast import broadcast_tensors
from .process_group import (backend_to_compare, require_process_group, value_checksums,
                            verify_same_on_all_ranks)

#: what ``initial_parameters`` accepts (see ``DistributedGradReducer``)
INITIAL_PARAMETERS = ("verify", "broadcast", "unchecked")

#: the fix that the first reduction's error gives for replicas that differ
REPLICAS_REMEDY = (
    "The replicas did not start equal (a different seed per rank?), and a reduced gradient "
    "applied to different parameters trains different models. Copy rank 0's parameters to "
    "every rank before training: fusedreduce.parameter_broadcast(model) or "
    "fusedreduce.broadcast_tensors(params, src=0), or pass initial_parameters='broadcast' "
    "(DDP's behaviour); initial_parameters='unchecked' if they are not replicas")


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

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: a parameter is not a dense floating tensor, ``parameters``
            is a single tensor, a bad ``reduce_dtype``/``fusion_type`` type,
            or ``mean``/``check_finite`` is not a bool.
        ValueError: ``degree`` is not a positive int (as in MindSpore), a
            parameter passed twice, a bad ``fusion_type`` length,
            ``bucket_cap_mb`` or ``prescale``; ``initial_parameters`` is not
            one of ``INITIAL_PARAMETERS`` (a TypeError if not a string).
        RuntimeError: (at the first reduction, on every rank, with
            ``initial_parameters="verify"``) a rank's parameters differ from
            group rank 0's.

    Examples:
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
    ) -> None:
        self.parameters: List[torch.Tensor] = tensor_list(parameters, "parameters")
        check_bool(mean, "mean")  # a string such as "False" would be true
        check_bool(check_finite, "check_finite")
        check_choice(initial_parameters, "initial_parameters", INITIAL_PARAMETERS)
        self.max_grad_norm, self.norm_type = check_clipping(max_grad_norm, norm_type,
                                                            error_if_nonfinite)
        if self.max_grad_norm is not None:
            warn_if_exhausted(parameters, self.parameters)
        check_split_norm(split_norm)
        self.error_if_nonfinite = error_if_nonfinite
        # the norm's dtype, as torch's stack of per-dtype norms promotes it
        self._norm_dtype = norm_dtype_of(p.dtype for p in self.parameters
                                         if isinstance(p, torch.Tensor))
        #: the total norm of the last reduced gradients, before clipping
        #: (with ``max_grad_norm``): a 0-d tensor on their device, fp32 or
        #: fp64 (``clipping.norm_dtype_of`` the parameters' dtypes)
        self.grad_norm: Optional[torch.Tensor] = None
        self._loss_scale: Optional[Union[float, torch.Tensor]] = None
        for i, p in enumerate(self.parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{i}] must be a tensor, got {type(p).__name__}")
        check_distinct(self.parameters, "parameters")
        if degree is not None:
            check_int(degree, "degree")
        if reduce_dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(f"reduce_dtype must be a floating dtype, got {reduce_dtype}")
        check_prescale(prescale)
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
                               fusion_ids=[fusion_ids[i] for i in self._order],
                               shards=self._plan_shards())
        total = 1.0 / self.degree if self.mean else 1.0
        # by default 16-bit communication divides fully before the sum (guarding
        # fp16 overflow); wider communication divides after it
        self._scales = [split_scale(total, prescale,
                                    total if b.dtype in kernels.SIXTEEN_BIT_DTYPES else 1.0)
                        for b in self.plan.buckets]
        #: who shares the reading of the clipping norm (None: each rank reads
        #: all of the reduced buffers); see ``split_norm``
        self.norm_split: Optional[NormSplit] = norm_split_for(
            split_norm, group, self.world_size, sum(p.numel() for p in self.parameters),
            self.parameters[0].device if self.parameters else torch.device("cpu"))
        self._buffers: Optional[List[torch.Tensor]] = None
        self._views: Optional[BucketViews] = None
        self._call_buffers: Optional[List[torch.Tensor]] = None
        self._verified = self.world_size == 1
        # DistributedOptimizer's rule (DDP's): a parameter no rank gave a
        # gradient in a pass keeps none, so the optimizer skips it
        self.unused_grads_to_none = False
        # with the rule off, whether a pass that misses a gradient warns (once)
        self.warn_missing = False
        # plan slots of the parameters no rank had a gradient for in the last
        # reducing pass (``unused_grads_to_none``)
        self.unused_slots: List[int] = []
        self._warned_missing = False
        # with the rule on and a summing collective: the spare element, after
        # each bucket's, where a rank missing one of the bucket's gradients
        # puts 1, so that the sum says whether any rank missed any (set when
        # the buffers are made)
        self._missing_spare: Optional[int] = None
        self._spares_clear = False  # the last check found every such sum zero
        # what every call's gradients must match, compared one property at a time
        self._expected = (list(map(_size, self.parameters)), list(map(_dtype, self.parameters)),
                          list(map(_device, self.parameters)), [torch.strided] * n)
        # the same in one C++ call, made from the first gradients accepted
        # (False: not made yet; None: not available here)
        self._grads_guard = False
        self._overlap = BackwardOverlap([self.parameters[i] for i in self._order], self.plan,
                                        self._start, self._finish, self._verify_once)
        # checked at the first reduction (where the layout check is made
        # anyway), unless they are made equal now or are not replicas
        self._verify_values = initial_parameters == "verify"
        if initial_parameters == "broadcast" and self.world_size > 1:
            with torch.no_grad():
                broadcast_tensors([p.detach() for p in self.parameters], 0, group=group,
                                  bucket_cap_mb=bucket_cap_mb, backend=backend,
                                  names=[f"parameters[{i}]" for i in range(n)])

    def _plan_shards(self) -> int:
        """How many parts each bucket splits into (1: the all-reduce path)."""
        return 1

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
        # clipping that differs by rank would clip differently, and a norm
        # split on some ranks only would leave them waiting in its all-reduce;
        # the backends sum the norm in rows of different lengths (other bits,
        # and a split's all-reduce of another size)
        clipping = ("clipping", self.max_grad_norm, self.norm_type, self.norm_split is not None)
        resolved, unusable = backend_to_compare(self.backend, self.parameters[0].device) \
            if self.parameters else (self.backend, None)
        backend = ("backend", resolved)
        # how the buckets are combined and scaled: a mean on some ranks and a
        # sum on others (or another prescale, degree, local_size) gives the
        # ranks other gradients; AdaSum against a sum, or another count of
        # passes per reduction or of collectives for unused parameters, leaves
        # ranks waiting in collectives the others never start
        hooked = self._overlap.attached
        reduction = ("reduction", type(self).__name__, self._scales, self.check_finite,
                     getattr(self, "local_size", 1),
                     self._overlap.passes_per_sync if hooked else None,
                     self.unused_grads_to_none if hooked else None)
        # the values last: a layout that differs is named as such first
        values = value_checksums(self.parameters) if self._verify_values else ()
        verify_same_on_all_ranks(description, names, self.group, what="parameter",
                                 values=values, values_remedy=REPLICAS_REMEDY,
                                 bucket_layout=self.plan.layout() + [clipping, backend,
                                                                     reduction],
                                 bucket_layout_hint="pass the same bucket_cap_mb, fusion_type, "
                                                    "shard, max_grad_norm, norm_type, "
                                                    "split_norm, backend, mean (reduce_method), "
                                                    "degree, prescale, local_size, "
                                                    "check_finite, passes per reduction and "
                                                    "find_unused_parameters on every rank")
        if unusable is not None:
            raise unusable
        self._verified = True

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
    #: whether the buckets' collective sums every element of the buffer (a count
    #: can travel in a spare element); AdaSum's combine does not
    _sums_buffers = True

    def _new_buffers(self) -> List[torch.Tensor]:
        spare = int(self.check_finite)
        if self.unused_grads_to_none and self._sums_buffers and self.world_size > 1:
            self._missing_spare, spare = spare, spare + 1
        return [self.plan.new_buffer(b, spare=spare) for b in self.plan.buckets]

    def _missing_in(self, bucket) -> bool:
        """Whether this rank misses one of ``bucket``'s gradients in this
        pass: only a bucket started when backward ended can (one started
        during backward had every gradient)."""
        if self._overlap.in_backward or not self._overlap.missing:
            return False
        missing = set(self._overlap.missing)
        return any(slot in missing for slot in bucket.tensor_indices)

    def _start(self, index: int, tensors: Sequence[Optional[torch.Tensor]]) -> PendingBucket:
        """Start bucket ``index`` of a backward pass (the hooks' path)."""
        if self._buffers is None:
            self._buffers = self._new_buffers()
        bucket, buffer = self.plan.buckets[index], self._buffers[index]
        if self._views is not None and self._views.viewed(bucket):
            # the gradients are the buffer already: no flatten
            prescale, _ = self._scales[index]
            self._views.adopt(bucket)
            flag = self._views.gather(bucket, prescale, self.check_finite)
            spare = None
            if flag is not None:
                spare = buffer[bucket.size]
                spare.copy_(flag)
            if self._missing_spare is not None:
                # the views' buffer keeps the last sum there: rewritten unless
                # the last check found every sum zero (a stale non-zero only
                # sends that check to the exact count, which clears it)
                if self._missing_in(bucket):
                    buffer[bucket.size + self._missing_spare] = 1
                elif not self._spares_clear:
                    buffer[bucket.size + self._missing_spare] = 0
            return self._communicate(bucket, buffer, spare)
        return self._start_flat(bucket, tensors, buffer)

    def _start_flat(self, bucket, tensors: Sequence[Optional[torch.Tensor]],
                    buffer: torch.Tensor) -> PendingBucket:
        """Flatten ``bucket``'s tensors into ``buffer`` and start its all-reduce."""
        prescale, _ = self._scales[bucket.index]
        # the flatten zeroes the spare elements; a rank missing a gradient
        # marks its one before the collective
        mark = self._missing_spare if self._missing_spare is not None and \
            buffer.numel() > bucket.size + self._missing_spare and self._missing_in(bucket) \
            else None
        return start_bucket_all_reduce(
            self.plan, bucket, tensors, buffer, group=self.group,
            world_size=self.world_size, prescale=prescale, backend=self.backend,
            count_nonfinite=self.check_finite, mark_spare=mark)

    def _communicate(self, bucket, buffer: torch.Tensor,
                     spare: Optional[torch.Tensor]) -> PendingBucket:
        """Start combining ``bucket``'s filled ``buffer`` across the ranks: a sum
        (``_start_flat`` does the same through ``start_bucket_all_reduce``)."""
        return start_all_reduce(bucket, buffer, group=self.group, world_size=self.world_size,
                                spare=spare)

    def _finish_flat(self, pending: PendingBucket, outputs: Sequence[torch.Tensor]) -> None:
        """Wait for ``pending`` and write its bucket into ``outputs``, postscaled."""
        _, postscale = self._scales[pending.bucket.index]
        finish_bucket(self.plan, pending, outputs, postscale=postscale, backend=self.backend)

    def _clipped_postscales(self, pending: Sequence[PendingBucket]) -> List:
        """Wait for every bucket; each bucket's postscale times the clip
        coefficient of the reduced buffers' norm, as a one-element device
        tensor (``clipping.clip_buffers``), the total norm into ``grad_norm``.

        Raises:
            RuntimeError: the norm is non-finite and ``error_if_nonfinite``.
        """
        for p in pending:
            wait_for(p)
        if not pending:
            self._no_gradients()
            return []
        return self._kept_norm(clip_buffers(
            [p.flat[:p.bucket.size] for p in pending], self._postscales_of(pending),
            self.max_grad_norm, self.norm_type, self.loss_scale, backend=self.backend,
            split=self.norm_split, norm_dtype=self._norm_dtype))

    def _no_gradients(self) -> None:
        """A reduction of no gradients (no parameters, or none produced one):
        ``grad_norm`` is 0, as torch's ``clip_grad_norm_`` of no gradients."""
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self.grad_norm = torch.zeros((), dtype=self._norm_dtype, device=device)

    def _postscales_of(self, pending: Sequence[PendingBucket]) -> List[float]:
        return [self._scales[p.bucket.index][1] for p in pending]

    def _clip(self, pending: Sequence[PendingBucket], powers: torch.Tensor) -> List:
        """``_clipped_postscales`` from each pending bucket's sum of powers
        (``clipping.norm_powers``, a float64 vector), already computed."""
        return self._kept_norm(clip_scales(powers, self._postscales_of(pending),
                                           self.max_grad_norm, self.norm_type,
                                           self.loss_scale, backend=self.backend,
                                           norm_dtype=self._norm_dtype))

    def _kept_norm(self, clipped) -> List:
        """The scales of ``clipped`` (``(total_norm, scales)``), its norm kept
        in ``grad_norm``; raises for a non-finite norm with ``error_if_nonfinite``."""
        self.grad_norm, scales = clipped
        if self.error_if_nonfinite:
            raise_if_nonfinite(self.grad_norm, self.norm_type)
        return scales

    def _finish(self, pending: Sequence[PendingBucket], outputs: Sequence[torch.Tensor]) -> None:
        """Finish a backward pass's buckets (the hooks' path)."""
        scales = self._clipped_postscales(pending) if self.max_grad_norm is not None else None
        for i, p in enumerate(pending):
            if self._views is not None and self._views.viewed(p.bucket):
                wait_for(p)
                postscale = self._scales[p.bucket.index][1] if scales is None else scales[i]
                self._views.scatter(p.bucket, postscale)  # the views are the outputs
            elif scales is not None:
                self.plan.unflatten(p.bucket, p.flat, outputs, scale=scales[i],
                                    backend=self.backend)
            else:
                self._finish_flat(p, outputs)
        self._record_nonfinite(pending)
        self._settle_unused(pending=pending)

    def _settle_unused(self, extra: Optional[torch.Tensor] = None,
                       pending: Sequence[PendingBucket] = ()) -> Optional[torch.Tensor]:
        """After a pass: with ``unused_grads_to_none``, give a parameter no
        rank had a gradient for ``.grad = None`` on every rank. When the
        buckets' sums (``pending``'s spare elements, ``_missing_spare``) say no
        rank missed any, that is one host read; otherwise one small
        all-reduce counts who had each gradient, with ``extra``'s value summed
        alongside. Returns ``extra``'s sum.

        Without ``unused_grads_to_none`` a parameter missing on this rank
        contributes zeros and keeps its zero ``.grad``; the first time, a
        ``warn_missing`` reducer says so, from what this rank knows (the
        check and its host read are what ``find_unused_parameters=False``,
        the default, saves)."""
        self.unused_slots = []
        if not self.unused_grads_to_none and self.warn_missing and self._overlap.missing \
                and not self._warned_missing:
            self._warned_missing = True
            shapes = [tuple(self.parameters[self._order[slot]].shape)
                      for slot in self._overlap.missing[:5]]
            warnings.warn(
                f"{len(self._overlap.missing)} parameters (shapes {shapes}...) had no gradient on "
                f"this rank in this backward pass; with find_unused_parameters=False (the "
                f"default) they contribute zeros, and one that no rank had a gradient for gets a "
                f"zero .grad, so the optimizer steps it (weight decay, momentum). Pass "
                f"find_unused_parameters=True to leave .grad None, as torch does, when no rank "
                f"has one (one host read per backward)", RuntimeWarning, stacklevel=2)
        slots = len(self.parameters) if self.unused_grads_to_none else 0
        if extra is None and slots == 0:
            return None
        if not self.parameters:
            return extra
        refuse_in_capture(self.parameters[0].device,
                          "finding unused parameters (the ranks' counts are read to the host)",
                          "pass find_unused_parameters=False when every parameter has a "
                          "gradient in every step")
        if extra is None and self.world_size == 1:
            self.unused_slots = list(self._overlap.missing)  # this rank is every rank
            for slot in self.unused_slots:
                self.parameters[self._order[slot]].grad = None
            return None
        if extra is None and self._missing_spare is not None and pending and \
                all(p.flat.numel() > p.bucket.size + self._missing_spare for p in pending):
            # each bucket's sum says how many ranks missed one of its
            # gradients: when none did, there is nothing to count
            riding = torch.stack([p.flat[p.bucket.size + self._missing_spare] for p in pending])
            self._spares_clear = not bool(riding.any())
            if self._spares_clear:
                return None
        counts = torch.ones(slots + 1, dtype=torch.int32, device=self.parameters[0].device)
        if slots and self._overlap.missing:
            counts[self._overlap.missing] = 0  # the hooks' slots: plan order
        counts[-1] = 0 if extra is None else extra
        if self.world_size > 1:
            dist.all_reduce(counts, group=self.group)
        if slots:
            unused = self.unused_slots = (counts[:-1] == 0).nonzero().flatten().tolist()
            for slot in unused:
                self.parameters[self._order[slot]].grad = None
        return counts[-1]

    def _record_nonfinite(self, pending: Sequence[PendingBucket]) -> None:
        if self.check_finite:
            counts = [p.nonfinite_ranks for p in pending]
            self.found_nonfinite = (torch.stack(counts) != 0).any() if counts else \
                torch.zeros((), dtype=torch.bool)

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
        self._verify_once()
        ordered = [grad_list[i] for i in self._order]
        outputs = [torch.empty_like(g) for g in ordered]
        if self._views is not None:
            # the hooks' buffers hold the parameters' .grad: calls get their own
            if self._call_buffers is None:
                self._call_buffers = self._new_buffers()
            buffers = self._call_buffers
        else:
            if self._buffers is None:
                self._buffers = self._new_buffers()
            buffers = self._buffers
        pending = [self._start_flat(bucket, ordered, buffer)
                   for bucket, buffer in zip(self.plan.buckets, buffers)]
        if self.max_grad_norm is not None:
            for p, scale in zip(pending, self._clipped_postscales(pending)):
                self.plan.unflatten(p.bucket, p.flat, outputs, scale=scale,
                                    backend=self.backend)
        else:
            for p in pending:
                self._finish_flat(p, outputs)
        self._record_nonfinite(pending)
        result = [None] * len(grad_list)
        for slot, i in enumerate(self._order):
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
        if self._overlap.attached:
            raise ValueError("hooks are already registered on this reducer")
        check_int(passes_per_sync, "passes_per_sync")
        for i, p in enumerate(self.parameters):
            if not p.requires_grad:
                raise ValueError(f"parameters[{i}] does not require grad: its gradient would "
                                 f"never be ready; leave it out of the reducer")
        if gradient_as_bucket_view:
            if self._buffers is None:
                self._buffers = self._new_buffers()
            self._views = BucketViews([self.parameters[i] for i in self._order], self.plan,
                                      self._buffers, self.backend)
        # bucket views: a gradient accumulated twice in a pass (a reentrant
        # checkpoint) would land in a bucket already on the wire, so the first
        # pass finds such gradients before any bucket starts early
        self._overlap.attach(passes_per_sync, hold_first_pass=gradient_as_bucket_view)
        return self

    def remove_hooks(self) -> None:
        """Undo ``register_hooks``. Gradients that were bucket views keep their
        memory; the reducer takes fresh buffers."""
        self._overlap.detach()
        if self._views is not None:
            self._views = None
            self._buffers = None

    def no_sync(self):
        """A context in which backward passes accumulate gradients locally."""
        return self._overlap.no_sync()

    @property
    def reduced(self) -> bool:
        """Whether ``.grad`` holds reduced gradients that ``consume`` has not taken yet."""
        return self._overlap.reduced

    @property
    def accumulated_passes(self) -> int:
        """Backward passes accumulated locally since the last reduction."""
        return self._overlap.passes_since_sync

    @property
    def syncing(self) -> bool:
        """False inside ``no_sync()``."""
        return self._overlap.sync_enabled

    @property
    def loss_scale(self) -> Optional[Union[float, torch.Tensor]]:
        """With ``max_grad_norm`` under a GradScaler: the scale the gradients
        carry (a number, or a one-element floating tensor read on their
        device at each reduction: no host sync), so the limit applies to the
        unscaled norm. None: unscaled gradients. Checked when set; a tensor's
        value is not read: one that is not finite and > 0 makes
        ``grad_norm`` NaN (see the clipping guide).

        Raises:
            TypeError: not None, a Python number (bools excluded) or a
                floating tensor.
            ValueError: a number that is not finite and > 0; a tensor of
                more than one element or on the meta device.
        """
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        self._loss_scale = check_loss_scale(value)

    def _held_buffers(self) -> List[torch.Tensor]:
        """What this reducer keeps between calls for its own use."""
        held = [*(self._buffers or ()), *(self._call_buffers or ())]
        if self._views is not None:
            held += self._views.grad_buffers.values()
        return held

    @property
    def flat_buffers(self) -> FlatBuffers:
        """The flat buffers this reducer keeps, by role (``gradients``: the
        hooks' path, ``calls``: the call path, ``views``: the buffers of
        bucket views of other dtypes); read-only, for memory accounting,
        tests and benchmarks (``buckets.FlatBuffers``).

        Examples:
            >>> reducer = DistributedGradReducer([torch.zeros(10)])  # doctest: +SKIP
            >>> _ = reducer([torch.ones(10)])                        # doctest: +SKIP
            >>> reducer.flat_buffers.gradients, len(reducer.flat_buffers.calls)  # doctest: +SKIP
            ((None,), 1)
        """
        unmade = (None,) * len(self.plan.buckets)
        return FlatBuffers(gradients=unmade if self._buffers is None else tuple(self._buffers),
                           calls=unmade if self._call_buffers is None
                           else tuple(self._call_buffers),
                           views=() if self._views is None
                           else tuple(self._views.grad_buffers.values()))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the flat buffers this reducer keeps from one reduction to
        the next, each piece of memory counted once: one buffer per bucket in
        the bucket's communication dtype (fp32 for 16-bit gradients by
        default), made at the first reduction (0 before it; the call path and
        the hooks' path keep one set each). With ``gradient_as_bucket_view``
        they are made when the hooks are registered, and the gradients live
        in them (and in one buffer per other gradient dtype of a bucket,
        counted too), so the gradients take no memory of their own.

        Examples:
            >>> reducer = DistributedGradReducer([torch.zeros(1000, 10)])  # doctest: +SKIP
            >>> reducer.buffer_bytes                                       # doctest: +SKIP
            0
            >>> _ = reducer([torch.ones(1000, 10)])                        # doctest: +SKIP
            >>> reducer.buffer_bytes   # one fp32 bucket of 10,000 elements  # doctest: +SKIP
            40000
        """
        return storage_bytes(self._held_buffers())

    def mark_reduced(self) -> None:
        """Declare ``.grad`` reduced (it was, by another reducer)."""
        self._overlap.reduced = True

    def consume(self) -> None:
        """Mark the reduced gradients as used (an optimizer step took them)."""
        self._overlap.reduced = False


_size = torch.Tensor.size
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_layout = operator.attrgetter("layout")


def _fusion_ids(fusion_type, n: int) -> List[int]:
    if isinstance(fusion_type, bool):
        raise TypeError("fusion_type must be an int or a sequence of ints, got a bool")
    if isinstance(fusion_type, int):
        return [fusion_type] * n
    ids = list(fusion_type)
    if len(ids) != n:
        raise ValueError(f"fusion_type has {len(ids)} entries for {n} parameters")
    return ids
