"""DDP communication hooks on the fused kernels: ``model.register_comm_hook(state, hook)``.

DDP already hands a hook one flat bucket (``bucket.buffer()``); these hooks
use the fused kernels for the cast/scale passes around the collective, and
AdaSum's kernels per parameter segment.

- ``allreduce_hook``: the average; fp16/bf16 buckets are reduced in fp32 (one
  fused upcast-and-divide pass before, one cast-back pass after).
- ``fp16_compress_hook``, ``bf16_compress_hook``: communicate in 16 bits; the
  cast and the pre-division are one pass, the decompression (and cast back)
  one pass into the bucket. Both work on gloo/CPU too.
- ``adasum_hook``: AdaSum across ranks with per-parameter coefficients;
  bitwise the result of ``fusedreduce.adasum_allreduce`` on the bucket's
  gradients.

``state`` is what torch's own hooks take (``None``: the world group; a
``torch.distributed.ProcessGroup``), with defaults, or a ``HookState``;
``HookState(max_grad_norm=...)`` also clips the reduced gradients, in the
pass that writes each bucket back (``HookState.clipped``).

This module must not use ``from __future__ import annotations``: DDP compares
the hooks' annotations with the real ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]`` objects, not strings.
"""
import weakref
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from . import kernels
from ._checks import check_int, check_loss_scale, check_prescale
from .adasum import adasum_allreduce_plan, adasum_flat_unchecked
from .allreduce import cast_back, start_cast_all_reduce
from .buckets import BucketPlan, TensorSpec
from .clipping import (NormSplit, check_clipping, check_split_norm, clip_buffers, clip_shared,
                       norm_dtype_of, norm_split_for, raise_if_nonfinite, share_norm)
from .kernels import refuse_in_capture
from .node_collectives import check_node_options
from .node_groups import check_local_size
from .node_hook import NodeWays, reduce_by_node
from .precision import communication_dtype, split_scale
from .process_group import global_ranks, require_process_group
from .rank_agreement import verify_hook_agrees


