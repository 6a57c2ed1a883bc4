"""``fusedreduce-bench sharded`` for this checkout against another git revision, alternating runs.

    python -m fusedreduce.bench.sharded_versus REV [--runs 2] [--methods M,M] [sharded options]

Memory counts do not vary between runs, but step times on a shared VM drift
by tens of percent from one run to the next, so a before/after claim needs
both versions measured in turn on the same machine. Each version runs
``fusedreduce-bench sharded`` in processes of its own: the revision's
``fusedreduce`` and ``kernels`` come from ``git archive`` (this checkout's
from its work tree), and both get this checkout's ``bench``, so only the
library differs (``state_dict_versus.alternating_runs``). The runs alternate, before
then after, ``--runs`` times; every option this tool does not know
(``--world-sizes 2,4 --repeats 5``, ``--quick``) goes to
``fusedreduce-bench sharded`` unchanged.

Prints one table: per case and method, what a rank holds between steps
(``held_bytes``), the peak during a step (``peak_bytes``) and the step time
(``time_ms``), each the median over the runs, before → after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .state_dict_versus import alternating_runs
from . import output_files

#: the methods the table shows unless --methods says otherwise
DEFAULT_METHODS = ("fused_sharded_adamw", "fused_sharded_grads_adamw")
#: (column, record key, unit scale, format)
COLUMNS = (("held MB", "held_bytes", 1e-6, ".2f"), ("peak MB", "peak_bytes", 1e-6, ".2f"),
           ("ms", "time_ms", 1.0, ".1f"))


def _run_side(tree: Path, bench_args: List[str], into: Path) -> List[dict]:
    """One run of ``fusedreduce-bench sharded`` with ``tree``'s library: its result records."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", "fusedreduce.bench", "sharded", *bench_args,
                    "--no-progress", "--json", str(into)],
                   check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(into.read_text())["results"]


def _key(record: dict) -> tuple:
    return (record["world_size"], record["model"], record["dtype"], record["size"],
            record["method"])


def _median(records: List[dict], key: str) -> Optional[float]:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(runs: Dict[str, List[List[dict]]], methods) -> str:
    """The table: per case and method, median before → median after (after / before)."""
    grouped: Dict[str, Dict[tuple, List[dict]]] = {}
    for side, side_runs in runs.items():
        for run in side_runs:
            for record in run:
                if record["method"] in methods and record.get("time_ms") is not None:
                    grouped.setdefault(side, {}).setdefault(_key(record), []).append(record)
    lines = ["| ranks | model | dtype | size | method | " +
             " | ".join(f"{name}: before → after (x)" for name, *_ in COLUMNS) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    before, after = grouped.get("before", {}), grouped.get("after", {})
    for key in sorted(set(before) & set(after)):
        cells = []
        for _, field, scale, fmt in COLUMNS:
            old, new = _median(before[key], field), _median(after[key], field)
            if old is None or new is None:
                cells.append("-")
                continue
            ratio = f" ({new / old:.2f}x)" if old else ""
            cells.append(f"{old * scale:{fmt}} → {new * scale:{fmt}}{ratio}")
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _passed_on() -> List[str]:
    """The options of ``fusedreduce-bench sharded`` this tool passes on."""
    from . import sharded_bench
    holder = argparse.ArgumentParser().add_subparsers()
    sharded_bench.add_parser(holder)
    options = [o for action in holder.choices[sharded_bench.NAME]._actions
               for o in action.option_strings]
    return [o for o in options if o not in ("-h", "--help", "--json", "--plot", "--no-progress")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"passed on to fusedreduce-bench sharded: {', '.join(_passed_on())}")
    parser.add_argument("revision", help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=2, help="alternating runs of each version")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated methods the table shows (default %(default)s)")
    parser.add_argument("--json", type=output_files.output_file, help="write every run's records here")
    args, bench_args = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be positive, got {args.runs}")
    if "--plot" in bench_args:
        parser.error("--plot is not passed on (each run's figures go to --json)")
    methods = set(args.methods.split(","))
    runs = alternating_runs(args.revision, args.runs,
                            lambda tree, into: _run_side(tree, bench_args, into))
    print(f"# {args.revision} (before) against this checkout (after): fusedreduce-bench sharded "
          f"{' '.join(bench_args)}; median of {args.runs} alternating runs")
    print(report(runs, methods))
    if args.json:
        with output_files.open_output(args.json) as f:
            json.dump({"revision": args.revision, "bench_args": bench_args, "runs": runs}, f,
                      indent=1)


if __name__ == "__main__":
    main()
