"""The end of a sharded step: this rank's slices of the parameters, stepped,
then gathered back into the parameters of every rank.

``ShardedParameters`` holds this rank's part of every bucket as what the
wrapped optimizer steps: a parameter wholly owned is stepped as itself (or
as its master copy), a parameter cut by a part boundary as a 1-D slice (a
view, or a master copy). After the step, each bucket comes back into the
parameters by one way of gathering, chosen once, at construction, from the
process group and the options (``_gather_ways``, the only place that looks
at them):

- ``_AllGather``: one all-gather per bucket into its flat buffer, in the
  parameters' own dtype (NCCL's way);
- ``_SlotBroadcasts``: the same by one broadcast per rank from its slot
  (gloo, whose all-gather copies through a temporary of the whole buffer);
- ``_DirectBroadcasts``: on gloo, a bucket of one dtype and large tensors by
  one broadcast per tensor range straight into the parameters: no buffer,
  no write-back (not when deferred: see ``_gather_ways``);
- ``_TreeSwaps``: AdaSum's reverse swaps down its tree;
- ``_OneRank``: a world of one rank, where the part is the whole bucket.

Every way has the same three calls: ``prepare`` (the bucket's buffer given
memory, this rank's stepped tensors copied into the slot it sends),
``start`` (the collective) and ``finish`` (wait, then the write-back: one
unflatten launch per bucket into the parameters, and the buffer's memory
given back where ``shard_gradients`` releases it, ``buffer_lifetime``). The
state of the wrapped optimizer crosses between this rank's part and the
whole in ``shard_transport``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import shard_transport
from .adasum import TreeShare, adasum_gather
from .allreduce import PendingBucket, wait_for
from .buckets import Bucket, BucketPlan
from .buffer_lifetime import ALIVE, KeptBuffer, ReleasedBuffer, reinterpret
from .clipping import norm_dtype_of, norm_over_ranks
from .param_shard import ParamShard, param_shard
from .node_scatter import start_level_gathers
from .param_swap import swapped
from .precision import exact_common_dtype
from .sharded import (DIRECT_MEAN_NUMEL, broadcast_from, broadcast_slots, part_ranges,
                      ranges_between, start_all_gather)


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

    def __init__(self, params: Sequence[torch.Tensor], reducer, master_dtype: torch.dtype,
                 group, parameter_gather: Optional[str] = None) -> None:
        self.params = list(params)
        self.reducer = reducer
        self.plan: BucketPlan = reducer.plan
        self.group = group
        self.world_size = reducer.world_size
        self.master_dtype = master_dtype
        order = reducer._order
        self.by_param: Dict[torch.Tensor, ParamShard] = {}
        self.per_bucket: List[List[ParamShard]] = []
        for bucket in self.plan.buckets:
            shards = []
            for r in ranges_between(bucket, *reducer.owned[bucket.index]):
                index = order[r.tensor]
                shard = param_shard(self.params[index], index, r, master_dtype)
                self.by_param[shard.param] = shard
                shards.append(shard)
            self.per_bucket.append(shards)
        self.masters = [s for s in self.by_param.values() if s.master]
        self._versions: Dict[torch.Tensor, int] = {}
        self._note_versions()
        self._targets_of = reducer.plan_tensors()  # the parameters, plan order
        # bucket index -> the way that started its gather, and the gather in flight
        self._pending: Dict[int, Tuple[_BufferGather, PendingBucket]] = {}
        self._awaited: Dict[torch.Tensor, int] = {}  # parameter -> its bucket in flight
        self._hook = None
        self._held, self._ways, self._deferred_ways = _gather_ways(self, parameter_gather)
        # released buffers are gathered a few at a time (``_gather_in_turn``)
        self._gather_now = self._gather_in_turn if reducer.shard_gradients \
            else self._gather_at_once

    def held_buffers(self) -> List[torch.Tensor]:
        """The all-gather's buffers (most reuse the reducer's memory; what
        each rank sends is its slot of them); with ``shard_gradients`` their
        memory is held only while a gather is in flight."""
        return [held.tensor for held in self._held if held.tensor is not None]

    @property
    def gathers(self) -> List[Optional[torch.Tensor]]:
        """Per bucket, its all-gather buffer (``FlatBuffers.gathers``)."""
        return [held.tensor for held in self._held]

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
                current = s.slice_of(s.param.detach())
                kept = torch.where(s.tensor.to(s.param.dtype) == current, s.tensor,
                                   current.to(s.tensor.dtype))
                s.tensor.copy_(kept)
        self._note_versions()

    def _note_versions(self) -> None:
        self._versions = {s.param: s.param._version for s in self.masters}

    def step(self, optimizer: torch.optim.Optimizer, run_step):
        """Run ``run_step()`` (the wrapped optimizer's step) on this rank's
        slices: each group's ``params`` and the ``state`` keys are swapped to
        the slices for its duration. Parameters without a gradient, or owned
        by other ranks, are left out, as torch leaves out a parameter whose
        ``.grad`` is None."""
        state = optimizer.state
        moved: List[ParamShard] = []
        try:
            stepped = [[] for _ in optimizer.param_groups]
            for g, into in zip(optimizer.param_groups, stepped):
                for p in g["params"]:
                    s = self.by_param.get(p)
                    if s is None or p.grad is None:
                        continue
                    if s.swapped:
                        grad = s.slice_of(p.grad)
                        s.tensor.grad = grad if grad.dtype == s.tensor.dtype \
                            else grad.to(s.tensor.dtype)
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

    # ---------------------------------------------------------------- gather
    def gather(self, defer: bool = False) -> None:
        """All-gather every bucket's parts and write them into the parameters.

        The buckets go last first: the last bucket holds the first layers'
        parameters, which the next forward reads first. ``defer``: leave the
        all-gathers in flight; each bucket is written when a module that owns
        one of its parameters starts its forward (a global forward pre-hook),
        or by ``finish_gather``."""
        self.finish_gather()
        if not defer:
            self._gather_now()
            return
        self._start_all(self._deferred_ways)
        for index in self._pending:
            for slot in self.plan.buckets[index].tensor_indices:
                self._awaited[self._targets_of[slot]] = index
        if self._pending and self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                self._before_forward)

    def _start_all(self, ways: Sequence[_BufferGather]) -> None:
        """Prepare every bucket, then start their gathers, last bucket first."""
        for way in ways:
            way.prepare()
        for way in reversed(ways):
            self._start(way)

    def _start(self, way: _BufferGather) -> None:
        pending = way.start()
        if pending is not None:
            self._pending[way.bucket.index] = way, pending

    def _gather_at_once(self) -> None:
        self._start_all(self._ways)
        self.finish_gather()

    def _gather_in_turn(self) -> None:
        """``shard_gradients``, gathering at once: bucket by bucket, each
        bucket's buffer made as it starts and written into the parameters
        (its memory released) before the bucket after next starts, so that
        at most ``ALIVE`` buffers have memory at a time."""
        for way in reversed(self._ways):
            while len(self._pending) >= ALIVE:
                self.finish_gather([next(iter(self._pending))])
            way.prepare()
            self._start(way)
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
                way, pending = self._pending.pop(index)
                way.finish(pending)
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

    # ------------------------------------------------------------------ norm
    def owned_grad_slices(self, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The slices this rank holds of ``params``' gradients, in their order
        (parameters without a gradient, or not sharded here, left out): the
        share of a norm this rank reads."""
        return [self.by_param[p].slice_of(p.grad) for p in params
                if p.grad is not None and p in self.by_param]

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The norm of order ``norm_type`` of the whole reduced gradient, from
        this rank's owned slices and one scalar all-reduce, on the gradients'
        device, the same bits on every rank: fp32, or fp64 when a parameter
        is fp64 (``clipping.norm_dtype_of``, as torch's ``clip_grad_norm_``),
        the ranks' shares combined by ``clipping.norm_over_ranks``."""
        slices = [s.slice_of(s.param.grad) for s in self.by_param.values()
                  if s.param.grad is not None]
        device = self.params[0].device if self.params else torch.device("cpu")
        # every rank's parameters, not its slices: the ranks agree on the dtype
        dtype = norm_dtype_of(p.dtype for p in self.params)
        # each slice's norm in its dtype, as torch takes each gradient's (its
        # fast path for p = 2 on a CPU); the rest in fp64: fp32 p-th powers
        # overflow from |x| ~ 1.8e19 for p = 2 (torch's 2e22 row)
        norms = torch.stack([n.double() for n in torch._foreach_norm(slices, norm_type)]) \
            if slices else torch.zeros(1, dtype=torch.float64, device=device)
        return norm_over_ranks(norms, norm_type, self.group, self.world_size).to(dtype)

    # ----------------------------------------------------------------- state
    # the optimizer state across the cut between this rank's part and the
    # whole: ``shard_transport``
    def take_state(self, state: Dict[torch.Tensor, dict]) -> Dict[torch.Tensor, dict]:
        return shard_transport.take_state(self.by_param, state)

    def own_part(self, state_dict: dict) -> dict:
        return shard_transport.own_part(self.by_param, state_dict)

    def checkpoint_pieces(self, state: Dict[torch.Tensor, dict]) -> Dict[int, dict]:
        return shard_transport.checkpoint_pieces(self.by_param, state)

    def part_to_send(self, state: Dict[torch.Tensor, dict]) -> dict:
        return shard_transport.part_to_send(self.by_param, state)

    def gather_parts(self, part: dict, group, to: Optional[int] = None, *,
                     chunk_bytes: int = 0) -> Optional[List[dict]]:
        return shard_transport.gather_parts(part, group, to, chunk_bytes=chunk_bytes)

    def whole_state(self, parts: Sequence[dict], cpu_offload: bool = False
                    ) -> Dict[torch.Tensor, dict]:
        return shard_transport.whole_state(self.params, parts, cpu_offload)


# ------------------------------------------------------- the ways of gathering
@dataclass(frozen=True)
class _Gathering:
    """What every way of gathering reads, the same for all buckets."""

    plan: BucketPlan
    targets: List[torch.Tensor]  # the parameters, detached, in plan order
    group: object
    world_size: int
    backend: str
    owned: List[Tuple[int, int]]  # per bucket, the elements this rank sends
    tree_shares: Optional[List[TreeShare]]
    adasum_local_size: Optional[int]
    levels: Optional[list]  # the node-aware levels the parts come back over


class _BufferGather:
    """A bucket gathered into its flat buffer (in place: this rank sends its
    own slot of it), then written into the parameters by one unflatten
    launch; ``start`` is each way's collective."""

    def __init__(self, gathering: _Gathering, bucket: Bucket, shards: List[ParamShard],
                 held) -> None:
        self.gathering, self.bucket, self.shards, self.held = gathering, bucket, shards, held
        self.send: Optional[torch.Tensor] = None
        self._send_slices: List[torch.Tensor] = []

    def prepare(self) -> None:
        """Give the buffer memory and copy this rank's stepped tensors into
        the slot it sends."""
        flat = self.held.take()
        if self.send is None:
            self.send = flat[slice(*self.gathering.owned[self.bucket.index])]
            self._send_slices = [self.send[s.range.offset:s.range.offset + s.range.numel]
                                 for s in self.shards]
        if self.shards:
            with torch.no_grad():
                torch._foreach_copy_(self._send_slices,
                                     [s.tensor.reshape(-1) for s in self.shards])

    def start(self) -> Optional[PendingBucket]:
        """Start the bucket's collective; None: nothing to gather or write."""
        raise NotImplementedError

    def finish(self, pending: PendingBucket) -> None:
        """Wait for the collective, write the bucket into the parameters and
        give the buffer back (its memory, where it is released between uses)."""
        wait_for(pending)
        self.gathering.plan.unflatten(pending.bucket, pending.flat, self.gathering.targets,
                                      backend=self.gathering.backend)
        self.held.done()


class _OneRank(_BufferGather):
    def start(self) -> Optional[PendingBucket]:
        return PendingBucket(self.bucket, self.send, None)


class _TreeSwaps(_BufferGather):
    def start(self) -> Optional[PendingBucket]:
        # point-to-point swaps that each wait: done here, written at once or deferred
        g = self.gathering
        adasum_gather(self.held.tensor, g.tree_shares[self.bucket.index], g.group,
                      g.adasum_local_size)
        return PendingBucket(self.bucket, self.held.tensor, None)


class _AllGather(_BufferGather):
    def start(self) -> Optional[PendingBucket]:
        if not self.bucket.size:
            return None
        work = start_all_gather(self.held.tensor, self.send, self.gathering.group)
        return PendingBucket(self.bucket, self.held.tensor, work)


class _LevelGathers(_BufferGather):
    """The node-aware sharded step's parts, out of rank order: gathered
    across nodes, then inside the node (``node_scatter``)."""

    def start(self) -> Optional[PendingBucket]:
        if not self.bucket.size:
            return None
        work = start_level_gathers(self.held.tensor, self.gathering.levels)
        return PendingBucket(self.bucket, self.held.tensor, work)


class _SlotBroadcasts(_BufferGather):
    def start(self) -> Optional[PendingBucket]:
        if not self.bucket.size:
            return None
        work = broadcast_slots(self.held.tensor, self.gathering.group, self.gathering.world_size)
        return PendingBucket(self.bucket, self.held.tensor, work)


class _DirectBroadcasts(_BufferGather):
    """A bucket broadcast straight into the parameters: each range of each
    rank's part from the parameter's own memory (``pieces``, ``(owner,
    elements)``); nothing to unflatten."""

    def __init__(self, gathering: _Gathering, bucket: Bucket, shards: List[ParamShard],
                 pieces: List[Tuple[int, torch.Tensor]]) -> None:
        super().__init__(gathering, bucket, [s for s in shards if s.master], None)
        self.pieces = pieces

    def prepare(self) -> None:
        """Copy the master copies into their parameters, as the unflatten of
        the gathered buffer would write them (one dtype in the bucket: the
        same single rounding)."""
        if self.shards:
            with torch.no_grad():
                torch._foreach_copy_([s.slice_of(s.param.detach()) for s in self.shards],
                                     [s.tensor for s in self.shards])

    def start(self) -> Optional[PendingBucket]:
        return PendingBucket(self.bucket, None, broadcast_from(self.pieces, self.gathering.group))

    def finish(self, pending: PendingBucket) -> None:
        wait_for(pending)


def _gather_ways(params: ShardedParameters, parameter_gather: Optional[str]
                 ) -> Tuple[list, List[_BufferGather], List[_BufferGather]]:
    """Per bucket: its held all-gather buffer, the way it is gathered in
    ``step()`` and the way when the gather is deferred (the same, but for
    direct broadcasts, which would write the parameters while code before the
    next forward may read them).

    The buffers are kept over the reducer's memory, or with
    ``shard_gradients`` made for each gather and released once the bucket is
    written into the parameters."""
    reducer = params.reducer
    targets = [p.detach() for p in reducer.plan_tensors()]
    gathering = _Gathering(params.plan, targets, params.group, params.world_size,
                           reducer.backend, list(reducer.owned), reducer.tree_shares,
                           reducer.adasum_local_size, reducer.gather_levels)
    direct_mean_numel = None  # the mean tensor size gathered straight into the parameters
    if params.world_size == 1:
        way = _OneRank
    elif reducer.tree_shares is not None:
        way = _TreeSwaps
    elif reducer.gather_levels is not None:
        way = _LevelGathers
    else:
        if parameter_gather is None:
            # gloo's all-gather copies through a temporary of the whole buffer and
            # was slower than one broadcast per rank (see broadcast_slots)
            gloo = dist.get_backend(params.group) == dist.Backend.GLOO
            parameter_gather = "broadcast" if gloo else "all_gather"
        way = _AllGather if parameter_gather == "all_gather" else _SlotBroadcasts
        if way is _SlotBroadcasts:
            direct_mean_numel = 0 if parameter_gather == "broadcast_direct" \
                else DIRECT_MEAN_NUMEL
    held = [_held_buffer(reducer, bucket, exact_common_dtype(
                params.plan.specs[slot].dtype for slot in bucket.tensor_indices))
            for bucket in params.plan.buckets]
    deferred = [way(gathering, bucket, params.per_bucket[bucket.index], held[bucket.index])
                for bucket in params.plan.buckets]
    now = list(deferred)
    if direct_mean_numel is not None:
        for bucket in params.plan.buckets:
            pieces = _direct_pieces(params.plan, bucket, targets, params.world_size,
                                    direct_mean_numel)
            if pieces is not None:
                now[bucket.index] = _DirectBroadcasts(gathering, bucket,
                                                      params.per_bucket[bucket.index], pieces)
    return held, now, deferred


def _held_buffer(reducer, bucket: Bucket, dtype: torch.dtype):
    """Bucket ``bucket``'s all-gather buffer: over the reducer's buffer and
    kept, or with ``shard_gradients`` its own, made for each gather."""
    def new() -> torch.Tensor:
        return torch.empty(bucket.size, dtype=dtype, device=bucket.device)
    if reducer.shard_gradients:
        return ReleasedBuffer(new)
    buffer = reducer.buffers[bucket.index]
    flat = None if buffer is None else reinterpret(buffer, dtype, bucket.size)
    return KeptBuffer(new() if flat is None else flat)


def _direct_pieces(plan: BucketPlan, bucket: Bucket, targets: List[torch.Tensor],
                   world_size: int, mean_numel: int) -> Optional[List[Tuple[int, torch.Tensor]]]:
    """The ``(owner, elements)`` broadcasts that gather ``bucket`` straight
    into the parameters, each range of each rank's part from the
    parameter's own memory; None where the bucket is gathered through its
    buffer (mixed dtypes, a non-contiguous parameter, or tensors of fewer
    than ``mean_numel`` elements on average: see ``DIRECT_MEAN_NUMEL``)."""
    slots = bucket.tensor_indices
    if not slots or sum(bucket.numels) < mean_numel * len(slots) \
            or len({plan.specs[slot].dtype for slot in slots}) > 1 \
            or not all(targets[slot].is_contiguous() for slot in slots):
        return None
    return [(rank, targets[r.tensor].view(-1)[r.start:r.end])
            for rank in range(world_size) for r in part_ranges(bucket, rank)]

