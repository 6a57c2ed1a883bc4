"""The bucket engine both gradient reducers are built on.

``BucketEngine`` holds what ``DistributedGradReducer`` and the sharded
reducer share: the checked options, the bucket plan (reverse parameter
order) and each bucket's ``(prescale, postscale)``, the gradient collective
(``grad_collectives``, chosen once), the overlap with backward
(``overlap.BackwardOverlap``, which runs the reducer's start and finish of
a bucket), the one-time check that every rank agrees, the clipping norm's
bookkeeping and the unused-parameter settlement. A reducer composes one and
adds how its buckets are written back (unflatten or bucket views; owned
parts).
"""
from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import feedback_state, kernels, uneven_inputs
from .kernels import refuse_in_capture
from ._checks import (check_bool, check_choice, check_distinct, check_int, check_loss_scale,
                      check_prescale, tensor_list)
from .allreduce import PendingBucket
from .broadcast import broadcast_tensors
from .buckets import BucketPlan, storage_bytes
from .clipping import (check_clipping, check_split_norm, clip_buffers, clip_scales,
                       norm_dtype_of, norm_powers, norm_split_for, over_ranks,
                       raise_if_nonfinite, warn_if_exhausted)
from .grad_collectives import all_reduce_collective
from .node_collectives import check_exchanged_dtypes, check_node_options
from .overlap import BackwardOverlap
from .precision import communication_dtype, split_scale
from .process_group import require_process_group
from .rank_agreement import verify_reducer_agrees

#: what ``initial_parameters`` accepts (see ``DistributedGradReducer``)
INITIAL_PARAMETERS = ("verify", "broadcast", "unchecked")


