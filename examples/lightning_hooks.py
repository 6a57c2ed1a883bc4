"""PyTorch Lightning with fusedreduce's DDP communication hooks, on CPUs or GPUs.

    torchrun --nproc_per_node=2 examples/lightning_hooks.py --hook fp16_compress_hook
    python examples/lightning_hooks.py --devices 2        # Lightning starts the processes

The hook is registered by ``fusedreduce.lightning.CommHook``, a callback:
Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` ignores hooks unless the
device is CUDA. Trains a small MLP on a fixed synthetic set (or scikit-learn's
digits when installed) and with ``--out PATH`` saves the final weights.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedreduce import hooks
from fusedreduce.lightning import CommHook

HOOKS = ("none", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")


def dataset() -> TensorDataset:
    try:
        from sklearn.datasets import load_digits
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target)
    except ImportError:
        gen = torch.Generator().manual_seed(0)
        x, y = torch.rand(1797, 64, generator=gen), torch.randint(0, 10, (1797,), generator=gen)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=HOOKS, default="allreduce_hook")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="save the final weights here (rank 0)")
    args = parser.parse_args(argv)

    model = Classifier()
    callbacks = [] if args.hook == "none" else [CommHook(getattr(hooks, args.hook))]
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=args.devices,
        strategy="ddp", max_steps=args.steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Lightning's distributed sampler gives each rank its own shard
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=False))
    if args.out and trainer.is_global_zero:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
