"""Accelerate with fusedreduce's DDP communication hooks.

    torchrun --nproc_per_node=2 examples/accelerate_hooks.py --hook allreduce_hook
    torchrun --nproc_per_node=2 examples/accelerate_hooks.py --hook fp16_compress_hook --compare-ddp
    torchrun --nproc_per_node=2 examples/accelerate_hooks.py --max-grad-norm 0.05 --compare-ddp
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_hooks.py   # the same

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only
Accelerate's own hook enum and silently ignores a function, so register the
hook on the module ``accelerator.prepare`` returns (a
``DistributedDataParallel`` when there are several processes). Works on CPU
(gloo) and on GPUs (NCCL) alike.

Trains a small MLP on scikit-learn's digits when scikit-learn is installed
(``pip install -e ".[examples]"``), else on a fixed synthetic set, and
with ``--out PATH`` saves the final weights (rank 0). Rank 0 prints the
training loss (the batch's, averaged over the ranks) every 5 steps, then the
final one and a digest of the final weights (``train_digits.py``'s: equal
digests, bitwise equal weights). ``--compare-ddp`` then trains Accelerate's
own DDP, without a hook, from the same start on the same batches and prints
its loss and digest and how the two compare: ``allreduce_hook`` gives its
weights bitwise, ``fp16_compress_hook`` within fp16's rounding.

``--max-grad-norm X`` clips the reduced gradients in the hook's write-back
(``HookState(max_grad_norm=X)``) instead of calling
``accelerator.clip_grad_norm_``; rank 0 prints the last step's norm before
clipping, and the ``--compare-ddp`` reference clips with
``accelerator.clip_grad_norm_(model.parameters(), X)``: the same clipping,
the norm summed in another order, so within a few roundings.
"""
from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from fusedreduce import hooks
# scikit-learn's digits (read without importing it), the report of weights digests
from train_digits import final_report, read_digits

HOOKS = ("none", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")


def data(rank: int, batch: int, steps: int):
    """This rank's batches: its own shard of the digits (or of a synthetic set)."""
    digits = read_digits()
    if digits is not None:
        x, y = digits
    else:  # no scikit-learn: a synthetic set of the same shape
        gen = torch.Generator().manual_seed(0)
        x, y = torch.rand(1797, 64, generator=gen), torch.randint(0, 10, (1797,), generator=gen)
    for step in range(steps):
        start = ((step * 8 + rank) * batch) % (len(x) - batch)
        yield x[start:start + batch], y[start:start + batch]


def train(accelerator: Accelerator, hook: str, args, report: bool):
    """A model trained from the fixed start with ``hook``: (its final training
    loss, the model, the last norm before clipping or None). ``report``: rank
    0 prints the loss every 5 steps. Each loss is the batch's, averaged over
    the ranks. With ``--max-grad-norm`` the hook's state clips; without a hook
    (or on one process) ``accelerator.clip_grad_norm_`` does."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = None
    if hook != "none" and accelerator.num_processes > 1:
        if args.max_grad_norm is not None:
            state = hooks.HookState(max_grad_norm=args.max_grad_norm)
        model.register_comm_hook(state, getattr(hooks, hook))

    for step, (x, y) in enumerate(data(accelerator.process_index, args.batch, args.steps)):
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)  # with a clipping state: reduced and clipped
        if args.max_grad_norm is not None and state is None:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if report and step % 5 == 4 and step < args.steps - 1:
            mean = accelerator.reduce(loss.detach(), "mean")  # a collective: every rank
            if accelerator.is_main_process:
                print(f"step {step + 1}: loss {float(mean):.4f}")
    norm = None if state is None else float(state.grad_norm)
    return float(accelerator.reduce(loss.detach(), "mean")), accelerator.unwrap_model(model), \
        norm


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", choices=HOOKS, default="allreduce_hook")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--compare-ddp", action="store_true",
                        help="also train Accelerate's own DDP (no hook) and compare the weights")
    parser.add_argument("--max-grad-norm", type=float,
                        help="clip the reduced gradients to this total 2-norm in the hook's "
                             "pass (accelerator.clip_grad_norm_ for --compare-ddp)")
    parser.add_argument("--out", help="save the final weights here (rank 0)")
    args = parser.parse_args(argv)
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error(f"--max-grad-norm must be positive, got {args.max_grad_norm}")

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    label = "DDP, no hook" if args.hook == "none" else args.hook
    clipped = "" if args.max_grad_norm is None else f", max_grad_norm={args.max_grad_norm:g}"
    loss, model, norm = train(accelerator, args.hook, args, report=True)
    if accelerator.is_main_process and args.out:
        torch.save(model.state_dict(), args.out)
    runs = [(label + clipped, loss, model)]
    if args.compare_ddp:
        reference = "Accelerate's DDP" + ("" if args.max_grad_norm is None else
                                          f", clip_grad_norm_ {args.max_grad_norm:g}")
        runs.append((reference, *train(accelerator, "none", args, report=False)[:2]))
    if accelerator.is_main_process:
        print(final_report(runs))
        if norm is not None:
            print(f"{label + clipped}: last norm before clipping {norm:.4f}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
