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

Importing this module needs Lightning (``pip install lightning``).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("fusedreduce.lightning needs PyTorch Lightning: pip install lightning "
                      "(or pip install \"fusedreduce[integrations]\")") from exc

__all__ = ["CommHook"]


class CommHook(Callback):
    """Register ``hook`` (with ``state``) on Lightning's DDP module at the start of fitting.

    Args:
        hook: a DDP communication hook, e.g. ``fusedreduce.hooks.allreduce_hook``.
        state: its state: None, a process group or a ``fusedreduce.hooks.HookState``
            (which can be built before Lightning starts the process group).

    Raises:
        TypeError: ``hook`` is not callable.

    Example:
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
