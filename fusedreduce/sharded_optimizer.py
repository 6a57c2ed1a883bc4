"""The machinery of ``DistributedOptimizer(..., shard=True)``: ZeRO on the fused buckets.

- ``ShardedGradReducer`` (``sharded_grads.py``, re-exported here): during backward each bucket is flattened (cast and
  prescaled in the same launch) and reduce-scattered as soon as it is ready;
  when backward ends, each ``.grad`` holds the reduced gradient on the
  elements this rank owns and zeros elsewhere (one write-back launch per
  bucket), and one small all-reduce settles, for every rank alike, which
  parameters got no gradient anywhere and whether any owned gradient is
  non-finite.
- ``ShardedParameters``: this rank's part of every bucket as optimizer
  parameters: a parameter wholly owned is stepped as itself (or as its
  master copy), a parameter cut by a part boundary as a 1-D slice (a view,
  or a master copy); after the step the parts are all-gathered (one
  collective per bucket, in the parameters' own dtype) and written back into
  the parameters with one unflatten launch per bucket.

The layout is ``BucketPlan(..., shards=world_size)``: padding at bucket ends
only, part ``r`` of every bucket owned by group rank ``r``. With AdaSum a
rank owns instead the slice the tree's halving leaves it (``TreeShare``),
and the parameters come back through the tree's reverse swaps.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from .adasum import TreeShare, adasum_gather
from .allreduce import PendingBucket, wait_for
from .buckets import Bucket, BucketPlan, FlatBuffers
from .buffer_lifetime import materialise, reinterpret, release
from ._checks import check_choice
from .clipping import max_over_ranks, norm_dtype_of
from .param_swap import swapped
from .process_group import comm_device, global_rank
from .grad_collectives import DIRECT_MEAN_NUMEL
from .shard_buffers import ALIVE
from .sharded import (PartRange, broadcast_from, broadcast_slots, part_ranges, ranges_between,
                      start_all_gather)
from .sharded_checkpoint import collect_pieces, make_piece, pack_pieces, state_over
from .sharded_grads import ShardedGradReducer  # noqa: F401  (re-exported)

#: optimizers whose step updates every element from that element's gradient
#: and state alone (and per-parameter scalars such as a step count), so a
#: slice of a parameter steps exactly as the whole would
ELEMENTWISE_OPTIMIZERS: Tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
     "Rprop", "ASGD") if hasattr(torch.optim, name))

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

#: how many buckets' whole buffers may have memory at once with
#: ``shard_gradients``, and when gloo gathers a bucket straight into the
#: parameters: the gradient side's rules, kept alike on the gather side
_ALIVE = ALIVE
_DIRECT_MEAN_NUMEL = DIRECT_MEAN_NUMEL


def check_shardable(optimizer: torch.optim.Optimizer, assume_elementwise: bool) -> None:
    """Refuse an optimizer whose step is not known to be elementwise.

    Raises:
        ValueError: ``optimizer``'s class is not one of
            ``ELEMENTWISE_OPTIMIZERS`` (exactly: a subclass may change the
            step) and ``assume_elementwise`` is false.
    """
    if assume_elementwise or type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"shard=True steps each rank's slice of a parameter on its own, which is exact only "
        f"for an optimizer whose step is elementwise; {type(optimizer).__name__} is not known "
        f"to be (known: {names}). An optimizer that needs whole tensors (LBFGS, Adafactor's "
        f"factored statistics, orthogonalising ones) would step wrongly. If its step is "
        f"elementwise, pass assume_elementwise=True")


def check_master_dtype(master_dtype) -> torch.dtype:
    """``master_dtype`` if it is a floating dtype the kernels handle.

    Raises:
        TypeError: not a ``torch.dtype``, or not floating.
    """
    if not isinstance(master_dtype, torch.dtype) or master_dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"master_dtype must be torch.float16, bfloat16, float32 or float64, "
                        f"got {master_dtype!r}")
    return master_dtype


#: ``gradient_collective=`` values: how the sharded reduction leaves each
#: rank its part of a bucket
GRADIENT_COLLECTIVES = ("reduce_scatter", "all_reduce", "exchange")
#: ``parameter_gather=`` values: how the stepped parts come back into the
#: parameters of every rank
PARAMETER_GATHERS = ("all_gather", "broadcast", "broadcast_direct")


def check_collectives(gradient_collective: Optional[str], parameter_gather: Optional[str], *,
                      shard: bool, adasum: bool) -> None:
    """Refuse a collective choice that is not one of the sharded step's.

    Raises:
        TypeError: ``gradient_collective`` or ``parameter_gather`` is neither
            None nor a string.
        ValueError: not one of ``GRADIENT_COLLECTIVES`` / ``PARAMETER_GATHERS``;
            given without ``shard``, or with AdaSum (whose tree is its own
            collective both ways).
    """
    for name, value, known in (("gradient_collective", gradient_collective,
                                GRADIENT_COLLECTIVES),
                               ("parameter_gather", parameter_gather, PARAMETER_GATHERS)):
        if check_choice(value, name, known, optional=True) is None:
            continue
        if not shard:
            raise ValueError(f"{name}={value!r} applies to shard=True only (unsharded, every "
                             f"bucket is all-reduced)")
        if adasum:
            raise ValueError(f"{name}={value!r} does not combine with reduce_method='adasum': "
                             f"AdaSum's tree reduces the gradients and gathers the parameters")


def master_dtype_of(param: torch.Tensor, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``param``'s slice is stepped in: ``master_dtype`` for 16-bit
    parameters, the parameter's own dtype otherwise."""
    return master_dtype if param.dtype in _SIXTEEN_BIT else param.dtype


