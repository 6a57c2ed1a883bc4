"""Optimizer wrappers: the wrapped optimizer steps on data-parallel results.

- ``DistributedOptimizer``: gradients averaged (or summed) across ranks through
  fused buckets overlapped with backward. PyTorch counterpart of MegEngine's
  ``DistributedOptimizer`` (``reduce_method``, ``param_pack``/``param_pack_thd``,
  ``bcast_period``) with Horovod's ``backward_passes_per_step``.
- ``AdaSumByDeltaWeight``: each rank steps locally, then the weight deltas are
  combined with AdaSum. PyTorch counterpart of MindSpore's
  ``AdaSumByDeltaWeightWrapCell``, for any world size.

Both return an object that *is* an instance of the wrapped optimizer's class
(it takes over its parameter groups and state), so learning-rate schedulers,
``torch.amp.GradScaler`` and ``state_dict()``/``load_state_dict()`` work as with
the original.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import check_instance, check_int
from .adasum import (AdaSumReducer, adasum_allreduce, check_adasum_reduce_dtype,
                     check_local_size)
from .broadcast import broadcast_tensors
from .process_group import require_process_group
from .reducer import DistributedGradReducer


def _instance_of_both(wrapper: type, optimizer) -> object:
    """A bare instance of a class deriving from ``wrapper`` and ``optimizer``'s class."""
    check_instance(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
    base = type(optimizer)
    if issubclass(base, (DistributedOptimizer, AdaSumByDeltaWeight)):
        raise TypeError(f"optimizer is already wrapped ({base.__name__})")
    combined = type(f"{wrapper.__name__.removesuffix('Optimizer')}{base.__name__}",
                    (wrapper, base), {})
    return object.__new__(combined)


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

    The trained set may change between steps: ``add_param_group`` adds to
    the reduction (and broadcasts the new parameters unless ``bcast_period``
    is -1), and parameters frozen or unfrozen with ``requires_grad_`` are
    followed at the next ``step()`` (see ``add_param_group`` and ``step``).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        reduce_method: ``"mean"`` or ``"sum"`` across ranks, or ``"adasum"``
            (Horovod's ``op=Adasum``): each bucket's gradients combine along
            AdaSum's tree during backward, bitwise ``adasum_allreduce`` of the
            gradients (per-parameter coefficients).
        group: the process group; default: the world.
        bcast_period: ``0``: broadcast the parameters from rank 0 of ``group``
            (a group rank) once, now; ``k > 0``: also every ``k`` steps
            (restores diverged replicas); ``-1``: never.
        param_pack: fuse gradients into buckets (``False``: one all-reduce per
            gradient).
        param_pack_thd: the byte cap of a fused bucket.
        backward_passes_per_step: reduce on every this-many backward passes,
            accumulating locally in between (call ``step()`` after the last).
        reduce_dtype: the communication dtype (see ``DistributedGradReducer``).
        gradient_as_bucket_view: keep each ``.grad`` as a view of its fused
            bucket (DDP's option; see ``DistributedGradReducer.register_hooks``):
            no flatten copy, one gradient copy less in memory, same results.
        local_size: with ``reduce_method="adasum"``: average inside
            consecutive blocks of this many ranks first (a node's GPUs), then
            AdaSum across the blocks, as ``hooks.adasum_hook``'s ``local_size``.

    Raises:
        ValueError: ``reduce_method`` is not "sum", "mean" or "adasum"; a bad
            ``bcast_period``, ``param_pack_thd`` or ``backward_passes_per_step``;
            ``local_size`` other than 1 without AdaSum, or not dividing the
            world size; a 16-bit ``reduce_dtype`` with AdaSum.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        RuntimeError: torch.distributed is not initialised.

    Examples:
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()          # doctest: +SKIP
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        return _instance_of_both(cls, optimizer)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reduce_method: str = "mean",
        group: Optional[dist.ProcessGroup] = None,
        bcast_period: int = 0,
        param_pack: bool = True,
        param_pack_thd: int = 10 * 1024 * 1024,
        backward_passes_per_step: int = 1,
        *,
        reduce_dtype: torch.dtype = torch.float32,
        gradient_as_bucket_view: bool = False,
        local_size: int = 1,
    ) -> None:
        if reduce_method not in ("sum", "mean", "adasum"):
            raise ValueError(f"reduce_method must be 'sum', 'mean' or 'adasum', got "
                             f"{reduce_method!r}")
        if reduce_method != "adasum" and local_size != 1:
            raise ValueError(f"local_size={local_size!r} applies to reduce_method='adasum' only")
        check_int(bcast_period, "bcast_period", minimum=-1)
        check_int(param_pack_thd, "param_pack_thd")
        check_int(backward_passes_per_step, "backward_passes_per_step")
        world_size = require_process_group(group)
        if reduce_method == "adasum":
            # checked here too, before the optimizer's state is taken over
            check_local_size(local_size, world_size)
            check_adasum_reduce_dtype(reduce_dtype)
        self.__dict__.update(optimizer.__dict__)
        self.group = group
        self.reduce_method = reduce_method
        self.bcast_period = bcast_period
        self.backward_passes_per_step = backward_passes_per_step
        # param_pack=False: a one-byte cap puts every gradient in its own bucket
        cap_bytes = param_pack_thd if param_pack else 1
        self._reducer_args = dict(group=group, bucket_cap_mb=cap_bytes / 2 ** 20,
                                  reduce_dtype=reduce_dtype)
        if reduce_method == "adasum":
            self._reducer_class = AdaSumReducer
            self._reducer_args["local_size"] = local_size
        else:
            self._reducer_class = DistributedGradReducer
            self._reducer_args["mean"] = reduce_method == "mean"
        self._gradient_as_bucket_view = gradient_as_bucket_view
        self._trainable = self._trainable_now()
        self.reducer = self._hooked_reducer()
        self._steps = 0
        if bcast_period != -1:
            self.broadcast_parameters()

    # ------------------------------------------- which parameters are reduced
    def _all_params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _trainable_now(self):
        return [p for p in self._all_params() if p.requires_grad]

    def _hooked_reducer(self) -> DistributedGradReducer:
        return self._reducer_class(self._trainable, **self._reducer_args).register_hooks(
            self.backward_passes_per_step, gradient_as_bucket_view=self._gradient_as_bucket_view)

    def _check_between_steps(self, what: str) -> None:
        if self.reducer.accumulated_passes or not self.reducer.syncing:
            raise RuntimeError(
                f"{what} between the backward passes of one step (inside no_sync() or before "
                f"the last of backward_passes_per_step={self.backward_passes_per_step}): the "
                f"gradients accumulated so far would not be reduced alike; do it after step()")

    def _rehook(self) -> None:
        """Reduce ``self._trainable`` from the next backward on (a new reducer;
        the old one's hooks are removed)."""
        reduced = self.reducer.reduced
        self.reducer.remove_hooks()
        self.reducer = self._hooked_reducer()
        if reduced:
            self.reducer.mark_reduced()

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, and the group's trainable
        parameters join the reduction from the next backward on. Every rank
        must call it alike (it is collective): unless ``bcast_period`` is
        -1, the new parameters are broadcast from the group's rank 0 at once, as the
        others were when the optimizer was wrapped.

        Raises:
            RuntimeError: called between the backward passes of one step
                (inside ``no_sync()``, or before the last of
                ``backward_passes_per_step``); nothing is changed.
            TypeError, ValueError: as ``torch.optim.Optimizer.add_param_group``
                raises them.

        Examples:
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-3})  # doctest: +SKIP
        """
        if getattr(self, "reducer", None) is None:  # torch.optim.Optimizer's own construction
            super().add_param_group(param_group)
            return
        self._check_between_steps("add_param_group() called")
        super().add_param_group(param_group)
        added = self.param_groups[-1]["params"]
        self._trainable = self._trainable_now()
        self._rehook()
        if self.bcast_period != -1 and added:
            with torch.no_grad():
                first = len(self._all_params()) - len(added)
                broadcast_tensors([p.data for p in added], 0, group=self.group,
                                  names=[f"parameters[{first + i}]" for i in range(len(added))])

    def _follow_requires_grad(self) -> None:
        """Parameters frozen or unfrozen since the last step: reduce the
        gradients of newly trainable ones that the hooks did not see (this
        step's), and hook the new set from the next backward on."""
        now = self._trainable_now()
        if len(now) == len(self._trainable) and all(map(operator.is_, now, self._trainable)):
            return
        self._check_between_steps("parameters were frozen or unfrozen")
        hooked = {id(p) for p in self._trainable}
        unseen = [p for p in now if id(p) not in hooked]
        self._trainable = now
        self._rehook()
        if unseen and self.reducer.reduced:
            # the backward of this step ran with the old hooks: reduce these now
            once = self._reducer_class(unseen, **self._reducer_args)
            grads = once([p.grad if p.grad is not None else torch.zeros_like(p) for p in unseen])
            for p, g in zip(unseen, grads):
                p.grad = g

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy the parameters of rank ``src`` of the optimizer's group (a group
        rank) to every rank of it (fused, bitwise exact)."""
        params = self._all_params()
        with torch.no_grad():
            # verified first: a rank with a differently shaped parameter gets a
            # RuntimeError naming it (on every rank), not a crashed broadcast
            broadcast_tensors([p.data for p in params], src, group=self.group,
                              names=[f"parameters[{i}]" for i in range(len(params))])

    def step(self, closure=None):
        """Run the wrapped optimizer's step on the reduced gradients.

        As ``torch.optim.Optimizer.step``: an optional ``closure`` re-evaluates
        the model (forward and ``backward()``) and returns the loss; it is
        called with grad enabled before the step (by the wrapped optimizer,
        as often as it calls it: once for SGD or Adam, several times for
        LBFGS), its backward reduces the gradients, and its loss is returned.
        With ``backward_passes_per_step=k`` the closure's backward is the k-th
        pass (the others ran before ``step``), as Lightning's gradient
        accumulation does it.

        Parameters frozen or unfrozen since the last step are followed
        first: the gradients a newly unfrozen parameter got in this step's
        backward (which ran before the optimizer knew) are reduced here, and
        from the next backward on the hooks cover exactly the trainable
        parameters; a frozen parameter without gradient keeps none.

        Raises:
            RuntimeError: the gradients were not reduced: ``step()`` (or the
                closure's backward) came after a backward pass that only
                accumulated (``backward_passes_per_step`` > 1, or ``no_sync()``);
                or parameters were frozen or unfrozen between the backward
                passes of one step.

        Examples:
            >>> def closure():                                   # doctest: +SKIP
            ...     opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); return loss
            >>> loss = opt.step(closure)                          # doctest: +SKIP
        """
        self._follow_requires_grad()
        if closure is None:
            self._check_reduced()
            loss = super().step()
        else:
            def reduced_closure():
                with torch.enable_grad():
                    value = closure()
                self._check_reduced()
                return value
            loss = super().step(reduced_closure)
        self.reducer.consume()
        self._steps += 1
        if self.bcast_period > 0 and self._steps % self.bcast_period == 0:
            self.broadcast_parameters()
        return loss

    def _check_reduced(self) -> None:
        has_grads = any(p.grad is not None for p in self._all_params())
        if has_grads and not self.reducer.reduced:
            raise RuntimeError(
                "step() called on gradients that were not reduced across ranks: call it "
                f"after every {self.backward_passes_per_step} backward pass(es), outside "
                f"no_sync()")

    def no_sync(self):
        """A context in which backward passes accumulate gradients locally."""
        return self.reducer.no_sync()


class AdaSumByDeltaWeight(torch.optim.Optimizer):
    """Step locally, then combine the ranks' weight deltas with AdaSum.

    ``step()`` saves the weights, runs the wrapped optimizer on this rank's
    own gradients, takes the delta, AdaSum-reduces the deltas of all ranks
    (``adasum_allreduce``: one fused collective, per-parameter coefficients,
    any world size) and sets ``weights = saved + AdaSum(deltas)``. Gradients
    are not all-reduced: that is the point of the delta-weight formulation.

    Use it for large-batch training where averaging gradients stalls
    convergence: AdaSum adds orthogonal updates and averages parallel ones.
    Start from the learning rate tuned for one rank's batch (AdaSum of k
    identical deltas is the delta itself), and with ``local_size`` (ranks of a
    node averaged first) from the rate tuned for one node's batch.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        group: the process group; default: the world.
        local_size: average inside consecutive blocks of this many ranks first.
        bucket_cap_mb: the byte cap of a fused bucket.

    Raises:
        RuntimeError: torch.distributed is not initialised (AdaSum needs a
            distributed run, as MindSpore's does).
        ValueError: ``local_size`` does not divide the world size.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    Examples:
        >>> opt = AdaSumByDeltaWeight(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()   # doctest: +SKIP
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        return _instance_of_both(cls, optimizer)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 group: Optional[dist.ProcessGroup] = None, *, local_size: int = 1,
                 bucket_cap_mb: float = 25.0) -> None:
        world_size = require_process_group(group)
        check_local_size(local_size, world_size)
        self.__dict__.update(optimizer.__dict__)
        self.group = group
        self.local_size = local_size
        self.bucket_cap_mb = bucket_cap_mb

    def step(self, closure=None):
        """Local step, then ``weights = saved + AdaSum(deltas)`` on every rank."""
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
        loss = super().step(closure)
        with torch.no_grad():
            deltas = torch._foreach_sub([p.detach() for p in params], saved)
            combined = adasum_allreduce(deltas, self.group, local_size=self.local_size,
                                        bucket_cap_mb=self.bucket_cap_mb)
            torch._foreach_add_(saved, combined)
            torch._foreach_copy_([p.detach() for p in params], saved)
        return loss
