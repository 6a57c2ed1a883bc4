"""DistributedOptimizer: wrap any torch optimizer so that it steps on gradients
averaged (or summed) across ranks, reduced through fused buckets overlapped with
backward.

PyTorch counterpart of MegEngine's ``DistributedOptimizer`` (``reduce_method``,
``param_pack``/``param_pack_thd``, ``bcast_period``) with Horovod's
``backward_passes_per_step``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .collectives import broadcast_tensors, require_process_group
from .reducer import DistributedGradReducer


class DistributedOptimizer(torch.optim.Optimizer):
    """Make ``optimizer`` step on gradients reduced across the process group.

    The returned object *is* an instance of the wrapped optimizer's class (it
    takes over its parameter groups and state), so learning-rate schedulers,
    ``torch.amp.GradScaler``, ``state_dict()``/``load_state_dict()`` work as
    with the original. Use it instead of the original from then on.

    Gradients are reduced during ``loss.backward()``: each fused bucket's
    all-reduce starts as soon as its gradients are ready, and when backward
    returns every ``.grad`` holds the reduced gradient, bitwise identical on
    all ranks (so a GradScaler sees the same infs everywhere and skips the same
    steps). ``step()`` then runs the wrapped optimizer.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        reduce_method: ``"mean"`` or ``"sum"`` across ranks.
        group: the process group; default: the world.
        bcast_period: ``0``: broadcast the parameters from rank 0 once, now;
            ``k > 0``: also every ``k`` steps (restores diverged replicas);
            ``-1``: never.
        param_pack: fuse gradients into buckets (``False``: one all-reduce per
            gradient).
        param_pack_thd: the byte cap of a fused bucket.
        backward_passes_per_step: reduce on every this-many backward passes,
            accumulating locally in between (call ``step()`` after the last).
        reduce_dtype: the communication dtype (see ``DistributedGradReducer``).

    Raises:
        ValueError: ``reduce_method`` is not "sum" or "mean"; a bad
            ``bcast_period``, ``param_pack_thd`` or ``backward_passes_per_step``.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        RuntimeError: torch.distributed is not initialised.

    Example:
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()          # doctest: +SKIP
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        base = type(optimizer)
        if issubclass(base, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        # a class that is both this wrapper and the optimizer's own class, so
        # isinstance checks (schedulers, GradScaler) keep working
        combined = type(f"Distributed{base.__name__}", (cls, base), {})
        return object.__new__(combined)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reduce_method: str = "mean",
        group=None,
        bcast_period: int = 0,
        param_pack: bool = True,
        param_pack_thd: int = 10 * 1024 * 1024,
        backward_passes_per_step: int = 1,
        *,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        if reduce_method not in ("sum", "mean"):
            raise ValueError(f"reduce_method must be 'sum' or 'mean', got {reduce_method!r}")
        for name, value, low in (("bcast_period", bcast_period, -1),
                                 ("param_pack_thd", param_pack_thd, 1),
                                 ("backward_passes_per_step", backward_passes_per_step, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        require_process_group(group)
        self.__dict__.update(optimizer.__dict__)
        self.group = group
        self.reduce_method = reduce_method
        self.bcast_period = bcast_period
        self.backward_passes_per_step = backward_passes_per_step
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # param_pack=False: a one-byte cap puts every gradient in its own bucket
        cap_bytes = param_pack_thd if param_pack else 1
        self.reducer = DistributedGradReducer(
            params, mean=reduce_method == "mean", group=group, bucket_cap_mb=cap_bytes / 2 ** 20,
            reduce_dtype=reduce_dtype).register_hooks(backward_passes_per_step)
        self._steps = 0
        if bcast_period != -1:
            self.broadcast_parameters()

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy rank ``src``'s parameters to every rank (fused, bitwise exact)."""
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            broadcast_tensors([p.data for p in params], src, group=self.group)

    def step(self, closure=None):
        """Run the wrapped optimizer's step on the reduced gradients.

        Raises:
            RuntimeError: the gradients were not reduced: ``step()`` came after
                a backward pass that only accumulated (``backward_passes_per_step``
                > 1, or ``no_sync()``).
        """
        if closure is not None:
            raise RuntimeError("DistributedOptimizer.step does not take a closure: the "
                               "gradients are reduced during backward, before step()")
        has_grads = any(p.grad is not None for g in self.param_groups for p in g["params"])
        if has_grads and not self.reducer.reduced:
            raise RuntimeError(
                "step() called on gradients that were not reduced across ranks: call it "
                f"after every {self.backward_passes_per_step} backward pass(es), outside "
                f"no_sync()")
        loss = super().step()
        self.reducer.consume()
        self._steps += 1
        if self.bcast_period > 0 and self._steps % self.bcast_period == 0:
            self.broadcast_parameters()
        return loss

    def no_sync(self):
        """A context in which backward passes accumulate gradients locally."""
        return self.reducer.no_sync()
