"""PyTorch Lightning glue: register a fusedreduce DDP hook where Lightning keeps its DDP module.

Lightning's ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a
hook only when the root device is CUDA and silently ignores it on the CPU.
``CommHook`` is a callback that registers the hook on the module Lightning
wrapped in ``DistributedDataParallel`` (``trainer.strategy.model``) when
fitting starts, on every device::

    import lightning.pytorch as pl
    from fusedreduce import hooks
    from fusedreduce.lightning import CommHook

    trainer = pl.Trainer(strategy="ddp", callbacks=[CommHook(hooks.fp16_compress_hook)])

``DistributedOptimizerStrategy`` is for a ``LightningModule`` whose
``configure_optimizers`` returns ``fusedreduce.DistributedOptimizer``: Lightning's
DDP strategy (process group, samplers, ``trainer.strategy.reduce``/``barrier``)
without the DDP wrapper, whose all-reduce would reduce every gradient a second
time::

    trainer = pl.Trainer(strategy=DistributedOptimizerStrategy(), ...)

    def configure_optimizers(self):        # in the LightningModule
        return DistributedOptimizer(torch.optim.SGD(self.parameters(), lr=0.1))

Importing this module needs Lightning (``pip install lightning``).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("fusedreduce.lightning needs PyTorch Lightning: pip install lightning "
                      "(the \"integrations\" extra: pip install -e \".[integrations]\" in a "
                      "fusedreduce checkout)") from exc

from .broadcast import broadcast_tensors
from .optimizer import DistributedOptimizer

__all__ = ["CommHook", "DistributedOptimizerStrategy"]


class CommHook(Callback):
    """Register ``hook`` (with ``state``) on Lightning's DDP module at the start of fitting.

    Args:
        hook: a DDP communication hook, e.g. ``fusedreduce.hooks.allreduce_hook``.
        state: its state: None, a process group or a ``fusedreduce.hooks.HookState``
            (which can be built before Lightning starts the process group).

    Raises:
        TypeError: ``hook`` is not callable.

    Examples:
        >>> trainer = pl.Trainer(strategy="ddp", callbacks=[CommHook(hooks.allreduce_hook)])  # doctest: +SKIP
    """

    def __init__(self, hook: Callable, state: Optional[object] = None) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self.hook, self.state = hook, state
        self.registered = False

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        # one process (no DDP): nothing to reduce, nothing to register
        if isinstance(model, DistributedDataParallel) and not self.registered:
            model.register_comm_hook(self.state, self.hook)
            self.registered = True


class DistributedOptimizerStrategy(DDPStrategy):
    """Lightning's DDP strategy with the model left unwrapped, for ``DistributedOptimizer``.

    ``fusedreduce.DistributedOptimizer`` reduces the gradients itself, during
    backward; under Lightning's ``strategy="ddp"`` the DDP wrapper would
    all-reduce them as well (twice the communication, and with
    ``reduce_method="sum"`` the wrong sum). This strategy keeps everything else
    of ``DDPStrategy`` (the launch, the process group, the distributed
    samplers, ``reduce``/``broadcast``/``barrier``, checkpointing from rank 0)
    and, when fitting starts:

    - makes every rank's parameters and buffers bitwise rank 0's (DDP's
      constructor does this; buffers are not re-broadcast before each forward
      as DDP's ``broadcast_buffers`` does, so BatchNorm statistics stay per rank);
    - checks that the optimizers from ``configure_optimizers`` are
      ``DistributedOptimizer`` instances covering every trainable parameter,
      each with ``backward_passes_per_step`` equal to the trainer's
      ``accumulate_grad_batches``, so that no gradient goes unreduced.

    Takes ``DDPStrategy``'s arguments (those about the DDP wrapper have no effect).

    Raises:
        TypeError: an optimizer is not a ``DistributedOptimizer``.
        ValueError: a trainable parameter is in no optimizer, or an optimizer's
            ``backward_passes_per_step`` differs from ``accumulate_grad_batches``.

    Examples:
        >>> trainer = pl.Trainer(strategy=DistributedOptimizerStrategy(), devices=2)  # doctest: +SKIP
    """

    strategy_name = "fusedreduce_distributed_optimizer"

    def configure_ddp(self) -> None:
        # no DDP wrapper: the optimizers' hooks reduce the gradients
        module = self.model
        tensors = list(module.parameters()) + list(module.buffers())
        with torch.no_grad():
            broadcast_tensors([t.data for t in tensors], 0,
                              names=[f"module state {i}" for i in range(len(tensors))])

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.check_optimizers(trainer.accumulate_grad_batches)

    def check_optimizers(self, accumulate_grad_batches: int = 1) -> None:
        """Refuse ``self.optimizers`` (what ``configure_optimizers`` gave) unless
        they reduce every trainable parameter of the module, each once every
        ``accumulate_grad_batches`` backward passes. ``setup`` calls it with
        the trainer's value before fitting.

        Raises:
            TypeError: an optimizer is not a ``DistributedOptimizer``.
            ValueError: a trainable parameter is in no optimizer, or an
                optimizer's ``backward_passes_per_step`` differs from
                ``accumulate_grad_batches``.

        Examples:
            >>> strategy.check_optimizers(trainer.accumulate_grad_batches)  # doctest: +SKIP
        """
        optimizers: List[object] = [getattr(o, "optimizer", o) for o in self.optimizers]
        for index, optimizer in enumerate(optimizers):
            if not isinstance(optimizer, DistributedOptimizer):
                raise TypeError(
                    f"DistributedOptimizerStrategy: optimizer {index} from configure_optimizers "
                    f"is a {type(optimizer).__name__}, not a fusedreduce.DistributedOptimizer, "
                    f"so its gradients would not be reduced across ranks: return "
                    f"DistributedOptimizer({type(optimizer).__name__}(...)), or use "
                    f"strategy=\"ddp\"")
            if optimizer.backward_passes_per_step != accumulate_grad_batches:
                raise ValueError(
                    f"DistributedOptimizerStrategy: optimizer {index} reduces every "
                    f"{optimizer.backward_passes_per_step} backward pass(es) "
                    f"(backward_passes_per_step) but the trainer steps every "
                    f"{accumulate_grad_batches} (accumulate_grad_batches): make them "
                    f"equal")
        covered = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        missing = [name for name, p in self.lightning_module.named_parameters()
                   if p.requires_grad and id(p) not in covered]
        if missing:
            raise ValueError(
                f"DistributedOptimizerStrategy: trainable parameters in no optimizer, whose "
                f"gradients nobody would reduce: {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
