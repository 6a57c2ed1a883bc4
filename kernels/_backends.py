"""The backend protocol, and which backend a call runs on.

A backend is one implementation of every kernel, with arguments the façade
(``kernels/__init__.py``) has already validated and normalised:

=====================  =======================================================
``prepare_flatten``    ``(tensors, starts, extents, out)``: the launch
                       ``(tensors, out, scale, check_finite) -> flag or None``
                       that fills ``out`` (segment ``i`` at ``starts[i]``,
                       ``extents[i]`` long, the rest zeroed) and returns the
                       0-d bool non-finite flag with ``check_finite``
``prepare_unflatten``  ``(flat, tensors, starts)``: the launch
                       ``(flat, tensors, scale, accumulate) -> None`` that
                       writes (or adds) each segment into its tensor, in place
``chunk_stats``        ``(a, b, boundaries, out)``: every AdaSum chunk's partial
                       sums into float64 ``out[n_chunks, 3]``
``reduce_chunks``      ``(partials, counts, out)``: each segment's ``counts[i]``
                       rows added in chunk order into float64 ``out[n, 3]``
``combine``            ``(a, b, boundaries, stats, out)``: ``out = ca·a + cb·b``
                       per segment (``out`` may be ``a`` or ``b``)
``norm_powers``        ``(buffers, norm_type)``: each buffer's sum of
                       ``|x| ** p`` (max ``|x|`` for inf), a float64 vector
``clip_scales``        ``(powers, postscales, max_norm, norm_type, loss_scale,
                       norm_dtype)``: ``(total_norm, scales)``, the norm in
                       ``norm_dtype`` (fp32 or fp64), the clip coefficient
                       times each postscale, on the device
``clip_buffers``       ``(buffers, postscales, max_norm, norm_type,
                       loss_scale, norm_dtype)``: ``clip_scales`` of
                       ``norm_powers``
``norm_partials``      ``(buffers, norm_type, share)``: the float64 partials
                       (row sums of powers on Triton, row norms on torch)
                       the two above finish per buffer, those of share
                       ``(index, count)`` only, the others zero: the shares'
                       vectors add up to the whole one, bit for bit
``clip_partials``      ``(partials, buffers, postscales, max_norm, norm_type,
                       loss_scale, norm_dtype)``: ``clip_buffers`` from the whole
                       ``norm_partials`` (``clip_buffers`` is exactly this)
``prepare_quantize``   ``(tensors, starts, extents, codes, block)``: the launch
                       ``(tensors, codes, block_scales, residual, scale,
                       check_finite) -> flag or None`` that fills ``codes`` of
                       a wire dtype (and the block scales and the residual)
``dequantize_sum``     ``(codes, block_scales, out, block)``: the ``R`` rows of
                       ``codes`` dequantized and summed in the fixed order
=====================  =======================================================

The op families (``flatten/``, ``adasum/``, ``norm/``, ``wire/``) each have a
``torch_backend`` and a ``triton_backend`` module with their functions above;
a ``Backend`` gathers one of each. The flatten family's launches are prepared once per layout and
kept by the façade (``_prepared.py``): a launch takes tensors and a buffer of
the layout it was prepared for. Triton is optional: its modules are imported
on first use.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ._common import triton_launch_mode
from .adasum import torch_backend as _adasum_torch
from .flatten import torch_backend as _flatten_torch
from .norm import torch_backend as _norm_torch
from .wire import torch_backend as _wire_torch

BACKEND_NAMES = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Backend:
    """The kernels of one implementation (see the module docstring)."""

    name: str
    prepare_flatten: Callable
    prepare_unflatten: Callable
    chunk_stats: Callable
    reduce_chunks: Callable
    combine: Callable
    norm_powers: Callable
    clip_scales: Callable
    clip_buffers: Callable
    norm_partials: Callable
    clip_partials: Callable
    prepare_quantize: Callable
    dequantize_sum: Callable

    @classmethod
    def of(cls, name: str, flatten_ops, adasum_ops, norm_ops, wire_ops) -> "Backend":
        """The backend made of an op family module each."""
        return cls(name, flatten_ops.prepare_flatten, flatten_ops.prepare_unflatten,
                   adasum_ops.chunk_stats,
                   adasum_ops.reduce_chunks, adasum_ops.combine,
                   norm_ops.norm_powers, norm_ops.clip_scales, norm_ops.clip_buffers,
                   norm_ops.norm_partials, norm_ops.clip_partials,
                   wire_ops.prepare_quantize, wire_ops.dequantize_sum)


TORCH = Backend.of("torch", _flatten_torch, _adasum_torch, _norm_torch, _wire_torch)

#: the oldest Triton the kernels run on (torch 2.6's CUDA build pins 3.2.0);
#: pyproject.toml states the same floor, docs/guides/gpu.md the versions tested
MIN_TRITON = (3, 2)
#: the newest Triton the test matrix (``.ci/triton-matrix``) has run
NEWEST_TESTED_TRITON = (3, 9)

_triton: Optional[Backend] = None
_triton_error: Optional[BaseException] = None


def parse_version(text: str) -> Tuple[int, ...]:
    """The leading release numbers of a version string: ``"3.3.1+git"`` -> (3, 3, 1).

    Raises:
        ValueError: ``text`` does not start with a number.
    """
    numbers = re.match(r"\d+(?:\.\d+)*", str(text))
    if numbers is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(n) for n in numbers.group().split("."))


def triton_version_problem(version: str) -> Optional[str]:
    """Why Triton ``version`` cannot run the kernels, or None when it can.

    Examples:
        >>> triton_version_problem("3.1.0") is not None
        True
        >>> triton_version_problem("3.6.0") is None
        True
    """
    floor = _dotted(MIN_TRITON)
    try:
        release = parse_version(version)
    except ValueError:
        return f"Triton reports an unreadable version {version!r}; fusedreduce needs triton>={floor}"
    if release[:2] < MIN_TRITON:
        return (f"Triton {version} is installed but fusedreduce's kernels need triton>={floor} "
                f"(torch>=2.6's CUDA builds ship one): upgrade torch, or `pip install "
                f"\"triton>={floor}\"` where your torch allows it; the torch fallback "
                f"(backend='torch') works without it")
    return None


def triton_backend() -> Optional[Backend]:
    """The Triton backend, imported on first use; None when Triton is missing,
    broken or older than ``MIN_TRITON`` (the reason is kept for error messages)."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        # Triton 3.9 warns once unless this is set explicitly
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        try:
            import triton
        except Exception as exc:  # noqa: BLE001 (missing, or broken on import)
            _triton_error = ImportError(f"Triton cannot be imported ({type(exc).__name__}: "
                                        f"{exc}); install it with `pip install "
                                        f"\"triton>={_dotted(MIN_TRITON)}\"`")
            return None
        problem = triton_version_problem(getattr(triton, "__version__", "unknown"))
        if problem is not None:
            _triton_error = ImportError(problem)
            return None
        triton_launch_mode()  # a bad FUSEDREDUCE_TRITON_LAUNCH is the caller's error, raised
        try:
            from .adasum import triton_backend as adasum_ops
            from .flatten import triton_backend as flatten_ops
            from .norm import triton_backend as norm_ops
            from .wire import triton_backend as wire_ops
        except Exception as exc:  # noqa: BLE001 (a Triton this code does not know)
            _triton_error = ImportError(
                f"fusedreduce's Triton kernels failed to load with Triton "
                f"{triton.__version__} ({type(exc).__name__}: {exc}); the versions tested are "
                f"{_dotted(MIN_TRITON)} to {_dotted(NEWEST_TESTED_TRITON)}")
        else:
            _triton = Backend.of("triton", flatten_ops, adasum_ops, norm_ops, wire_ops)
    return _triton


