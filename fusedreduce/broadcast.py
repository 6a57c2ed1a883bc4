"""Broadcast through fused buckets: tensors, a module's parameters, optimizer state.

``broadcast_tensors`` is the mechanism: floating tensors flattened into
buckets of their own dtype, one ``broadcast`` per bucket, unflattened (no
cast, so the copy is exact). ``PackedBroadcast`` is the same for a set of
small tensors broadcast again and again (``DistributedOptimizer``'s
``buffers``): their bytes packed into one kept buffer, one ``broadcast`` per
call whatever their dtypes. ``parameter_broadcast`` is the PyTorch
counterpart of MindSpore's ``parameter_broadcast(net, layout, cur_rank,
initial_rank)``; ``broadcast_optimizer_state`` follows Horovod's: ranks whose
optimizer has no state yet (nothing stepped) receive the source's full state.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from ._checks import check_bool, check_distinct, check_instance, tensor_list
from .buckets import BucketPlan
from .process_group import (check_rank, comm_device, global_rank, refuse_one_shot_in_capture,
                            require_process_group, verify_same_on_all_ranks)


def dense_tensors(value, name: str) -> List[torch.Tensor]:
    """``value`` as a list of dense tensors that hold data.

    Raises:
        TypeError: not an iterable of tensors, or a sparse one (naming
            ``name`` and the index).
        ValueError: a meta tensor (it has no data to send or receive).
    """
    tensors = tensor_list(value, name)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}[{i}] is a {t.layout} tensor; only dense tensors can "
                            f"be broadcast")
        if t.is_meta:
            raise ValueError(f"{name}[{i}] is a meta tensor: it holds no data to broadcast")
    return tensors


def _labels(names, count: int) -> List[str]:
    """``names`` checked: one string per tensor."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a list of strings, one per tensor, got "
                        f"{type(names).__name__}")
    labels = list(names)
    if len(labels) != count or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"names must hold one string per tensor ({count}), got {labels!r}")
    return labels


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, *,
                      group: Optional[dist.ProcessGroup] = None,
                      bucket_cap_mb: float = 25.0, backend: str = "auto",
                      verify: bool = True, names: Optional[Sequence[str]] = None) -> None:
    """Make every rank's ``tensors`` bitwise equal to those of ``group``'s rank ``src``, in place.

    Floating tensors go through fused buckets of their own dtype (one
    ``broadcast`` per bucket, no cast, so the copy is exact); other dtypes
    (integer and bool buffers, say) are packed per dtype with torch and
    broadcast once per dtype. Tensors on a device the backend cannot use
    (CPU tensors under NCCL) travel through a staging copy.

    ``src`` is a rank of ``group`` (its group rank, as every rank fusedreduce
    takes; the same as the global rank for the default group). With
    ``verify`` (the default), one small all-reduce first checks that every
    rank passes the same shapes and dtypes, the same ``src`` and the same
    bucket cap; ``names`` (one per tensor) label the first mismatch in the
    error.

    Raises:
        RuntimeError: torch.distributed is not initialised; with ``verify``:
            the ranks' tensor lists, ``src`` or bucket layouts differ (raised
            on every rank before any broadcast); called during CUDA graph
            capture.
        TypeError: ``tensors`` is not an iterable of dense tensors, ``verify``
            not a bool, ``names`` not a list of strings.
        ValueError: ``src`` is not a rank of ``group``; a meta tensor;
            ``names`` not one per tensor; an unknown ``backend``.

    Examples:
        >>> broadcast_tensors([p.data for p in model.parameters()], src=0)   # doctest: +SKIP
    """
    tensors = dense_tensors(tensors, "tensors")
    check_bool(verify, "verify")
    kernels.check_backend(backend)
    labels = [f"tensors[{i}]" for i in range(len(tensors))] if names is None \
        else _labels(names, len(tensors))
    refuse_one_shot_in_capture(tensors, "broadcast_tensors")
    world_size = require_process_group(group)
    check_rank(src, "src", world_size)
    src_global = global_rank(group, src)
    device = comm_device(group)
    floating = [t for t in tensors if t.dtype in kernels.SUPPORTED_DTYPES]
    others = [t for t in tensors if t.dtype not in kernels.SUPPORTED_DTYPES]
    staged = [t if t.device == device else t.to(device) for t in floating]
    plan = BucketPlan(staged, bucket_cap_mb=bucket_cap_mb)
    if world_size == 1:
        return  # every tensor is rank src's already: nothing to send or copy
    if verify:
        # src is compared too: ranks naming different sources would each
        # send, and wait for one another until the collective timeout
        verify_same_on_all_ranks(
            [(tuple(t.shape), str(t.dtype)) for t in tensors],
            [f"{label} {tuple(t.shape)} {t.dtype}" for label, t in zip(labels, tensors)],
            group, what="tensor", bucket_layout=plan.layout(), options=[("src", src)],
            bucket_layout_hint="pass the same bucket_cap_mb on every rank")
    with torch.no_grad():
        for bucket in plan.buckets:
            buffer = plan.flatten(bucket, staged, backend=backend)
            dist.broadcast(buffer, src_global, group=group)
            plan.unflatten(bucket, buffer, staged, backend=backend)
        for t, s in zip(floating, staged):
            if s is not t:
                t.copy_(s)
        for dtype in sorted({t.dtype for t in others}, key=str):
            same = [t for t in others if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1).to(device) for t in same])
            dist.broadcast(flat, src_global, group=group)
            start = 0
            for t in same:
                t.copy_(flat[start:start + t.numel()].view(t.shape))
                start += t.numel()


