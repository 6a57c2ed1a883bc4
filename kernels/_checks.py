"""Argument checks of the public kernel API, shared by its functions.

Every check runs before anything is written, and names the offending argument
(and index) in its error.
"""
from __future__ import annotations

import math
import operator
from typing import List, Optional, Sequence, Tuple

import torch

from ._common import SUPPORTED_DTYPES, packed_boundaries

try:  # a C++ check of many tensors' metadata in one call; optional (see metadata_guard)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
    _TensorGuards = None

_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
_STRIDED = frozenset([torch.strided])


def metadata_guard(tensors: Sequence[torch.Tensor]):
    """A check that later tensors have exactly the Python type, dtype, device,
    shape, strides, ``requires_grad`` and dispatch keys of ``tensors``, in one
    C++ call (``guard.check(*others)``: True or False), or None where torch
    has no such check or it does not recognise ``tensors`` themselves.

    A fast path for checks that compare a list of tensors with a kept one
    every step (``_prepared.Prepared.matches``, the reducer's gradients): it
    compares at least what they compare, except addresses, so its True means
    equal. Its False may come from what they ignore (a reshaped tensor of the
    same count, a ``requires_grad`` flag, ``inference_mode``'s dispatch
    keys), so a False is settled by the caller's own per-tensor passes.
    ``torch._C._dynamo.guards.TensorGuards`` is TorchDynamo's; it is private,
    hence optional.
    """
    if _TensorGuards is None or not tensors:
        return None
    try:
        guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return guard if guard.check(*tensors) is True else None
    except Exception:  # noqa: BLE001 - a private torch API: any failure means "not usable"
        return None


def capturing(device: torch.device) -> bool:
    """Whether work issued now for ``device`` is being recorded into a CUDA
    graph (``torch.cuda.graph``) instead of run."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_in_capture(device: torch.device, what: str, remedy: str) -> None:
    """Raise before ``what`` if ``device``'s current stream is capturing.

    A host read, or a host-to-device upload, inside a capture either fails
    deep inside CUDA or is recorded with values that go stale on replay: say
    which step cannot be captured, and what to do instead.

    Raises:
        RuntimeError: capturing now.
    """
    if capturing(device):
        raise RuntimeError(f"{what} cannot run inside CUDA graph capture: {remedy}")


def check_scale(scale, name: str = "scale") -> float:
    """``scale`` as a float.

    Raises:
        TypeError: not a Python int or float (bools included), naming ``name``.
        ValueError: not finite.

    Examples:
        >>> check_scale(1)
        1.0
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a Python int or float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def check_flag(value, name: str) -> bool:
    """``value`` if it is a bool: a string such as ``"False"`` would be true.

    Raises:
        TypeError: anything else, naming ``name``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def scale_argument(scale):
    """A checked Python scale as a float, or a checked tensor scale as it is.

    Raises:
        TypeError: neither a real number nor an fp32/fp64 tensor.
        ValueError: a non-finite number, or a tensor of more than one element.
    """
    if isinstance(scale, torch.Tensor):
        if scale.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"a tensor scale must be float32 or float64, got {scale.dtype}")
        if scale.numel() != 1:
            raise ValueError(f"a tensor scale must hold one element, got shape "
                             f"{tuple(scale.shape)}")
        return scale.detach()
    return check_scale(scale)


def check_scale_device(scale, device: torch.device) -> None:
    """A tensor ``scale`` must be on the buffer's ``device``."""
    if isinstance(scale, torch.Tensor) and scale.device != device:
        raise ValueError(f"the scale tensor is on {scale.device} but the buffer is on {device}")


def check_dtype(dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be one of float16, bfloat16, float32, float64; got {dtype}")


def check_tensors(tensors, name: str) -> Tuple[torch.Tensor, ...]:
    """The tensors as a tuple: dense floating tensors of one device."""
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
        check_dtype(t.dtype, f"{name}[{i}].dtype")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on "
                             f"{tensors[0].device}; one call fuses tensors of one device")
    return tensors


def check_flat(t, name: str) -> None:
    """``t`` must be a 1-D contiguous tensor of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; it must be a dense tensor")
    check_dtype(t.dtype, f"{name}.dtype")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(t.shape)}")


def check_out(out, tensors, size: int, exact: bool) -> None:
    """``out`` must be a 1-D contiguous buffer of a supported dtype on the
    tensors' device, of ``size`` elements (``exact``) or at least that many."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    check_dtype(out.dtype, "out.dtype")
    if tensors and out.device != tensors[0].device:
        raise ValueError(f"out is on {out.device} but the tensors are on {tensors[0].device}")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a 1-D contiguous tensor, got shape {tuple(out.shape)} "
                         f"with strides {out.stride()}")
    if (exact and out.numel() != size) or out.numel() < size:
        need = f"{size}" if exact else f"at least {size}"
        raise ValueError(f"out has {out.numel()} elements but the tensors need {need}")


def as_index(value, name: str) -> int:
    """``value`` as an int (numpy and torch integers included); TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def segment_starts(tensors, offsets, name: str) -> Tuple[List[int], int]:
    """Where each tensor's segment starts in the flat buffer, and the size the
    segments need: packed densely without ``offsets``, else ``offsets`` checked
    (ints, non-negative, increasing, disjoint)."""
    numels = [t.numel() for t in tensors]
    if offsets is None:
        boundaries = packed_boundaries(numels)
        return boundaries[:-1], boundaries[-1]
    if not all(type(o) is int for o in offsets):
        offsets = [as_index(o, f"offsets[{i}]") for i, o in enumerate(offsets)]
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


def extents(starts: Sequence[int], total: int) -> List[int]:
    """How far each segment's writes reach: up to the next segment (or the
    buffer's end), so padding after a segment is zeroed in the same pass."""
    return [end - start for start, end in zip(starts, list(starts[1:]) + [total])]


