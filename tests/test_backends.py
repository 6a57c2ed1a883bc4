"""The kernels' backend protocol: each op family's Triton and torch backends are interchangeable.

The public kernel API validates its arguments and hands them to whichever
backend runs on the device; that only works if both backends of an op family
take exactly the same arguments. Results are compared between backends in the
kernel tests (``test_kernels.py``, ``test_adasum_kernels.py``); here the
shapes of the two implementations are.
"""
import importlib
import inspect
import os
import subprocess
import sys

import pytest
import torch

from fusedreduce import kernels

#: the protocol: each op family's functions, in both backend modules
PROTOCOL = {"flatten": ("prepare_flatten", "prepare_unflatten"),
            "adasum": ("chunk_stats", "reduce_chunks", "combine"),
            "norm": ("norm_powers", "clip_scales", "clip_buffers"),
            "wire": ("prepare_quantize", "dequantize_sum")}


def _backend_module(family: str, name: str):
    if name == "triton" and not kernels.triton_available():
        pytest.skip("triton cannot be imported here")
    return importlib.import_module(f"fusedreduce.kernels.{family}.{name}_backend")


@pytest.mark.parametrize("family", sorted(PROTOCOL))
def test_both_backends_of_an_op_family_define_the_protocol_with_identical_signatures(family):
    torch_side = _backend_module(family, "torch")
    triton_side = _backend_module(family, "triton")
    for function in PROTOCOL[family]:
        ours, theirs = getattr(torch_side, function), getattr(triton_side, function)
        assert inspect.signature(ours) == inspect.signature(theirs), \
            f"{family}.{function}: torch {inspect.signature(ours)} vs triton " \
            f"{inspect.signature(theirs)}"


def test_importing_the_kernels_does_not_import_triton_until_a_triton_backend_is_needed():
    # Triton is optional at run time on the CPU: the façade and the torch
    # backends must come up without it
    code = ("import sys; import fusedreduce, fusedreduce.kernels as k; "
            "import torch; k.flatten_cast_scale([torch.ones(3)]); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_auto_runs_the_torch_backend_on_the_cpu():
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"


# ------------------------------------------------------ which Tritons are accepted

@pytest.mark.parametrize("version, accepted", [
    ("3.2.0", True), ("3.3.1", True), ("3.6.0", True), ("3.9.0", True), ("3.10.0", True),
    ("4.0.0", True), ("3.3.1+git8e7ec2a", True), ("3.1.0", False), ("3.0.0", False),
    ("2.3.1", False), ("unknown", False), ("", False)])
def test_triton_versions_below_the_floor_or_unreadable_are_refused(version, accepted):
    problem = kernels._backends.triton_version_problem(version)
    assert (problem is None) == accepted, problem
    if not accepted:
        assert "triton>=3.2" in problem and (f"Triton {version} " in problem
                                              or repr(version) in problem), problem


def test_the_installed_triton_is_usable_when_it_meets_the_floor():
    # the matrix (tests/triton_matrix.sh, and CI's second environment) runs this
    # on every supported Triton: a version we claim must load our kernels
    triton = pytest.importorskip("triton")
    if kernels._backends.triton_version_problem(triton.__version__) is not None:
        pytest.skip(f"Triton {triton.__version__} is below the floor")
    assert kernels.triton_available(), kernels.triton_unavailable_reason()
    assert kernels.triton_unavailable_reason() is None


@pytest.fixture
def fresh_backend_state(monkeypatch):
    """The Triton backend forgotten, so the next use checks Triton again; restored after."""
    monkeypatch.setattr(kernels._backends, "_triton", None)
    monkeypatch.setattr(kernels._backends, "_triton_error", None)


def test_an_old_triton_is_refused_by_name_and_the_torch_fallback_keeps_working(
        monkeypatch, fresh_backend_state):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.1.0")
    assert not kernels.triton_available()
    reason = kernels.triton_unavailable_reason()
    assert "Triton 3.1.0 is installed" in reason and "triton>=3.2" in reason
    x = torch.arange(5, dtype=torch.float16)
    flat = kernels.flatten_cast_scale([x], dtype=torch.float32, scale=2.0)
    assert torch.equal(flat, x.float() * 2)
    with pytest.raises(RuntimeError, match=r"Triton 3\.1\.0 is installed.*triton>=3\.2"):
        kernels.flatten_cast_scale([x], dtype=torch.float32, backend="triton")


FAKE_TRITONS = {
    "broken": "raise AttributeError(\"module 'triton' has no attribute 'constexpr_function'\")",
    "missing": "raise ModuleNotFoundError(\"No module named 'triton'\")",
    "old": "__version__ = '3.1.0'",
}


@pytest.mark.parametrize("kind", sorted(FAKE_TRITONS))
def test_a_missing_broken_or_old_triton_gives_a_message_and_the_cpu_fallback_runs(tmp_path, kind):
    # a fresh interpreter that finds a fake ``triton`` package first
    package = tmp_path / "triton"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_TRITONS[kind] + "\n")
    code = ("import torch, fusedreduce.kernels as k; "
            "flat = k.flatten_cast_scale([torch.ones(3, dtype=torch.float16)], "
            "dtype=torch.float32, scale=0.5); "
            "print(flat.tolist()); print(k.triton_available()); "
            "print(k.triton_unavailable_reason())")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    flat, available, reason = out.stdout.strip().split("\n", 2)
    assert flat == "[0.5, 0.5, 0.5]" and available == "False"
    if kind == "old":
        assert "Triton 3.1.0 is installed" in reason and 'pip install "triton>=3.2"' in reason
    else:
        # Triton is an optional dependency: the message says what to install
        error = "AttributeError" if kind == "broken" else "ModuleNotFoundError"
        assert f"Triton cannot be imported ({error}" in reason, reason
        assert 'pip install "triton>=3.2"' in reason, reason
