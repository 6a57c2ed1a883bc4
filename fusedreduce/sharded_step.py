"""The sharded step behind ``DistributedOptimizer(shard=True)`` (ZeRO-1/2 on
the fused buckets): each rank steps its part of every bucket, then the parts
are gathered into every rank's parameters.

``ShardedStep`` owns the ``ShardedGradReducer`` (a plan over every
parameter, frozen ones too: freezing must not move the layout the state
sits on), the ``ShardedParameters`` that step this rank's part, gather it
and write the parameters back, and the checkpoint group the collective
checkpoint calls meet on. ``add_param_group`` lays the buckets out anew
and moves the state to its new owners. The step itself is
``ShardedParameters.step`` then ``ShardedParameters.gather``
(``sharded_params``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch

from .buckets import FlatBuffers, storage_bytes
from .join_scaling import FollowedScaler, ScalerHand, scaler_slots
from .optimizer_checkpoint import ShardedCheckpoint, state_gather
from .param_swap import params_of
from .sharded import ShardLayout
from .sharded_optimizer import ShardedGradReducer, ShardedParameters
from .torch_clip import track as track_torch_clip
from .uneven_inputs import agree_hyperparameters, in_join, someone_ran_out


class ShardedStep(ShardedCheckpoint):
    """The step of a ``DistributedOptimizer(shard=True)``.

    ``options`` is the optimizer's checked options
    (``optimizer_options.OptimizerOptions``); the reducer is hooked on
    construction, the parameters are taken over by ``start`` (after the
    broadcast that makes them equal: the masters are taken from them).
    """

    #: whether the last ``step`` skipped, as a GradScaler that found an inf
    #: skips it (inside ``Join``, where every rank must reach ``step``)
    skipped = False

    def __init__(self, opt: torch.optim.Optimizer, options) -> None:
        self.options = options
        self.trainable: List[torch.Tensor] = [p for p in params_of(opt) if p.requires_grad]
        self.sharded: Optional[ShardedParameters] = None
        self.state_gather = None
        self.reducer: ShardedGradReducer = self._hooked_reducer(opt)
        # torch's clip_grad_norm_ left in the loop must take the whole
        # gradient's norm; alone, a rank holds the whole gradient already
        self._follow_torch_clip = track_torch_clip if options.world_size > 1 else _untracked

    def _hooked_reducer(self, opt: torch.optim.Optimizer) -> ShardedGradReducer:
        """The sharded plan over every parameter, hooked."""
        options = self.options
        args = dict(options.reducer_args)
        mean = args.pop("mean", False)
        # AdaSum's local_size is its tree's; the others' go to the reducer's node options
        local_size = args.pop("local_size") if options.reduce_method == "adasum" else None
        args["split_norm"] = False  # the sharded norm reads each rank's part already
        reducer = ShardedGradReducer(params_of(opt), mean=mean, adasum_local_size=local_size,
                                     shard_gradients=options.shard_gradients,
                                     gradient_collective=options.gradient_collective, **args)
        options.follow_unused(reducer)
        return reducer.register_hooks(options.backward_passes_per_step)

    def connect(self) -> None:
        """The checkpoint group (made where every rank is: making a group is
        collective), in how ``full_state`` gathers (``state_gather``)."""
        self.state_gather = state_gather(self.options.group, self.options.world_size,
                                         self.options.checkpoint_timeout)

    def start(self, opt: torch.optim.Optimizer) -> None:
        """This rank's slices of the (broadcast) parameters, and its part of
        the state."""
        self._take_shards(opt, opt.state)
        self._follow_torch_clip(opt)

    def _take_shards(self, opt: torch.optim.Optimizer, full_state) -> None:
        """This rank's slices of the parameters, and its part of ``full_state``
        (per-parameter state, keyed by parameter)."""
        options = self.options
        self.sharded = ShardedParameters(params_of(opt), self.reducer, options.master_dtype,
                                         options.group, options.parameter_gather)
        self.reducer.before_communicating = self.sharded.finish_gather
        opt.state = self.sharded.take_state(full_state)

    def rehook(self) -> None:
        self.reducer.rehook()  # the layout stays: the state sits on it

    def follow(self, opt: torch.optim.Optimizer, now: List[torch.Tensor]) -> None:
        """The trainable parameters are ``now``: the layout covers frozen
        parameters too, and the last backward read every gradient there was
        when it ended, so only the hooks change."""
        self.trainable = now
        self.rehook()

    def add_param_group(self, opt: torch.optim.Optimizer, add: Callable[[], None]) -> None:
        """``add()`` adds the group; the buckets are laid out anew over all the
        parameters and the state moves to its new owners (collective)."""
        if self.reducer.reduced and any(p.grad is not None for p in params_of(opt)):
            raise RuntimeError(
                "add_param_group() called between a backward pass and step() with shard=True: "
                "the reduced gradients are laid out for the current parameters; call it after "
                "step() (or after zero_grad())")
        self.finish_param_gather()
        full_state = self.full_state(opt, "DistributedOptimizer.add_param_group() with shard=True",
                                     "Call it on every rank alike")
        add()
        self.trainable = [p for p in params_of(opt) if p.requires_grad]
        self.reducer.remove_hooks()
        self.reducer = self._hooked_reducer(opt)
        self._take_shards(opt, full_state)

    def step(self, opt: torch.optim.Optimizer, wrapped, closure,
             check_reduced: Callable[[], None], shadow: bool = False):
        """The closure's backward, then this rank's part stepped
        (``ShardedParameters.step``) and gathered into the parameters.
        Inside ``Join``, once a rank has run out of data, the ranks first
        agree on the groups' hyperparameters and their GradScaler's state
        (``shadow``: this rank ran out and takes the others'); a step whose
        GradScaler found an inf is skipped there on every rank, and the
        gradients are unscaled here (``join_scaling``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_reduced()
        self.skipped = False
        joined = in_join(opt)  # a shadow step runs inside Join too
        scaling = ScalerHand(opt) if joined and not shadow else None
        try:
            if joined:
                if shadow or someone_ran_out(opt):
                    values = agree_hyperparameters(
                        opt, has_data=not shadow, extra=scaler_slots(opt, scaling, opt.join_device))
                    if shadow:
                        scaling = FollowedScaler(opt, values)
                        scaling.update()
                if scaling.skips():
                    self.skipped = True
                    return loss
                scaling.unscale()
            self.sharded.finish_gather()
            self.sharded.refresh_masters()
            self.sharded.step(opt, wrapped.step)
            self.sharded.gather(defer=self.options.overlap_param_gather)
        finally:
            if scaling is not None:
                scaling.restore()
        return loss

    def clip_grad_norm_(self, with_grads: List[torch.Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
        """The norm over the ranks' shares (one scalar all-reduce), each
        share scaled by the same coefficient."""
        grads = [p.grad for p in with_grads]
        total = self.sharded.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                f"cannot be clipped (error_if_nonfinite=True)")
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return total

    def finish_param_gather(self) -> None:
        if self.sharded is not None:
            self.sharded.finish_gather()

    def reload_master_weights(self) -> None:
        if self.sharded is not None:
            self.sharded.finish_gather()
            self.sharded.refresh_masters(everything=True)

    @property
    def param_gather_in_flight(self) -> bool:
        return self.sharded is not None and self.sharded.gathering

    @property
    def layout(self) -> ShardLayout:
        return self.reducer.layout

    @property
    def flat_buffers(self) -> FlatBuffers:
        held = self.reducer.flat_buffers
        if self.sharded is None:
            return held
        return dataclasses.replace(held, gathers=tuple(self.sharded.gathers))

    @property
    def buffer_bytes(self) -> int:
        held = self.reducer.held_tensors()
        if self.sharded is not None:
            held += self.sharded.held_buffers()
        return storage_bytes(held)

    def steps_here(self, param: torch.Tensor) -> bool:
        """Whether this rank steps elements of ``param``."""
        return param in self.sharded.by_param

    def locally_stepped(self, opt: torch.optim.Optimizer) -> List[torch.Tensor]:
        """What a local step changes: this rank's slices and masters (the
        deferred gathers finished first, the masters refreshed)."""
        self.sharded.finish_gather()
        self.sharded.refresh_masters()
        return [s.tensor for s in self.sharded.by_param.values()]

    def step_locally(self, opt: torch.optim.Optimizer, wrapped) -> None:
        """The wrapped optimizer's step on this rank's part, nothing gathered."""
        self.sharded.step(opt, wrapped.step)


def _untracked(opt: torch.optim.Optimizer) -> None:
    """A world of one rank: torch's ``clip_grad_norm_`` reads the whole
    gradient as it is."""