class PackedBroadcast:
    """Make ``tensors`` (any dtypes and devices) equal to group rank ``src``'s
    at every call: rank ``src`` packs their bytes into one kept buffer, one
    ``broadcast`` sends it, the other ranks unpack it. Bitwise exact (bytes
    are copied, never cast), one collective whatever the dtypes (BatchNorm's
    float statistics and int64 counters travel together), two multi-tensor
    copies and no host work beyond the calls. Building it communicates
    nothing: the caller checks that every rank passes the same shapes and
    dtypes (``description()`` for ``verify_same_on_all_ranks``) before the
    first call.

    Raises:
        TypeError: ``tensors`` is not an iterable of dense tensors (naming
            ``name`` and the index).
        ValueError: a tensor appears twice; ``src`` is not a rank of ``group``.

    Examples:
        >>> sync = PackedBroadcast(model.buffers(), name="buffers")   # doctest: +SKIP
        >>> sync()   # every rank's buffers are rank 0's                # doctest: +SKIP
    """

    #: each tensor's bytes start at a multiple of this, so that its slice of
    #: the byte buffer can be viewed in its own dtype (complex128: 16 bytes)
    ALIGN = 16

    def __init__(self, tensors: Iterable[torch.Tensor], src: int = 0, *,
                 group: Optional[dist.ProcessGroup] = None, name: str = "tensors") -> None:
        self.tensors: List[torch.Tensor] = dense_tensors(tensors, name)
        check_distinct(self.tensors, name)
        world_size = require_process_group(group)
        check_rank(src, "src", world_size)
        self.name, self.group = name, group
        #: whether a call communicates (another rank, and something to send)
        self.communicates = world_size > 1 and bool(self.tensors)
        self._src = global_rank(group, src)
        self._sends = dist.get_rank(group) == src
        sizes = [t.numel() * t.element_size() for t in self.tensors]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // self.ALIGN) * self.ALIGN)
        #: the bytes that travel (kept: allocated once)
        self.buffer = torch.empty(starts[-1], dtype=torch.uint8, device=comm_device(group))
        self._views = [self.buffer[start:start + size].view(t.dtype).view(t.shape)
                       for t, start, size in zip(self.tensors, starts, sizes)]

    def description(self) -> List[tuple]:
        """What every rank must agree on before the first call: each tensor's
        shape and dtype (the bytes each rank sends or expects follow)."""
        return [(tuple(t.shape), str(t.dtype)) for t in self.tensors]

    def names(self) -> List[str]:
        """How an error names each tensor."""
        return [f"{self.name}[{i}] {tuple(t.shape)} {t.dtype}"
                for i, t in enumerate(self.tensors)]

    def __call__(self) -> None:
        """Copy group rank ``src``'s tensors into every rank's (collective)."""
        if not self.communicates:
            return
        with torch.no_grad():
            if self._sends:
                torch._foreach_copy_(self._views, self.tensors)
            dist.broadcast(self.buffer, self._src, group=self.group)
            if not self._sends:
                torch._foreach_copy_(self.tensors, self._views)