def check_pair(a, b) -> None:
    """``a`` and ``b`` must be flat buffers of one dtype, device and size."""
    check_flat(a, "a")
    check_flat(b, "b")
    if a.dtype != b.dtype or a.device != b.device or a.numel() != b.numel():
        raise ValueError(f"a and b must match in dtype, device and size: a is {a.numel()} "
                         f"{a.dtype} on {a.device}, b is {b.numel()} {b.dtype} on {b.device}")


def boundary_list(segments) -> List[int]:
    """``segments`` (a sequence or a tensor of boundaries) as a list of ints, each checked."""
    if isinstance(segments, torch.Tensor):
        segments = segments.tolist()
    return [as_index(s, f"segments[{i}]") for i, s in enumerate(segments)]


def check_boundaries(segments, size: Optional[int] = None) -> List[int]:
    """The segments' boundaries as ints: from 0 to ``size`` (default: the last
    one), never decreasing."""
    boundaries = boundary_list(segments)
    if size is None:
        size = boundaries[-1] if boundaries else 0
    if len(boundaries) < 1 or boundaries[0] != 0 or boundaries[-1] != size:
        raise ValueError(f"segments must be the boundaries [0, ..., {size}] of the buffer, "
                         f"got {boundaries[:3]}...{boundaries[-2:]}")
    for i in range(1, len(boundaries)):
        if boundaries[i] < boundaries[i - 1]:
            raise ValueError(f"segments must not decrease: segments[{i}]={boundaries[i]} < "
                             f"segments[{i - 1}]={boundaries[i - 1]}")
    return boundaries


def _byte_span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes ``[start, end)`` a dense tensor's elements lie in (empty: ``(0, 0)``)."""
    if t.numel() == 0:
        return 0, 0
    reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size()


def _element_starts(t: torch.Tensor) -> torch.Tensor:
    """The first byte of every element of ``t``, sorted (int64, on the CPU)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (t.data_ptr() + offsets.reshape(-1) * t.element_size()).sort().values


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of an element of ``a`` is a byte of an element of ``b``."""
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    if a_start >= b_end or b_start >= a_end or a_start == a_end or b_start == b_end:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    # strided tensors can interleave within overlapping spans (``x[:, 0]`` and
    # ``x[:, 1]``): compare element by element. For each element of b, the
    # element of a with the last start before b's element ends is the only
    # candidate, as all of a's elements have one length.
    starts_a, starts_b = _element_starts(a), _element_starts(b)
    after = torch.searchsorted(starts_a, starts_b + b.element_size())
    candidates = after > 0
    if not bool(candidates.any()):
        return False
    last = starts_a[(after - 1).clamp(min=0)][candidates]
    return bool((last + a.element_size() > starts_b[candidates]).any())


def check_not_meta(t: torch.Tensor, name: str) -> None:
    """The kernels copy data, and a meta tensor holds none: refused by name."""
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device: it holds no data to copy. Materialize "
                         f"the tensors first (module.to_empty(device=...), then initialise "
                         f"the parameters)")


def check_disjoint(buffer: torch.Tensor, buffer_name: str, tensors, name: str,
                   indices: Optional[Sequence[int]] = None) -> None:
    """``buffer`` shares no memory with any of ``tensors`` (``indices``: the
    positions they are named by, in the caller's list; default 0, 1, ...).

    The callers have checked that the buffer and the tensors share a device:
    on the meta device there is no memory to compare (every address is 0), and
    no data to copy, so a meta ``buffer`` is refused here.

    Raises:
        ValueError: naming the first tensor that overlaps the buffer, or the
            buffer on the meta device.

    Examples:
        >>> flat = torch.zeros(8)
        >>> check_disjoint(flat, "flat", [flat[4:]], "tensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: tensors[0] overlaps flat: ...
    """
    check_not_meta(buffer, buffer_name)
    for i, t in zip(range(len(tensors)) if indices is None else indices, tensors):
        if share_bytes(buffer, t):
            raise ValueError(f"{name}[{i}] overlaps {buffer_name}: the fused copy would read "
                             f"values it has already overwritten; pass tensors that do not "
                             f"share memory with {buffer_name}")


def check_outputs_disjoint(tensors, name: str) -> None:
    """No two of ``tensors`` (written in place) share memory, and none writes one
    memory location twice.

    Raises:
        ValueError: naming the overlapping tensors.
    """
    spans = sorted((_byte_span(t), i) for i, t in enumerate(tensors) if t.numel() > 0)
    active = []  # (end, index) of the spans that reach past the current start
    for (start, end), i in spans:
        active = [(e, j) for e, j in active if e > start]
        for _, j in active:
            if share_bytes(tensors[j], tensors[i]):
                first, second = sorted((j, i))
                raise ValueError(f"{name}[{first}] and {name}[{second}] share memory; each "
                                 f"output must be written by one segment only")
        active.append((end, i))
    for i, t in enumerate(tensors):
        if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(f"{name}[{i}] has elements that share memory (an expanded or "
                             f"overlapping view); it cannot be written in place")
