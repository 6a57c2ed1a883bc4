"""Does a compressed wire hurt training? A small character GPT trained with each wire format.

    python examples/train_wire.py                       # 4 local gloo ranks, 2 "nodes" of 2
    python examples/train_wire.py --cluster 1gbit       # the same over a simulated 2-node cluster (root)
    python examples/train_wire.py --quick               # a short run, to see it work
    python examples/train_wire.py --shard               # the sharded optimizer (ZeRO-1)

Every run trains the same decoder (``train_gpt.py``'s: tied embeddings,
AdamW, warm-up and cosine decay) on the same data from the same seed, on 4
ranks that ``local_size=2`` groups in 2 nodes, with
``fusedreduce.DistributedOptimizer(opt, local_size=2, wire_dtype=...,
error_feedback=...)``: only the format of the cross-node hop changes. The
text is the documentation of Python's standard library as it ships (the
docstrings of a fixed list of modules, read from their source: nothing is
downloaded); its last tenth is the validation set, never trained on.

For each wire (``fp32``: full precision, the fixed-order sum;
``fp32-ring``: full precision, gloo's ring over all ranks, whose gap to
``fp32`` is what a mere rounding difference does to a run; ``bf16``; ``e4m3`` and
``int8``, blockwise with an fp32 scale per block, each with and without
error feedback) and each seed, rank 0 records the validation loss every
``--eval-every`` iterations; the report gives the final validation loss
against the fp32 wire's of the same seed, and the iteration at which the
validation loss first reached the target (the fp32 wire's final loss times
``1 + --target-margin``). ``--json`` writes every curve, ``--plot`` draws
them (matplotlib: the ``examples`` extra). ``--shard`` trains with
``shard=True``: the optimizer state sharded over the 4 ranks, the gradients
reduce-scattered and the parameters all-gathered on the two levels.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, learning_rate  # noqa: E402  (the example next to this one)

import fusedreduce  # noqa: E402
from fusedreduce.local_ranks import run_on_local_ranks  # noqa: E402

#: the wire formats compared: (name, wire_dtype, error_feedback)
WIRES = {
    "fp32": (torch.float32, False),
    # the default sum (no wire_dtype) over all ranks flat (gloo's ring): fp32
    # too, in another order than fp32's pairwise tree, so its gap to "fp32"
    # is what another rounding of the same sums does to a run
    "fp32-ring": (None, False),
    "bf16": (torch.bfloat16, False),
    "e4m3": (torch.float8_e4m3fn, False),
    "e4m3+ef": (torch.float8_e4m3fn, True),
    "int8": (torch.int8, False),
    "int8+ef": (torch.int8, True),
}
#: standard-library modules whose docstrings are the text: prose, stable across
#: the Python versions fusedreduce supports, together about 300 kB
MODULES = ("argparse", "collections", "contextlib", "dataclasses", "datetime", "decimal",
           "difflib", "enum", "fractions", "functools", "heapq", "inspect", "ipaddress",
           "pathlib", "pickle", "random", "statistics", "string", "subprocess", "textwrap",
           "threading", "typing", "zipfile")


def library_text() -> str:
    """The docstrings of ``MODULES``, in order, read from their source files."""
    parts = []
    for name in MODULES:
        origin = importlib.util.find_spec(name).origin
        if origin.endswith("__init__.py") or not origin.endswith(".py"):
            continue
        tree = ast.parse(open(origin, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts)


def encode(text: str):
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    return torch.tensor([index[c] for c in text]), len(alphabet)


def validation_loss(model, data: torch.Tensor, args) -> float:
    """The mean loss over fixed windows of ``data`` (the same on every run)."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(len(data) - args.context - 1, (args.eval_windows,),
                           generator=generator)
    windows = torch.stack([data[s:s + args.context + 1] for s in starts.tolist()])
    model.eval()
    with torch.no_grad():
        losses = [model(w[:, :-1], w[:, 1:]).item() for w in windows.split(64)]
    model.train()
    return statistics.fmean(losses)


