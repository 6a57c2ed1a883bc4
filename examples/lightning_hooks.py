"""PyTorch Lightning with fusedreduce, on CPUs or GPUs: its DDP hooks, or its optimizer.

    torchrun --nproc_per_node=2 examples/lightning_hooks.py --hook fp16_compress_hook
    torchrun --nproc_per_node=2 examples/lightning_hooks.py --distributed-optimizer
    torchrun --nproc_per_node=2 examples/lightning_hooks.py --distributed-optimizer --shard
    torchrun --nproc_per_node=2 examples/lightning_hooks.py --compare-ddp
    torchrun --nproc_per_node=2 examples/lightning_hooks.py --max-grad-norm 0.05 --compare-ddp
    python examples/lightning_hooks.py --devices 2        # Lightning starts the processes

A hook (``--hook``, default ``allreduce_hook``) is registered by
``fusedreduce.lightning.CommHook``, a callback: Lightning's own
``DDPStrategy(ddp_comm_hook=...)`` ignores hooks unless the device is CUDA.
With ``--distributed-optimizer``, ``configure_optimizers`` returns a
``fusedreduce.DistributedOptimizer`` and the trainer runs
``fusedreduce.lightning.DistributedOptimizerStrategy``, which leaves out the
DDP wrapper (it would reduce every gradient a second time), so no hook runs;
``--shard`` makes it ``DistributedOptimizer(..., shard=True)`` (each rank keeps
its part of the optimizer state; Lightning's checkpoint holds the whole state,
gathered on every rank).
``--max-grad-norm X`` clips the reduced gradients in the pass that writes
them back: ``HookState(max_grad_norm=X)`` for the hook,
``DistributedOptimizer(..., max_grad_norm=X)`` for the optimizer; Lightning's
own ``gradient_clip_val`` stays unset (it would take the norm again, tensor by
tensor), and rank 0 prints the last step's norm before clipping.
Trains a small MLP on a fixed synthetic set (or scikit-learn's digits when
installed) and with ``--out PATH`` saves the final weights.

Rank 0 prints the final training loss (the last batch's, averaged over the
ranks) and a digest of the final weights (``train_digits.py``'s: equal
digests, bitwise equal weights). ``--compare-ddp`` then trains Lightning's own
DDP, without a hook, from the same start on the same batches and prints its
loss and digest and how the two compare: ``allreduce_hook`` and
``--distributed-optimizer`` give its weights bitwise, ``fp16_compress_hook``
within fp16's rounding. With ``--max-grad-norm X`` Lightning's DDP clips with
``gradient_clip_val=X`` (torch's ``clip_grad_norm_``): the same clipping, the
norm summed in another order, so within a few roundings.
"""
from __future__ import annotations

