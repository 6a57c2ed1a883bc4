"""Train a digit classifier on several ranks, with each of fusedreduce's ways to reduce.

    python examples/train_digits.py --world-size 4                 # spawns 4 local gloo workers
    torchrun --nproc_per_node=4 examples/train_digits.py           # or joins a torchrun launch
    python examples/train_digits.py --world-size 4 --reduction ddp,adasum_hook --plot digits.png

The data is scikit-learn's digits set (1,797 8x8 images, shipped inside the
package: nothing is downloaded). Every rank draws its own ``--batch-per-rank``
images each step, so a step sees ``world size x batch`` images; the model is a
64-128-10 MLP, the same initial weights on every rank. Each ``--reduction``
trains from the same start on the same batches:

- ``ddp``: torch's DistributedDataParallel, no hook (the reference);
- ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
  ``adasum_hook``: DDP with that ``fusedreduce.hooks`` hook;
- ``reducer``: ``DistributedGradReducer(...).register_hooks()``, reducing
  ``.grad`` in fused buckets while backward runs;
- ``distributed_optimizer``: ``DistributedOptimizer`` around the optimizer;
- ``adasum_delta``: ``AdaSumByDeltaWeight``: each rank steps on its own
  gradient, then the weight changes are AdaSum-combined.

Rank 0 prints progress and a table (test accuracy, loss, steps to
``--target`` accuracy, time per step) and writes ``--json`` (every curve, and a
digest of the final weights: equal digests mean bitwise equal models) and
``--plot`` (test accuracy and loss against steps, one line per reduction).
Needs scikit-learn and matplotlib: ``pip install -e ".[examples]"`` in the checkout.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fusedreduce
from fusedreduce import hooks
from fusedreduce.local_ranks import run_on_local_ranks

HOOKS = ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "adasum_hook")
REDUCTIONS = ("ddp",) + HOOKS + ("reducer", "distributed_optimizer", "adasum_delta")
EXTRA = 'pip install scikit-learn matplotlib (the "examples" extra: pip install -e ".[examples]")'


def read_digits():
    """scikit-learn's digits as ``(x, y)``: x float32 [1797, 64] with pixels scaled
    to [0, 1], y int64 labels; None if scikit-learn (and so its data file) is not
    installed.

    The file is read from the installed package without importing scikit-learn:
    importing it loads its OpenMP runtime beside torch's, and then about one in
    five processes launched by torchrun on gloo aborted at exit ("terminate
    called without an active exception"; seen on the 2-core VM with torch
    2.13, plain DDP included, never without the import). The values are those
    of ``sklearn.datasets.load_digits()``.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):
        return None
    table = np.loadtxt(path, delimiter=",")
    return (torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0,
            torch.tensor(table[:, -1], dtype=torch.long))


def load_digits(device: torch.device):
    """(train x, train y, test x, test y): a fixed 80/20 split, pixels scaled to [0, 1]."""
    digits = read_digits()
    if digits is None:
        raise SystemExit(f"this example needs scikit-learn for its data set: {EXTRA}")
    x, y = digits
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    return x[train].to(device), y[train].to(device), x[test].to(device), y[test].to(device)


def make_model(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)


def make_optimizer(params, args) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)


def setup(reduction: str, model: nn.Module, args):
    """(the module to call, the optimizer to step) for one way to reduce."""
    optimizer = make_optimizer(model.parameters(), args)
    if reduction == "ddp" or reduction in HOOKS:
        ddp = DistributedDataParallel(model)
        if reduction in HOOKS:
            ddp.register_comm_hook(None, getattr(hooks, reduction))
        return ddp, optimizer
    if reduction == "reducer":
        fusedreduce.DistributedGradReducer(list(model.parameters())).register_hooks()
        return model, optimizer
    if reduction == "distributed_optimizer":
        return model, fusedreduce.DistributedOptimizer(optimizer)
    return model, fusedreduce.AdaSumByDeltaWeight(optimizer)


def batch_indices(step: int, rank: int, world_size: int, batch: int, n: int,
                  seed: int) -> torch.Tensor:
    """Rank ``rank``'s images at ``step``: disjoint slices of one shuffled epoch."""
    per_step = world_size * batch
    epoch, position = divmod(step * per_step, n - n % per_step)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    start = position + rank * batch
    return order[start:start + batch]


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def weights_comparison(model: nn.Module, reference: nn.Module) -> str:
    """``"bitwise equal"``, or how far ``model``'s parameters are from ``reference``'s."""
    pairs = [(p.detach().cpu().contiguous(), q.detach().cpu().contiguous())
             for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    if all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in pairs):
        return "bitwise equal"
    difference = max(float((p.double() - q.double()).abs().max()) for p, q in pairs)
    return f"not bitwise equal, max abs difference {difference:.2e}"


def final_report(runs: list) -> str:
    """The lines the Lightning and Accelerate examples end with (rank 0): per run
    ``(label, final loss, model)`` its loss and weights digest; with a second
    run (the framework's own DDP), how the first run's weights compare with it."""
    lines = [f"{label}: final loss {loss:.4f}, weights {weights_digest(model)}"
             for label, loss, model in runs]
    if len(runs) == 2:
        (label, _, model), (reference, _, reference_model) = runs
        lines.append(f"{label} vs {reference}: {weights_comparison(model, reference_model)}")
    return "\n".join(lines)


