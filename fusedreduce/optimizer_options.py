"""``DistributedOptimizer``'s options: checked in one place, kept as one
frozen record, and the one place the step strategy is chosen from them.

``check_options`` makes every check of the constructor (its ``Raises``), in
order, before anything of the wrapped optimizer is taken over, and returns
``OptimizerOptions``; ``build_step`` builds the step strategy from it:
``ShardedStep`` with ``shard=True``, else ``ReplicatedStep``, over the
reducer ``reduce_method`` names (``AdaSumReducer`` for AdaSum). The mode
flags (``shard``, AdaSum, the world size) are tested here and nowhere else
of the optimizer.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import kernels
from ._checks import check_bool, check_int
from .adasum import check_adasum_reduce_dtype
from .adasum_reducer import AdaSumReducer
from .broadcast import PackedBroadcast
from .checkpoint_group import check_timeout
from .clipping import check_clipping, check_split_norm
from .node_collectives import check_node_options
from .node_groups import check_local_size
from .param_swap import params_of
from .process_group import require_process_group, value_checksums, verify_same_on_all_ranks
from .reducer import DistributedGradReducer
from .replicated_step import ReplicatedStep
from .sharded_optimizer import (check_collectives, check_master_dtype, check_node_collectives,
                                check_shardable)
from .sharded_step import ShardedStep


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """The checked options of a ``DistributedOptimizer`` (see its docstring
    for each), and what follows from them: ``reducer_class`` and
    ``reducer_args`` (the reducer ``reduce_method`` names, and its
    arguments), ``world_size`` and ``rank`` (of ``group``), ``buffer_sync`` (the
    broadcast of ``buffers``), ``clips`` (a finite ``max_grad_norm``)."""

    group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    reduce_method: str
    bcast_period: int
    backward_passes_per_step: int
    reducer_class: type
    reducer_args: Mapping[str, Any]
    gradient_as_bucket_view: bool
    find_unused_parameters: bool
    shard: bool
    shard_gradients: bool
    master_dtype: torch.dtype
    overlap_param_gather: bool
    gradient_collective: Optional[str]
    parameter_gather: Optional[str]
    checkpoint_timeout: timedelta
    clips: bool
    buffer_sync: PackedBroadcast

    def follow_unused(self, reducer: DistributedGradReducer) -> None:
        """``find_unused_parameters`` on ``reducer``."""
        reducer.unused_grads_to_none = self.find_unused_parameters
        reducer.warn_missing = not self.find_unused_parameters


def buffer_sync_of(buffers, params, group) -> PackedBroadcast:
    """The broadcast that keeps ``buffers`` equal to group rank 0's
    (checked: a module, a non-tensor, a tensor twice or a parameter are
    refused before anything is taken over)."""
    if buffers is None:
        buffers = ()
    elif isinstance(buffers, torch.nn.Module):
        raise TypeError("buffers must be an iterable of tensors, got a "
                        f"{type(buffers).__name__} module: pass model.buffers()")
    sync = PackedBroadcast(buffers, 0, group=group, name="buffers")
    trained = {id(p) for p in params}
    for i, b in enumerate(sync.tensors):
        if id(b) in trained:
            raise ValueError(f"buffers[{i}] is one of the optimizer's parameters: pass "
                             f"model.buffers(), which the parameters are not part of")
    return sync


def check_options(
    optimizer: torch.optim.Optimizer, *, reduce_method: str,
    group: Optional[dist.ProcessGroup], bcast_period: int, param_pack: bool,
    param_pack_thd: int, backward_passes_per_step: int, reduce_dtype: torch.dtype,
    gradient_as_bucket_view: bool, local_size: int, wire_dtype: Optional[torch.dtype],
    deterministic: bool, error_feedback: bool, shard: bool, shard_gradients: bool,
    master_dtype: torch.dtype, assume_elementwise: bool, overlap_param_gather: bool,
    max_grad_norm: Optional[float], norm_type: Union[float, str], error_if_nonfinite: bool,
    find_unused_parameters: bool, split_norm: Optional[bool],
    buffers: Optional[Iterable[torch.Tensor]],
    checkpoint_timeout: Union[float, timedelta, None], gradient_collective: Optional[str],
    parameter_gather: Optional[str], backend: str,
) -> OptimizerOptions:
    """``DistributedOptimizer``'s arguments checked (its ``Raises``, in this
    order), as one record; nothing of ``optimizer`` is changed."""
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True or False, got {shard!r}")
    if not isinstance(shard_gradients, bool):
        raise TypeError(f"shard_gradients must be True or False, got {shard_gradients!r}")
    if not isinstance(find_unused_parameters, bool):
        raise TypeError(f"find_unused_parameters must be True or False, got "
                        f"{find_unused_parameters!r}")
    for name, value in (("param_pack", param_pack),
                        ("gradient_as_bucket_view", gradient_as_bucket_view),
                        ("assume_elementwise", assume_elementwise),
                        ("overlap_param_gather", overlap_param_gather)):
        check_bool(value, name)  # a string such as "False" would be true
    # its Raises holds with or without shard
    check_master_dtype(master_dtype)
    if shard:
        check_shardable(optimizer, assume_elementwise)
        if gradient_as_bucket_view:
            raise ValueError(
                "gradient_as_bucket_view=True does not combine with shard=True: the flat "
                "buffers are the reduce-scatter's input and the all-gather's output, and "
                "each .grad receives this rank's share in one write-back launch already")
    elif overlap_param_gather:
        raise ValueError("overlap_param_gather=True applies to shard=True only")
    elif checkpoint_timeout is not None:
        raise ValueError("checkpoint_timeout applies to shard=True only (without it no "
                         "checkpoint call communicates)")
    elif shard_gradients:
        raise ValueError("shard_gradients=True applies to shard=True only (the gradients "
                         "are sharded along the optimizer state)")
    if reduce_method not in ("sum", "mean", "adasum"):
        raise ValueError(f"reduce_method must be 'sum', 'mean' or 'adasum', got "
                         f"{reduce_method!r}")
    adasum = reduce_method == "adasum"
    check_collectives(gradient_collective, parameter_gather, shard=shard, adasum=adasum)
    kernels.check_backend(backend)
    check_int(bcast_period, "bcast_period", minimum=-1)
    check_int(param_pack_thd, "param_pack_thd")
    check_int(backward_passes_per_step, "backward_passes_per_step")
    max_grad_norm, norm_type = check_clipping(max_grad_norm, norm_type, error_if_nonfinite)
    check_split_norm(split_norm)
    timeout = check_timeout(checkpoint_timeout, "checkpoint_timeout")
    world_size = require_process_group(group)
    if adasum and (wire_dtype is not None or deterministic is not False
                   or error_feedback is not False):
        raise ValueError("wire_dtype, deterministic and error_feedback do not combine with "
                         "reduce_method='adasum' (AdaSum combines the gradients, it does not "
                         "sum them)")
    # AdaSum's local_size is its own (checked below)
    node = check_node_options(1 if adasum else local_size, wire_dtype, deterministic,
                              error_feedback, world_size=world_size, reduce_dtype=reduce_dtype)
    if shard:
        check_node_collectives(node, gradient_collective, parameter_gather,
                               world_size=world_size)
    buffer_sync = buffer_sync_of(buffers, params_of(optimizer), group)
    if adasum:
        # checked here too, before the optimizer's state is taken over
        check_local_size(local_size, world_size)
        check_adasum_reduce_dtype(reduce_dtype)
    # param_pack=False: a one-byte cap puts every gradient in its own bucket
    cap_bytes = param_pack_thd if param_pack else 1
    # the replicas are made equal by the optimizer (broadcast), or checked
    # there (bcast_period=-1): the reducers need not check them again
    reducer_args = dict(group=group, bucket_cap_mb=cap_bytes / 2 ** 20,
                        reduce_dtype=reduce_dtype, max_grad_norm=max_grad_norm,
                        norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                        split_norm=split_norm, initial_parameters="unchecked", backend=backend)
    if adasum:
        reducer_args["local_size"] = local_size
    else:
        reducer_args["mean"] = reduce_method == "mean"
        if not node.flat:
            reducer_args.update(local_size=local_size, wire_dtype=wire_dtype,
                                deterministic=deterministic, error_feedback=error_feedback)
    return OptimizerOptions(
        group=group, world_size=world_size,
        rank=dist.get_rank(group) if world_size > 1 else 0, reduce_method=reduce_method,
        bcast_period=bcast_period, backward_passes_per_step=backward_passes_per_step,
        reducer_class=AdaSumReducer if adasum else DistributedGradReducer,
        reducer_args=reducer_args, gradient_as_bucket_view=gradient_as_bucket_view,
        find_unused_parameters=find_unused_parameters, shard=shard,
        shard_gradients=shard_gradients, master_dtype=master_dtype,
        overlap_param_gather=bool(overlap_param_gather),
        gradient_collective=gradient_collective, parameter_gather=parameter_gather,
        checkpoint_timeout=timeout,
        # a finite clip under a GradScaler needs loss_scale
        clips=max_grad_norm is not None and max_grad_norm != float("inf"),
        buffer_sync=buffer_sync)


def check_ranks_agree(params, options: OptimizerOptions) -> None:
    """The ranks agree on ``bcast_period``, ``shard``, the shapes of the
    parameters and buffers, and with ``bcast_period=-1`` the parameters'
    values (raised on every rank; collective unless alone)."""
    if options.world_size == 1:
        return
    # before the first broadcast: a rank that skips it (-1), or
    # broadcasts at other steps or other buffers, would leave the
    # others waiting in a collective it never starts; so would a
    # rank alone making the sharded mode's checkpoint group. Without
    # a broadcast the replicas must be equal already: their
    # checksums ride in the same all-reduce
    sync, bcast_period = options.buffer_sync, options.bcast_period
    names = [f"parameters[{i}] {tuple(p.shape)} {p.dtype}" for i, p in enumerate(params)]
    verify_same_on_all_ranks(
        [(tuple(p.shape), str(p.dtype)) for p in params] + sync.description(),
        names + sync.names(), options.group, what="tensor",
        options=[("bcast_period", bcast_period), ("shard", options.shard)],
        values=value_checksums(params) if bcast_period == -1 else (),
        values_remedy="bcast_period=-1 skips the broadcast that makes the replicas "
                      "equal: pass bcast_period=0 (the default), or copy rank 0's "
                      "parameters first (fusedreduce.parameter_broadcast(model))")


def build_step(optimizer: torch.optim.Optimizer,
               options: OptimizerOptions) -> Union[ReplicatedStep, ShardedStep]:
    """The step strategy ``options`` ask for, its reducer hooked on
    ``optimizer``'s parameters (which the reducer checks, before any
    collective)."""
    if options.shard:
        return ShardedStep(optimizer, options)
    return ReplicatedStep(optimizer, options)
