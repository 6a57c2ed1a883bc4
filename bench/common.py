"""What the benchmarks share: sizes, result records, the machine record, JSON, tables, progress.

Timing is in ``timing.py``, starting and joining ranks in ``ranks.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from importlib import metadata
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .output_files import open_output, output_file
from .timing import summary_ms

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


_SUFFIXES = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}


def parse_sizes(text: str) -> List[int]:
    """``"256K,1M,25.6M"`` -> ``[256000, 1000000, 25600000]``: element counts, decimal
    suffixes K, M, G (case-insensitive). An argparse ``type``."""
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kKmMgG]?)", item.replace("_", ""))
        size = round(float(match[1]) * _SUFFIXES[match[2].upper()]) if match else 0
        if size < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated element counts such as 256K,1M,25.6M, got {text!r}")
        sizes.append(size)
    return sizes


def positive_number(kind: type = float, *, zero: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite ``kind`` (``int`` or ``float``) above 0,
    or at least 0 with ``zero``; anything else is a parser error naming the
    option (``int("0")`` steps, NaN or infinite figures would only fail later,
    in a traceback, or print nonsense)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"expected a {'non-negative' if zero else 'positive'} "
                f"{'integer' if kind is int else 'finite number'}, got {text!r}")
        return value
    return parse


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """The options every one-model step tool (``one_gpu_step``, ``join_cost``)
    takes: the ResNet-50's parameter count, its batch and image side (each at
    least 1: a parser error otherwise), the device and a JSON path."""
    parser.add_argument("--size", type=parse_sizes, default=[25_600_000],
                        help="the model's parameter count, e.g. 25.6M (default)")
    parser.add_argument("--batch", type=positive_number(int), default=32)
    parser.add_argument("--image", type=positive_number(int), default=128,
                        help="image side in pixels")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--json", type=output_file, metavar="PATH",
                        help="write the configuration and figures")


def parse_counts(text: str) -> List[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: comma-separated positive integers. An argparse ``type``."""
    parse = positive_number(int)
    return [parse(part.strip()) for part in text.split(",")]


def format_count(n: int) -> str:
    """``25_600_000`` -> ``"25.6M"``: the inverse of ``parse_sizes`` for labels."""
    for suffix, factor in (("G", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def result(benchmark: str, case: str, size: int, method: str, role: str, baseline: str,
           world_size: int, n_tensors: int, n_elements: int, nbytes: int,
           samples: Mapping[str, Sequence[float]], **extra) -> dict:
    """One result record in the JSON's schema (docs/benchmarks/index.md, "The JSON").

    ``samples`` holds every method's times in ms from the same run; the
    record's ``time_ms`` is the median of ``samples[method]``, ``gbps`` is
    ``nbytes`` over it, and ``ratio`` is the baseline's median over it (above 1:
    faster than the baseline).
    """
    times = summary_ms(samples[method])
    return {"benchmark": benchmark, "case": case, "size": size, "method": method, "role": role,
            "baseline": baseline, "world_size": world_size, "n_tensors": n_tensors,
            "n_elements": n_elements, "bytes": nbytes, **times,
            "gbps": nbytes / (times["time_ms"] * 1e6),
            "ratio": summary_ms(samples[baseline])["time_ms"] / times["time_ms"], **extra}


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


def one_device(requested: str) -> torch.device:
    """The device of a one-process command's ``--device auto|cuda|cpu``:
    ``auto`` is CUDA when there is a GPU; ``cuda`` without one exits saying so."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def machine_info(device: torch.device, kernel_backend: str,
                 dist_backend: Optional[str]) -> dict:
    """What a result depends on: hardware, library versions, and the backends used.

    ``kernel_backend`` is the kernels' (``triton`` or ``torch``), ``dist_backend``
    the collectives' (``gloo``, ``nccl``, or None when no collective ran).
    """
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # other work on the machine distorts CPU timings; a high load explains outliers
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": str(device),
        "kernel_backend": kernel_backend,
        "dist_backend": dist_backend,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "fusedreduce": _package_version("fusedreduce"),
    }


def machine_summary(machine: dict) -> str:
    """One line for a table's header."""
    parts = [f"{machine['cpu_model']} ({machine['cores']} cores)"]
    if machine["gpu"]:
        parts.append(f"{machine['gpu_count']} x {machine['gpu']}")
    parts.append(f"python {machine['python']}, torch {machine['torch']}, "
                 f"triton {machine['triton']}")
    backends = f"kernels: {machine['kernel_backend']}"
    if machine["dist_backend"]:
        backends += f", collectives: {machine['dist_backend']}"
    parts.append(backends)
    if machine["loadavg_1min"] is not None:
        parts.append(f"load average {machine['loadavg_1min']:.2f} at start")
    return "; ".join(parts)


def warn_if_busy(machine: dict) -> None:
    """Say so on stderr when other work already occupies the CPU: every multi-threaded
    torch op then waits for a descheduled worker, and many-op methods suffer most."""
    load, cores = machine["loadavg_1min"], machine["cores"]
    if machine["device"] == "cpu" and load is not None and cores and load > 0.5 * cores:
        log(f"warning: load average {load:.2f} on {cores} cores before the run; other work "
            f"is competing for the CPU and the timings will be noisy")


def write_json(path: str, machine: dict, config: dict, results: List[dict]) -> None:
    """Write ``{"machine", "config", "results"}``; non-finite numbers are refused."""
    record = {"machine": machine, "config": config, "results": results}
    with open_output(path) as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")


# header, result key, format spec (a str for format(), or a function of the value)
Column = Tuple[str, str, Union[str, Callable[[object], str]]]


def format_table(rows: Sequence[Mapping], columns: Sequence[Column],
                 group_by: Sequence[str] = ()) -> str:
    """An aligned text table; a blank line separates runs of rows that differ in ``group_by``.

    Text columns are left-aligned, numbers right-aligned.
    """
    def cell(value, spec) -> str:
        if value is None:
            return "-"
        return spec(value) if callable(spec) else format(value, spec)

    cells = [[cell(row[key], spec) for _, key, spec in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells])
              for i, (header, _, _) in enumerate(columns)]
    numeric = [any(isinstance(row[key], (int, float)) for row in rows) for _, key, _ in columns]

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
    """Progress goes to stderr so stdout holds only the tables."""
    # on a terminal, first clear a progress bar drawn on the current line
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    print(prefix + message, file=sys.stderr, flush=True)


class Progress:
    """A progress bar over a known number of steps, on stderr.

    On a terminal one line is redrawn in place; otherwise (a log file, a CI
    run) each step logs one line. ``state()`` hands the count to worker
    processes, whose rank 0 continues the same bar.
    """

    WIDTH = 24

    def __init__(self, total: int, done: int = 0, enabled: bool = True,
                 started: Optional[float] = None) -> None:
        self.total, self.done, self.enabled = max(total, 1), done, enabled
        self.started = time.time() if started is None else started

    def state(self) -> dict:
        return {"total": self.total, "done": self.done, "enabled": self.enabled,
                "started": self.started}

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Show ``label`` as the step under way; count it done when the block exits."""
        self._show(label)
        yield
        self.done += 1
        if self.done == self.total and self.enabled and sys.stderr.isatty():
            self._show("done")
            print(file=sys.stderr, flush=True)

    def _show(self, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.started
        if sys.stderr.isatty():
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            print(f"\r\033[K[{bar}] {self.done}/{self.total} {elapsed:4.0f}s {label}",
                  end="", file=sys.stderr, flush=True)
        else:
            print(f"[{self.done + 1}/{self.total} {elapsed:.0f}s] {label}", file=sys.stderr,
                  flush=True)