import argparse
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedreduce import DistributedOptimizer, hooks
from fusedreduce.lightning import CommHook, DistributedOptimizerStrategy
# scikit-learn's digits (read without importing it), the report of weights digests
from train_digits import final_report, read_digits

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
    def __init__(self, distributed_optimizer: bool = False, accumulate: int = 1,
                 shard: bool = False, max_grad_norm: Optional[float] = None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.distributed_optimizer, self.accumulate = distributed_optimizer, accumulate
        self.shard, self.max_grad_norm = shard, max_grad_norm

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        if self.distributed_optimizer:
            # reduces on the pass the trainer steps after: accumulate_grad_batches
            return DistributedOptimizer(optimizer, backward_passes_per_step=self.accumulate,
                                        shard=self.shard, max_grad_norm=self.max_grad_norm)
        return optimizer


def fit(args, hook: str, distributed_optimizer: bool):
    """A model trained from the fixed start: (its final training loss averaged over
    the ranks, the model, whether this process is rank 0, the last norm before
    clipping or None). With ``--max-grad-norm``, fusedreduce clips (the hook's
    state or the optimizer) and, where neither runs (Lightning's own DDP),
    Lightning does (``gradient_clip_val``)."""
    fused = hook != "none" or distributed_optimizer
    clip = args.max_grad_norm
    model = Classifier(distributed_optimizer, args.accumulate,
                       shard=args.shard and distributed_optimizer, max_grad_norm=clip)
    state = hooks.HookState(max_grad_norm=clip) if hook != "none" and clip else None
    callbacks = [] if hook == "none" else [CommHook(getattr(hooks, hook), state)]
    strategy = DistributedOptimizerStrategy() if distributed_optimizer else "ddp"
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=args.devices,
        strategy=strategy, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=None if fused else clip, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Lightning's distributed sampler gives each rank its own shard
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=False))
    loss = float(trainer.strategy.reduce(model.last_loss, reduce_op="mean"))
    if args.checkpoint and distributed_optimizer:
        trainer.save_checkpoint(args.checkpoint)  # on every rank: the state is gathered
    norm = state.grad_norm if state is not None else \
        trainer.optimizers[0].grad_norm if distributed_optimizer and clip else None
    return loss, model, trainer.is_global_zero, None if norm is None else float(norm)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=HOOKS,
                        help="the DDP hook (default: allreduce_hook; none with "
                             "--distributed-optimizer)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="no DDP wrapper, so no hook: DistributedOptimizer reduces the "
                             "gradients")
    parser.add_argument("--shard", action="store_true",
                        help="with --distributed-optimizer: shard=True (each rank keeps its "
                             "part of the optimizer state)")
    parser.add_argument("--checkpoint",
                        help="with --distributed-optimizer: save Lightning's checkpoint here")
    parser.add_argument("--max-grad-norm", type=float,
                        help="clip the reduced gradients to this total 2-norm (fusedreduce's "
                             "fused clip; Lightning's gradient_clip_val for --compare-ddp)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="accumulate_grad_batches: backward passes per optimizer step")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare-ddp", action="store_true",
                        help="also train Lightning's own DDP (no hook) and compare the weights")
    parser.add_argument("--out", help="save the final weights here (rank 0)")
    args = parser.parse_args(argv)

    if (args.shard or args.checkpoint) and not args.distributed_optimizer:
        parser.error("--shard and --checkpoint go with --distributed-optimizer")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error(f"--max-grad-norm must be positive, got {args.max_grad_norm}")
    if args.hook is None:
        args.hook = "none" if args.distributed_optimizer else "allreduce_hook"
    elif args.distributed_optimizer and args.hook != "none":
        parser.error(f"--distributed-optimizer trains without DDP, so DDP's --hook "
                     f"{args.hook} cannot run: leave --hook out")
    label = ("DistributedOptimizer" if args.distributed_optimizer
             else "DDP, no hook" if args.hook == "none" else args.hook)
    clipped = "" if args.max_grad_norm is None else f", max_grad_norm={args.max_grad_norm:g}"
    loss, model, rank_zero, norm = fit(args, args.hook, args.distributed_optimizer)
    if rank_zero and args.out:
        torch.save(model.state_dict(), args.out)
    runs = [(label + clipped, loss, model)]
    if args.compare_ddp:
        reference = "Lightning's DDP" + (
            "" if args.max_grad_norm is None else f", gradient_clip_val={args.max_grad_norm:g}")
        runs.append((reference, *fit(args, "none", distributed_optimizer=False)[:2]))
    if rank_zero:
        print(final_report(runs))
        if norm is not None:
            print(f"{label + clipped}: last norm before clipping {norm:.4f}")
    if torch.distributed.is_initialized():
        # the ranks leave together, and the group is shut down while Python
        # still runs: a gloo group left to the interpreter's exit aborted a
        # process there ("terminate called without an active exception") in 3
        # of 10 CPU runs without the barrier, in 1 of 12 with the barrier alone
        # on a loaded 2-core machine, and in 0 of 30 with both
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