def train(wire: str, seed: int, args, train_data, valid_data, vocabulary: int) -> dict:
    rank = dist.get_rank()
    wire_dtype, feedback = WIRES[wire]
    torch.manual_seed(seed)  # the same initial model on every rank and every wire
    model = GPT(vocabulary, args.context, args.width, args.layers, args.heads)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = fusedreduce.DistributedOptimizer(
        torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, betas=(0.9, 0.95)),
        local_size=1 if wire == "fp32-ring" else args.local_size, wire_dtype=wire_dtype,
        error_feedback=feedback,
        max_grad_norm=args.grad_clip, shard=args.shard)
    data_generator = torch.Generator().manual_seed(seed * 1000 + rank)
    curve, started = [], time.perf_counter()
    for iteration in range(args.iterations):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(iteration, args)
        starts = torch.randint(len(train_data) - args.context - 1, (args.batch,),
                               generator=data_generator)
        window = torch.stack([train_data[s:s + args.context + 1] for s in starts.tolist()])
        model(window[:, :-1], window[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (iteration + 1) % args.eval_every == 0 or iteration + 1 == args.iterations:
            curve.append((iteration + 1, validation_loss(model, valid_data, args)))
    seconds = time.perf_counter() - started
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(weights.numpy().tobytes()).hexdigest())
    return {"wire": wire, "seed": seed, "curve": curve, "seconds": seconds,
            "ranks_equal": len(set(digests)) == 1}


def run(rank: int, world_size: int, args) -> list:
    torch.set_num_threads(1)  # a small model: threads only spin on a shared host
    data, vocabulary = encode(library_text())
    split = len(data) * 9 // 10
    train_data, valid_data = data[:split], data[split:]
    return [train(wire, seed, args, train_data, valid_data, vocabulary)
            for seed in args.seeds for wire in args.wire]


def first_reaching(curve, target: float):
    return next((it for it, loss in curve if loss <= target), None)


def summarise(results: list, args) -> list:
    """Per wire: each seed's final validation loss against the fp32 wire's, and
    the iteration it reached the target."""
    reference = {r["seed"]: r for r in results if r["wire"] == "fp32"}
    rows = []
    for wire in args.wire:
        runs = [r for r in results if r["wire"] == wire]
        finals = [r["curve"][-1][1] for r in runs]
        relative = [r["curve"][-1][1] / reference[r["seed"]]["curve"][-1][1] - 1
                    for r in runs if r["seed"] in reference]
        reached = [first_reaching(r["curve"], reference[r["seed"]]["curve"][-1][1]
                                  * (1 + args.target_margin))
                   for r in runs if r["seed"] in reference]
        rows.append({"wire": wire, "final": statistics.fmean(finals),
                     "worst_relative": max(relative, key=abs) if relative else None,
                     "reached": reached, "ranks_equal": all(r["ranks_equal"] for r in runs),
                     "seconds": statistics.fmean(r["seconds"] for r in runs)})
    return rows


def report(results: list, args, where: str) -> None:
    print(f"train_wire: {where}; {args.iterations} iterations x {args.batch} windows of "
          f"{args.context} per rank, seeds {args.seeds}; target = fp32 final x "
          f"(1 + {args.target_margin})")
    print(f"{'wire':>10}  {'final val loss':>14}  {'vs fp32 (worst seed)':>20}  "
          f"{'iteration at target':>20}  {'s/run':>6}  ranks equal")
    for row in summarise(results, args):
        worst = "-" if row["worst_relative"] is None else f"{row['worst_relative']:+.3%}"
        reached = ",".join("-" if r is None else str(r) for r in row["reached"]) or "-"
        print(f"{row['wire']:>10}  {row['final']:14.4f}  {worst:>20}  {reached:>20}  "
              f"{row['seconds']:6.1f}  {row['ranks_equal']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"where": where, "args": {k: v for k, v in vars(args).items()
                                                if k not in ("json", "plot")},
                       "results": results}, handle)
    if args.plot:
        plot(results, args)


def plot(results: list, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (axis, gap) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    reference = {r["seed"]: dict(r["curve"]) for r in results if r["wire"] == "fp32"}
    for index, wire in enumerate(args.wire):
        for n, r in enumerate(r for r in results if r["wire"] == wire):
            its, losses = zip(*r["curve"])
            label = wire if n == 0 else None
            axis.plot(its, losses, color=f"C{index}", alpha=0.85, linewidth=1.2, label=label)
            gap.plot(its, [100 * (loss / reference[r["seed"]][it] - 1)
                           for it, loss in zip(its, losses)],
                     color=f"C{index}", alpha=0.85, linewidth=1.2, label=label)
    axis.set_xlabel("iteration")
    axis.set_ylabel("validation loss")
    axis.set_title(f"4 ranks, local_size {args.local_size}: the cross-node wire's format")
    axis.legend()
    gap.axhline(0.0, color="black", linewidth=0.6)
    gap.set_xlabel("iteration")
    gap.set_ylabel("validation loss against the fp32 wire's, same seed (%)")
    gap.set_title("each seed against its fp32 run")
    figure.tight_layout()
    figure.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}", file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2, help="ranks per node")
    parser.add_argument("--cluster", metavar="RATE",
                        help="run over a simulated cluster with links of RATE (root)")
    parser.add_argument("--wire", default=",".join(WIRES))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--target-margin", type=float, default=0.01)
    parser.add_argument("--quick", action="store_true", help="few iterations, one seed")
    parser.add_argument("--shard", action="store_true",
                        help="the sharded optimizer (shard=True): state sharded over the ranks")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args(argv)
    args.wire = [w.strip() for w in args.wire.split(",") if w.strip()]
    unknown = sorted(set(args.wire) - set(WIRES))
    if unknown or not args.wire:
        parser.error(f"--wire: unknown {unknown}; choose from {','.join(WIRES)}")
    if "fp32" not in args.wire:
        args.wire.insert(0, "fp32")  # the reference every other wire is compared with
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.quick:
        args.iterations, args.eval_every, args.seeds = 30, 10, args.seeds[:1]
        args.eval_windows, args.warmup = 64, 5
    if args.world_size % args.local_size:
        parser.error(f"--local-size {args.local_size} must divide --world-size "
                     f"{args.world_size}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cluster:
        from fusedreduce.bench.cluster import Cluster, format_probe

        nodes = args.world_size // args.local_size
        with Cluster(nodes=nodes, ranks_per_node=args.local_size, rate=args.cluster) as cluster:
            print(format_probe(cluster.probe()))
            where = f"simulated cluster, {nodes} nodes x {args.local_size} ranks, links {args.cluster}"
            results = cluster.run(run, args, timeout=6 * 3600)[0]
    else:
        where = f"{args.world_size} local gloo ranks, local_size {args.local_size}"
        results = run_on_local_ranks(run, args.world_size, args, timeout=6 * 3600)[0]
    report(results, args, where + (", shard=True" if args.shard else ""))


if __name__ == "__main__":
    main()
