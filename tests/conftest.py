"""Shared test setup: the test device, Triton's interpreter, the backend fixture,
Hypothesis profiles.

Two modes, chosen by ``pytest --device``:

- ``cpu`` (the default): every test runs on CPU tensors; ``backend="triton"``
  runs the kernels through Triton's interpreter (``TRITON_INTERPRET=1``).
- ``cuda``: the tests marked ``device_aware`` run on CUDA tensors with the
  compiled Triton kernels (and the torch fallback on CUDA), and the
  ``cuda_only`` tests (large cases, NCCL, DDP hooks and AdaSum on a GPU) run
  as well; the CPU-only rest is skipped with the reason. Without a GPU every
  test is skipped, saying so.
"""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

import device_mode

# Interpreted Triton runs each program in numpy (~10 ms per 2048-element
# block), so example counts, not data sizes, set the suite's run time.
# "ci" is the default: derandomized so that a failure reproduces run to run.
settings.register_profile(
    "ci", max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# "compat": fewer derandomized examples, for re-running the Triton-facing
# tests on another Triton version (.ci/run's oldest-Triton run), where what is
# checked is that every kernel path still works there
settings.register_profile(
    "compat", max_examples=10, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", max_examples=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--device", choices=device_mode.MODES, default="cpu",
        help="cpu (default): CPU tensors, Triton through its interpreter; cuda: the "
             "device-aware and CUDA-only tests on the GPU with compiled Triton kernels")


def pytest_configure(config):
    mode = config.getoption("--device")
    if "triton" in sys.modules and device_mode.interpreting() != (mode == "cpu"):
        # Triton reads TRITON_INTERPRET when a kernel is decorated: too late now
        raise pytest.UsageError(
            f"--device {mode}: triton was imported before the test setup with "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}; unset it (or run "
            f"pytest in a fresh process)")
    device_mode.select(mode)
    if mode == "cpu":
        # ranks (run_on_local_ranks, here and in the programs the tests start)
        # fork from a server that imported torch once: 0.06 s to start two
        # ranks instead of 1.8 s, over some hundred calls. test_local_ranks
        # runs both start methods; the wheel check and users get "spawn"
        os.environ.setdefault("FUSEDREDUCE_START_METHOD", "forkserver")
    config.addinivalue_line(
        "markers", "device_aware: runs on the --device (CPU by default, CUDA with --device cuda)")
    config.addinivalue_line(
        "markers", "cuda_only: needs a GPU; runs only under --device cuda")


def pytest_report_header(config):
    return f"fusedreduce test device: {device_mode.describe()}"


def pytest_collection_modifyitems(config, items):
    mode = config.getoption("--device")
    if mode == "cpu":
        skip = pytest.mark.skip(reason="CUDA test mode only: run `pytest --device cuda` "
                                       "on a machine with a GPU")
        for item in items:
            if "cuda_only" in item.keywords:
                item.add_marker(skip)
        return
    missing = device_mode.cuda_missing()
    if missing:
        skip_all = pytest.mark.skip(reason=f"--device cuda: {missing}")
        for item in items:
            item.add_marker(skip_all)
        return
    cpu_only = pytest.mark.skip(reason="CPU-only test: --device cuda runs the tests marked "
                                       "device_aware or cuda_only")
    for item in items:
        if "device_aware" not in item.keywords and "cuda_only" not in item.keywords:
            item.add_marker(cpu_only)


@pytest.fixture(scope="session", params=["torch", "triton"])
def backend(request):
    """Each kernel test runs once per backend: on CPU, Triton's through its
    interpreter; under ``--device cuda``, the compiled kernels."""
    from fusedreduce.kernels import triton_unavailable_reason

    if request.param == "triton" and triton_unavailable_reason() is not None:
        pytest.skip(f"the Triton backend cannot be used here: {triton_unavailable_reason()}")
    return request.param


@pytest.fixture(scope="session")
def device():
    """The torch.device the device-aware tests build their tensors on."""
    return device_mode.DEVICE()


@pytest.fixture(scope="session")
def library_cluster_check():
    """The library's patterns (its reducer, its sharded step, each wire's way
    back, the deterministic sums beside the native collectives) on one
    simulated 2 x 2 cluster, one round of 1M elements: one cluster brought up
    and probed for every test that reads them (root only: skipped, with the
    reason, without it)."""
    from fusedreduce.bench import cluster, model_bench

    reason = cluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    kernels = {"flatten": 1e10, "unflatten": 1e10}
    return model_bench.check_cluster(
        1_000_000, 1, "1gbit", kernels,
        patterns=model_bench.parse_patterns("library,sharded,gather,deterministic"))
