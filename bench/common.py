"""Helpers shared by the benchmarks: timing, the machine record, JSON and tables."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from importlib import metadata
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def csv_choices(choices: Sequence[str]) -> Callable[[str], List[str]]:
    """An argparse ``type`` for a comma-separated subset of ``choices``, order kept."""
    def parse(text: str) -> List[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return names
    return parse


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeats: int,
                     device: torch.device) -> Dict[str, List[float]]:
    """``repeats`` wall times in ms of each function.

    The functions are timed round-robin, one call of each per round with the
    starting function rotating, rather than each in one burst: on a small,
    shared machine the noise drifts over seconds, and interleaving spreads it
    over every function instead of penalising whichever ran in a bad second.
    Callers warm the functions up first.
    """
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def time_do_bench(fns: Mapping[str, Callable[[], object]]) -> Dict[str, List[float]]:
    """The times in ms of each function from ``triton.testing.do_bench`` (CUDA
    events, L2 flushed before every call, as many calls as fill 100 ms)."""
    from triton.testing import do_bench
    return {name: list(do_bench(fn, return_mode="all")) for name, fn in fns.items()}


def _package_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, backend: str) -> dict:
    """What a result depends on: hardware, library versions, and the backend used."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # other work on the machine distorts CPU timings; a high load explains outliers
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpu": gpu,
        "device": str(device),
        "backend": backend,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "fusedreduce": _package_version("fusedreduce"),
    }


def machine_summary(machine: dict) -> str:
    """One line for a table's header."""
    parts = [f"{machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} "
             f"torch threads)"]
    if machine["gpu"]:
        parts.append(machine["gpu"])
    parts.append(f"torch {machine['torch']}, triton {machine['triton']}")
    parts.append(f"device {machine['device']}, backend {machine['backend']}")
    if machine["loadavg_1min"] is not None:
        parts.append(f"load average {machine['loadavg_1min']:.2f} at start")
    return "; ".join(parts)


def warn_if_busy(machine: dict) -> None:
    """Say so on stderr when other work already occupies the CPU: every multi-threaded
    torch op then waits for a descheduled worker, and many-op methods suffer most."""
    load, cores = machine["loadavg_1min"], machine["cpu_count"]
    if machine["device"] == "cpu" and load is not None and cores and load > 0.5 * cores:
        log(f"warning: load average {load:.2f} on {cores} cores before the run; other work "
            f"is competing for the CPU and the timings will be noisy")


def write_json(path: str, machine: dict, config: dict, results: List[dict]) -> None:
    """Write ``{"machine", "config", "results"}``; non-finite numbers are refused."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    record = {"machine": machine, "config": config, "results": results}
    with open(path, "w") as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")


Column = Tuple[str, str, str]  # header, result key, format spec


def format_table(rows: Sequence[Mapping], columns: Sequence[Column],
                 group_by: Sequence[str] = ()) -> str:
    """An aligned text table; a blank line separates runs of rows that differ in ``group_by``.

    Text columns are left-aligned, numbers right-aligned.
    """
    cells = [[format(row[key], spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells])
              for i, (header, _, _) in enumerate(columns)]
    numeric = [bool(rows) and isinstance(rows[0][key], (int, float)) for _, key, _ in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line([header for header, _, _ in columns]), "  ".join("-" * w for w in widths)]
    previous = None
    for row, values in zip(rows, cells):
        group = tuple(row[key] for key in group_by)
        if previous is not None and group != previous:
            out.append("")
        previous = group
        out.append(line(values))
    return "\n".join(out)


def log(message: str) -> None:
    """Progress goes to stderr so stdout holds only the table."""
    print(message, file=sys.stderr, flush=True)


def time_across_ranks(fns: Mapping[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median over ``repeats`` of the slowest rank's time per call (ms), round-robin.

    Each call starts after a barrier; its time is all-reduced with MAX, so every
    rank returns the same figures. Every function runs once first as a warm-up.
    """
    import torch.distributed as dist
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for name in names:
        fns[name]()
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            fns[name]()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples[name].append(float(elapsed) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def _rank_main(body, rank, world_size, init_file, config, queue):
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=600))
        # the ranks share this machine's cores: don't oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
        try:
            queue.put((rank, True, body(rank, world_size, config)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it instead of waiting forever
        queue.put((rank, False, traceback.format_exc()))


def run_on_ranks(body, world_size: int, config: dict) -> Dict[int, dict]:
    """``{rank: body(rank, world_size, config)}``, each rank a spawned gloo process.

    ``body`` must be a module-level function returning a picklable record. A
    rank that raises stops the others and raises here with its traceback.
    """
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main,
                             args=(body, r, world_size, init_file, config, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: Dict[int, dict] = {}
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=3600)
            if not ok:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outcome[rank] = payload
        for p in procs:
            p.join()
    return outcome
