"""What the benchmark tests share: running the CLI once and checking its figures.

The benchmark tests prove that a benchmark runs and writes well-formed
results, never that one method is faster than another: no timing is asserted.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import pytest

from harness import ROOT, once_per_session, shared_directory

# the JSON's documented keys (docs/benchmarks/index.md, "The JSON")
MACHINE_KEYS = {"cpu_model", "cores", "torch_threads", "loadavg_1min", "gpu", "gpu_count",
                "device", "kernel_backend", "dist_backend", "python", "torch", "triton"}
RESULT_KEYS = {"benchmark", "case", "size", "method", "role", "baseline", "world_size",
               "n_tensors", "n_elements", "bytes", "time_ms", "time_ms_min", "gbps", "ratio"}
# every measured figure of a record: each must be a positive, finite number
FIGURES = ("time_ms", "time_ms_min", "gbps", "ratio")


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def run_bench(args: Sequence[str], json_path: Path,
              timeout: float = 600) -> Tuple[subprocess.CompletedProcess, Optional[dict]]:
    """``python -m fusedreduce.bench *args --json json_path``: (the process, the JSON record).

    The installed package, not the checkout's ``bench`` directory, is what
    runs: the same code as the ``fusedreduce-bench`` console script.
    """
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench", *args, "--json", str(json_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    record = json.loads(json_path.read_text()) if json_path.exists() else None
    return process, record


def run_bench_once(tmp_path_factory, name: str, args: Sequence[str]
                   ) -> Tuple[subprocess.CompletedProcess, Optional[dict], Path]:
    """``run_bench(args)`` once per test session, shared by pytest-xdist's workers
    (``harness.once_per_session``: a benchmark costs a minute of a small CPU).

    ``{dir}`` in ``args`` stands for the run's own directory (for other files
    it writes). Returns (process, record, that directory).
    """
    def run(directory: Path):
        process, record = run_bench([arg.format(dir=directory) for arg in args],
                                    directory / "result.json")
        return process, record

    process, record = once_per_session(tmp_path_factory, f"bench-{name}", run)
    return process, record, shared_directory(tmp_path_factory, f"bench-{name}")


def quick_run_fixture(name: str, args: Sequence[str], what: str):
    """A module fixture: ``(process, JSON record)`` of one benchmark run with
    ``args`` (``what`` describes it), once per test session."""
    @pytest.fixture(scope="module")
    def quick_run(tmp_path_factory):
        process, record, _ = run_bench_once(tmp_path_factory, name, args)
        return process, record

    quick_run.__doc__ = f"One {what}: (process, JSON record)."
    return quick_run


def assert_exits_cleanly_and_prints(process: subprocess.CompletedProcess,
                                    methods: Sequence[str]) -> None:
    """The benchmark exited with 0 and its tables name every method."""
    assert process.returncode == 0, process.stderr
    for method in methods:
        assert method in process.stdout


def check_record(record: Optional[dict], benchmarks: Sequence[str]) -> List[dict]:
    """Assert the record's schema and that every figure is positive; return its results."""
    assert record is not None, "no JSON was written"
    assert set(record) == {"machine", "config", "results"}
    assert MACHINE_KEYS <= set(record["machine"])
    results = record["results"]
    assert results
    assert list(dict.fromkeys(r["benchmark"] for r in results)) == list(benchmarks)
    for result in results:
        assert RESULT_KEYS <= set(result), result
        # a host-cost record times the host alone: it has no bandwidth or ratio
        host = result["role"] == "host"
        for key in FIGURES:
            if host and key in ("gbps", "ratio"):
                assert result[key] is None, (key, result)
            else:
                assert positive_finite(result[key]), (key, result)
        assert result["time_ms_min"] <= result["time_ms"]
        for key in ("size", "world_size", "n_tensors", "n_elements", "bytes"):
            assert isinstance(result[key], int) and result[key] > 0, (key, result)
        assert result["role"] in ("reference", "baseline", "ours", "host")
        if not host:
            assert math.isclose(result["gbps"], result["bytes"] / (result["time_ms"] * 1e6))
    for key in dict.fromkeys((r["benchmark"], r["case"], r["size"]) for r in results):
        group = [r for r in results if (r["benchmark"], r["case"], r["size"]) == key]
        baseline = next(r for r in group if r["method"] == group[0]["baseline"])
        assert baseline["ratio"] == 1.0
        for result in group:
            assert result["baseline"] == baseline["method"]
            if result["role"] != "host":
                assert math.isclose(result["ratio"], baseline["time_ms"] / result["time_ms"])
        assert {"baseline", "ours"} <= {r["role"] for r in group}
    return results


def gpu_session_summary(directory: Path) -> str:
    """``.ci/gpu-session-summary directory``'s output: the issue's aims read
    from the JSON a GPU session writes there (the tests hand it the same
    commands' CPU-made files, so a field it reads cannot be misnamed)."""
    process = subprocess.run([sys.executable, str(ROOT / ".ci" / "gpu-session-summary"),
                              str(directory)], capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
    return process.stdout