def train(reduction: str, args, data, device: torch.device, probe=None) -> dict:
    """Train one model with ``reduction``; its curves and final state (rank 0's view).

    ``probe(model, x, y)``, if given, runs at every evaluation step before the
    step trains, on this rank's batch, and returns a dict of numbers that are
    recorded in the curves; it must not touch ``.grad`` or the weights.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = data
    model = make_model(args.seed, device)
    module, optimizer = setup(reduction, model, args)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    autocast = (torch.autocast(device.type, dtype=torch.float16 if args.amp == "fp16"
                               else torch.bfloat16) if args.amp != "none" else nullcontext())
    curve = {"step": [], "loss": [], "test_accuracy": []}
    steps_to_target = None
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = batch_indices(step - 1, rank, world_size, args.batch_per_rank, len(x_train),
                              args.seed)
        evaluating = step % args.eval_every == 0 or step == args.steps
        if probe is not None and evaluating:
            for name, value in probe(model, x_train[index], y_train[index]).items():
                curve.setdefault(name, []).append(value)
        with autocast:
            loss = nn.functional.cross_entropy(module(x_train[index]), y_train[index])
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if evaluating:
            # every rank holds the same weights: each evaluates, rank 0 reports
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)  # the training loss over every rank's batch
            curve["step"].append(step)
            curve["loss"].append(float(mean_loss) / world_size)
            curve["test_accuracy"].append(accuracy)
            if steps_to_target is None and accuracy >= args.target:
                steps_to_target = step
            if rank == 0 and not getattr(args, "quiet", False):
                progress(reduction, step, args.steps, curve["loss"][-1], accuracy)
    seconds = time.perf_counter() - started
    return {"reduction": reduction, **curve, "final_test_accuracy": curve["test_accuracy"][-1],
            "final_loss": curve["loss"][-1], "steps_to_target": steps_to_target,
            "ms_per_step": 1e3 * seconds / args.steps, "weights_sha256": weights_digest(model)}


def progress(reduction: str, step: int, steps: int, loss: float, accuracy: float) -> None:
    line = f"{reduction:>22} step {step:>5}/{steps}  loss {loss:.4f}  test accuracy {accuracy:.3f}"
    if sys.stderr.isatty():  # one line redrawn in place
        filled = 20 * step // steps
        print(f"\r\033[K[{'#' * filled}{'-' * (20 - filled)}] {line}", end="" if step < steps
              else "\n", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def run(rank: int, world_size: int, args) -> list:
    """What every rank runs; rank 0's return value is the results."""
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              and dist.get_backend() == "nccl" else torch.device("cpu"))
    if device.type == "cpu":
        # a 64-128-10 MLP gains nothing from threads, and idle ones spin on a busy host
        torch.set_num_threads(1)
    data = load_digits(device)
    return [train(reduction, args, data, device) for reduction in args.reduction]


def report(results: list, args, world_size: int) -> None:
    print(f"digits: {world_size} ranks x {args.batch_per_rank} images per step, {args.steps} "
          f"steps, {args.optimizer} lr {args.lr}, amp {args.amp}, seed {args.seed}")
    print(f"{'reduction':>22}  {'test acc':>8}  {'loss':>7}  {f'steps to {args.target:g}':>14}"
          f"  {'ms/step':>8}  weights")
    for r in results:
        reached = r["steps_to_target"] if r["steps_to_target"] is not None else "-"
        print(f"{r['reduction']:>22}  {r['final_test_accuracy']:8.3f}  {r['final_loss']:7.4f}  "
              f"{reached!s:>14}  {r['ms_per_step']:8.2f}  {r['weights_sha256']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"world_size": world_size, "config": {
                k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                "results": results}, handle, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(results, args.plot, f"digits, {world_size} ranks x {args.batch_per_rank}")
        print(f"wrote {args.plot}", file=sys.stderr)


def plot(results: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accuracy, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        accuracy.plot(r["step"], r["test_accuracy"], label=r["reduction"])
        loss.plot(r["step"], r["loss"], label=r["reduction"])
    accuracy.set(xlabel="step", ylabel="test accuracy", title=title)
    loss.set(xlabel="step", ylabel="training loss", yscale="log")
    accuracy.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="local gloo workers to spawn (ignored under torchrun)")
    parser.add_argument("--reduction", default="ddp,allreduce_hook,reducer,"
                        "distributed_optimizer,adasum_hook",
                        help=f"comma-separated, any of {','.join(REDUCTIONS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-per-rank", type=int, default=16)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                        help="autocast dtype; fp16 adds a GradScaler and needs CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.95, help="the accuracy to reach")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    args.reduction = [r.strip() for r in args.reduction.split(",") if r.strip()]
    unknown = sorted(set(args.reduction) - set(REDUCTIONS))
    if unknown or not args.reduction:
        parser.error(f"--reduction: unknown {unknown}; choose from {','.join(REDUCTIONS)}")
    if args.amp == "fp16" and not torch.cuda.is_available():
        parser.error("--amp fp16 needs CUDA (use bf16 on the CPU)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot needs matplotlib: {EXTRA}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    load_digits(torch.device("cpu"))  # says what to install before any worker starts
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        results = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            report(results, args, dist.get_world_size())
        dist.destroy_process_group()
    else:
        results = run_on_local_ranks(run, args.world_size, args)[0]
        report(results, args, args.world_size)


if __name__ == "__main__":
    main()
