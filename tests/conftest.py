"""Shared test setup: Triton's interpreter, the backend fixture, Hypothesis profiles."""
import os

# Before anything imports triton: its interpreter is what lets backend="triton"
# run on CPU tensors, and the variable is read once, at import time.
os.environ["TRITON_INTERPRET"] = "1"
# Triton 3.9 warns once unless this is set explicitly.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from fusedreduce.kernels import triton_available  # noqa: E402

# Interpreted Triton runs each program in numpy (~10 ms per 2048-element
# block), so example counts, not data sizes, set the suite's run time.
# "ci" is the default: derandomized so that a failure reproduces run to run.
settings.register_profile(
    "ci", max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", max_examples=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", params=["torch", "triton"])
def backend(request):
    """Each kernel test runs once per backend; Triton's on CPU through its interpreter."""
    if request.param == "triton" and not triton_available():
        pytest.skip("triton cannot be imported here")
    return request.param
