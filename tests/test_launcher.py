"""Direct launches through Triton's compiled launcher (``kernels/_launcher.py``).

On the CPU the kernels run under Triton's interpreter, where there is no
compiled launcher; the direct path is proven there with a driver that compiles
for sm_90 and records launches (``fusedreduce.bench.recording_driver``):
tests/launch_fidelity.py runs, in a subprocess without the interpreter, every kernel family's calls
both ways and requires identical launcher arguments. Under ``--device cuda``
the last test runs the real launcher and compares bits with
``JITFunction.run``'s launches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import device_mode
from fusedreduce.kernels import (_prepared, flatten_cast_scale, triton_available,
                                 unflatten_cast_scale)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")

HERE = Path(__file__).resolve().parent
KERNELS = ["_chunk_stats_kernel", "_combine_kernel", "_finish_kernel", "_flatten_kernel",
           "_reduce_chunks_kernel", "_row_powers_kernel", "_unflatten_kernel"]


def run_without_interpreter(args, **env):
    """``python args...`` in a fresh process without TRITON_INTERPRET."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run([sys.executable, *args], env=environ, capture_output=True, text=True,
                          cwd=HERE, timeout=600)


@pytest.mark.skipif(device_mode.cuda_mode(), reason="the recording driver stands in for a GPU")
def test_direct_launches_hand_the_launcher_what_jit_run_would():
    done = run_without_interpreter([str(HERE / "launch_fidelity.py")])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # every kernel family was checked, and took the direct path as well
    assert sorted(report["checked"]) == KERNELS
    assert all(report["direct"].get(k, 0) > 0 for k in KERNELS), report


SWITCH = """
from fusedreduce.bench import recording_driver; recording_driver.install()
import torch
from types import SimpleNamespace
from fusedreduce.kernels import _launcher
from fusedreduce.kernels.flatten import triton_backend as tb
ts = [torch.randn(100), torch.randn(7)]
out = torch.empty(112)
launch = tb.prepare_flatten(ts, [0, 104], [100, 7], out)
for _ in range(3):
    launch(ts, out, 0.5, False)
odd = SimpleNamespace(src=SimpleNamespace(signature={"only": "i32"}))
print(launch.kernel.enabled, launch.kernel.direct_calls, launch.kernel.jit_calls,
      launch.kernel.enabled and launch.kernel._knows_protocol(odd))
"""


@pytest.mark.skipif(device_mode.cuda_mode(), reason="the recording driver stands in for a GPU")
@pytest.mark.parametrize("mode, expected", [("compiled", "True 2 1 False"),
                                            ("jit", "False 0 3 False")])
def test_the_environment_switch_sends_every_launch_through_jit_run(mode, expected):
    done = run_without_interpreter(["-c", SWITCH], FUSEDREDUCE_TRITON_LAUNCH=mode)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == expected.split()


UNKNOWN_MODE = """
import torch
from fusedreduce import kernels
try:
    kernels.flatten_cast_scale([torch.ones(3)], torch.empty(3), backend="triton")
except ValueError as exc:
    print("ValueError:", exc)
"""


def test_an_unknown_launch_mode_is_refused_naming_the_variable():
    # at the first Triton call (not swallowed into "Triton cannot be used")
    done = run_without_interpreter(["-c", UNKNOWN_MODE], FUSEDREDUCE_TRITON_LAUNCH="fast",
                                   TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ValueError: FUSEDREDUCE_TRITON_LAUNCH must be one of")
    assert "'fast'" in done.stdout


def test_under_the_interpreter_every_launch_goes_through_triton():
    if device_mode.cuda_mode():
        pytest.skip("the interpreter runs only on the CPU")
    from fusedreduce.kernels import _launcher
    from fusedreduce.kernels.flatten import triton_backend as tb
    launch = _launcher.CompiledLaunch(tb._flatten_kernel, (1,), num_warps=4)
    assert not launch.enabled


@pytest.mark.cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_direct_launches_on_the_gpu_write_the_bits_jit_run_writes(dtype):
    _prepared.LAUNCHES.clear()
    generator = torch.Generator(device="cuda").manual_seed(5)
    tensors = [torch.randn(n, device="cuda", dtype=dtype, generator=generator)
               for n in (1, 2049, 300_000, 77)]
    flat = torch.empty(sum(t.numel() for t in tensors), device="cuda")
    back = [torch.empty_like(t) for t in tensors]

    def steps():
        flat.fill_(float("nan"))
        for b in back:
            b.fill_(float("nan"))
        for step in range(3):
            flatten_cast_scale(tensors, out=flat, scale=0.5 + step)
            unflatten_cast_scale(flat, back, scale=torch.tensor(2.0, device="cuda"))
        torch.cuda.synchronize()
        return [t.clone().view(torch.uint8) for t in (flat, *back)]

    direct = steps()
    kernels = [entry.launch.kernel for entry in _prepared.LAUNCHES._entries.values()]
    assert len(kernels) == 2
    assert all(k.enabled and k.direct_calls >= 2 for k in kernels), [vars(k) for k in kernels]
    for k in kernels:
        k.enabled = False  # the same kept launches, through JITFunction.run
    through_jit = steps()
    assert all(k.direct_calls == 2 for k in kernels)
    for a, b in zip(direct, through_jit):
        assert torch.equal(a, b)
    _prepared.LAUNCHES.clear()
