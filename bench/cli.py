"""Measure fusedreduce's kernels and collectives against their torch baselines.

Commands: kernels (one process), collectives (N ranks: the reducer vs
per-tensor all_reduce and DDP-style buckets, a DDP training step with each
hook, AdaSum vs all_reduce), hooks and adasum (one part of collectives each)
and all (kernels, then collectives); sharded (its own ranks per world size:
sharded optimizers against DDP, step time and memory per rank) and gpu-check
have their own options; cluster makes a simulated multi-node cluster (network
namespaces, shaped links) and probes it or runs a script on it; model predicts
each reduction strategy's step time across nodes (and checks itself against
the simulated cluster). Tables go to
stdout, progress to stderr; --json and --plot keep every figure. Under torchrun (RANK, WORLD_SIZE and
MASTER_ADDR set) the command joins that launch instead of spawning workers,
and only rank 0 prints and writes.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from fusedreduce.kernels import resolve_backend

from . import (cluster, collectives_bench, common, gpu_check, kernels_bench, model_bench,
               output_files, plot, ranks, reduce_bench, sharded_bench)
from .models import TENSOR_LISTS

# command -> the parts it runs: "kernels" and the collectives' parts
COMMANDS: Dict[str, Sequence[str]] = {
    "kernels": ("kernels",),
    "collectives": ("reduce", "step", "adasum"),
    "hooks": ("step",),
    "adasum": ("adasum",),
    "clip": ("clip",),
    "all": ("kernels", "reduce", "step", "adasum"),
}
HELP = {
    "kernels": "flatten/unflatten kernels vs torch baselines and the copy bandwidth (one process)",
    "collectives": "reducer vs per-tensor all_reduce vs DDP buckets; DDP step with each hook; "
                   "AdaSum vs all_reduce (N ranks)",
    "hooks": "the training-step part of collectives: DDP vs the reducer's hooks and "
             "fusedreduce's DDP hooks",
    "adasum": "the AdaSum part of collectives: adasum_allreduce vs all_reduce, bytes sent",
    "clip": "reduce and clip the gradients: the reducer's fused clipping (max_grad_norm) vs "
            "torch's clip_grad_norm_(foreach=True) after it (N ranks)",
    "all": "kernels, then collectives",
}
QUICK_REPEATS = {"kernels": 10, "collectives": 3}
FULL_REPEATS = {"kernels": 20, "collectives": 7}
DEVICE_TIMER = kernels_bench.DEVICE_TIMER
COLLECTIVE_TIMER = "perf_counter after a barrier, the slowest rank's, round-robin"


def build_parser(prog: str = "fusedreduce-bench") -> argparse.ArgumentParser:
    """The command line: one subcommand per entry of ``COMMANDS``, the same options on each."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--quick", action="store_true",
                         help="small sizes and few repeats: `all --quick` takes about a "
                              "minute on a 2-core CPU with 2 workers")
    options.add_argument("--world-size", type=common.positive_number(int), metavar="N",
                         help="collectives: spawn N local workers (default 2; gloo on the "
                              "CPU, NCCL with one GPU each); under torchrun the launch's size")
    options.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                         help="default auto: cuda when available (for collectives: when "
                              "there is a GPU per worker), else cpu")
    options.add_argument("--dtype", type=common.csv_choices(kernels_bench.DTYPE_CHOICES),
                         help="gradient dtypes, comma-separated: the kernels' input (default "
                              "float16,bfloat16; --quick float16) and the collectives' "
                              "gradients (default float32); the training step is always "
                              "float32")
    options.add_argument("--sizes", type=common.parse_sizes,
                         help="gradient-set sizes in elements, comma-separated, decimal "
                              "suffixes K/M/G (kernels default 1M,4M,25.6M, --quick "
                              "250K,1M; collectives default 4M,25.6M, --quick 1M)")
    options.add_argument("--lists", type=common.csv_choices(tuple(TENSOR_LISTS)),
                         default=list(TENSOR_LISTS),
                         help="kernels: tensor lists, comma-separated (default "
                              "resnet50,transformer)")
    options.add_argument("--repeats", type=common.positive_number(int),
                         help="timed calls per method, median kept (default: kernels 20, "
                              "collectives 7; --quick 10 and 3); on CUDA the kernels' device "
                              "time alone, launch cost excluded")
    options.add_argument("--json", type=output_files.output_file,
                                   metavar="PATH", help="write machine, config and results here")
    options.add_argument("--plot", type=output_files.output_file, metavar="PATH.png",
                         help="write a PNG of GB/s against size per method (needs "
                              "matplotlib: pip install matplotlib)")
    options.add_argument("--no-progress", action="store_true",
                         help="no progress bar or per-case lines on stderr")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        subparsers.add_parser(name, parents=[options], help=HELP[name], description=HELP[name])
    gpu_check.add_parser(subparsers)
    sharded_bench.add_parser(subparsers)
    cluster.add_parser(subparsers)
    model_bench.add_parser(subparsers)
    return parser


