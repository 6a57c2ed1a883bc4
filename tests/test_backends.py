"""The kernels' backend protocol: each op family's Triton and torch backends are interchangeable.

The public kernel API validates its arguments and hands them to whichever
backend runs on the device; that only works if both backends of an op family
take exactly the same arguments. Results are compared between backends in the
kernel tests (``test_kernels.py``, ``test_adasum_kernels.py``); here the
shapes of the two implementations are.
"""
import importlib
import inspect
import subprocess
import sys

import pytest
import torch

from fusedreduce import kernels

#: the protocol: each op family's functions, in both backend modules
PROTOCOL = {"flatten": ("prepare_flatten", "prepare_unflatten"),
            "adasum": ("chunk_stats", "reduce_chunks", "combine")}


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
