"""``fusedreduce-bench gpu-check``: what can be proven without a GPU.

The command's correctness part runs here on CPU tensors (Triton through its
interpreter), and must both pass on the real kernels and fail on wrong ones;
its verdict table, plot, test-suite runner and its clean skip without a GPU
are checked directly. On a GPU machine the command itself is the check.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fusedreduce.bench import cli, gpu_check
from fusedreduce.kernels import triton_available

from harness import ROOT

CPU = torch.device("cpu")
#: a few small tensors, to which check_tensors adds the awkward ones
SHAPES = [(3, 5), (7,), (300,)]


def _backends():
    return ["triton", "torch"] if triton_available() else ["torch"]


def test_every_kernel_and_dtype_is_checked_and_right_with_both_backends():
    records = gpu_check.check_kernels(CPU, _backends(), 0, shapes=SHAPES)
    assert len(records) == len(gpu_check.KERNELS) * len(gpu_check.CHECK_DTYPES) * len(_backends())
    assert {(r["kernel"], r["dtype"]) for r in records} == {
        (k, d) for k in gpu_check.KERNELS for d in gpu_check.CHECK_DTYPES}
    wrong = [r for r in records if not r["correct"] or r.get("same_as_torch") is False]
    assert not wrong, wrong
    if len(_backends()) == 2:
        bitwise = [r for r in records if r["kernel"] in gpu_check.BITWISE]
        assert bitwise and all(r["same_as_torch"] is True for r in bitwise)
    assert gpu_check.all_correct(records)


def _one_ulp_off(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first non-zero element moved to the next representable value."""
    t = t.clone()
    flat = t.view(-1)
    index = int((flat != 0).nonzero()[0])
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat.view(ints)[index] += 1
    return t


def test_a_flatten_one_ulp_off_is_caught_as_wrong_and_as_disagreeing_with_torch(monkeypatch):
    real = gpu_check.flatten_cast_scale

    def off_by_one_ulp(tensors, *args, backend="auto", **kwargs):
        flat = real(tensors, *args, backend=backend, **kwargs)
        # only the checked backend's result; the AdaSum operands use backend="torch"
        return _one_ulp_off(flat) if backend == "triton" else flat

    monkeypatch.setattr(gpu_check, "flatten_cast_scale", off_by_one_ulp)
    records = gpu_check.check_kernels(CPU, ["triton", "torch"] if triton_available()
                                      else ["torch"], 0, shapes=SHAPES)
    flatten = [r for r in records if r["kernel"] == "flatten"]
    if triton_available():
        assert all(not r["correct"] for r in flatten if r["backend"] == "triton")
        assert all(r["same_as_torch"] is False for r in flatten)
        assert not gpu_check.all_correct(records)
    assert all(r["correct"] for r in flatten if r["backend"] == "torch")


@pytest.mark.parametrize("kernel", ["unflatten_accumulate", "adasum_stats", "adasum_combine"])
def test_bounded_kernels_fail_the_check_when_off_by_more_than_their_bound(monkeypatch, kernel):
    if kernel == "unflatten_accumulate":
        real = gpu_check.unflatten_cast_scale

        def wrong(flat, tensors, *, accumulate=False, **kwargs):
            real(flat, tensors, accumulate=accumulate, **kwargs)
            for t in tensors:  # a 1% error on every element: far above a few ulps
                t.mul_(1.01)
        monkeypatch.setattr(gpu_check, "unflatten_cast_scale", wrong)
    elif kernel == "adasum_stats":
        real = gpu_check.adasum_stats
        monkeypatch.setattr(gpu_check, "adasum_stats",
                            lambda *a, **k: real(*a, **k) * (1 + 1e-9))
    else:
        real = gpu_check.adasum_combine
        monkeypatch.setattr(gpu_check, "adasum_combine",
                            lambda *a, **k: real(*a, **k) * 1.01)
    records = [r for r in gpu_check.check_kernels(CPU, ["torch"], 0, shapes=SHAPES)
               if r["kernel"] == kernel]
    assert records and all(not r["correct"] for r in records)
    assert all(r["max_error_over_bound"] > 1 for r in records)


