"""The replicated step behind ``DistributedOptimizer``: every rank holds the
whole reduced gradient, the whole state, and runs the wrapped optimizer's
step on all of it.

``ReplicatedStep`` owns the reducer (a ``DistributedGradReducer`` or an
``AdaSumReducer``, over the trainable parameters), rebuilds it when the
trained set changes (``follow``, ``add_param_group``: a parameter newly
unfrozen after this step's backward is reduced on the spot), and runs the
step (the closure's backward reduces inside the wrapped optimizer's step).
``ShardedStep`` (``sharded_step``) is the other strategy; the optimizer
builds one of them (``optimizer_options.build_step``).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .buckets import FlatBuffers, storage_bytes
from .optimizer_checkpoint import ReplicatedCheckpoint
from .param_swap import params_of
from .reducer import DistributedGradReducer


class ReplicatedStep(ReplicatedCheckpoint):
    """The step of a ``DistributedOptimizer`` without ``shard``.

    ``options`` is the optimizer's checked options
    (``optimizer_options.OptimizerOptions``); the reducer is hooked on
    construction.
    """

    sharded = None
    layout = None
    param_gather_in_flight = False

    def __init__(self, opt: torch.optim.Optimizer, options) -> None:
        self.options = options
        self.trainable: List[torch.Tensor] = [p for p in params_of(opt) if p.requires_grad]
        self.reducer: DistributedGradReducer = self._hooked_reducer()

    def _hooked_reducer(self) -> DistributedGradReducer:
        options = self.options
        reducer = options.reducer_class(self.trainable, **options.reducer_args)
        options.follow_unused(reducer)
        return reducer.register_hooks(options.backward_passes_per_step,
                                      gradient_as_bucket_view=options.gradient_as_bucket_view)

    def connect(self) -> None:
        """Nothing to connect: no checkpoint call communicates."""

    def start(self, opt: torch.optim.Optimizer) -> None:
        """Nothing to take over: the wrapped optimizer steps the parameters."""

    def rehook(self) -> None:
        """Reduce ``self.trainable`` from the next backward on (a new reducer;
        the old one's hooks are removed)."""
        reduced, loss_scale = self.reducer.reduced, self.reducer.loss_scale
        self.reducer.remove_hooks()
        self.reducer = self._hooked_reducer()
        self.reducer.loss_scale = loss_scale
        if reduced:
            self.reducer.mark_reduced()

    def follow(self, opt: torch.optim.Optimizer, now: List[torch.Tensor]) -> None:
        """The trainable parameters are ``now``: reduce the gradients of newly
        trainable ones that the hooks did not see (this step's), and hook
        the new set from the next backward on."""
        hooked = {id(p) for p in self.trainable}
        unseen = [p for p in now if id(p) not in hooked]
        self.trainable = now
        self.rehook()
        if unseen and self.reducer.reduced:
            # the backward of this step ran with the old hooks: reduce these now
            once = self.options.reducer_class(unseen, **self.options.reducer_args)
            grads = once([p.grad if p.grad is not None else torch.zeros_like(p) for p in unseen])
            for p, g in zip(unseen, grads):
                p.grad = g

    def add_param_group(self, opt: torch.optim.Optimizer, add: Callable[[], None]) -> None:
        """``add()`` adds the group; its trainable parameters join the reduction."""
        add()
        self.trainable = [p for p in params_of(opt) if p.requires_grad]
        self.rehook()

    def step(self, opt: torch.optim.Optimizer, wrapped, closure,
             check_reduced: Callable[[], None]):
        """The wrapped optimizer's step on the reduced gradients; the
        closure's backward reduces them, as often as the step calls it."""
        if closure is None:
            check_reduced()
            return wrapped.step()

        def reduced_closure():
            with torch.enable_grad():
                value = closure()
            check_reduced()
            return value
        return wrapped.step(reduced_closure)

    def clip_grad_norm_(self, with_grads: List[torch.Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
        """Every rank holds the whole reduced gradient: torch's function."""
        return torch.nn.utils.clip_grad_norm_(with_grads, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)

    def finish_param_gather(self) -> None:
        """No gather: the parameters are stepped in place."""

    def reload_master_weights(self) -> None:
        """No masters: the wrapped optimizer steps the parameters."""

    @property
    def flat_buffers(self) -> FlatBuffers:
        return self.reducer.flat_buffers

    @property
    def buffer_bytes(self) -> int:
        return storage_bytes(self.reducer.held_tensors())

    def steps_here(self, param: torch.Tensor) -> bool:
        """Whether this rank steps ``param``: every one."""
        return True

    def locally_stepped(self, opt: torch.optim.Optimizer) -> List[torch.Tensor]:
        """What a local step changes: the parameters with a gradient."""
        return [p for p in params_of(opt) if p.grad is not None]

    def step_locally(self, opt: torch.optim.Optimizer, wrapped) -> None:
        """The wrapped optimizer's step, nothing communicated."""
        wrapped.step()