class BucketEngine:
    """The shared state of a gradient reducer (``DistributedGradReducer``'s
    arguments and errors; ``shards``: each bucket splits into the world's
    size of parts, the sharded plan). ``start``/``finish``/``before_sync``
    are the reducer's, run by the overlap with backward."""

    def __init__(self, parameters, mean: bool = True, degree: Optional[int] = None,
                 fusion_type=1, group=None, *, bucket_cap_mb: float = 25.0,
                 reduce_dtype: torch.dtype = torch.float32, prescale: Optional[float] = None,
                 check_finite: bool = False, backend: str = "auto",
                 max_grad_norm: Optional[float] = None, norm_type=2.0,
                 error_if_nonfinite: bool = False, split_norm: Optional[bool] = None,
                 initial_parameters: str = "verify", local_size: int = 1,
                 wire_dtype: Optional[torch.dtype] = None, deterministic: bool = False,
                 error_feedback: bool = False, kind: str, shards: bool, start: Callable,
                 finish: Callable, before_sync: Optional[Callable[[], None]] = None) -> None:
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
        self.norm_dtype = norm_dtype_of(p.dtype for p in self.parameters
                                        if isinstance(p, torch.Tensor))
        self.grad_norm: Optional[torch.Tensor] = None
        self.loss_scale: Optional[Union[float, torch.Tensor]] = None
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
        self.node = check_node_options(local_size, wire_dtype, deterministic, error_feedback,
                                       world_size=self.world_size, reduce_dtype=reduce_dtype)
        self.mean = bool(mean)
        self.degree = self.world_size if degree is None else degree
        self.reduce_dtype = reduce_dtype
        self.check_finite = check_finite
        self.backend = backend
        self.found_nonfinite: Optional[torch.Tensor] = None
        self.kind = kind
        n = len(self.parameters)
        fusion_ids = _fusion_ids(fusion_type, n)
        # buckets follow the reverse parameter order: backward produces the last
        # layers' gradients first, so the first buckets fill (and launch) first
        self.order = list(range(n - 1, -1, -1))
        self.plan = BucketPlan([self.parameters[i] for i in self.order],
                               bucket_cap_mb=bucket_cap_mb,
                               comm_dtype=lambda d: communication_dtype(d, reduce_dtype),
                               fusion_ids=[fusion_ids[i] for i in self.order],
                               shards=self.world_size if shards
                               else self.node.shards(self.world_size),
                               part_multiple=self.node.part_multiple())
        check_exchanged_dtypes(self.plan, self.node)
        total = 1.0 / self.degree if self.mean else 1.0
        # by default 16-bit communication divides fully before the sum (guarding
        # fp16 overflow); wider communication divides after it
        self.scales = [split_scale(total, prescale,
                                   total if b.dtype in kernels.SIXTEEN_BIT_DTYPES else 1.0)
                       for b in self.plan.buckets]
        self.norm_split = norm_split_for(
            split_norm, group, self.world_size, sum(p.numel() for p in self.parameters),
            self.parameters[0].device if self.parameters else torch.device("cpu"))
        # where each rank reads the clip norm: all of the reduced buffers (or
        # its split of their rows), or only its own parts of a sharded plan
        self._owned_norm = shards
        # the one-rank world is decided here: a collective that does not
        # communicate (nothing to verify, broadcast or count over the ranks)
        self.collective = all_reduce_collective(self.plan, group, self.world_size, backend,
                                                None if shards else self.node)
        self.verified = not self.collective.communicates
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
        self.missing_spare: Optional[int] = None
        self.spares_clear = False  # the last check found every such sum zero
        self.overlap = BackwardOverlap([self.parameters[i] for i in self.order], self.plan,
                                       start, finish, before_sync or self.verify_once)
        # whether a pass that adds to reduced gradients no step took, reduced
        # again, gives what one reduction of everything accumulated gives:
        # when every rank holds the reduced value and the sum is divided by the
        # world size (the mean of reduced + new is reduced + the new mean), or
        # each element's owner alone holds it and the sum is not divided.
        # AdaSum's reducers set it False: combining is not summing
        divisor = self.degree if self.mean else 1
        self.stacks_exactly = divisor == (1 if shards else self.world_size)
        # checked at the first reduction (where the layout check is made
        # anyway), unless they are made equal now or are not replicas
        self._verify_values = initial_parameters == "verify"
        if initial_parameters == "broadcast" and self.collective.communicates:
            with torch.no_grad():
                broadcast_tensors([p.detach() for p in self.parameters], 0, group=group,
                                  bucket_cap_mb=bucket_cap_mb, backend=backend,
                                  names=[f"parameters[{i}]" for i in range(n)])

    def combine_by(self, collective) -> None:
        """Combine the buckets by ``collective`` (``grad_collectives``), with
        the prescales it takes."""
        self.collective = collective
        self.scales = collective.prescales(self.scales)

    def verify_once(self) -> None:
        """On first use: every rank must have the same plan (one collective)."""
        if self.verified:
            return
        hooked = self.overlap.attached
        verify_reducer_agrees(
            self.parameters, self.order, self.plan, self.group, self.backend,
            clipping=("clipping", self.max_grad_norm, self.norm_type,
                      self.norm_split is not None),
            reduction=("reduction", self.kind, self.scales, self.check_finite,
                       self.collective.signature, self.node.signature(),
                       self.overlap.passes_per_sync if hooked else None,
                       self.unused_grads_to_none if hooked else None),
            values=self._verify_values)
        self.verified = True

    def new_buffers(self) -> List[torch.Tensor]:
        """A flat buffer per bucket, with the spare elements the settlements use."""
        spare = int(self.check_finite)
        if self.unused_grads_to_none and self.collective.sums and self.collective.communicates:
            self.missing_spare, spare = spare, spare + 1
        return [self.plan.new_buffer(b, spare=spare) for b in self.plan.buckets]

    def missing_in(self, bucket) -> bool:
        """Whether this rank misses one of ``bucket``'s gradients in this
        pass: only a bucket started when backward ended can (one started
        during backward had every gradient)."""
        if self.overlap.in_backward or not self.overlap.missing:
            return False
        missing = set(self.overlap.missing)
        return any(slot in missing for slot in bucket.tensor_indices)

    # --------------------------------------------------------- the clip norm
    def no_gradients(self) -> None:
        """A reduction of no gradients (no parameters, or none produced one):
        ``grad_norm`` is 0, as torch's ``clip_grad_norm_`` of no gradients."""
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self.grad_norm = torch.zeros((), dtype=self.norm_dtype, device=device)

    def postscales_of(self, pending: Sequence[PendingBucket]) -> List[float]:
        return [self.scales[p.bucket.index][1] for p in pending]

    def clip(self, pending: Sequence[PendingBucket], buffers: Sequence[torch.Tensor]) -> List:
        """Each finished bucket's postscale times the clip coefficient, as a
        one-element device tensor, the total norm into ``grad_norm``.
        ``buffers``: the reduced elements of each bucket this rank reads,
        all of them (every rank holds the same; ``clipping.clip_buffers``,
        with ``norm_split`` each rank reading its share of the rows) or, on a
        sharded plan, its owned parts (each element owned once: the
        per-bucket sums of powers combined over the ranks,
        ``clipping.over_ranks``). Either way every rank gets the same bits.

        Raises:
            RuntimeError: the norm is non-finite and ``error_if_nonfinite``.
        """
        if not pending:
            self.no_gradients()
            return []
        postscales = self.postscales_of(pending)
        if self._owned_norm:
            powers = over_ranks(norm_powers(buffers, self.norm_type, backend=self.backend),
                                self.norm_type, self.group, self.world_size)
            clipped = clip_scales(powers, postscales, self.max_grad_norm, self.norm_type,
                                  self.loss_scale, backend=self.backend,
                                  norm_dtype=self.norm_dtype)
        else:
            clipped = clip_buffers(buffers, postscales, self.max_grad_norm, self.norm_type,
                                   self.loss_scale, backend=self.backend,
                                   split=self.norm_split, norm_dtype=self.norm_dtype)
        self.grad_norm, scales = clipped
        if self.error_if_nonfinite:
            raise_if_nonfinite(self.grad_norm, self.norm_type)
        return scales

    # ------------------------------------------------------ unused parameters
    def settle_unused(self, extra: Optional[torch.Tensor] = None,
                      pending: Sequence[PendingBucket] = ()) -> Optional[torch.Tensor]:
        """After a pass: with ``unused_grads_to_none``, give a parameter no
        rank had a gradient for ``.grad = None`` on every rank. When the
        buckets' sums (``pending``'s spare elements, ``missing_spare``) say no
        rank missed any, that is one host read; otherwise one small
        all-reduce counts who had each gradient, with ``extra``'s value summed
        alongside. Returns ``extra``'s sum.

        Without ``unused_grads_to_none`` a parameter missing on this rank
        contributes zeros and keeps its zero ``.grad``; the first time, a
        ``warn_missing`` reducer says so, from what this rank knows (the
        check and its host read are what ``find_unused_parameters=False``,
        the default, saves)."""
        self.unused_slots = []
        missing = self.overlap.missing
        if not self.unused_grads_to_none and self.warn_missing and missing \
                and not self._warned_missing:
            self._warned_missing = True
            shapes = [tuple(self.parameters[self.order[slot]].shape) for slot in missing[:5]]
            warnings.warn(
                f"{len(missing)} parameters (shapes {shapes}...) had no gradient on "
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
        if extra is None and not self.collective.communicates:
            self.unused_slots = list(missing)  # this rank is every rank
            for slot in self.unused_slots:
                self.parameters[self.order[slot]].grad = None
            return None
        spare = self.missing_spare
        if extra is None and spare is not None and pending and \
                all(p.flat.numel() > p.bucket.size + spare for p in pending):
            # each bucket's sum says how many ranks missed one of its
            # gradients: when none did, there is nothing to count
            riding = torch.stack([p.flat[p.bucket.size + spare] for p in pending])
            self.spares_clear = not bool(riding.any())
            if self.spares_clear:
                return None
        counts = torch.ones(slots + 1, dtype=torch.int32, device=self.parameters[0].device)
        if slots and missing:
            counts[missing] = 0  # the hooks' slots: plan order
        counts[-1] = 0 if extra is None else extra
        if self.collective.communicates:
            dist.all_reduce(counts, group=self.group)
        if slots:
            unused = self.unused_slots = (counts[:-1] == 0).nonzero().flatten().tolist()
            for slot in unused:
                self.parameters[self.order[slot]].grad = None
        return counts[-1]


def engine_member(name: str, doc: str = "") -> property:
    """A reducer's member that reads (and sets) its engine's ``name``."""
    return property(lambda self: getattr(self._engine, name),
                    lambda self, value: setattr(self._engine, name, value), doc=doc)


class ReducerSurface(uneven_inputs.JoinParticipant):
    """The members both reducers show over their ``_engine`` (a
    ``BucketEngine``), the same for both: the options, the last reduction's
    results, and the overlap's state. Nothing here is overridden; each
    reducer adds how it registers hooks, starts and writes back its buckets.
    """

    _engine: BucketEngine

    parameters = engine_member("parameters")
    group = engine_member("group")
    world_size = engine_member("world_size")
    mean = engine_member("mean")
    degree = engine_member("degree")
    reduce_dtype = engine_member("reduce_dtype")
    check_finite = engine_member("check_finite")
    backend = engine_member("backend")
    plan = engine_member("plan")
    _order = engine_member("order")
    max_grad_norm = engine_member("max_grad_norm")
    norm_type = engine_member("norm_type")
    error_if_nonfinite = engine_member("error_if_nonfinite")
    #: who shares the reading of the clipping norm (None: each rank reads
    #: all of the reduced buffers); see ``split_norm``
    norm_split = engine_member("norm_split")
    grad_norm = engine_member("grad_norm", """The total norm of the last reduced gradients,
        before clipping (with ``max_grad_norm``): a 0-d tensor on their device, fp32 or fp64
        (``clipping.norm_dtype_of`` the parameters' dtypes).""")
    found_nonfinite = engine_member("found_nonfinite")
    stacks_exactly = engine_member("stacks_exactly", """Whether a backward pass that adds
        to reduced gradients no step took, reduced again, still gives the reduced sum of
        every pass (``BucketEngine``'s comment says when).""")

    def join_hook(self, **kwargs):
        """Take part in ``torch.distributed.algorithms.Join`` (uneven inputs),
        with the hooks registered: a rank that ran out of data runs, for
        each communicating backward pass of the others, the same
        collectives with zeros and no parameter used (the mean still
        divides by the whole world size, DDP's default); when every rank
        has run out, every rank takes the parameters of the last one to
        join (its own optimizer is not stepped meanwhile, as under DDP).

        Raises:
            RuntimeError: no hooks are registered.
            ValueError: ``divide_by_initial_world_size=False`` with a mean.

        Examples:
            >>> with Join([reducer]):                       # doctest: +SKIP
            ...     for x, y in loader: loss_fn(model(x), y).backward(); opt.step()
        """
        return uneven_inputs.reducer_join_hook(self, kwargs)

    #: DistributedOptimizer's rule (DDP's): a parameter no rank gave a
    #: gradient in a pass keeps none, so the optimizer skips it
    unused_grads_to_none = engine_member("unused_grads_to_none")
    #: with the rule off, whether a pass that misses a gradient warns (once)
    warn_missing = engine_member("warn_missing")
    #: plan slots of the parameters no rank had a gradient for in the last
    #: reducing pass (``unused_grads_to_none``)
    unused_slots = engine_member("unused_slots")


    def no_sync(self):
        """A context in which backward passes accumulate gradients locally."""
        return self._engine.overlap.no_sync()

    @property
    def reduced(self) -> bool:
        """Whether ``.grad`` holds reduced gradients that ``consume`` has not taken yet."""
        return self._engine.overlap.reduced

    @property
    def accumulated_passes(self) -> int:
        """Backward passes accumulated locally since the last reduction."""
        return self._engine.overlap.passes_since_sync

    @property
    def syncing(self) -> bool:
        """False inside ``no_sync()``."""
        return self._engine.overlap.sync_enabled

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
        return self._engine.loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        self._engine.loss_scale = check_loss_scale(value)

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
        With ``wire_dtype`` or ``deterministic``, the collective's kept
        codes, received chunks, block scales and error feedback's residuals
        are counted too.

        Examples:
            >>> reducer = DistributedGradReducer([torch.zeros(1000, 10)])  # doctest: +SKIP
            >>> reducer.buffer_bytes                                       # doctest: +SKIP
            0
            >>> _ = reducer([torch.ones(1000, 10)])                        # doctest: +SKIP
            >>> reducer.buffer_bytes   # one fp32 bucket of 10,000 elements  # doctest: +SKIP
            40000
        """
        return storage_bytes(self.held_tensors())

    @property
    def keeps_error_feedback(self) -> bool:
        """Whether this reducer keeps error-feedback residuals (a compressing
        ``wire_dtype`` with ``error_feedback=True``, over more than one rank)."""
        return self._engine.collective.residual_sizes() is not None

    def error_feedback_state(self) -> Optional[dict]:
        """This rank's error-feedback residuals, for a checkpoint that resumes a
        compressed run exactly (``wire_dtype`` with ``error_feedback=True``),
        or None where the reducer keeps none. Not collective: each rank saves
        its own (the residuals differ by rank). The tensors are fresh fp32
        copies on the host; a bucket not reduced yet is saved as zeros.
        ``DistributedOptimizer.sharded_state_dict()`` includes it.

        Examples:
            >>> torch.save(reducer.error_feedback_state(), f"ef.{rank}.pt")  # doctest: +SKIP
            >>> reducer.load_error_feedback_state(torch.load(f"ef.{rank}.pt"))  # doctest: +SKIP
        """
        return feedback_state.state_of(self._engine.collective)

    def load_error_feedback_state(self, state: dict) -> None:
        """Continue from residuals this rank saved with
        ``error_feedback_state()``, in the same layout (world size, rank,
        ``local_size``, ``wire_dtype``, buckets). Not collective.

        Raises:
            TypeError: ``state`` is not a dict, or a residual is not a tensor.
            ValueError: this reducer keeps no residuals, ``state`` is not an
                error-feedback state, or it was saved in another layout (the
                entry that differs is named) or has a residual of another
                size. Nothing is changed when an error is raised.
        """
        collective = self._engine.collective
        residuals = feedback_state.check_state(state, collective, "state")
        feedback_state.load_into(collective, residuals)

    def mark_reduced(self) -> None:
        """Declare ``.grad`` reduced (it was, by another reducer)."""
        self._engine.overlap.reduced = True

    def consume(self) -> None:
        """Mark the reduced gradients as used (an optimizer step took them, or
        ``zero_grad`` discarded them)."""
        overlap = self._engine.overlap
        overlap.reduced = overlap.reduced_again = False

    @property
    def reduced_again(self) -> bool:
        """Whether a backward pass added to reduced gradients that ``consume``
        had not taken: ``stacks_exactly`` says if the reduction after it is
        still the reduced sum of every pass."""
        return self._engine.overlap.reduced_again



def _fusion_ids(fusion_type, n: int) -> List[int]:
    if isinstance(fusion_type, bool):
        raise TypeError("fusion_type must be an int or a sequence of ints, got a bool")
    if isinstance(fusion_type, int):
        return [fusion_type] * n
    ids = list(fusion_type)
    if len(ids) != n:
        raise ValueError(f"fusion_type has {len(ids)} entries for {n} parameters")
    return ids