def test_the_device_scale_check_fails_when_the_tensor_scale_is_not_applied(monkeypatch):
    real = gpu_check.unflatten_cast_scale

    def ignores_tensors(flat, tensors, *, scale=1.0, **kwargs):
        real(flat, tensors, scale=1.0 if isinstance(scale, torch.Tensor) else scale, **kwargs)
    monkeypatch.setattr(gpu_check, "unflatten_cast_scale", ignores_tensors)
    records = gpu_check.check_kernels(CPU, ["torch"], 0, shapes=SHAPES)
    assert all(not r["correct"] for r in records if r["kernel"] == "unflatten_device_scale")
    assert all(r["correct"] for r in records if r["kernel"] == "unflatten")


def test_a_kernel_that_raises_is_recorded_as_wrong_with_its_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(gpu_check, "adasum_combine", broken)
    records = [r for r in gpu_check.check_kernels(CPU, ["torch"], 0, shapes=SHAPES)
               if r["kernel"] == "adasum_combine"]
    assert all(not r["correct"] and "no kernel image" in r["error"] for r in records)


def _bench_record(direction, dtype, method, role, time_ms, size=4_000_000, scale=0.125):
    return {"benchmark": "kernels", "case": f"resnet50 {direction}", "size": size,
            "list": "resnet50", "direction": direction, "dtype": dtype, "scale": scale,
            "method": method, "role": role, "time_ms": time_ms, "n_elements": size,
            "gbps": 24e-3 / time_ms, "ratio": 1.0 / time_ms,
            "host_us": time_ms * 1e3 if role == "host" else None}