class HookState:
    """The process group and options of the fusedreduce DDP hooks.

    Cheap and lazy, like torch's ``PowerSGDState``: it can be built before
    ``init_process_group`` (frameworks such as Lightning build their strategy,
    and its hook state, first); the group is resolved on first use and
    defaults to the world. Arguments are checked as far as they can be at
    construction (all of them when a process group already exists).

    Picklable in every form (``spawn``-started workers need that): a process
    group cannot be pickled, so a state made with one travels without it and
    resolves to the world on the other side; if the world is not the group it
    was made with, first use raises and says to set ``state.group`` to the
    group again.

    Args:
        group: the process group (must be DDP's); default: the world.
        prescale: the factor applied before the collective; the rest of the
            ``1 / world_size`` average is applied after it. Default: divide
            fully before the collective, as DDP does (for the compress hooks
            and 16-bit buckets it also keeps fp16 sums from overflowing; for
            fp32/fp64 buckets ``allreduce_hook`` then multiplies by
            ``1 / world_size`` in place, as DDP without a hook does).
        local_size: ranks per node (contiguous; under torchrun
            ``int(os.environ["LOCAL_WORLD_SIZE"])``). ``adasum_hook`` first
            averages inside consecutive blocks of this many ranks, then
            AdaSums across them; ``allreduce_hook`` sums inside the node,
            this rank's ``1/local_size`` part across nodes, and gathers the
            parts inside the node (``DistributedGradReducer``'s
            ``local_size``; ``node_hook``). The compress hooks ignore it.
        wire_dtype: ``allreduce_hook`` only: the compressed wire format
            (``torch.bfloat16``, ``torch.float8_e4m3fn``, ``torch.int8``), as
            ``DistributedGradReducer``'s; each DDP bucket is summed to its
            end inside the hook (on gloo the hook returns when it is).
        deterministic: ``allreduce_hook`` only: the all-to-all fp32 sum in a
            fixed order, as ``DistributedGradReducer``'s.
        error_feedback: ``allreduce_hook`` with a compressing
            ``wire_dtype``: the quantization error kept per DDP bucket
            buffer and added at the next iteration (lost when DDP rebuilds
            its buckets after the first).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).
        max_grad_norm: clip the reduced gradients of every bucket to this total
            norm, as ``clip_grad_norm_`` would: each bucket's future completes
            when the last bucket is reduced, and the clip coefficient rides
            in the pass that writes each bucket back (its postscale or its
            cast back; AdaSum's 16-bit buckets take one extra multiply).
            ``grad_norm`` then holds the total norm of the last iteration
            (divided by ``loss_scale`` when that is set: under a GradScaler),
            fp32, or fp64 when a bucket's gradients are fp64, as torch's.
            None (default): no clipping; ``math.inf``: the norm measured into
            ``grad_norm``, the gradients unchanged.
        norm_type: the clipping norm's order (``math.inf`` or ``'inf'``: the max
            norm), positive: ``clipping.check_norm_type``.
        error_if_nonfinite: fail the backward pass (every bucket's future) if
            the total norm is inf or NaN, before any bucket is written back.
        split_norm: as ``DistributedGradReducer``'s: each rank reads
            ``1 / world_size`` of the reduced buckets for the norm, and one
            more all-reduce (of row sums, started from the last bucket's
            callback, as torch's PowerSGD hook chains its collectives)
            shares them; the same bits. None (default): where it spares each
            rank at least ``clipping.SPLIT_NORM_MIN_SPARED`` elements.

    Raises:
        ValueError: a zero or non-finite ``prescale``; ``local_size`` not a
            positive int, or (once the group is known) not dividing its size;
            ``wire_dtype`` not one of ``kernels.WIRE_DTYPES``,
            ``error_feedback`` without a compressing ``wire_dtype``; (at the
            first bucket) ``wire_dtype`` or ``deterministic`` with another
            hook than ``allreduce_hook``, or with float64 gradients.
        TypeError: a non-number ``prescale``; ``split_norm`` not None or a
            bool; ``wire_dtype`` not a dtype, ``deterministic`` or
            ``error_feedback`` not a bool.
        RuntimeError: on first use (or at construction, when a process group
            exists): torch.distributed is not initialised, this process is not
            a member of ``group``, or an unpickled state's group is not the
            world. At the first bucket a state sees (every rank, before
            anything is written): the ranks run different hooks, or the same
            hook with different options (``prescale``, ``local_size``,
            ``wire_dtype``, ``deterministic``, ``error_feedback``, the
            backend each resolves to, ``max_grad_norm``, ``norm_type``,
            ``error_if_nonfinite``, ``split_norm``), or the bucket dtypes
            differ; the error names the first option that differs and each
            rank's value. Such options would otherwise give the ranks other
            gradients, or leave them waiting in collectives the others never
            start.

    Examples:
        >>> state = HookState(prescale=1 / 8)          # before init_process_group too
        >>> state.prescale
        0.125
        >>> ddp.register_comm_hook(state, fp16_compress_hook)  # doctest: +SKIP
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *,
                 prescale: Optional[float] = None, local_size: int = 1,
                 backend: str = "auto", max_grad_norm: Optional[float] = None,
                 norm_type: Union[float, str] = 2.0, error_if_nonfinite: bool = False,
                 split_norm: Optional[bool] = None, wire_dtype: Optional[torch.dtype] = None,
                 deterministic: bool = False, error_feedback: bool = False) -> None:
        check_prescale(prescale)
        self.max_grad_norm, self.norm_type = check_clipping(max_grad_norm, norm_type,
                                                            error_if_nonfinite)
        check_split_norm(split_norm)
        self.error_if_nonfinite = error_if_nonfinite
        self.split_norm = split_norm
        #: with ``max_grad_norm``: the total norm before clipping of the last
        #: iteration's reduced buckets (0-d, fp32, or fp64 when a bucket's
        #: gradients are fp64: ``clipping.norm_dtype_of``), or None
        self.grad_norm: Optional[torch.Tensor] = None
        self._loss_scale: Optional[Union[float, torch.Tensor]] = None
        self._clipping: list = []  # this iteration's buckets so far
        # ((split_norm, elements, device), its NormSplit or None): decided once
        self._norm_split: Optional[tuple] = None
        check_int(local_size, "local_size")
        # the name only: the buckets' device (known at the first bucket) decides
        # whether it can run there
        kernels.check_backend(backend)
        self.prescale = prescale
        self.local_size = local_size
        self.backend = backend
        # checked at once where they can be without the group (its size too
        # once it is known, in _resolve)
        self._node = check_node_options(1, wire_dtype, deterministic, error_feedback,
                                        world_size=1, reduce_dtype=torch.float32)
        self.wire_dtype, self.deterministic = wire_dtype, deterministic
        self.error_feedback = error_feedback
        self.node_ways = NodeWays()
        self._group = group
        self._world_size: Optional[int] = None
        self._pickled_ranks: Optional[List[int]] = None
        self._adasum_plans: Dict[tuple, BucketPlan] = {}
        self._wires: Dict[tuple, list] = {}
        self._iteration = 0
        # whether every rank was seen to run the same hook with the same options
        self._agreed = False
        if dist.is_available() and dist.is_initialized():
            self._resolve()  # everything checked now, when it can be

    @property
    def group(self):
        """The process group (None: the world). Settable, e.g. after unpickling."""
        group = self._group
        return group() if isinstance(group, weakref.ref) else group

    @group.setter
    def group(self, group) -> None:
        self._group = group
        self._world_size = None
        self._norm_split = None  # decided for the old group
        self._agreed = False  # checked in the old group
        if group is not None:
            self._pickled_ranks = None  # the caller names the group: trust it

    @property
    def loss_scale(self) -> Optional[Union[float, torch.Tensor]]:
        """With ``max_grad_norm`` under a GradScaler: the scale the gradients
        carry (set before each backward to ``scaler.scale(torch.ones((),
        device=...))``: a device tensor, no host sync), so the limit applies
        to the unscaled norm; the gradients stay scaled for ``scaler.step``.
        Checked when set; a tensor's value is not read: one that is not
        finite and > 0 makes ``grad_norm`` NaN (see the clipping guide).

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

    @property
    def world_size(self) -> int:
        """The group's size (resolves the group on first use)."""
        return self._resolve()

    @property
    def wire_buffers(self) -> List[torch.Tensor]:
        """The kept buffers the compress hooks cast each DDP bucket into (one
        per bucket buffer and wire dtype, see ``wire_for``), as the tensor
        objects: for memory accounting and tests; read them, never write
        them.

        Examples:
            >>> model.register_comm_hook(state, hooks.fp16_compress_hook)  # doctest: +SKIP
            >>> loss.backward()                                           # doctest: +SKIP
            >>> [w.dtype for w in state.wire_buffers]                     # doctest: +SKIP
            [torch.float16, torch.float16]
        """
        return [entry[0] for entry in self._wires.values()]

    def _resolve(self) -> int:
        if self._world_size is None:
            world_size = require_process_group(self.group)
            if self._pickled_ranks is not None:
                if global_ranks(None) != self._pickled_ranks:
                    raise RuntimeError(
                        f"this HookState was pickled with the process group of global ranks "
                        f"{self._pickled_ranks}; process groups cannot be pickled, so it came "
                        f"back with the world's: set state.group to that group again")
                self._pickled_ranks = None
            check_local_size(self.local_size, world_size)
            self._node = check_node_options(self.local_size, self.wire_dtype, self.deterministic,
                                            self.error_feedback, world_size=world_size,
                                            reduce_dtype=torch.float32)
            self._world_size = world_size
        return self._world_size

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        group = self.group
        state["_group"] = None
        state["_world_size"] = None
        state["_adasum_plans"] = {}
        state["_wires"], state["_iteration"] = {}, 0
        state["_clipping"], state["grad_norm"], state["_norm_split"] = [], None, None
        state["_agreed"] = False  # the other side's ranks are checked there
        state["node_ways"] = NodeWays()
        if group is not None:
            # a group's members are known only while it exists; record them so
            # that the other side can tell whether the world is the same group
            state["_pickled_ranks"] = global_ranks(group)
        return state

    def _check_ranks_agree(self, hook: str, bucket: dist.GradBucket,
                           wire_dtype: torch.dtype) -> None:
        """At the first bucket this state sees: every rank must run the same
        hook with the same options, or all raise, before the hook writes
        anything.

        Options that differ by rank would not fail by themselves: another
        ``prescale``, backend or clip limit gives each rank other gradients,
        and a norm split on some ranks only, or another hook, would leave
        ranks waiting in collectives the others never start. DDP starts its
        buckets in index order on every rank, so a state's first bucket 0 is
        the same point of the program everywhere (whether to check must not
        depend on anything that may differ by rank, such as the hook: a rank
        that skipped the check would meet another's check collective with a
        collective of its own). One all-reduce of two int64s
        (``rank_agreement.verify_hook_agrees``), read on the host: the first bucket of
        a warm-up step, never a captured one.
        """
        if self._agreed or bucket.index() != 0:
            return
        buffer = bucket.buffer()
        refuse_in_capture(buffer.device,
                          "a DDP hook's first bucket with a new HookState (it checks that "
                          "every rank runs the same hook with the same options, an all-reduce "
                          "read on the host)",
                          "run an eager step with the same state first, the warm-up a "
                          "capture needs anyway")
        verify_hook_agrees(lambda backend: [
            ("hook", hook), ("bucket dtype", str(buffer.dtype)), ("wire dtype", str(wire_dtype)),
            ("prescale", self.prescale), ("local_size", self.local_size), ("backend", backend),
            ("max_grad_norm", self.max_grad_norm), ("norm_type", self.norm_type),
            ("error_if_nonfinite", self.error_if_nonfinite), ("split_norm", self.split_norm),
            ("wire_dtype", str(self.wire_dtype)), ("deterministic", self.deterministic),
            ("error_feedback", self.error_feedback)],
            self.backend, buffer.device, self.group)
        self._agreed = True

    def scales(self):
        """``(before, after)`` with ``before * after == 1 / world_size``: by
        default all of the division before the collective, as DDP does."""
        total = 1.0 / self.world_size
        return split_scale(total, self.prescale, total)

    def wire_for(self, bucket: dist.GradBucket, dtype: torch.dtype) -> torch.Tensor:
        """The kept buffer ``bucket`` travels in as ``dtype`` (the compress hooks').

        Kept per DDP bucket buffer (address, size, dtype), so that every step
        casts into the same tensor and the kernels' prepared launch for it is
        found again. A buffer not seen during the last iteration is dropped:
        DDP replaces its first iteration's one big bucket by the real ones.
        """
        buffer = bucket.buffer()
        if bucket.index() == 0:
            self._iteration += 1
            self._wires = {key: entry for key, entry in self._wires.items()
                           if entry[1] >= self._iteration - 1}
        key = (buffer.data_ptr(), buffer.numel(), buffer.dtype, dtype, buffer.device)
        entry = self._wires.get(key)
        if entry is None:
            entry = self._wires[key] = [torch.empty(buffer.numel(), dtype=dtype,
                                                    device=buffer.device), 0]
        entry[1] = self._iteration
        return entry[0]

    def clipped(self, bucket: dist.GradBucket, reduced: torch.futures.Future,
                flat_of, postscale: float, write_back) -> torch.futures.Future:
        """The future DDP waits on for ``bucket`` when clipping: ``reduced``
        completes when its collective has; ``flat_of()`` is then the reduced
        flat buffer (times ``1/postscale`` of what is written), and
        ``write_back(scale)`` writes the bucket with ``scale`` (postscale times
        the coefficient, a one-element device tensor) and returns DDP's
        result. Every bucket's future completes after the last one's
        collective, when the total norm is known."""
        if bucket.index() == 0:
            self._clipping = []
        device = bucket.buffer().device
        out = torch.futures.Future(devices=[device]) if device.type == "cuda" \
            else torch.futures.Future()
        # the bucket's gradients' dtype decides the norm's (``norm_dtype_of``)
        self._clipping.append((reduced, flat_of, postscale, bucket.buffer().dtype, write_back,
                               out))
        if bucket.is_last():
            entries, self._clipping = self._clipping, []
            torch.futures.collect_all([e[0] for e in entries]).then(
                lambda _: self._clip_all(entries))
        return out

    def _clip_all(self, entries) -> None:
        try:
            for reduced, *_ in entries:
                reduced.value()  # raises if a collective failed
            buffers = [flat_of() for _, flat_of, *_ in entries]
            postscales = [e[2] for e in entries]
            split = self._split_for(buffers)
            if split is None:
                self._write_clipped(entries, clip_buffers(
                    buffers, postscales, self.max_grad_norm, self.norm_type, self.loss_scale,
                    backend=self.backend, norm_dtype=norm_dtype_of(e[3] for e in entries)))
                return
            # a collective from a future's callback: started, never waited on here
            partials, work = share_norm(buffers, self.norm_type, split, self.backend)
            work.get_future().then(lambda done: self._finish_shared(
                entries, done, partials, buffers, postscales))
        except Exception as exc:  # noqa: BLE001 (every bucket's future must complete)
            self._fail(entries, exc)

    def _split_for(self, buffers) -> Optional[NormSplit]:
        """``norm_split_for`` of these buckets, kept while ``split_norm``,
        their size and their device stay (every step after DDP's first)."""
        key = (self.split_norm, sum(b.numel() for b in buffers), buffers[0].device)
        if self._norm_split is None or self._norm_split[0] != key:
            split_norm, elements, device = key
            self._norm_split = (key, norm_split_for(split_norm, self.group, self.world_size,
                                                    elements, device))
        return self._norm_split[1]

    def _finish_shared(self, entries, done, partials, buffers, postscales) -> None:
        try:
            done.value()  # raises if the collective failed
            self._write_clipped(entries, clip_shared(
                partials, buffers, postscales, self.max_grad_norm, self.norm_type,
                self.loss_scale, backend=self.backend,
                norm_dtype=norm_dtype_of(e[3] for e in entries)))
        except Exception as exc:  # noqa: BLE001 (every bucket's future must complete)
            self._fail(entries, exc)

    def _write_clipped(self, entries, clipped) -> None:
        """Write every bucket with its scale from ``clipped`` (``(total_norm,
        scales)``) and complete its future; raises for a non-finite norm
        with ``error_if_nonfinite``, before writing any."""
        self.grad_norm, scales = clipped
        if self.error_if_nonfinite:
            raise_if_nonfinite(self.grad_norm, self.norm_type)
        results = [write_back(scale) for (*_, write_back, _), scale in zip(entries, scales)]
        for (*_, out), result in zip(entries, results):
            out.set_result(result)

    @staticmethod
    def _fail(entries, exc: Exception) -> None:
        for *_, out in entries:
            if not out.done():
                out.set_exception(exc)

    def adasum_plan_for(self, grads) -> BucketPlan:
        """The one-bucket AdaSum plan of a DDP bucket holding ``grads``, kept per
        shapes and dtypes (never per DDP's bucket index: DDP rebuilds its
        buckets after the first iteration)."""
        key = tuple((tuple(g.shape), g.dtype) for g in grads)
        if key not in self._adasum_plans:
            self._adasum_plans[key] = BucketPlan(
                [TensorSpec.of(g) for g in grads], bucket_cap_mb=float("1e9"),
                comm_dtype=communication_dtype)
        return self._adasum_plans[key]


