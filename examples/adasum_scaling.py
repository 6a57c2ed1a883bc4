"""When does AdaSum help? Mean, sum and AdaSum on 1 ... 16 real ranks, on real data.

    python examples/adasum_scaling.py --sweep "" --json adasum.json --plot adasum.png  # ~20 min
    python examples/adasum_scaling.py --quick                                # ~1 min
    python examples/adasum_scaling.py --momentum 0.9 --lr 0.1 --sweep-seeds 0 ...  # docs/adasum-study.md

(times on a 2-core CPU; docs/adasum-study.md has every configuration
measured, with its command.)

The training of ``train_digits.py`` (scikit-learn's digits, a 64-128-10 MLP,
``--batch-per-rank`` images per rank and step) with four ways to combine the
ranks' gradients, each from the same start on the same batches:

- ``mean``: DDP's average, at the learning rate tuned for one rank (``--lr``);
- ``sum``: the same average at ``world size x lr`` (the linear-scaling rule,
  which is what summing the gradients amounts to);
- ``adasum``: ``fusedreduce.hooks.adasum_hook`` on DDP, at ``--lr``;
- ``adasum_delta``: ``AdaSumByDeltaWeight`` (AdaSum of the ranks' weight
  changes), at ``--lr``.

For every world size and seed it records test accuracy against steps, the
steps to ``--target`` accuracy and the final accuracy, and at every
evaluation step how the ranks' gradients relate there (``gradient_geometry``:
their mean pairwise cosine, and how much longer AdaSum's combined gradient is
than their mean); at the largest world
size it also sweeps the learning rate (``--sweep``) for every mode, so each
can be compared at its best rate as well as at the single-rank rate. Prints
the tables, and writes ``--json`` (every curve) and ``--plot``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import fusedreduce
import train_digits
from fusedreduce.local_ranks import run_on_local_ranks

#: mode -> (train_digits reduction, whether the rate scales with the world size)
MODES = {"mean": ("ddp", False), "sum": ("ddp", True), "adasum": ("adasum_hook", False),
         "adasum_delta": ("adasum_delta", False)}


def gradient_geometry(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, float]:
    """How the ranks' gradients relate at this point, and what AdaSum makes of them.

    ``grad_cosine``: the mean over pairs of ranks of the cosine between their
    whole-model gradients (1: parallel, 0: orthogonal). ``adasum_gain``:
    ``|AdaSum(g_1 ... g_n)| / |mean(g_1 ... g_n)|``, AdaSum per tensor as
    ``adasum_hook`` applies it: 1 where AdaSum averages (parallel gradients),
    n where it adds (orthogonal ones of equal length; above n only for
    opposed ones). It is the factor by which AdaSum's step is longer than the
    mean's at the same rate: its learning-rate multiplier, in effect.

    The gradients come from ``torch.autograd.grad`` on a forward pass of its own,
    so ``.grad``, DDP's hooks and the training step are untouched.
    """
    params = list(model.parameters())
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
    world_size = dist.get_world_size()
    flat = torch.cat([g.reshape(-1) for g in grads])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    every = torch.stack(gathered).double()
    unit = every / every.norm(dim=1, keepdim=True)
    pairs = world_size * (world_size - 1)
    cosine = float(((unit @ unit.T).sum() - world_size) / pairs) if pairs else 1.0
    adasum = torch.cat([t.reshape(-1) for t in fusedreduce.adasum_allreduce(list(grads))])
    gain = float(adasum.double().norm() / every.mean(0).norm())
    return {"grad_cosine": cosine, "adasum_gain": gain}


def rank_jobs(rank: int, world_size: int, jobs: List[dict], args) -> List[dict]:
    """Train every job (mode, lr, seed) on this launch's ranks; rank 0's results."""
    # a 64-128-10 MLP gains nothing from threads, and idle ones spin on a busy host
    torch.set_num_threads(1)
    data = train_digits.load_digits(torch.device("cpu"))
    results = []
    for job in jobs:
        options = copy.copy(args)
        options.lr, options.seed, options.quiet = job["lr"], job["seed"], True
        result = train_digits.train(MODES[job["mode"]][0], options, data, torch.device("cpu"),
                                    probe=gradient_geometry)
        results.append({**job, "world_size": world_size, **result})
        if dist.get_rank() == 0:
            reached = result["steps_to_target"] or "-"
            print(f"  {world_size:>2} ranks  {job['mode']:>12}  lr {job['lr']:<7g} seed "
                  f"{job['seed']}: accuracy {result['final_test_accuracy']:.3f}, to "
                  f"{args.target:g} in {reached}", file=sys.stderr, flush=True)
    return results


def jobs_for(world_size: int, args, rates: Optional[List[float]] = None) -> List[dict]:
    jobs = []
    for seed in args.sweep_seeds if rates else args.seeds:
        for mode, (_, scaled) in MODES.items():
            for lr in rates or [args.lr * (world_size if scaled else 1)]:
                if rates and mode == "sum":
                    continue  # in a sweep, sum is mean at another rate
                jobs.append({"mode": mode, "lr": lr, "seed": seed,
                             "sweep": rates is not None})
    return jobs


def phase_median(runs: List[dict], key: str, phase: str) -> Optional[float]:
    """The median of ``key`` over the seeds' first (or last) quarter of evaluations."""
    values = []
    for run in runs:
        curve = run.get(key, [])
        quarter = max(1, len(curve) // 4)
        values += curve[:quarter] if phase == "early" else curve[-quarter:]
    return statistics.median(values) if values else None


def summarise(results: List[dict], args) -> List[dict]:
    """Per (world size, mode, lr, sweep): seeds' steps to target and accuracies."""
    rows = {}
    for r in results:
        key = (r["world_size"], r["mode"], r["lr"], r["sweep"])
        rows.setdefault(key, []).append(r)
    summary = []
    for (world_size, mode, lr, sweep), runs in sorted(rows.items()):
        steps = [r["steps_to_target"] for r in runs]
        reached = [s for s in steps if s is not None]
        summary.append({
            "world_size": world_size, "mode": mode, "lr": lr, "sweep": sweep,
            "seeds": [r["seed"] for r in runs], "steps_to_target": steps,
            "median_steps_to_target": (statistics.median(reached)
                                       if len(reached) == len(steps) else None),
            "final_test_accuracy": [r["final_test_accuracy"] for r in runs],
            "mean_final_test_accuracy": statistics.fmean(r["final_test_accuracy"]
                                                         for r in runs),
            **{f"{key}_{phase}": phase_median(runs, key, phase)
               for key in ("grad_cosine", "adasum_gain") for phase in ("early", "late")}})
    return summary


def best_rates(summary: List[dict]) -> Dict[str, dict]:
    """Per mode, the swept rate with the highest mean final accuracy (ties: fewer steps)."""
    best = {}
    for row in (r for r in summary if r["sweep"]):
        key = (row["mean_final_test_accuracy"], -(row["median_steps_to_target"] or 1e9))
        if row["mode"] not in best or key > best[row["mode"]][0]:
            best[row["mode"]] = (key, row)
    return {mode: row for mode, (_, row) in best.items()}


def print_tables(summary: List[dict], args) -> None:
    print(f"digits, {args.batch_per_rank} images per rank and step, {args.steps} steps, "
          f"{args.optimizer} (momentum {args.momentum}), single-rank lr {args.lr}, seeds "
          f"{args.seeds}; target accuracy {args.target:g}")
    print(f"\n{'ranks':>5}  {'mode':>12}  {'lr':>7}  {'steps to target (per seed)':>28}  "
          f"{'median':>6}  {'final accuracy (per seed)':>28}")
    for r in (r for r in summary if not r["sweep"]):
        steps = ", ".join(str(s) if s is not None else "-" for s in r["steps_to_target"])
        accuracy = ", ".join(f"{a:.3f}" for a in r["final_test_accuracy"])
        median = r["median_steps_to_target"]
        print(f"{r['world_size']:>5}  {r['mode']:>12}  {r['lr']:>7g}  {steps:>28}  "
              f"{median if median is not None else '-':>6}  {accuracy:>28}")
    print("\nthe ranks' gradients along each run (median over seeds; early: the first quarter "
          "of the evaluations, late: the last):")
    print(f"{'ranks':>5}  {'mode':>12}  {'cosine early':>12}  {'late':>6}  "
          f"{'AdaSum/mean length early':>24}  {'late':>6}")
    for r in (r for r in summary if not r["sweep"] and r["world_size"] > 1):
        print(f"{r['world_size']:>5}  {r['mode']:>12}  {r['grad_cosine_early']:>12.3f}  "
              f"{r['grad_cosine_late']:>6.3f}  {r['adasum_gain_early']:>24.2f}  "
              f"{r['adasum_gain_late']:>6.2f}")
    swept = [r for r in summary if r["sweep"]]
    if swept:
        print(f"\nlearning-rate sweep at {swept[0]['world_size']} ranks (mean over seeds):")
        for r in swept:
            median = r["median_steps_to_target"]
            print(f"  {r['mode']:>12}  lr {r['lr']:<7g}  steps to target "
                  f"{median if median is not None else '-':>5}  final accuracy "
                  f"{r['mean_final_test_accuracy']:.3f}")
        print("best rate per mode: " + "; ".join(
            f"{mode} lr {row['lr']:g} ({row['mean_final_test_accuracy']:.3f}, "
            f"{row['median_steps_to_target'] or '-'} steps)"
            for mode, row in best_rates(summary).items()))


def plot(results: List[dict], summary: List[dict], path: str, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world_sizes = sorted({r["world_size"] for r in results})
    fig, axes = plt.subplots(2, len(world_sizes) + 1, figsize=(4 * (len(world_sizes) + 1), 7),
                             squeeze=False)
    colours = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for ax, world_size in zip(axes[0], world_sizes):
        for mode in MODES:
            runs = [r for r in results if r["world_size"] == world_size and r["mode"] == mode
                    and not r["sweep"]]
            for i, r in enumerate(runs):
                ax.plot(r["step"], r["test_accuracy"], color=colours[mode], alpha=0.8,
                        label=mode if i == 0 else None, linewidth=1)
        ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"{world_size} rank(s)", xlabel="step", ylim=(0, 1))
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=7)
    # what AdaSum made of the gradients along its own runs: 1 = the mean, n = the sum
    for ax, world_size in zip(axes[1], world_sizes):
        if world_size == 1:
            ax.set_visible(False)
            continue
        runs = [r for r in results if r["world_size"] == world_size and r["mode"] == "adasum"
                and not r["sweep"]]
        for i, r in enumerate(runs):
            ax.plot(r["step"], r["adasum_gain"], color=colours["adasum"], linewidth=1,
                    alpha=0.8, label="adasum run" if i == 0 else None)
        for level, name in ((1, "mean"), (world_size, "sum")):
            ax.axhline(level, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"= {name}", (0, level), xycoords=("axes fraction", "data"),
                        fontsize=7, color="grey", va="bottom")
        ticks = [2 ** k for k in range(world_size.bit_length()) if 2 ** k <= world_size]
        ax.set(xlabel="step", ylim=(0.8, world_size * 1.15), yscale="log", yticks=ticks,
               yticklabels=[str(t) for t in ticks],
               title=f"{world_size} ranks: AdaSum's step / the mean's")
        ax.minorticks_off()
    next(ax for ax in axes[1] if ax.get_visible()).set_ylabel("|AdaSum| / |mean| of the gradients")
    axes[1][-1].set_visible(False)
    sweep = axes[0][-1]
    if not any(r["sweep"] for r in summary):
        sweep.set_visible(False)
    for mode in MODES:
        rows = [r for r in summary if r["sweep"] and r["mode"] == mode]
        if rows:
            sweep.plot([r["lr"] for r in rows], [r["mean_final_test_accuracy"] for r in rows],
                       marker="o", color=colours[mode], label=mode)
    if sweep.get_visible():
        rates = sorted({r["lr"] for r in summary if r["sweep"]})
        sweep.set(xscale="log", xlabel="learning rate", ylabel="final test accuracy",
                  title=f"rate sweep, {max(world_sizes)} ranks", ylim=(0, 1), xticks=rates,
                  xticklabels=[f"{lr:g}" for lr in rates])
        sweep.minorticks_off()
        sweep.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4,8,16")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-per-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.2, help="the rate tuned for one rank")
    parser.add_argument("--sweep", default="0.05,0.1,0.2,0.4,0.8,1.6,3.2",
                        help="rates tried at the largest world size ('' for none)")
    parser.add_argument("--sweep-seeds", help="the sweep's seeds (default: --seeds)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--sweep-only", action="store_true",
                        help="only the sweep, at the largest world size")
    parser.add_argument("--quick", action="store_true",
                        help="1, 2 and 8 ranks, one seed, 60 steps, no sweep")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.seeds, args.steps, args.sweep = "1,2,8", "0", 60, ""
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.sweep_seeds = ([int(s) for s in args.sweep_seeds.split(",")] if args.sweep_seeds
                        else args.seeds)
    args.sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    args.amp = "none"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    train_digits.load_digits(torch.device("cpu"))  # says what to install, up front
    started = time.perf_counter()
    results = []
    for world_size in args.world_sizes:
        largest = world_size == max(args.world_sizes)
        if args.sweep_only and not largest:
            continue
        jobs = [] if args.sweep_only else jobs_for(world_size, args)
        if largest and args.sweep:
            jobs += jobs_for(world_size, args, args.sweep)
        results += run_on_local_ranks(rank_jobs, world_size, jobs, args, timeout=3600)[0]
    summary = summarise(results, args)
    print_tables(summary, args)
    print(f"\n{time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": {k: v for k, v in vars(args).items()
                                  if k not in ("json", "plot")},
                       "summary": summary, "results": results}, handle, indent=1)
    if args.plot:
        plot(results, summary, args.plot, args)


if __name__ == "__main__":
    main()