def test_the_verdict_quotes_ours_beside_torchs_best_at_the_largest_size(capsys, tmp_path):
    checks = gpu_check.check_kernels(CPU, ["torch"], 0, shapes=SHAPES)
    bench = []
    for direction in ("flatten", "unflatten"):
        for size, factor in ((1_000_000, 10.0), (4_000_000, 1.0)):
            bench += [_bench_record(direction, "float16", "copy", "reference", 1.0 * factor, size),
                      _bench_record(direction, "float16", "torch_foreach", "baseline",
                                    2.0 * factor, size),
                      _bench_record(direction, "float16", "torch_cat", "baseline",
                                    1.6 * factor, size),
                      _bench_record(direction, "float16", "fusedreduce", "ours", 1.25 * factor,
                                    size),
                      _bench_record(direction, "float16", "fusedreduce_host", "host",
                                    0.04, size),
                      _bench_record(direction, "float16", "fusedreduce_host_moved", "host",
                                    0.06, size),
                      _bench_record(direction, "float16", "fusedreduce_host_new", "host",
                                    0.07, size),
                      _bench_record(direction, "float16", "fusedreduce_host_prepared", "host",
                                    0.02, size)]
    bench.append(_bench_record("flatten", "float16", "fusedreduce", "ours", 9.0, scale=1.0))
    rows = gpu_check.verdict_rows(checks, bench)
    row = next(r for r in rows if (r["kernel"], r["dtype"]) == ("flatten", "float16"))
    assert row["torch"] == "ok" and row["n_elements"] == 4_000_000
    assert row["best_torch"] == "torch_cat"
    assert math.isclose(row["x_copy"], 0.8) and math.isclose(row["best_torch_x_copy"], 1 / 1.6)
    assert math.isclose(row["x_best_torch"], 1.6 / 1.25)
    assert math.isclose(row["host_us"], 40.0) and math.isclose(row["host_moved_us"], 60.0)
    assert math.isclose(row["host_new_us"], 70.0) and math.isclose(row["host_prepared_us"], 20.0)
    assert next(r for r in rows if r["kernel"] == "adasum_stats")["gbps"] is None

    machine = gpu_check.environment(CPU)
    ok = gpu_check.print_verdict(machine, checks, bench, None, 1.0)
    out = capsys.readouterr().out
    assert ok and "# PASS" in out and "torch_cat" in out and "x best torch" in out
    assert "host us, moved" in out
    assert f"Triton {machine['triton']}" in out

    pytest.importorskip("matplotlib")
    png = tmp_path / "verdict.png"
    gpu_check.write_plot(str(png), rows, "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_test_suite_makes_the_verdict_fail(capsys):
    checks = gpu_check.check_kernels(CPU, ["torch"], 0, shapes=SHAPES)
    tests = {"command": "pytest --device cuda tests", "returncode": 1,
             "counts": {"passed": 3, "failed": 1}, "seconds": 2.0,
             "failed": ["FAILED tests/test_cuda.py::test_x"], "ok": False, "log": None}
    assert not gpu_check.print_verdict(gpu_check.environment(CPU), checks, [], tests, 1.0)
    out = capsys.readouterr().out
    assert "3 passed, 1 failed" in out and "FAILED tests/test_cuda.py::test_x" in out
    assert "# FAIL" in out


def test_the_test_suite_runner_reports_counts_and_failures(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--device', default='cpu')\n")
    (tests / "test_two.py").write_text(
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert False\n")
    log = tmp_path / "log.txt"
    result = gpu_check.run_tests(tests, str(log))
    assert result["counts"] == {"passed": 1, "failed": 1}, result
    assert not result["ok"] and result["returncode"] == 1
    assert any("test_fails" in line for line in result["failed"])
    assert "--device cuda" in result["command"] and log.read_text()


def test_the_checkouts_tests_are_found_beside_an_editable_install():
    found = gpu_check.find_tests()
    # a wheel install has no tests beside it; this checkout's install is editable
    assert found is None or found == ROOT / "tests"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the command would run")
def test_without_a_gpu_the_command_says_so_and_exits_zero(tmp_path, capsys):
    path = tmp_path / "check.json"
    assert cli.main(["gpu-check", "--json", str(path)]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["config"]["skipped"] == "no CUDA device" and record["results"] == []
    with pytest.raises(SystemExit, match="CUDA is not available"):
        cli.main(["gpu-check", "--device", "cuda"])


def test_the_cpu_dry_run_runs_the_checks_and_the_benchmark_end_to_end(tmp_path):
    # a fresh process without the interpreter: the torch backend alone, quickly
    path = tmp_path / "gpu_check.json"  # the name a GPU session gives it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench", "gpu-check", "--device", "cpu",
         "--sizes", "20K", "--quick", "--no-progress", "--json", str(path)],
        capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "## verdict" in out.stdout and "# PASS" in out.stdout
    record = json.loads(path.read_text())
    checks = [r for r in record["results"] if r["benchmark"] == "gpu-check"]
    assert checks and all(r["correct"] and r["backend"] == "torch" for r in checks)
    bench = [r for r in record["results"] if r["benchmark"] == "kernels"]
    methods = {r["method"] for r in bench}
    assert {"copy", "fusedreduce", "torch_foreach", "torch_cat", "torch_chunk_cat"} <= methods
    # what .ci/gpu-session-summary reads of it: the host µs at 161 tensors
    from bench_utils import gpu_session_summary
    summary = gpu_session_summary(tmp_path)
    assert "eager host per fused call, ResNet-50's 161 tensors (gpu-check on cpu" in summary
    assert "same tensors " in summary, summary
    assert ("with the same tensors: met" in summary) != ("with the same tensors: missed"
                                                        in summary), summary
    assert "not measured (no one_gpu_step.json)" in summary


def test_an_unusable_triton_backend_fails_its_rows_with_the_reason(monkeypatch):
    # what a CUDA machine with an old Triton gets: every triton row wrong, saying why
    from fusedreduce.kernels import _backends

    monkeypatch.setattr(_backends, "_triton", None)
    monkeypatch.setattr(_backends, "_triton_error",
                        ImportError("Triton 3.1.0 is installed but fusedreduce's kernels need "
                                    "triton>=3.2"))
    records = gpu_check.check_kernels(CPU, ["triton", "torch"], 0, shapes=SHAPES)
    triton_rows = [r for r in records if r["backend"] == "triton"]
    assert triton_rows and all(not r["correct"] for r in triton_rows)
    assert all("Triton 3.1.0 is installed" in r["error"] for r in triton_rows)
    assert all(r["correct"] for r in records if r["backend"] == "torch")
    assert not gpu_check.all_correct(records)
