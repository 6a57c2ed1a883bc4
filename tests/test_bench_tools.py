"""The one-off measurement tools in bench/ run end to end (no timing asserted)."""
import subprocess
import sys

import pytest

from harness import ROOT, TIMEOUT


@pytest.mark.timeout(TIMEOUT)
def test_versus_revision_times_this_checkout_against_another_revision_in_one_run():
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.versus_revision", "HEAD", "--sizes", "20K",
         "--repeats", "2"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    out = process.stdout
    for direction in ("flatten", "unflatten"):
        line = next(line for line in out.splitlines() if f"tensors, {direction}" in line
                    and "elements" in line)
        assert "torch_foreach" in line and "HEAD" in line and "this checkout" in line
    assert "HEAD flatten:" in out and "this checkout unflatten:" in out


@pytest.mark.timeout(TIMEOUT)
def test_bucket_view_memory_reports_every_method():
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.bucket_view_memory", "--size", "30K",
         "--steps", "1", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    for method in ("ddp", "ddp_bucket_view", "fused", "fused_bucket_view"):
        line = next(line for line in lines if line.split()[0] == method)
        step_ms, peak_mb = float(line.split()[3]), float(line.split()[-1])
        assert step_ms > 0 and peak_mb >= 0