#: benchmarks that measure work beside the collective run on one rank too (the
#: all-reduce is then a copy), so a machine with one GPU can run them
ONE_RANK_COMMANDS = frozenset({"clip"})


def min_ranks(command: str) -> int:
    """The fewest ranks ``command``'s collectives part runs on."""
    return 1 if command in ONE_RANK_COMMANDS else 2


def _device_type(requested: str, needs_ranks: bool, world_size: int, joined: bool) -> str:
    """``cpu`` or ``cuda``; spawned collectives need one GPU per worker."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = gpus >= 1 and (joined or not needs_ranks or gpus >= world_size)
    if requested == "auto":
        return "cuda" if enough else "cpu"
    if requested == "cuda" and not gpus:
        raise SystemExit("--device cuda: CUDA is not available here")
    if requested == "cuda" and not enough:
        raise SystemExit(f"--device cuda: {gpus} GPU(s) visible, but {world_size} local "
                         f"workers need one each")
    return requested


def _kernel_config(args: argparse.Namespace, device: torch.device) -> dict:
    return {"lists": args.lists,
            "sizes": args.sizes or (kernels_bench.QUICK_SIZES if args.quick
                                    else kernels_bench.DEFAULT_SIZES),
            "dtypes": args.dtype or (kernels_bench.QUICK_DTYPES if args.quick
                                     else kernels_bench.DEFAULT_DTYPES),
            "scales": list(kernels_bench.QUICK_SCALES if args.quick else kernels_bench.SCALES),
            "repeats": args.repeats or (QUICK_REPEATS if args.quick
                                        else FULL_REPEATS)["kernels"],
            "flat_dtype": common.dtype_name(kernels_bench.FLAT_DTYPE),
            "timer": (DEVICE_TIMER if device.type == "cuda"
                      else "perf_counter, round-robin")}


def _collective_config(args: argparse.Namespace, parts: Sequence[str], world_size: int,
                       backend: str) -> dict:
    return {"parts": list(parts),
            "sizes": args.sizes or (collectives_bench.QUICK_SIZES if args.quick
                                    else collectives_bench.DEFAULT_SIZES),
            "dtypes": args.dtype or collectives_bench.DEFAULT_DTYPES,
            "repeats": args.repeats or (QUICK_REPEATS if args.quick
                                        else FULL_REPEATS)["collectives"],
            "world_size": world_size, "backend": backend,
            # the training step's per-rank batch: images of image x image pixels
            "batch": 2, "image": 32 if args.quick else 64,
            "bucket_cap_mb": reduce_bench.BUCKET_CAP_MB,
            "timer": COLLECTIVE_TIMER}


def _ms(value: float) -> str:
    return format(value, ".4g")


def _columns(benchmark: str, baseline: str) -> List[common.Column]:
    columns: List[common.Column] = [
        ("case", "case", ""), ("elements", "n_elements", ",d"), ("method", "method", ""),
        ("role", "role", ""), ("ms", "time_ms", _ms), ("min ms", "time_ms_min", _ms),
        ("GB/s", "gbps", ".4g"), (f"x {baseline}", "ratio", ".2f")]
    if benchmark == "step":
        columns.append(("compute ms", "compute_ms", _ms))
    if benchmark == "clip":
        columns += [("clip ms", "clip_ms", _ms), ("launches", "launches", "d")]
    if benchmark == "adasum":
        columns += [("MB sent/rank", "bytes_sent_per_rank", lambda v: f"{v / 1e6:,.2f}"),
                    ("how", "bytes_sent_source", ""), ("x ring", "ratio_to_ring_bytes", ".4f")]
    return columns


NOTES = {
    "kernels": "GB/s: every element read once and written once / time; x copy: the "
               "single-tensor copy's time over the method's (1.00 = copy bandwidth); "
               "fusedreduce_host: host time of a steady-state call on the Triton path, "
               "the kernel's execution excluded; fusedreduce_host_moved: the same, every "
               "call's tensors at other addresses (gradients set to None), two sets in "
               "turn; fusedreduce_host_new: at addresses the launch has not kept; "
               "fusedreduce_host_prepared: a prepared handle's call (no layout check)",
    "reduce": "mean of every rank's gradients; GB/s: gradient bytes / time (algbw); "
              "x per_tensor: its time over the method's",
    "step": "forward + backward + gradient reduction; GB/s: gradient bytes / step time; "
            "compute ms: the same step without communication",
    "adasum": "GB/s: gradient bytes / time; x all_reduce: its time over the method's; "
              "bytes sent per rank counted for adasum, ring model for the others",
    "clip": "mean of every rank's gradients, clipped to a total 2-norm of 1; clip ms: the "
            "method's time minus reduce_only's (what clipping costs)",
}
SUMMARY = [("benchmark", "benchmark", ""), ("case", "case", ""),
           ("elements", "n_elements", ",d"), ("baseline", "baseline", ""),
           ("ms", "baseline_ms", _ms), ("GB/s", "baseline_gbps", ".4g"), ("ours", "ours", ""),
           ("ms", "ours_ms", _ms), ("GB/s", "ours_gbps", ".4g"), ("speed-up", "speedup", ".2f")]


def summary_rows(results: Sequence[dict]) -> List[dict]:
    """For every case and size: each of our methods beside the fastest baseline."""
    rows = []
    for key in dict.fromkeys((r["benchmark"], r["case"], r["size"]) for r in results):
        group = [r for r in results if (r["benchmark"], r["case"], r["size"]) == key]
        best = min((r for r in group if r["role"] == "baseline"), key=lambda r: r["time_ms"])
        for ours in (r for r in group if r["role"] == "ours"):
            rows.append({"benchmark": key[0], "case": key[1], "n_elements": ours["n_elements"],
                         "baseline": best["method"], "baseline_ms": best["time_ms"],
                         "baseline_gbps": best["gbps"], "ours": ours["method"],
                         "ours_ms": ours["time_ms"], "ours_gbps": ours["gbps"],
                         "speedup": best["time_ms"] / ours["time_ms"]})
    return rows


def print_report(results: Sequence[dict], machine: dict, elapsed: float) -> None:
    """The tables, on stdout: one per benchmark, then baseline against ours."""
    print(f"# {common.machine_summary(machine)}")
    print("# time: median of the timed calls after a warm-up (collectives: the slowest rank's)")
    for benchmark in dict.fromkeys(r["benchmark"] for r in results):
        rows = [r for r in results if r["benchmark"] == benchmark]
        print(f"\n## {benchmark}: {NOTES[benchmark]}")
        print(common.format_table(rows, _columns(benchmark, rows[0]["baseline"]),
                                  group_by=("case", "size")))
    print("\n## baseline vs ours: the fastest baseline of each case beside each of our "
          "methods; speed-up: baseline time / ours")
    print(common.format_table(summary_rows(results), SUMMARY, group_by=("benchmark", "case")))
    print(f"\n# {elapsed:.1f} s in all")


def main(argv: Optional[Sequence[str]] = None, prog: str = "fusedreduce-bench") -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    args = build_parser(prog).parse_args(argv)
    if args.command == "gpu-check":
        return gpu_check.main(args)
    if args.command == sharded_bench.NAME:
        return sharded_bench.main(args)
    if args.command == cluster.NAME:
        return cluster.main(args)
    if args.command == model_bench.NAME:
        return model_bench.main(args)
    if args.plot:
        plot.require_matplotlib()  # before any measurement
    parts = COMMANDS[args.command]
    collective_parts = [part for part in parts if part != "kernels"]
    joined = ranks.torchrun_env()
    world_size = args.world_size or 2
    device_type = _device_type(args.device, bool(collective_parts), world_size, joined)
    backend = "nccl" if device_type == "cuda" else "gloo"
    rank = 0
    if joined:
        rank, world_size = ranks.join_launch(backend)
        if args.world_size not in (None, world_size):
            raise SystemExit(f"--world-size {args.world_size}, but torchrun launched "
                             f"{world_size} ranks")
    if collective_parts and world_size < min_ranks(args.command):
        raise SystemExit(f"{args.command} needs at least {min_ranks(args.command)} ranks, "
                         f"got --world-size {world_size}")
    lead = rank == 0
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    machine = common.machine_info(device, resolve_backend("auto", device),
                                  backend if collective_parts else None)
    kernel_config = _kernel_config(args, device) if "kernels" in parts else None
    collective_config = (_collective_config(args, collective_parts, world_size, backend)
                         if collective_parts else None)
    config = {"command": args.command, "quick": args.quick,
              "launcher": "torchrun" if joined else "spawn",
              "kernels": kernel_config, "collectives": collective_config}
    steps = ((kernels_bench.n_steps(kernel_config) if kernel_config else 0)
             + (len(collectives_bench.cases(collective_config)) if collective_config else 0))
    progress = common.Progress(steps, enabled=lead and not args.no_progress)
    if lead:
        common.warn_if_busy(machine)

    started = time.perf_counter()
    results: List[dict] = []
    if kernel_config and lead:  # under torchrun, rank 0 alone times the kernels
        results += kernels_bench.run(kernel_config, device, progress)
    if collective_config:
        if joined:
            dist.barrier()  # the other ranks wait for rank 0's kernels
        results += collectives_bench.run(collective_config, progress, joined)
    elapsed = time.perf_counter() - started

    if lead:
        print_report(results, machine, elapsed)
        if args.json:
            common.write_json(args.json, machine, config, results)
            common.log(f"wrote {args.json}")
        if args.plot:
            plot.write_plot(args.plot, results, common.machine_summary(machine))
            common.log(f"wrote {args.plot}")
    if joined:
        dist.destroy_process_group()
    return 0
