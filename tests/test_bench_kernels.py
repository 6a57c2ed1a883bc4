"""The kernel benchmark runs end to end and writes well-formed results.

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

MACHINE_KEYS = {"cpu", "cpu_count", "torch_threads", "gpu", "device", "backend", "torch",
                "triton"}
RESULT_KEYS = {"list", "dtype_in", "dtype_out", "scale", "method", "n_tensors", "n_elements",
               "bytes", "time_ms", "time_ms_min", "gbps", "ratio_to_copy"}
METHODS = {"copy", "naive", "views_then_scale", "fusedreduce", "fusedreduce_fresh_out",
           "fusedreduce_unflatten"}


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``python -m bench kernels --quick`` run on the CPU: (process, JSON record)."""
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    process = subprocess.run(
        [sys.executable, "-m", "bench", "kernels", "--quick", "--repeats", "2",
         "--device", "cpu", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    record = json.loads(path.read_text()) if path.exists() else None
    return process, record


def test_quick_kernel_benchmark_exits_cleanly_and_prints_a_table(quick_run):
    process, _ = quick_run
    assert process.returncode == 0, process.stderr
    for method in METHODS:
        assert method in process.stdout


def test_quick_kernel_benchmark_records_the_machine(quick_run):
    _, record = quick_run
    assert record is not None
    assert MACHINE_KEYS <= set(record["machine"])
    assert record["machine"]["device"] == "cpu"
    assert record["machine"]["backend"] == "torch"
    assert record["machine"]["torch"] == torch.__version__


def test_quick_kernel_benchmark_results_are_complete_and_positive(quick_run):
    _, record = quick_run
    results = record["results"]
    assert results
    for result in results:
        assert RESULT_KEYS <= set(result), result
        for key in ("time_ms", "time_ms_min", "gbps", "ratio_to_copy"):
            assert _positive_finite(result[key]), (key, result)
        assert result["time_ms_min"] <= result["time_ms"]
        for key in ("n_tensors", "n_elements", "bytes"):
            assert isinstance(result[key], int) and result[key] > 0, (key, result)
        assert result["dtype_out"] == "float32"
    cases = {(r["list"], r["dtype_in"], r["scale"]) for r in results}
    assert {(name, dtype) for name, dtype, _ in cases} == {
        (name, dtype) for name in ("resnet50", "transformer") for dtype in ("float16", "bfloat16")}
    assert {scale for _, _, scale in cases} == {0.125, 1.0}
    for case in cases:
        methods = [r["method"] for r in results if (r["list"], r["dtype_in"], r["scale"]) == case]
        assert sorted(methods) == sorted(METHODS), case
        copy = next(r for r in results
                    if (r["list"], r["dtype_in"], r["scale"]) == case and r["method"] == "copy")
        assert copy["ratio_to_copy"] == 1.0


def test_bytes_count_one_read_and_one_write_of_every_element(quick_run):
    _, record = quick_run
    for result in record["results"]:
        in_size = torch.finfo(getattr(torch, result["dtype_in"])).bits // 8
        assert result["bytes"] == result["n_elements"] * (in_size + 4)


def test_full_tensor_lists_have_the_documented_sizes(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.kernels import resnet50_shapes, transformer_shapes

    resnet = resnet50_shapes()
    assert len(resnet) == 161
    assert sum(math.prod(s) for s in resnet) == 25_557_032
    transformer = transformer_shapes()
    assert len(transformer) == 147
    assert 20e6 < sum(math.prod(s) for s in transformer) < 30e6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.125, 1.0])
def test_every_method_including_the_cuda_only_ones_computes_the_right_buffer(
        monkeypatch, dtype, scale):
    # torch_foreach is timed on CUDA only; its result is checked here on the CPU
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.kernels import CUDA_METHODS, Workload, check, method_fns

    workload = Workload("tiny", [(3, 5), (7,), (2, 2, 3)], dtype, torch.device("cpu"))
    fns = method_fns(workload, scale, foreach=True)
    assert set(fns) == set(CUDA_METHODS)
    for name, fn in fns.items():
        workload.out.fill_(float("nan"))
        check(workload, scale, name, fn())


def test_the_result_check_rejects_a_wrong_buffer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.kernels import Workload, check

    workload = Workload("tiny", [(4,), (6,)], torch.float16, torch.device("cpu"))
    with pytest.raises(AssertionError, match="fusedreduce"):
        check(workload, 0.125, "fusedreduce", workload.src.float())  # scale never applied