def parameter_broadcast(
    module: torch.nn.Module,
    layout: Optional[Dict[str, Any]] = None,
    cur_rank: Optional[int] = None,
    initial_rank: int = 0,
    *,
    src: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    buffers: bool = True,
    bucket_cap_mb: float = 25.0,
) -> None:
    """Copy ``module``'s parameters (and buffers) from the source rank to all ranks.

    One broadcast per fused bucket; afterwards every rank's tensors are bitwise
    equal to the source's, whatever their dtype.

    Args:
        module: the module whose parameters are overwritten in place.
        layout: a dict keyed by parameter name (values are ignored): only these
            parameters are broadcast (MindSpore's parallel layout dict).
            Default: all parameters.
        cur_rank: this process's rank in ``group``, as a check (MindSpore's
            argument); default: not checked.
        initial_rank: the first rank of the (pipeline) group, the default source.
        src: the source rank within ``group``; default ``initial_rank``.
        group: the process group; default: the world.
        buffers: also broadcast the module's buffers (BatchNorm statistics...)
            when no ``layout`` restricts the broadcast.
        bucket_cap_mb: the byte cap of a fused bucket, in MiB.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module`` (a list of tensors
            goes to ``broadcast_tensors``); ``layout`` is a string or not
            iterable. Raised first, even without a process group.
        RuntimeError: torch.distributed is not initialised; the ranks' modules
            differ in their parameters' (or buffers') names order, shapes or
            dtypes, or the source rank or ``bucket_cap_mb`` differs (raised on
            every rank, naming the first mismatch, before anything is
            broadcast); called during CUDA graph capture.
        ValueError: ``cur_rank`` is not this process's rank; ``initial_rank``
            or ``src`` is not a rank of ``group``; a ``layout`` name is not in
            ``module.named_parameters()``. Raised before any communication.

    Examples:
        >>> parameter_broadcast(model)            # rank 0's weights everywhere  # doctest: +SKIP
    """
    check_instance(module, "module", torch.nn.Module, "a torch.nn.Module",
                   hint="; for tensors (a list, model.parameters()) use "
                        "fusedreduce.broadcast_tensors(tensors, src)")
    if layout is not None and (isinstance(layout, (str, torch.Tensor))
                               or not isinstance(layout, Iterable)):
        raise TypeError(f"layout must be a dict keyed by parameter name, got "
                        f"{type(layout).__name__}")
    refuse_one_shot_in_capture(module.parameters(), "parameter_broadcast")
    world_size = require_process_group(group)
    rank = dist.get_rank(group)
    if cur_rank is not None and cur_rank != rank:
        raise ValueError(f"cur_rank={cur_rank!r} is not this process's rank ({rank})")
    for name, value in (("initial_rank", initial_rank), ("src", src)):
        if value is not None:
            check_rank(value, name, world_size)
    named = dict(module.named_parameters())
    if layout is not None:
        unknown = [n for n in layout if n not in named]
        if unknown:
            raise ValueError(f"layout names parameters not in module.named_parameters(): "
                             f"{unknown[:5]}")
        chosen = [(n, named[n]) for n in named if n in layout]
    else:
        chosen = list(named.items())
        if buffers:
            chosen += [(f"buffer {n}", b) for n, b in module.named_buffers()]
    source = initial_rank if src is None else src
    with torch.no_grad():
        broadcast_tensors([t.data for _, t in chosen], source, group=group,
                          bucket_cap_mb=bucket_cap_mb, names=[n for n, _ in chosen])


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int = 0,
                              group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every rank rank ``src``'s optimizer state and hyperparameters.

    The state's tensors are fused per dtype (one broadcast per bucket), the
    rest (scalars, hyperparameters, the structure) goes with one object
    broadcast. Works when other ranks have no state yet: they receive the
    source's full state, loaded with ``optimizer.load_state_dict``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (its
            parameters or ``param_groups``, say). Raised first, even without a
            process group.
        RuntimeError: torch.distributed is not initialised; called during CUDA
            graph capture.
        ValueError: ``src`` is not a rank of the group; the ranks pass
            different ``src`` ranks, or their optimizers differ in parameter
            groups (raised on every rank, before any broadcast).

    Examples:
        >>> broadcast_optimizer_state(optimizer, src=0)          # doctest: +SKIP
    """
    check_instance(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
    refuse_one_shot_in_capture((p for g in optimizer.param_groups for p in g["params"]),
                               "broadcast_optimizer_state")
    world_size = require_process_group(group)
    check_rank(src, "src", world_size)
    rank = dist.get_rank(group)
    global_src = global_rank(group, src)
    state_dict = optimizer.state_dict()
    # the source describes its state: tensors become (shape, dtype) placeholders
    skeleton = None
    if rank == src:
        skeleton = copy.copy(state_dict)
        skeleton["state"] = {k: {name: _placeholder(v) for name, v in entry.items()}
                             for k, entry in state_dict["state"].items()}
    sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    everyone: List[Any] = [None] * world_size
    # src is gathered too: ranks naming different sources would each wait in
    # a broadcast the others never join
    dist.all_gather_object(everyone, (src, sizes), group=group)
    sources = [s for s, _ in everyone]
    if any(s != src for s in sources):
        raise ValueError(f"the ranks passed different src ranks (by rank: {sources}): every "
                         f"rank must name the same source")
    if any(theirs != sizes for _, theirs in everyone):
        raise ValueError(f"the ranks' optimizers have different parameter groups (parameters "
                         f"per group, by rank: {[s for _, s in everyone]})")
    holder = [skeleton]
    dist.broadcast_object_list(holder, src=global_src, group=group)
    skeleton = holder[0]
    devices = _param_devices(optimizer)
    if rank == src:
        received = state_dict
    else:
        received = copy.copy(skeleton)
        received["state"] = {k: {name: _materialize(v, devices.get(k)) for name, v in entry.items()}
                             for k, entry in skeleton["state"].items()}
    tensors = [v for k in sorted(received["state"]) for _, v in sorted(received["state"][k].items())
               if isinstance(v, torch.Tensor)]
    # the shapes come from the source's skeleton: nothing left to verify
    broadcast_tensors(tensors, src, group=group, verify=False)
    if rank != src:
        optimizer.load_state_dict(received)


class _TensorPlaceholder:
    """Shape, dtype and device kind of a state tensor, sent instead of its data."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.on_cpu = tuple(t.shape), t.dtype, t.device.type == "cpu"


def _placeholder(value):
    return _TensorPlaceholder(value) if isinstance(value, torch.Tensor) else value


def _materialize(value, device):
    if isinstance(value, _TensorPlaceholder):
        where = torch.device("cpu") if value.on_cpu or device is None else device
        return torch.empty(value.shape, dtype=value.dtype, device=where)
    return value


def _param_devices(optimizer) -> Dict[int, torch.device]:
    devices, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            devices[index] = p.device
            index += 1
    return devices
