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
import operator
import os
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _torch

__all__ = [
    "flatten_cast_scale",
    "unflatten_cast_scale",
    "adasum_stats",
    "adasum_chunk_stats",
    "adasum_reduce_chunks",
    "adasum_chunk_counts",
    "adasum_combine",
    "ADASUM_NORM_FLOOR",
    "ADASUM_CHUNK",
    "ADASUM_FP32_LIMIT",
    "triton_available",
    "resolve_backend",
    "check_backend",
    "check_scale",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "torch")
_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
_STRIDED = frozenset([torch.strided])

#: AdaSum coefficients are 1 where a squared norm is below this: sqrt(float64 tiny)
ADASUM_NORM_FLOOR = math.sqrt(2.2250738585072014e-308)
#: AdaSum statistics are sums over chunks of this many elements from a segment's start
ADASUM_CHUNK = _torch.ADASUM_CHUNK
#: fp32/16-bit buffers are combined in fp32 while both coefficients are at most
#: this in magnitude, in fp64 otherwise
ADASUM_FP32_LIMIT = _torch.ADASUM_FP32_LIMIT

_triton_modules = None
_triton_error: Optional[BaseException] = None


def _triton_kernels():
    """The Triton kernel modules ``(flatten, adasum)``, imported on first use
    (Triton is optional), or None when Triton cannot be imported."""
    global _triton_modules, _triton_error
    if _triton_modules is None and _triton_error is None:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        try:
            from . import adasum, flatten
        except ImportError as exc:  # Triton missing or broken
            _triton_error = exc
        else:
            _triton_modules = (flatten, adasum)
    return _triton_modules


def _triton():
    modules = _triton_kernels()
    return modules[0] if modules else None


def triton_available() -> bool:
    """Whether the Triton backend can be imported here."""
    return _triton() is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend) -> str:
    """``backend`` itself if it names a backend (``"auto"``, ``"triton"`` or
    ``"torch"``); whether it can run is decided per device by ``resolve_backend``.

    Raises:
        ValueError: any other value.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


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
    check_backend(backend)
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
    # the common, valid case in a few C-level passes (this runs every step, for
    # every gradient); only a failure walks the list to name the culprit
    if all(isinstance(t, torch.Tensor) for t in tensors) and \
            {t.layout for t in tensors} <= _STRIDED and \
            {t.dtype for t in tensors} <= _SUPPORTED_SET and \
            len({t.device for t in tensors}) <= 1:
        return tensors
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


def _index(value, name: str) -> int:
    """``value`` as an int (numpy and torch integers included); TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _layout(tensors, offsets, name: str):
    """Start offsets of the segments and the flat size they need."""
    numels = [t.numel() for t in tensors]
    if offsets is None:
        starts, position = [], 0
        for n in numels:
            starts.append(position)
            position += n
        return starts, position
    if not all(type(o) is int for o in offsets):
        offsets = [_index(o, f"offsets[{i}]") for i, o in enumerate(offsets)]
    offsets = list(offsets)
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries but {name} has {len(tensors)}")
    end = 0
    for i, (o, n) in enumerate(zip(offsets, numels)):
        if o < 0:
            raise ValueError(f"offsets[{i}]={o} is negative")
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


def _check_pair(a, b):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} has layout {t.layout}; it must be a dense tensor")
        _check_dtype(t.dtype, f"{name}.dtype")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a 1-D contiguous buffer, got shape "
                             f"{tuple(t.shape)}")
    if a.dtype != b.dtype or a.device != b.device or a.numel() != b.numel():
        raise ValueError(f"a and b must match in dtype, device and size: a is {a.numel()} "
                         f"{a.dtype} on {a.device}, b is {b.numel()} {b.dtype} on {b.device}")


def _segment_list(segments) -> list:
    """``segments`` (a sequence or a tensor) as a list of ints, each checked."""
    if isinstance(segments, torch.Tensor):
        segments = segments.tolist()
    return [_index(s, f"segments[{i}]") for i, s in enumerate(segments)]


def _check_segments(segments, size: Optional[int] = None):
    """The boundaries as ints: from 0 to ``size`` (default: the last one),
    never decreasing."""
    bounds = _segment_list(segments)
    if size is None:
        size = bounds[-1] if bounds else 0
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != size:
        raise ValueError(f"segments must be the boundaries [0, ..., {size}] of the buffer, "
                         f"got {bounds[:3]}...{bounds[-2:]}")
    for i in range(1, len(bounds)):
        if bounds[i] < bounds[i - 1]:
            raise ValueError(f"segments must not decrease: segments[{i}]={bounds[i]} < "
                             f"segments[{i - 1}]={bounds[i - 1]}")
    return bounds


def adasum_chunk_counts(segments: Sequence[int]) -> list:
    """How many AdaSum chunks each segment has: ``ceil(length / ADASUM_CHUNK)``.

    Example:
        >>> adasum_chunk_counts([0, 5, 5, ADASUM_CHUNK + 5])
        [1, 0, 1]
    """
    return _torch.adasum_chunk_counts(_segment_list(segments))


def adasum_stats(a: torch.Tensor, b: torch.Tensor, segments: Sequence[int], *,
                 backend: str = "auto") -> torch.Tensor:
    """Per segment ``(a·b, ‖a‖², ‖b‖²)`` of two flat buffers, as float64 ``[n, 3]``.

    Segment ``i`` is ``[segments[i], segments[i + 1])``. The statistics are
    defined over *chunks*: a segment is cut into chunks of ``ADASUM_CHUNK``
    elements from its start (the last one shorter); each chunk's three sums of
    fp64 products are formed by a fixed walk relative to the chunk's start
    (``adasum_chunk_stats``), and a segment's statistics are its chunk
    partials added in chunk order, ``((p0 + p1) + p2) + …`` in fp64
    (``adasum_reduce_chunks``). So a segment's statistics are bitwise the same
    wherever it sits in a buffer, alone or fused, and when its chunks are
    computed in pieces (on different ranks) and added afterwards; the result
    is deterministic. The walk inside a chunk is the backend's own (Triton's
    or torch's), so the two backends may differ in the last bits.

    Args:
        a, b: 1-D contiguous buffers of one floating dtype, device and size.
        segments: ``n + 1`` non-decreasing boundaries from 0 to ``a.numel()``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError/ValueError: as for the flatten kernels; bad ``segments``.

    Example:
        >>> a, b = torch.tensor([3.0, 4.0, 1.0]), torch.tensor([1.0, 0.0, 2.0])
        >>> adasum_stats(a, b, [0, 2, 3])
        tensor([[ 3., 25.,  1.],
                [ 2.,  1.,  4.]], dtype=torch.float64)
    """
    _check_pair(a, b)
    bounds = _check_segments(segments, a.numel())
    counts = _torch.adasum_chunk_counts(bounds)
    # never an empty allocation: a Triton launch must get a real pointer
    partials = torch.empty(max(sum(counts), 1), 3, dtype=torch.float64,
                           device=a.device)[:sum(counts)]
    out = torch.zeros(len(bounds) - 1, 3, dtype=torch.float64, device=a.device)
    if resolve_backend(backend, a.device) == "torch":
        _torch.adasum_chunk_stats(a, b, bounds, partials)
        _torch.adasum_reduce_chunks(partials, counts, out)
    else:
        triton_adasum = _triton_kernels()[1]
        triton_adasum.chunk_stats(a, b, bounds, partials)
        triton_adasum.reduce_chunks(partials, counts, out)
    return out


def adasum_chunk_stats(a: torch.Tensor, b: torch.Tensor, segments: Sequence[int], *,
                       backend: str = "auto") -> torch.Tensor:
    """Every chunk's ``(Σxy, Σx², Σy²)``, as float64 ``[n_chunks, 3]``.

    Chunks in order: segment by segment, each segment's chunks of
    ``ADASUM_CHUNK`` elements from its start (``adasum_chunk_counts``). A
    chunk's partial depends only on the chunk's values, not on where it sits,
    so a slice of a buffer that starts and ends on chunk boundaries of the
    segments it cuts gives exactly the rows of its chunks.
    ``adasum_reduce_chunks`` turns the rows into ``adasum_stats``.

    Raises:
        TypeError/ValueError: as ``adasum_stats``.

    Example:
        >>> a = torch.ones(ADASUM_CHUNK + 2)
        >>> adasum_chunk_stats(a, 2 * a, [0, ADASUM_CHUNK + 2])[:, 0].tolist()
        [32768.0, 4.0]
    """
    _check_pair(a, b)
    bounds = _check_segments(segments, a.numel())
    out = torch.zeros(sum(_torch.adasum_chunk_counts(bounds)), 3, dtype=torch.float64,
                      device=a.device)
    if resolve_backend(backend, a.device) == "torch":
        _torch.adasum_chunk_stats(a, b, bounds, out)
    else:
        _triton_kernels()[1].chunk_stats(a, b, bounds, out)
    return out


def adasum_reduce_chunks(partials: torch.Tensor, segments: Sequence[int], *,
                         backend: str = "auto") -> torch.Tensor:
    """Each segment's chunk partials added in chunk order: ``adasum_stats``.

    ``partials`` is float64 ``[n_chunks, 3]`` for the chunks of ``segments``
    (as ``adasum_chunk_stats`` returns them, or summed across ranks that each
    filled the rows of their own chunks). Returns float64 ``[n, 3]``: segment
    ``i``'s rows added one after the other, ``((p0 + p1) + p2) + …`` (zeros for
    an empty segment) — the same additions on both backends.

    Raises:
        TypeError/ValueError: bad ``segments`` (any non-decreasing boundaries
            from 0), or ``partials`` not float64 ``[n_chunks, 3]``.
    """
    bounds = _check_segments(segments)
    counts = _torch.adasum_chunk_counts(bounds)
    if not isinstance(partials, torch.Tensor) or partials.dtype != torch.float64 \
            or partials.shape != (sum(counts), 3):
        raise ValueError(f"partials must be a float64 tensor of shape ({sum(counts)}, 3) "
                         f"for these segments")
    partials = partials.contiguous()
    out = torch.zeros(len(bounds) - 1, 3, dtype=torch.float64, device=partials.device)
    if resolve_backend(backend, partials.device) == "torch":
        _torch.adasum_reduce_chunks(partials, counts, out)
    else:
        _triton_kernels()[1].reduce_chunks(partials, counts, out)
    return out


def adasum_combine(a: torch.Tensor, b: torch.Tensor, segments: Sequence[int],
                   stats: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                   backend: str = "auto") -> torch.Tensor:
    """``out = ca·a + cb·b`` per segment: the AdaSum of ``a`` and ``b``.

    ``ca = 1 - a·b / (2‖a‖²)`` and ``cb = 1 - a·b / (2‖b‖²)`` from that
    segment's row of ``stats`` (``adasum_stats``), in fp64; a coefficient is 1
    where its squared norm is below ``ADASUM_NORM_FLOOR``, so
    ``AdaSum(g, 0) = g``. fp64 buffers are combined in fp64. fp32 and 16-bit
    buffers are combined in fp32 (coefficients rounded to fp32) while
    ``|ca|`` and ``|cb|`` are at most ``ADASUM_FP32_LIMIT`` (2^64), and in fp64
    otherwise, rounded once to fp32: a gradient ~1e-38 meeting a parallel one
    ~1e19 gives coefficients ~1e56 that fp32 cannot hold. The choice is per
    segment, from its coefficients alone, so every rank makes the same one.
    Written in the buffers' dtype (16-bit via fp32).

    Args:
        a, b: 1-D contiguous buffers of one floating dtype, device and size.
        segments: ``n + 1`` boundaries, as for ``adasum_stats``.
        stats: float64 ``[n, 3]`` on the buffers' device.
        out: where to write (may be ``a`` or ``b``); default a new buffer.

    Raises:
        TypeError/ValueError: bad buffers, ``segments``, ``stats`` or ``out``.

    Example:
        >>> a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
        >>> adasum_combine(a, b, [0, 2], adasum_stats(a, b, [0, 2]))  # orthogonal: a + b
        tensor([1., 1.])
    """
    _check_pair(a, b)
    bounds = _check_segments(segments, a.numel())
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float64 \
            or stats.shape != (len(bounds) - 1, 3) or stats.device != a.device:
        raise ValueError(f"stats must be a float64 tensor of shape ({len(bounds) - 1}, 3) on "
                         f"{a.device}")
    if out is None:
        out = torch.empty_like(a)
    elif not isinstance(out, torch.Tensor) or out.dtype != a.dtype or out.device != a.device \
            or out.shape != a.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {a.dtype} tensor of shape {tuple(a.shape)} "
                         f"on {a.device}")
    stats = stats.contiguous()
    if resolve_backend(backend, a.device) == "torch":
        _torch.adasum_combine(a, b, bounds, stats, out, ADASUM_NORM_FLOOR, ADASUM_FP32_LIMIT)
    else:
        _triton_kernels()[1].combine(a, b, bounds, stats, out)
    return out
