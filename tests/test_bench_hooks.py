"""The DDP hook benchmark runs end to end and writes well-formed results.

No timing is asserted: these tests prove the benchmark works, never that one
method is faster than another.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

MACHINE_KEYS = {"cpu", "cpu_count", "torch_threads", "device", "backend", "torch", "triton"}
RESULT_KEYS = {"method", "world_size", "n_tensors", "n_elements", "time_ms", "ratio_to_ddp"}
METHODS = ["compute_only", "ddp", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "adasum_hook", "torch_fp16_compress_hook"]


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``python -m bench hooks --quick`` run on 2 gloo ranks: (process, JSON record)."""
    path = tmp_path_factory.mktemp("bench") / "hooks.json"
    process = subprocess.run(
        [sys.executable, "-m", "bench", "hooks", "--quick", "--world-size", "2",
         "--repeats", "2", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    record = json.loads(path.read_text()) if path.exists() else None
    return process, record


def test_quick_hook_benchmark_exits_cleanly_and_prints_every_method(quick_run):
    process, _ = quick_run
    assert process.returncode == 0, process.stderr
    for method in METHODS:
        assert method in process.stdout


def test_quick_hook_benchmark_writes_the_documented_json(quick_run):
    _, record = quick_run
    assert record is not None
    assert set(record) == {"machine", "config", "results"}
    assert MACHINE_KEYS <= set(record["machine"])
    assert record["machine"]["backend"] == "gloo"
    assert record["machine"]["torch"] == torch.__version__
    assert record["config"]["benchmark"] == "hooks"
    assert record["config"]["world_sizes"] == [2]
    assert record["config"]["repeats"] == 2
    results = record["results"]
    assert [r["method"] for r in results] == METHODS
    for result in results:
        assert RESULT_KEYS <= set(result), result
        assert result["world_size"] == 2
        for key in ("time_ms", "ratio_to_ddp"):
            assert _positive_finite(result[key]), (key, result)
        # ResNet-50's parameter list, at a quarter of the width
        assert result["n_tensors"] == 161
        assert isinstance(result["n_elements"], int) and result["n_elements"] > 0
    ddp = next(r for r in results if r["method"] == "ddp")
    assert ddp["ratio_to_ddp"] == 1.0
    for result in results:
        assert math.isclose(result["ratio_to_ddp"], result["time_ms"] / ddp["time_ms"])
