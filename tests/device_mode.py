"""Which device the tests run on: ``pytest --device cpu`` (default) or ``cuda``.

``select`` is called once per pytest process (conftest's ``pytest_configure``,
also in each pytest-xdist worker) before any test module imports Triton. It
puts the choice in the environment, so rank processes started by a test (which
import this module afresh) see the same mode, and sets ``TRITON_INTERPRET``:
``1`` on CPU, where Triton can only run through its interpreter, and removed
under CUDA, where the kernels must be compiled.

Test code builds its tensors on ``DEVICE()`` and compares on the CPU
(``on_cpu``), so the same test body serves both modes.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

MODES = ("cpu", "cuda")
#: carries the mode into rank processes and pytest-xdist workers
VARIABLE = "FUSEDREDUCE_TEST_DEVICE"


def select(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"the test device must be one of {MODES}, got {mode!r}")
    os.environ[VARIABLE] = mode
    if mode == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    # Triton 3.9 warns once unless this is set explicitly
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def mode() -> str:
    return os.environ.get(VARIABLE, "cpu")


def cuda_mode() -> bool:
    return mode() == "cuda"


def DEVICE() -> torch.device:  # noqa: N802 (reads as the constant it is per run)
    """The device test tensors are built on."""
    return torch.device("cuda") if cuda_mode() else torch.device("cpu")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_missing() -> Optional[str]:
    """Why CUDA tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return (f"no CUDA device here (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False)")
    return None


def describe() -> str:
    if not cuda_mode():
        return "cpu (Triton through its interpreter)"
    missing = cuda_missing()
    if missing:
        return f"cuda requested, but {missing}: every test is skipped"
    return f"cuda ({torch.cuda.get_device_name()}, compiled Triton kernels)"


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the test device (unchanged on CPU)."""
    return t.to(DEVICE()) if cuda_mode() else t


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, for comparisons with references computed there."""
    return t.cpu() if t.device.type != "cpu" else t
