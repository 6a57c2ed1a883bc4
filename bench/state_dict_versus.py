"""The sharded optimizer's checkpoint calls, this checkout against another git revision.

    python -m fusedreduce.bench.state_dict_versus REV [--world-sizes 2,4] [--runs 3]

Times, for ``fused_sharded_adamw`` (``DistributedOptimizer(AdamW, shard=True)``
after two steps), the collective ``state_dict()``, ``state_dict(to=0)``,
``sharded_state_dict()`` and ``load_state_dict(whole)`` (the whole dict
``state_dict()`` gave, already in memory) on gloo ranks: each call's median over
``--repeats`` calls, each call the slowest rank's, round-robin
(``timing.time_across_ranks``). Two versions of one package cannot be
imported in one process, so each version runs in processes of its own: a
directory holds the revision's ``fusedreduce`` and ``kernels`` (from
``git archive``), another this checkout's, and both get *this* checkout's
benchmark code (models, timing), so only the library differs. The two
alternate ``--runs`` times on the same machine, and the table gives the
median of the runs' figures with the ratio before / after.

Prints one table (``--json PATH`` writes every run's figures); run it from
the repository (it needs git).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

from . import output_files

CALLS = ("state_dict", "state_dict_to0", "sharded_state_dict", "load_state_dict")
ROOT = Path(__file__).resolve().parent


def _tree(into: Path, revision: str) -> Path:
    """A directory whose ``fusedreduce`` package is ``revision``'s (None:
    this checkout's, as in the work tree), with this checkout's ``bench``."""
    package = into / "fusedreduce"
    if revision is None:
        source = _repository()
        shutil.copytree(source / "fusedreduce", package, ignore=shutil.ignore_patterns(
            "__pycache__"))
        shutil.copytree(source / "kernels", package / "kernels",
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "archive", revision, "fusedreduce", "kernels"],
                                 check=True, capture_output=True, cwd=_repository()).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
        (into / "kernels").rename(package / "kernels")
    shutil.copytree(ROOT, package / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def alternating_runs(revision: str, runs: int,
                     run_side: Callable[[Path, Path], List[dict]]) -> Dict[str, List[List[dict]]]:
    """``runs`` runs of ``run_side(tree, scratch)`` for each version, before
    (``revision``'s library) then after (this checkout's) in turn, each
    version in a ``_tree`` of its own; ``scratch`` is a file path of its own
    per run in a temporary directory. Their results, per version."""
    with tempfile.TemporaryDirectory(prefix="fusedreduce-versus-") as tmp:
        trees = {"before": _tree(Path(tmp) / "before", revision),
                 "after": _tree(Path(tmp) / "after", None)}
        results: Dict[str, List[List[dict]]] = {"before": [], "after": []}
        for n in range(runs):
            for side, tree in trees.items():
                results[side].append(run_side(tree, Path(tmp) / f"{side}.{n}.json"))
    return results


def _repository() -> Path:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return Path(top)


def _run_side(tree: Path, args) -> List[dict]:
    """One version's figures: this module's ``--worker`` with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.state_dict_versus", "--worker",
         "--world-sizes", args.world_sizes, "--models", args.models, "--dtypes", args.dtypes,
         "--sizes", args.sizes, "--repeats", str(args.repeats)],
        check=True, capture_output=True, text=True, env=env, cwd=tree)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def rank_times(rank: int, world_size: int, cases: List[dict], repeats: int) -> List[dict]:
    import torch

    from fusedreduce.bench import common, sharded_bench, timing
    out = []
    for case in cases:
        dtype = common.DTYPES[case["dtype"]]
        model, net, optimizer = sharded_bench.build(sharded_bench.SHARDED, case["model"],
                                                    case["size"], dtype)
        inputs, labels = sharded_bench.rank_batch(case["model"], model, dtype, rank,
                                                  sharded_bench.QUICK_SHAPES)
        for _ in range(2):
            optimizer.zero_grad()
            sharded_bench.batch_loss(net, inputs, labels).backward()
            optimizer.step()
        optimizer.finish_param_gather()
        whole = optimizer.state_dict()
        calls = {"state_dict": optimizer.state_dict,
                 "state_dict_to0": lambda: optimizer.state_dict(to=0),
                 "sharded_state_dict": optimizer.sharded_state_dict,
                 "load_state_dict": lambda: optimizer.load_state_dict(whole)}
        samples = timing.time_across_ranks(calls, repeats, torch.device("cpu"))
        out.append({**case, "world_size": world_size,
                    **{name: timing.summary_ms(times)["time_ms"]
                       for name, times in samples.items()}})
    return out


def _worker(args) -> None:
    import fusedreduce
    from fusedreduce.bench import common
    from fusedreduce.local_ranks import run_on_local_ranks
    cases = [{"model": m, "dtype": d, "size": s} for m in args.models.split(",")
             for d in args.dtypes.split(",") for s in common.parse_sizes(args.sizes)]
    library = Path(fusedreduce.__file__).resolve().parent.parent.name  # "before" or "after"
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        results = run_on_local_ranks(rank_times, world_size, cases, args.repeats,
                                     threads=max(1, (os.cpu_count() or 1) // world_size),
                                     timeout=1800)
        for record in results[0]:
            print(json.dumps({**record, "library": library}), flush=True)


def _key(record: dict) -> tuple:
    return record["model"], record["dtype"], record["size"], record["world_size"]


def report(runs: Dict[str, List[List[dict]]]) -> str:
    """The table: per case and call, median before → median after (ratio)."""
    medians: Dict[str, Dict[tuple, Dict[str, float]]] = {}
    for side, side_runs in runs.items():
        by_case: Dict[tuple, Dict[str, List[float]]] = {}
        for run in side_runs:
            for record in run:
                for call in CALLS:
                    by_case.setdefault(_key(record), {}).setdefault(call, []).append(
                        record[call])
        medians[side] = {k: {c: statistics.median(v) for c, v in calls.items()}
                         for k, calls in by_case.items()}
    lines = ["| model | dtype | size | ranks | " +
             " | ".join(f"{c} ms: before → after (x)" for c in CALLS) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in CALLS) + " |"]
    for key in sorted(medians["before"], key=lambda k: (k[3], k[0], k[1], k[2])):
        before, after = medians["before"][key], medians["after"].get(key)
        if after is None:
            continue
        cells = [f"{before[c]:.1f} → {after[c]:.1f} ({before[c] / after[c]:.2f}x)"
                 for c in CALLS]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", nargs="?", help="the git revision to compare against")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--models", default="resnet50,transformer")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sizes", default="4M", help="parameters per model (suffixes K/M/G)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per run")
    parser.add_argument("--runs", type=int, default=3,
                        help="alternating runs of each version")
    parser.add_argument("--json", type=output_files.output_file, help="write every run's figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    if not args.revision:
        parser.error("the revision to compare against is required")
    runs = alternating_runs(args.revision, args.runs, lambda tree, _: _run_side(tree, args))
    print(f"# {args.revision} (before) against this checkout (after); median of "
          f"{args.runs} alternating runs, each call's median of {args.repeats}")
    print(report(runs))
    if args.json:
        with output_files.open_output(args.json) as f:
            json.dump({"revision": args.revision, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