def _dotted(release: Tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def triton_unavailable_reason() -> Optional[str]:
    """Why the Triton backend cannot be used here, or None when it can.

    Examples:
        >>> reason = triton_unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    triton_backend()
    return None if _triton_error is None else str(_triton_error)


def triton_available() -> bool:
    """Whether the Triton backend can be imported here.

    Examples:
        >>> isinstance(triton_available(), bool)
        True
    """
    return triton_backend() is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: set by ``allow_cpu_launches``: a stand-in Triton driver takes CPU tensors
_cpu_launches = False


def allow_cpu_launches() -> None:
    """Let the Triton backend take CPU tensors without the interpreter from
    now on, in this process: a driver standing in for a GPU's does the
    launches (``_instrument.allow_cpu_launches``)."""
    global _cpu_launches
    _cpu_launches = True


def check_backend(backend) -> str:
    """``backend`` itself if it names a backend (``"auto"``, ``"triton"`` or
    ``"torch"``); whether it can run is decided per device by ``resolve_backend``.

    Raises:
        ValueError: any other value.

    Examples:
        >>> check_backend("auto")
        'auto'
    """
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    return backend


def backend_for(backend: str, device: torch.device) -> Backend:
    """The backend a call on ``device`` runs with (see ``resolve_backend``)."""
    check_backend(backend)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH
    chosen = triton_backend()
    if chosen is None:
        raise RuntimeError(
            f"the Triton backend is needed for tensors on {device} but cannot be used: "
            f"{_triton_error}. Or pass backend='torch' to use the slower torch fallback")
    if device.type == "cpu" and not (_cpu_launches or _interpreting()):
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing triton, or use backend='torch'")
    return chosen


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend a call on ``device`` runs with: ``"triton"`` or ``"torch"``.

    ``"auto"`` picks Triton on CUDA and the torch fallback elsewhere. Triton on
    CPU tensors works only under its interpreter (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"triton"``, ``"torch"``.
        RuntimeError: Triton is needed (CUDA with ``"auto"``, or ``"triton"``)
            but cannot be imported, or ``"triton"`` was asked for on a CPU
            without the interpreter.

    Examples:
        >>> resolve_backend("auto", torch.device("cpu"))
        'torch'
    """
    return backend_for(backend, device).name