@dataclass
class _Shard:
    """One parameter's slice on this rank."""

    param: torch.Tensor
    index: int  # in the optimizer's parameter order
    range: PartRange
    tensor: torch.Tensor  # what the wrapped optimizer steps
    whole: bool  # the range is the whole parameter (``tensor`` has its shape)
    master: bool  # ``tensor`` is a copy, not the parameter's memory

    @property
    def swapped(self) -> bool:
        return self.tensor is not self.param


class ShardedParameters:
    """This rank's slices of the parameters, what the wrapped optimizer steps.

    Args:
        params: every parameter of the optimizer, in ``param_groups`` order.
        reducer: the sharded reducer over ``params`` (its plan and buffers).
        master_dtype: the dtype 16-bit parameters are stepped in.
        group: the process group.
        parameter_gather: one of ``PARAMETER_GATHERS``; None: from the
            process group (``DistributedOptimizer``'s argument).
    """

    def __init__(self, params: Sequence[torch.Tensor], reducer: ShardedGradReducer,
                 master_dtype: torch.dtype, group, parameter_gather: Optional[str] = None) -> None:
        self.params = list(params)
        self.reducer = reducer
        self.plan: BucketPlan = reducer.plan
        self.group = group
        self.world_size = reducer.world_size
        self.master_dtype = master_dtype
        order = reducer._order
        self.by_param: Dict[torch.Tensor, _Shard] = {}
        self.per_bucket: List[List[_Shard]] = []
        for bucket in self.plan.buckets:
            shards = []
            for r in ranges_between(bucket, *reducer.owned[bucket.index]):
                index = order[r.tensor]
                shard = self._new_shard(self.params[index], index, r)
                self.by_param[shard.param] = shard
                shards.append(shard)
            self.per_bucket.append(shards)
        self.masters = [s for s in self.by_param.values() if s.master]
        self._versions: Dict[torch.Tensor, int] = {}
        self._note_versions()
        self._targets = [p.detach() for p in reducer.plan_tensors()]
        self._targets_of = reducer.plan_tensors()  # the parameters, plan order
        self._pending: Dict[int, PendingBucket] = {}  # bucket index -> its all-gather
        self._awaited: Dict[torch.Tensor, int] = {}  # parameter -> its bucket in flight
        self._hook = None
        # gloo's all-gather copies through a temporary of the whole buffer and
        # was slower than one broadcast per rank (see broadcast_slots)
        if parameter_gather is None and self.world_size > 1:
            gloo = dist.get_backend(group) == dist.Backend.GLOO
            parameter_gather = "broadcast" if gloo else "all_gather"
        self._gather_by_broadcasts = self.world_size > 1 and parameter_gather != "all_gather"
        self._direct_mean_numel = 0 if parameter_gather == "broadcast_direct" \
            else _DIRECT_MEAN_NUMEL
        self._gather_dtypes = [self._gather_dtype(b) for b in self.plan.buckets]
        self._direct = [self._direct_pieces(b) for b in self.plan.buckets]
        # a bucket's all-gather buffer, what this rank sends from it and the
        # slices of that the stepped tensors are copied into: kept over the
        # reducer's buffer, or with shard_gradients made for each gather and
        # dropped once the bucket is written into the parameters
        self._gather_flat: List[Optional[torch.Tensor]] = [None] * len(self.plan.buckets)
        self._send: List[Optional[torch.Tensor]] = [None] * len(self.plan.buckets)
        self._send_slices: List[Optional[List[torch.Tensor]]] = [None] * len(self.plan.buckets)
        self._keeps_flats = not reducer.shard_gradients
        if self._keeps_flats:
            for bucket in self.plan.buckets:
                self._flat_for(bucket.index)

    def _direct_pieces(self, bucket: Bucket) -> Optional[List[Tuple[int, torch.Tensor]]]:
        """The ``(owner, elements)`` broadcasts that gather ``bucket`` straight
        into the parameters, each range of each rank's part from the
        parameter's own memory; None where the bucket is gathered through
        its buffer (not gloo, AdaSum's tree, mixed dtypes, a non-contiguous
        parameter, or small tensors: see ``_DIRECT_MEAN_NUMEL``)."""
        if not self._gather_by_broadcasts or self.reducer.tree_shares is not None:
            return None
        slots = bucket.tensor_indices
        if not slots or sum(bucket.numels) < self._direct_mean_numel * len(slots) \
                or len({self.plan.specs[slot].dtype for slot in slots}) > 1 \
                or not all(self._targets[slot].is_contiguous() for slot in slots):
            return None
        return [(rank, self._targets[r.tensor].view(-1)[r.start:r.end])
                for rank in range(self.world_size) for r in part_ranges(bucket, rank)]

    def _direct_for(self, index: int, defer: bool) -> Optional[List[Tuple[int, torch.Tensor]]]:
        """Bucket ``index``'s ``_direct_pieces`` where it is gathered that way
        now: not ``defer``red, whose broadcasts would write the parameters
        while code before the next forward may read them."""
        return None if defer or not self._gather_by_broadcasts else self._direct[index]

    def _flat_for(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s all-gather buffer, made (or its memory allocated
        again) if need be."""
        flat = self._gather_flat[index]
        if flat is not None:
            materialise(flat)
            return flat
        bucket, dtype = self.plan.buckets[index], self._gather_dtypes[index]
        buffer = self.reducer.buffers[index] if self._keeps_flats else None
        flat = None if buffer is None else reinterpret(buffer, dtype, bucket.size)
        if flat is None:
            flat = torch.empty(bucket.size, dtype=dtype, device=bucket.device)
        self._gather_flat[index] = flat
        # the all-gather (or the AdaSum tree's swaps) runs in place: this
        # rank sends its own slot of the flat buffer
        send = self._send[index] = flat[slice(*self.reducer.owned[index])]
        self._send_slices[index] = [send[s.range.offset:s.range.offset + s.range.numel]
                                    for s in self.per_bucket[index]]
        return flat

    def _drop_flat(self, index: int) -> None:
        """``shard_gradients``: release the memory of bucket ``index``'s
        all-gather buffer (the tensor and its views stay, for the next gather)."""
        if not self._keeps_flats:
            release(self._gather_flat[index])

    def held_buffers(self) -> List[torch.Tensor]:
        """The all-gather's buffers (most reuse the reducer's memory; what
        each rank sends is its slot of them); with ``shard_gradients`` their
        memory is held only while a gather is in flight."""
        return [flat for flat in self._gather_flat if flat is not None]

    @property
    def gathers(self) -> List[Optional[torch.Tensor]]:
        """Per bucket, its all-gather buffer (``FlatBuffers.gathers``)."""
        return self._gather_flat

    def _gather_dtype(self, bucket: Bucket) -> torch.dtype:
        """The widest dtype of the bucket's parameters: it carries each exactly
        (fp16 beside bf16 needs fp32)."""
        dtypes = {self.plan.specs[slot].dtype for slot in bucket.tensor_indices}
        if len(dtypes) == 1:
            return dtypes.pop()
        widest = max(dtypes, key=lambda d: torch.empty((), dtype=d).element_size())
        return torch.float32 if widest in _SIXTEEN_BIT else widest

    def _new_shard(self, param: torch.Tensor, index: int, r: PartRange) -> _Shard:
        dtype = master_dtype_of(param, self.master_dtype)
        whole = r.start == 0 and r.end == param.numel()
        if whole and dtype == param.dtype:
            return _Shard(param, index, r, param, True, False)
        if not whole and dtype == param.dtype and param.is_contiguous():
            return _Shard(param, index, r, param.detach().view(-1)[r.start:r.end], False, False)
        shard = _Shard(param, index, r, param, whole, True)
        shard.tensor = _slice_of(param.detach(), shard).to(dtype, copy=True)
        return shard

    # ------------------------------------------------------------------ step
    def refresh_masters(self, everything: bool = False) -> None:
        """Follow parameters changed outside ``step`` since the last gather
        (their version counter moved: ``model.load_state_dict``, an in-place
        edit under ``no_grad``; ``everything``: all, for writes through
        ``.data``, which no counter sees): keep each master element unless
        its parameter element no longer equals it rounded, else take the
        parameter's value."""
        with torch.no_grad():
            for s in self.masters:
                if not everything and s.param._version == self._versions.get(s.param):
                    continue
                current = _slice_of(s.param.detach(), s)
                kept = torch.where(s.tensor.to(s.param.dtype) == current, s.tensor,
                                   current.to(s.tensor.dtype))
                s.tensor.copy_(kept)
        self._note_versions()

    def _note_versions(self) -> None:
        self._versions = {s.param: s.param._version for s in self.masters}

    @staticmethod
    def _grad_slice(s: _Shard) -> torch.Tensor:
        grad = _slice_of(s.param.grad, s)
        return grad if grad.dtype == s.tensor.dtype else grad.to(s.tensor.dtype)

    def step(self, optimizer: torch.optim.Optimizer, run_step):
        """Run ``run_step()`` (the wrapped optimizer's step) on this rank's
        slices: each group's ``params`` and the ``state`` keys are swapped to
        the slices for its duration. Parameters without a gradient, or owned
        by other ranks, are left out, as torch leaves out a parameter whose
        ``.grad`` is None."""
        state = optimizer.state
        moved: List[_Shard] = []
        try:
            stepped = [[] for _ in optimizer.param_groups]
            for g, into in zip(optimizer.param_groups, stepped):
                for p in g["params"]:
                    s = self.by_param.get(p)
                    if s is None or p.grad is None:
                        continue
                    if s.swapped:
                        s.tensor.grad = self._grad_slice(s)
                        if p in state:
                            state[s.tensor] = state.pop(p)
                        moved.append(s)
                    into.append(s.tensor)
            with swapped(optimizer, params=stepped):
                return run_step()
        finally:
            for s in moved:
                if s.tensor in state:
                    state[s.param] = state.pop(s.tensor)
                s.tensor.grad = None

    def gather(self, defer: bool = False) -> None:
        """All-gather every bucket's parts and write them into the parameters.

        The buckets go last first: the last bucket holds the first layers'
        parameters, which the next forward reads first. ``defer``: leave the
        all-gathers in flight; each bucket is written when a module that owns
        one of its parameters starts its forward (a global forward pre-hook),
        or by ``finish_gather``."""
        self.finish_gather()
        if not self._keeps_flats and not defer:
            self._gather_in_turn()
            return
        for bucket in self.plan.buckets:
            direct = self._direct_for(bucket.index, defer)
            if not self._keeps_flats and direct is None:
                self._flat_for(bucket.index)  # its memory was given back after the last gather
            self._copy_to_send(bucket.index, direct is not None)
        for bucket in reversed(self.plan.buckets):
            self._start_gather(bucket, self._direct_for(bucket.index, defer))
        if not defer:
            self.finish_gather()
            return
        for index in self._pending:
            for slot in self.plan.buckets[index].tensor_indices:
                self._awaited[self._targets_of[slot]] = index
        if self._pending and self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                self._before_forward)

    def _copy_to_send(self, index: int, direct: bool = False) -> None:
        """Copy this rank's stepped tensors of bucket ``index`` into the
        slot of its all-gather buffer that this rank sends; ``direct``
        (broadcast from the parameters): only the master copies, into their
        parameters, as the unflatten of the gathered buffer would write them
        (one dtype in the bucket: the same single rounding)."""
        shards = self.per_bucket[index]
        if direct:
            shards = [s for s in shards if s.master]
        if not shards:
            return
        with torch.no_grad():
            if direct:
                torch._foreach_copy_([_slice_of(s.param.detach(), s) for s in shards],
                                     [s.tensor for s in shards])
            else:
                torch._foreach_copy_(self._send_slices[index],
                                     [s.tensor.reshape(-1) for s in shards])

    def _start_gather(self, bucket: Bucket,
                      direct: Optional[List[Tuple[int, torch.Tensor]]] = None) -> None:
        """Start gathering ``bucket`` into its buffer (its own part copied in
        already), or with ``direct`` (``_direct_pieces``) straight into the
        parameters (``pending.flat`` None: nothing to unflatten), in
        ``_pending``."""
        shares = self.reducer.tree_shares
        if direct is not None:
            pending = PendingBucket(bucket, None, broadcast_from(direct, self.group))
        elif self.world_size == 1:
            pending = PendingBucket(bucket, self._send[bucket.index], None)
        elif shares is not None:
            # point-to-point swaps that each wait: done here, written at once or deferred
            flat = self._gather_flat[bucket.index]
            adasum_gather(flat, shares[bucket.index], self.group,
                          self.reducer.adasum_local_size)
            pending = PendingBucket(bucket, flat, None)
        elif bucket.size:
            flat = self._gather_flat[bucket.index]
            if self._gather_by_broadcasts:
                work = broadcast_slots(flat, self.group, self.world_size)
            else:
                work = start_all_gather(flat, self._send[bucket.index], self.group)
            pending = PendingBucket(bucket, flat, work)
        else:
            return
        self._pending[bucket.index] = pending

    def _gather_in_turn(self) -> None:
        """``shard_gradients``, gathering at once: bucket by bucket, each
        bucket's buffer made as it starts and written into the parameters
        (its memory released) before the bucket after next starts, so that
        at most ``_ALIVE`` buffers have memory at a time."""
        for bucket in reversed(self.plan.buckets):
            while len(self._pending) >= _ALIVE:
                self.finish_gather([next(iter(self._pending))])
            direct = self._direct_for(bucket.index, False)
            if direct is None:
                self._flat_for(bucket.index)
            self._copy_to_send(bucket.index, direct is not None)
            self._start_gather(bucket, direct)
        self.finish_gather()

    @property
    def gathering(self) -> bool:
        """Whether all-gathers are still in flight (``gather(defer=True)``)."""
        return bool(self._pending)

    def finish_gather(self, indices: Optional[Sequence[int]] = None) -> None:
        """Wait for the in-flight all-gathers (or those of ``indices``) and
        write their buckets into the parameters."""
        if not self._pending:
            return
        indices = list(self._pending) if indices is None else indices
        with torch.no_grad():
            for index in indices:
                pending = self._pending.pop(index)
                wait_for(pending)
                if pending.flat is not None:  # else broadcast into the parameters
                    self.plan.unflatten(pending.bucket, pending.flat, self._targets,
                                        backend=self.reducer.backend)
                    self._drop_flat(index)
                for slot in pending.bucket.tensor_indices:
                    param = self._targets_of[slot]
                    self._awaited.pop(param, None)
                    if param in self._versions:
                        self._versions[param] = param._version
        if not self._pending and self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        if not self._awaited:
            return
        indices = {self._awaited[p] for p in module._parameters.values() if p in self._awaited}
        if indices:
            self.finish_gather(sorted(indices, reverse=True))

    def owned_grad_slices(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The slices this rank holds of ``params``' gradients, in their order
        (parameters without a gradient, or not sharded here, left out): the
        share of a norm this rank reads."""
        return [_slice_of(p.grad, self.by_param[p]) for p in params
                if p.grad is not None and p in self.by_param]

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The norm of order ``norm_type`` of the whole reduced gradient, from
        this rank's owned slices and one scalar all-reduce, on the gradients'
        device, the same bits on every rank: fp32, or fp64 when a parameter
        is fp64 (``clipping.norm_dtype_of``, as torch's ``clip_grad_norm_``)."""
        slices = [_slice_of(s.param.grad, s) for s in self.by_param.values()
                  if s.param.grad is not None]
        device = self.params[0].device if self.params else torch.device("cpu")
        # every rank's parameters, not its slices: the ranks agree on the dtype
        dtype = norm_dtype_of(p.dtype for p in self.params)
        # each slice's norm in its dtype, as torch takes each gradient's (its
        # fast path for p = 2 on a CPU); the rest in fp64: fp32 p-th powers
        # overflow from |x| ~ 1.8e19 for p = 2 (torch's 2e22 row)
        norms = torch.stack([n.double() for n in torch._foreach_norm(slices, norm_type)]) \
            if slices else torch.zeros(1, dtype=torch.float64, device=device)
        if norm_type == math.inf:
            local = norms.max()  # NaN propagates
            if self.world_size > 1:
                local = max_over_ranks(local, self.group, self.world_size)
            return local.to(dtype)
        # sums of p-th powers add across the ranks; the root is taken once
        power = norms.pow(norm_type).sum()
        if self.world_size > 1:
            dist.all_reduce(power, group=self.group)
        return power.pow(1.0 / norm_type).to(dtype)

    # ------------------------------------------------------------- state
    def take_state(self, state: Dict[torch.Tensor, dict]) -> Dict[torch.Tensor, dict]:
        """This rank's part of ``state`` (full per-parameter state, keyed by
        parameter): slices of per-element tensors, other entries as they are;
        a ``master_weight`` entry sets the master copy. Parameters this rank
        owns nothing of are left out."""
        kept: Dict[torch.Tensor, dict] = defaultdict(dict)
        for p, entry in state.items():
            s = self.by_param.get(p)
            if s is None:
                continue
            master = entry.get("master_weight")
            if s.master:
                if master is not None and not s.whole and master.shape != p.shape:
                    piece = master  # already this rank's elements (a sharded checkpoint)
                else:
                    piece = _slice_of(master if master is not None else p.detach(), s)
                with torch.no_grad():
                    s.tensor.copy_(piece)
            part = {}
            for key, value in entry.items():
                if key == "master_weight":
                    continue
                if not s.whole and _per_element(value, p):
                    value = _slice_of(value, s).clone()
                part[key] = value
            if part:
                kept[p] = part
        return kept

    def own_part(self, state_dict: dict) -> dict:
        """``state_dict`` (a whole one in torch's form, matched to the
        parameters) cut down to this rank's part before anything moves: the
        entries of the parameters it owns elements of, a cut one's
        per-element values (its master too) as 1-D copies of the owned
        elements. Loading that moves 1/N of the state onto the device."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        state = {}
        for s in self.by_param.values():
            entry = state_dict["state"].get(ids[s.index])
            if entry is None:
                continue
            if not s.whole:
                entry = {key: _slice_of(value, s).clone()
                         if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                         for key, value in entry.items()}
            state[ids[s.index]] = entry
        return {**state_dict, "state": state}

    def checkpoint_pieces(self, state: Dict[torch.Tensor, dict]) -> Dict[int, dict]:
        """This rank's part of ``state`` (and of the masters) as
        ``sharded_state_dict()`` pieces, per parameter index."""
        return {s.index: make_piece(p, s.range.start, s.range.end, state[p],
                                    s.tensor if s.master else None)
                for p, s in self.by_param.items() if state.get(p)}

    def part_to_send(self, state: Dict[torch.Tensor, dict]) -> dict:
        """This rank's part of ``state`` for ``whole_state`` on every rank:
        its pieces packed on the host (a few flat tensors, however many
        parameters), and which of its non-per-element tensors (a capturable
        optimizer's ``step``) the optimizer keeps on a device."""
        pieces = self.checkpoint_pieces(state)
        on_device = {key for piece in pieces.values() for key, value in piece["values"].items()
                     if isinstance(value, torch.Tensor) and value.device.type != "cpu"}
        return {"state": pack_pieces(pieces), "on_device": sorted(on_device)}

    def gather_parts(self, part: dict, group, to: Optional[int] = None, *,
                     chunk_bytes: int = 0) -> Optional[List[dict]]:
        """Every rank's ``part_to_send`` (collective over ``group``, a gloo
        group over the same ranks: ``checkpoint_group``), in ``group``'s rank
        order, on every rank (``to`` None) or on ``group``'s rank ``to`` only
        (None elsewhere).

        The tensors travel as bytes, from and into host buffers, in rounds of
        at most ``chunk_bytes`` (default ``GATHER_CHUNK_BYTES``) per rank, so
        that each collective ends within the group's timeout however large
        the state; nothing is pickled but the layout."""
        chunk_bytes = chunk_bytes or GATHER_CHUNK_BYTES
        world_size = dist.get_world_size(group)
        state, tensors = _without_data(part["state"])
        layouts = [None] * world_size
        receiving = to is None or dist.get_rank(group) == to
        layout = {"state": state, "on_device": part["on_device"],
                  "specs": [(t.dtype, t.numel()) for t in tensors]}
        if to is None:
            dist.all_gather_object(layouts, layout, group=group)
        else:
            dst = global_rank(group, to)
            dist.gather_object(layout, layouts if receiving else None, dst=dst, group=group)
        offsets, size = _offsets(layout["specs"])
        # the ranks other than ``to`` have no layouts: the sizes come apart
        sizes = _all_gather_sizes(size, group, world_size)
        chunk = min(chunk_bytes, max(sizes))
        rounds = -(-max(sizes) // chunk) if chunk else 0
        stream = torch.empty(rounds * chunk, dtype=torch.uint8)
        for at, t in zip(offsets, tensors):
            stream[at:at + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
        received = [torch.empty(rounds * chunk, dtype=torch.uint8)
                    for _ in range(world_size)] if receiving else None
        for j in range(rounds):
            at = slice(j * chunk, (j + 1) * chunk)
            outs = [r[at] for r in received] if receiving else None
            if to is None:
                dist.all_gather(outs, stream[at], group=group)
            else:
                dist.gather(stream[at], outs, dst=dst, group=group)
        if not receiving:
            return None
        return [{"state": _with_data(got["state"], _read_stream(stream_r, got["specs"])),
                 "on_device": got["on_device"]} for got, stream_r in zip(layouts, received)]

    def whole_state(self, parts: Sequence[dict], cpu_offload: bool = False
                    ) -> Dict[torch.Tensor, dict]:
        """The whole state, keyed by parameter, from every rank's
        ``part_to_send`` (in rank order). Tensors sit where an unsharded
        optimizer keeps them: per-element values (and masters) on their
        parameter's device, other tensors on the device where the ranks kept
        them; with ``cpu_offload`` all of them on the host."""
        by_index = collect_pieces([part["state"] for part in parts],
                                  [p.shape for p in self.params])
        on_device = set().union(*(part["on_device"] for part in parts))
        full: Dict[torch.Tensor, dict] = {}
        for index in sorted(by_index):
            p, pieces = self.params[index], by_index[index]
            entry = state_over(pieces, 0, p.numel(), p.shape)
            if not cpu_offload and p.device.type != "cpu":
                moved = set(pieces[0]["slices"]) | on_device
                entry = {key: value.to(p.device) if key in moved else value
                         for key, value in entry.items()}
            full[p] = entry
        return full


#: bytes per rank per round of the collective ``state_dict()``'s gather: each
#: round must end within the checkpoint group's timeout (``checkpoint_timeout``)
GATHER_CHUNK_BYTES = 64 * 2 ** 20


def _without_data(packed: dict) -> Tuple[dict, List[torch.Tensor]]:
    """``packed`` with each flat tensor of slices taken out (in order), and
    those tensors: the layout, small to pickle, and the bytes to send."""
    tensors: List[torch.Tensor] = []
    slices = {}
    for key, entry in packed["slices"].items():
        slices[key] = {**entry, "data": len(entry["data"])}
        tensors.extend(entry["data"])
    return {**packed, "slices": slices}, tensors


def _with_data(layout: dict, tensors: Sequence[torch.Tensor]) -> dict:
    """``_without_data``'s inverse."""
    slices, at = {}, 0
    for key, entry in layout["slices"].items():
        slices[key] = {**entry, "data": list(tensors[at:at + entry["data"]])}
        at += entry["data"]
    return {**layout, "slices": slices}


def _offsets(specs: Sequence[Tuple[torch.dtype, int]]) -> Tuple[List[int], int]:
    """Where each tensor of ``specs`` starts in a byte stream (8-byte
    aligned, so that each is viewed back as its dtype), and the length."""
    offsets, at = [], 0
    for dtype, numel in specs:
        at = -(-at // 8) * 8
        offsets.append(at)
        at += numel * dtype.itemsize
    return offsets, at


def _read_stream(stream: torch.Tensor, specs: Sequence[Tuple[torch.dtype, int]]
                 ) -> List[torch.Tensor]:
    """The tensors of ``specs`` written at their ``_offsets``, as views of ``stream``."""
    offsets, _ = _offsets(specs)
    return [stream[at:at + numel * dtype.itemsize].view(dtype)
            for at, (dtype, numel) in zip(offsets, specs)]


def _all_gather_sizes(size: int, group, world_size: int) -> List[int]:
    """Every rank's ``size``, one small all-gather."""
    mine = torch.tensor([size], dtype=torch.int64, device=comm_device(group))
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _slice_of(tensor: torch.Tensor, s: _Shard) -> torch.Tensor:
    """The elements of ``tensor`` (shaped like ``s.param``) that ``s`` holds:
    the tensor itself for a whole parameter, else a 1-D slice of it."""
    return tensor if s.whole else tensor.reshape(-1)[s.range.start:s.range.end]


def _per_element(value, param: torch.Tensor) -> bool:
    """A full state value that holds one entry per element of ``param``."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape
