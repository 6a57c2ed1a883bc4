"""Fused multi-tensor kernels: flatten/cast/scale into one flat buffer and back.

``flatten_cast_scale`` and ``unflatten_cast_scale`` are the one mechanism every
fusedreduce API moves gradients with. On CUDA they run as one Triton launch per
call whatever the number of tensors; on the CPU (and with ``backend="torch"``)
a torch fallback with the same semantics serves.

Semantics shared by both backends:

- element ``j`` of tensor ``i`` (in row-major order) lives at
  ``flat[offsets[i] + j]``; without ``offsets`` the tensors are packed densely
  in order;
- each element is computed as ``cast_to(dst_dtype)(x * scale)`` with ``x`` and
  ``scale`` in fp32, or in fp64 when the source or the destination is fp64;
- flat elements not covered by any tensor (padding between ``offsets``) are
  written as zero by ``flatten_cast_scale`` and ignored by the inverse.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _torch

__all__ = [
    "flatten_cast_scale",
    "unflatten_cast_scale",
    "triton_available",
    "resolve_backend",
    "check_scale",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "torch")

_triton_module = None
_triton_error: Optional[BaseException] = None


def _triton():
    """The Triton kernel module, imported on first use (Triton is optional)."""
    global _triton_module, _triton_error
    if _triton_module is None and _triton_error is None:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        try:
            from . import flatten as module
        except ImportError as exc:  # Triton missing or broken
            _triton_error = exc
        else:
            _triton_module = module
    return _triton_module


def triton_available() -> bool:
    """Whether the Triton backend can be imported here."""
    return _triton() is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend a call on ``device`` runs with: ``"triton"`` or ``"torch"``.

    ``"auto"`` picks Triton on CUDA and the torch fallback elsewhere. Triton on
    CPU tensors works only under its interpreter (``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"triton"``, ``"torch"``.
        RuntimeError: Triton is needed (CUDA with ``"auto"``, or ``"triton"``)
            but cannot be imported, or ``"triton"`` was asked for on a CPU
            without the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    if _triton() is None:
        raise RuntimeError(
            f"the Triton backend is needed for tensors on {device} but Triton cannot be "
            f"imported ({_triton_error}); install it with `pip install triton`, or pass "
            f"backend='torch' to use the slower torch fallback")
    if device.type == "cpu" and not _interpreting():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing triton, or use backend='torch'")
    return "triton"


def check_scale(scale, name: str = "scale") -> float:
    """``scale`` as a float; TypeError/ValueError (naming ``name``) unless it is a
    finite Python number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a Python int or float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def _check_dtype(dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be one of float16, bfloat16, float32, float64; got {dtype}")


def _check_tensors(tensors, name: str) -> Tuple[torch.Tensor, ...]:
    """The tensors as a tuple, after the checks shared by both directions."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = tuple(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}[{i}] has layout {t.layout}; only dense (strided) tensors "
                            f"can be fused, densify sparse gradients first")
        _check_dtype(t.dtype, f"{name}[{i}].dtype")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on "
                             f"{tensors[0].device}; one call fuses tensors of one device")
    return tensors


def _layout(tensors, offsets, name: str):
    """Start offsets of the segments and the flat size they need."""
    numels = [t.numel() for t in tensors]
    if offsets is None:
        starts, position = [], 0
        for n in numels:
            starts.append(position)
            position += n
        return starts, position
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries but {name} has {len(tensors)}")
    end = 0
    for i, (o, n) in enumerate(zip(offsets, numels)):
        if o < end:
            raise ValueError(f"offsets[{i}]={o} overlaps the previous segment (which ends at "
                             f"{end}); offsets must be increasing and segments disjoint")
        end = o + n
    return offsets, end


def flatten_cast_scale(
    tensors: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    *,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    check_finite: bool = False,
    offsets: Optional[Sequence[int]] = None,
    backend: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Gather ``tensors`` into one 1-D buffer of ``dtype``, each element ``cast(x) * scale``.

    Any number of tensors of any shapes (0-element and non-contiguous included)
    and of mixed floating dtypes go into one buffer in one pass.

    Args:
        tensors: floating tensors on one device.
        out: a persistent 1-D contiguous buffer of ``dtype`` on that device to
            fill; its size must be the packed size (the sum of numels) or, with
            ``offsets``, at least the end of the last segment (the rest is zeroed).
        dtype: the buffer's dtype when ``out`` is None.
        scale: a finite factor applied in fp32 (fp64 when fp64 is involved).
        check_finite: also return a 0-d bool tensor on the device, true if any
            input element is inf or NaN (no host sync on accelerators).
        offsets: where each tensor starts in the buffer (increasing, disjoint);
            the gaps are zeroed. Default: packed densely.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``resolve_backend``).

    Returns:
        The buffer, or ``(buffer, found_nonfinite)`` with ``check_finite=True``.

    Raises:
        TypeError: not a list of dense floating tensors (the index is named),
            an unsupported ``dtype`` or a non-number ``scale``.
        ValueError: tensors on different devices, a non-finite ``scale``, bad
            ``offsets``, or an ``out`` of the wrong size, dtype, device or shape.
            Nothing is written when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Example:
        >>> grads = [torch.ones(2, 3, dtype=torch.float16), torch.full((4,), 2.0)]
        >>> flatten_cast_scale(grads, scale=0.5)
        tensor([0.5000, 0.5000, 0.5000, 0.5000, 0.5000, 0.5000, 1.0000, 1.0000, 1.0000, 1.0000])
    """
    tensors = _check_tensors(tensors, "tensors")
    scale = check_scale(scale)
    starts, size = _layout(tensors, offsets, "tensors")
    if out is None:
        _check_dtype(dtype, "dtype")
        device = tensors[0].device if tensors else torch.device("cpu")
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        dtype, device = out.dtype, out.device
        _check_dtype(dtype, "out.dtype")
        if tensors and device != tensors[0].device:
            raise ValueError(f"out is on {device} but the tensors are on {tensors[0].device}")
        if out.dim() != 1 or not out.is_contiguous():
            raise ValueError(f"out must be a 1-D contiguous tensor, got shape {tuple(out.shape)} "
                             f"with strides {out.stride()}")
        if (offsets is None and out.numel() != size) or out.numel() < size:
            need = f"{size}" if offsets is None else f"at least {size}"
            raise ValueError(f"out has {out.numel()} elements but the tensors need {need}")
    chosen = resolve_backend(backend, device)
    if out is None:
        out = torch.empty(size, dtype=dtype, device=device)
    extents = _extents(starts, out.numel())
    if chosen == "torch":
        flag = _torch.flatten(tensors, starts, extents, out, scale, check_finite)
    else:
        flag = torch.zeros(1, dtype=torch.uint8, device=device) if check_finite else None
        staged = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        lead = starts[0] if tensors else out.numel()
        if lead > 0:
            # an empty pseudo-segment whose programs zero the buffer's leading gap
            staged, starts, extents = [out[:0]] + staged, [0] + starts, [lead] + extents
        _triton().flatten(staged, starts, extents, out, scale, flag)
        if flag is not None:
            flag = flag.view(torch.bool)[0]
    return (out, flag) if check_finite else out


def _extents(starts, total):
    """How far each segment's writes reach: up to the next segment (or the
    buffer's end), so padding after a segment is zeroed in the same pass."""
    return [end - start for start, end in zip(starts, starts[1:] + [total])]


def unflatten_cast_scale(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    offsets: Optional[Sequence[int]] = None,
    backend: str = "auto",
) -> None:
    """Scatter ``flat`` back: ``t = cast_to(t.dtype)(segment * scale)`` for each tensor, in place.

    With ``accumulate=True`` the segment is added instead:
    ``t = cast_to(t.dtype)(t + segment * scale)``, the sum in the compute dtype.
    Destinations may be non-contiguous and of mixed dtypes.

    Args:
        flat: a 1-D contiguous floating buffer.
        tensors: the destinations, on ``flat``'s device, written in place.
        scale: a finite factor (fp32 math, fp64 when fp64 is involved).
        accumulate: add into the destinations instead of overwriting them.
        offsets: where each tensor's segment starts in ``flat``; default packed.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError/ValueError: as ``flatten_cast_scale``, and ``flat`` too small
            for the segments. Nothing is written when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Example:
        >>> grads = [torch.zeros(2, 2, dtype=torch.float16), torch.zeros(3)]
        >>> unflatten_cast_scale(torch.arange(7.0), grads, scale=2.0)
        >>> grads[1]
        tensor([ 8., 10., 12.])
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a torch.Tensor, got {type(flat).__name__}")
    if flat.layout != torch.strided:
        raise TypeError(f"flat has layout {flat.layout}; it must be a dense tensor")
    _check_dtype(flat.dtype, "flat.dtype")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a 1-D contiguous tensor, got shape {tuple(flat.shape)}")
    tensors = _check_tensors(tensors, "tensors")
    scale = check_scale(scale)
    if tensors and tensors[0].device != flat.device:
        raise ValueError(f"tensors are on {tensors[0].device} but flat is on {flat.device}")
    starts, size = _layout(tensors, offsets, "tensors")
    if flat.numel() < size:
        raise ValueError(f"flat has {flat.numel()} elements but the segments need {size}")
    chosen = resolve_backend(backend, flat.device)
    if chosen == "torch":
        _torch.unflatten(flat, tensors, starts, scale, accumulate)
        return
    with torch.no_grad():
        staged = tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
        _triton().unflatten(flat, staged, starts, scale, accumulate)
        for t, s in zip(tensors, staged):
            if s is not t:
                t.copy_(s)
