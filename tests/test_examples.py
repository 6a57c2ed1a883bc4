"""The examples run as a user would run them, from a checkout, and report success."""
import subprocess
import sys

from harness import ROOT


def test_the_fused_allreduce_example_matches_its_float64_reference_on_two_ranks():
    process = subprocess.run(
        [sys.executable, "examples/fused_allreduce.py", "--width", "8", "--repeats", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout + process.stderr
    assert "vs float64 reference   : EQUAL" in process.stdout, process.stdout
    assert "bitwise identical on all ranks: True" in process.stdout
