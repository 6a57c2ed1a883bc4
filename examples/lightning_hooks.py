"""PyTorch Lightning with fusedreduce, on CPUs or GPUs: its DDP hooks, or its optimizer.

    torchrun --nproc_per_node=2 examples/lightning_hooks.py --hook fp16_compress_hook
    torchrun --nproc_per_node=2 examples/lightning_hooks.py --distributed-optimizer
    python examples/lightning_hooks.py --devices 2        # Lightning starts the processes

A hook is registered by ``fusedreduce.lightning.CommHook``, a callback:
Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` ignores hooks unless the
device is CUDA. With ``--distributed-optimizer``, ``configure_optimizers``
returns a ``fusedreduce.DistributedOptimizer`` and the trainer runs
``fusedreduce.lightning.DistributedOptimizerStrategy``, which leaves out the
DDP wrapper (it would reduce every gradient a second time). Trains a small
MLP on a fixed synthetic set (or scikit-learn's digits when installed) and
with ``--out PATH`` saves the final weights.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedreduce import DistributedOptimizer, hooks
from fusedreduce.lightning import CommHook, DistributedOptimizerStrategy
from train_digits import read_digits  # scikit-learn's digits, read without importing it

HOOKS = ("none", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")


def dataset() -> TensorDataset:
    digits = read_digits()
    if digits is not None:
        x, y = digits
    else:  # no scikit-learn: a synthetic set of the same shape
        gen = torch.Generator().manual_seed(0)
        x, y = torch.rand(1797, 64, generator=gen), torch.randint(0, 10, (1797,), generator=gen)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, distributed_optimizer: bool = False, accumulate: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.distributed_optimizer, self.accumulate = distributed_optimizer, accumulate

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        if self.distributed_optimizer:
            # reduces on the pass the trainer steps after: accumulate_grad_batches
            return DistributedOptimizer(optimizer, backward_passes_per_step=self.accumulate)
        return optimizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=HOOKS, default="allreduce_hook")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="no DDP wrapper: DistributedOptimizer reduces the gradients "
                             "(with --hook none)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="accumulate_grad_batches: backward passes per optimizer step")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="save the final weights here (rank 0)")
    args = parser.parse_args(argv)

    if args.distributed_optimizer and args.hook != "none":
        parser.error("--distributed-optimizer reduces without DDP, so without a hook: "
                     "add --hook none")
    model = Classifier(args.distributed_optimizer, args.accumulate)
    callbacks = [] if args.hook == "none" else [CommHook(getattr(hooks, args.hook))]
    strategy = DistributedOptimizerStrategy() if args.distributed_optimizer else "ddp"
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=args.devices,
        strategy=strategy, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    # Lightning's distributed sampler gives each rank its own shard
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=False))
    if args.out and trainer.is_global_zero:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
