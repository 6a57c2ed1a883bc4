"""A Triton driver that compiles for an sm_90 GPU and records launches instead of running them.

With it active, ``JITFunction.run`` takes its real path on a machine without a
GPU: it binds and specializes the arguments, compiles (to a cubin, with
Triton's own ``ptxas``) and calls the compiled kernel's launcher, which here
does nothing but, with ``record=True``, append ``(launcher, args)`` to
:data:`LAUNCHES`. Each compiled kernel gets its own launcher object, so a
record also says which compiled kernel a call used. No kernel runs: tensors
may live on the CPU.

Two users: tests/launch_fidelity.py (every direct launch hands the launcher
what ``JITFunction.run`` would) and ``versus_revision --launch compiled``
(the host cost of Triton's launch path on a CPU). Install it before any
kernel is launched, in a process without ``TRITON_INTERPRET`` (under the
interpreter ``@triton.jit`` makes functions that never reach a driver).
Works with Triton 3.2 to 3.9.

Example::

    from fusedreduce.bench import recording_driver
    recording_driver.install(record=True)
"""
from __future__ import annotations

import inspect
import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402

#: what get_current_stream returns: launches must pass it on
STREAM = 7
#: ``(launcher, args)`` per launch, while recording
LAUNCHES: list = []

# CompiledKernel._init_handles unpacks 4 values from load_binary up to 3.3, 5 after
_LOADED = 5 if "n_max_threads" in inspect.getsource(CompiledKernel._init_handles) else 4


class RecordingLauncher:
    """Stands for the C launcher Triton builds per compiled kernel."""

    record = True

    def __init__(self, src, metadata):
        self.src, self.metadata = src, metadata

    def __call__(self, *args):
        if self.record:
            LAUNCHES.append((self, args))


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        # module, function, registers, spills (, max threads from 3.4 on)
        return ("module", f"function:{name}", 32, 0, 1024)[:_LOADED]

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}

    def unload_module(self, module):
        pass


class RecordingDriver:
    def __init__(self):
        self.utils = _Utils()
        self.launcher_cls = RecordingLauncher

    def is_active(self):
        return True

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return STREAM

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return "void*"


def install(record: bool = True) -> None:
    """Make the recording driver Triton's active one; ``record=False``: its
    launchers keep nothing (for timing)."""
    RecordingLauncher.record = record
    driver.set_active(RecordingDriver())