# the states made for ``None`` (the world) and for process groups passed as
# ``state``, as torch's own hooks take them: one per group object, held weakly
# (the state made for a group refers to it weakly too). A group kept here past
# destroy_process_group would keep gloo's threads alive into the interpreter's
# exit, which they can abort; and the world object (not its id, which a new
# group may reuse) says whether a kept state is still current.
_group_states: "weakref.WeakKeyDictionary[Any, HookState]" = weakref.WeakKeyDictionary()


def _state(state) -> HookState:
    if isinstance(state, HookState):
        state._resolve()
        return state
    if state is None:
        require_process_group()  # the clear error when there is no world yet
        key = dist.group.WORLD
    elif isinstance(state, dist.ProcessGroup):
        key = state
    else:
        raise TypeError(f"the fusedreduce hooks take as state what torch's default hooks "
                        f"take (None or a torch.distributed.ProcessGroup) or a "
                        f"fusedreduce.hooks.HookState; got {type(state).__name__}")
    kept = _group_states.get(key)
    if kept is None:
        kept = HookState(state)
        if state is not None:
            kept._group = weakref.ref(state)
        _group_states[key] = kept
    kept._resolve()
    return kept


def _refuse_exchanges(state: HookState, hook: str) -> None:
    if state._node.exchanges and hook != "allreduce_hook":
        raise ValueError(f"wire_dtype and deterministic apply to allreduce_hook only, not to "
                         f"{hook}")


