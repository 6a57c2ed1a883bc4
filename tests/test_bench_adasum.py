"""The AdaSum benchmark runs end to end and writes well-formed results.

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

MACHINE_KEYS = {"cpu", "cpu_count", "torch_threads", "loadavg_1min", "gpu", "device", "backend",
                "torch", "triton"}
RESULT_KEYS = {"method", "world_size", "n_tensors", "n_elements", "bytes", "time_ms",
               "ratio_to_all_reduce", "bytes_sent_per_rank", "bytes_sent_source",
               "ratio_to_ring_bytes"}
METHODS = {"all_reduce", "grad_reducer", "adasum"}


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``python -m bench adasum --quick`` run on 2 ranks: (process, JSON record)."""
    path = tmp_path_factory.mktemp("bench") / "adasum.json"
    process = subprocess.run(
        [sys.executable, "-m", "bench", "adasum", "--quick", "--world-size", "2",
         "--repeats", "2", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    record = json.loads(path.read_text()) if path.exists() else None
    return process, record


def test_quick_adasum_benchmark_exits_cleanly_and_prints_a_table(quick_run):
    process, _ = quick_run
    assert process.returncode == 0, process.stderr
    for method in METHODS:
        assert method in process.stdout


def test_quick_adasum_benchmark_records_the_machine_and_the_config(quick_run):
    _, record = quick_run
    assert record is not None
    assert MACHINE_KEYS <= set(record["machine"])
    assert record["machine"]["backend"] == "gloo"
    assert record["machine"]["torch"] == torch.__version__
    assert record["config"]["benchmark"] == "adasum"
    assert record["config"]["world_sizes"] == [2]
    assert record["config"]["width"] == 16


def test_quick_adasum_benchmark_results_are_complete_and_positive(quick_run):
    _, record = quick_run
    results = record["results"]
    assert sorted(r["method"] for r in results) == sorted(METHODS)
    for result in results:
        assert RESULT_KEYS <= set(result), result
        assert result["world_size"] == 2
        for key, value in result.items():
            if not isinstance(value, str):
                assert _positive_finite(value), (key, result)
        for key in ("n_tensors", "n_elements", "bytes"):
            assert isinstance(result[key], int), (key, result)
        assert result["n_tensors"] == 161
        assert result["bytes"] == 4 * result["n_elements"]
    all_reduce = next(r for r in results if r["method"] == "all_reduce")
    assert all_reduce["ratio_to_all_reduce"] == 1.0


def test_adasum_bytes_are_counted_and_match_the_two_rank_tree_exactly(quick_run, monkeypatch):
    # at 2 ranks each rank sends half of every bucket, its half of the
    # all-gather, the 3 fp64 statistics of every tensor, and its share (half)
    # of the 16-byte agreement check: the count must come to exactly that
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.models import resnet50
    from fusedreduce import BucketPlan
    from fusedreduce.collectives import adasum_comm_dtype

    _, record = quick_run
    params = list(resnet50(width=16).parameters())
    plan = BucketPlan(params, bucket_cap_mb=25.0, comm_dtype=adasum_comm_dtype)
    expected = sum(b.nbytes for b in plan.buckets) + 3 * 8 * len(params) + 16
    adasum = next(r for r in record["results"] if r["method"] == "adasum")
    assert adasum["bytes_sent_source"] == "counted"
    assert adasum["bytes_sent_per_rank"] == expected