def _future_of(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _reduce_in(state: HookState, bucket: dist.GradBucket, dtype: torch.dtype,
               hook: str) -> torch.futures.Future:
    """All-reduce ``bucket`` in ``dtype``: in place when that is the bucket's own
    dtype, else through the state's kept wire buffer (one fused
    cast-and-prescale pass before, one cast-back-and-postscale pass after)."""
    buffer = bucket.buffer()
    _refuse_exchanges(state, hook)
    state._check_ranks_agree(hook, bucket, dtype)
    if hook == "allreduce_hook" and not state._node.flat:
        return reduce_by_node(state, bucket, dtype, state._node)
    before, after = state.scales()
    wire = buffer if buffer.dtype == dtype else state.wire_for(bucket, dtype)
    reduced = start_cast_all_reduce(buffer, wire, group=state.group, prescale=before,
                                    backend=state.backend)

    def write_back(scale):
        return cast_back(wire, buffer, scale, backend=state.backend)

    if state.max_grad_norm is not None:
        return state.clipped(bucket, reduced, lambda: wire, after, write_back)

    def finish(future):
        future.value()  # raises if the collective failed
        return write_back(after)

    return reduced.then(finish)


def fusedreduce_allreduce_hook(state: Optional[HookState],
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across the group; fp16/bf16 buckets are reduced in fp32.

    Examples:
        >>> ddp.register_comm_hook(None, allreduce_hook)          # doctest: +SKIP
    """
    return _reduce_in(_state(state), bucket, communication_dtype(bucket.buffer().dtype),
                      "allreduce_hook")


def fusedreduce_fp16_compress_hook(state: Optional[HookState],
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in fp16 on the wire: half the bytes of fp32, divided before the sum.

    Examples:
        >>> ddp.register_comm_hook(None, fp16_compress_hook)      # doctest: +SKIP
    """
    return _reduce_in(_state(state), bucket, torch.float16, "fp16_compress_hook")


def fusedreduce_bf16_compress_hook(state: Optional[HookState],
                                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average in bf16 on the wire (fp32's range, 8 bits of mantissa); works on gloo.

    Defined under another name because DDP refuses any hook *named*
    ``bf16_compress_hook`` without CUDA and NCCL; ``bf16_compress_hook`` (and
    ``bfloat16_compress_hook``) are aliases of this function.

    Examples:
        >>> ddp.register_comm_hook(None, bf16_compress_hook)      # doctest: +SKIP
    """
    return _reduce_in(_state(state), bucket, torch.bfloat16, "bf16_compress_hook")




def fusedreduce_adasum_hook(state: Optional[HookState],
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """AdaSum across ranks, one segment (and coefficient pair) per parameter.

    The result is bitwise that of ``fusedreduce.adasum_allreduce`` on the
    bucket's per-parameter gradients. fp32 and fp64 buckets are combined in
    DDP's buffer itself (no copies); 16-bit ones go through an fp32 buffer
    (one cast in, one cast back). AdaSum's halving tree is a chain of
    dependent point-to-point steps, so this hook runs it before returning (an
    already completed future): it does not overlap with the rest of backward.

    Examples:
        >>> ddp.register_comm_hook(HookState(local_size=8), adasum_hook)  # doctest: +SKIP
    """
    state = _state(state)
    buffer = bucket.buffer()
    _refuse_exchanges(state, "adasum_hook")
    state._check_ranks_agree("adasum_hook", bucket, communication_dtype(buffer.dtype))
    grads = bucket.gradients()
    # DDP packs a bucket densely in gradients() order
    boundaries = kernels.packed_boundaries([g.numel() for g in grads])
    if buffer.dtype == communication_dtype(buffer.dtype):
        # an fp32/fp64 bucket is combined where it is: a tensor's statistics do
        # not depend on where it sits, so this is still bitwise adasum_allreduce's.
        # The state was checked when it was made and the boundaries are built
        # here, so the per-bucket path skips adasum_allreduce_flat's checks
        adasum_flat_unchecked(buffer, boundaries + [buffer.numel()], state.group,
                              state.local_size, state.backend, prescaled=False,
                              exchanges_only=False)
    else:
        outputs = [buffer[lo:hi].view(g.shape)
                   for g, lo, hi in zip(grads, boundaries[:-1], boundaries[1:])]
        adasum_allreduce_plan(state.adasum_plan_for(grads), grads, outputs, group=state.group,
                              local_size=state.local_size, backend=state.backend)
    if state.max_grad_norm is not None:
        return state.clipped(bucket, _future_of(buffer), lambda: buffer, 1.0,
                             lambda scale: buffer.mul_(scale.to(buffer.dtype)))
    return _future_of(buffer)


# The functions carry a ``fusedreduce_`` prefix because DDP logs a hook by its
# qualified name (``_get_ddp_logging_data()["comm_hook"]``): torch's names
# would make its logs say that torch's hooks ran. Pickling (spawn) finds them
# under these names too. The short names are the ones to use.
allreduce_hook = fusedreduce_allreduce_hook
fp16_compress_hook = fusedreduce_fp16_compress_hook
bf16_compress_hook = bfloat16_compress_hook = fusedreduce_bf16_compress_hook
adasum_hook = fusedreduce_adasum_hook

__all__ = ["HookState", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "bfloat16_compress_hook", "adasum_hook", "fusedreduce_allreduce_hook",
           "fusedreduce_fp16_compress_hook", "fusedreduce_bf16_compress_hook",
           "fusedreduce_adasum_hook"]
