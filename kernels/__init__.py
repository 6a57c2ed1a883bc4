"""Fused multi-tensor kernels: flatten/cast/scale into one flat buffer and back,
and AdaSum's per-segment statistics and combine.

This module is the public kernel API. Each function validates its arguments
(raising before anything is written), picks a backend for the device
(``resolve_backend``: Triton on CUDA, the torch fallback elsewhere) and
dispatches to it; nothing else happens here. The backends implement one
protocol (``_backends.py``), one op family per subpackage: ``flatten/``,
``adasum/`` and ``norm/``, each with a ``triton_backend`` and a ``torch_backend``
module side by side. Constants and helpers both families share are in ``_common.py``.

Flatten semantics (both backends):

- element ``j`` of tensor ``i`` (in row-major order) lives at
  ``flat[offsets[i] + j]``; without ``offsets`` the tensors are packed densely
  in order;
- each element is computed as ``cast_to(dst_dtype)(x * scale)`` with ``x`` and
  ``scale`` in fp32, or in fp64 when the source or the destination is fp64;
- flat elements not covered by any tensor (padding between ``offsets``) are
  written as zero by ``flatten_cast_scale`` and ignored by the inverse.

``quantize_flatten`` and ``dequantize_sum`` are the wire family's
(``_wire.py``; semantics in ``wire/__init__.py``): the flatten pass writing a
wire dtype (bf16, or int8/e4m3 with one fp32 scale per ``WIRE_BLOCK``
elements, with an optional error-feedback residual), and the chunks of ``R``
ranks dequantized and summed in one fixed pairwise order.

``norm_powers`` is the clipping norm's kernel: each flat buffer's sum of
``|x| ** p`` in a fixed order (rows of ``NORM_ROW`` elements summed in fp32,
fp64 for fp64 buffers, the rows then added in fp64), the same bits on every
rank that holds the same buffers; on Triton two launches for any number of
buffers. It and the clip functions built on it (``norm_partials``,
``clip_scales``, ``clip_partials``, ``clip_buffers``) are in ``_norms.py``.

Also public, for the layers above: ``capturing``, ``refuse_in_capture`` and
``metadata_guard`` (``_checks.py``), what every CUDA-graph-aware step and
per-step layout check uses; and, for the benchmarks, the kept launches seen
from outside (``kept_launch``, ``count_launches``,
``compiled_launch_arguments``, ``allow_cpu_launches``: ``_instrument.py``).
fusedreduce's other modules and its benchmarks use only the names in
``__all__`` (``tests/test_layers.py`` holds that).

AdaSum functions take the segments of their flat buffers as ``segments``: the
``n + 1`` boundaries ``[0, ..., size]`` of ``n`` segments (one per tensor).

Over 300 lines because of the public functions' docstrings (semantics,
errors, examples); their code is a validation and one dispatch each.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _checks, _prepared
from ._backends import (backend_for, check_backend, resolve_backend, triton_available,
                        triton_unavailable_reason)
from ._checks import capturing, check_disjoint, check_scale, metadata_guard, refuse_in_capture
from ._handles import PreparedFlatten, PreparedUnflatten
from ._common import (ADASUM_CHUNK, ADASUM_FP32_LIMIT, ADASUM_NORM_FLOOR, ALIGN_BYTES,
                      NORM_ROW, SIXTEEN_BIT_DTYPES, SUPPORTED_DTYPES, WIRE_BLOCK, WIRE_DTYPES,
                      adasum_chunk_counts as _chunk_counts, packed_boundaries, scratch_buffer)
from ._instrument import (LAUNCH_OUTCOMES, allow_cpu_launches, compiled_launch_arguments,
                          count_launches, kept_launch)
from ._norms import clip_buffers, clip_partials, clip_scales, norm_partials, norm_powers
from ._wire import dequantize_sum, quantize_flatten, wire_scale_count

__all__ = [
    "flatten_cast_scale",
    "unflatten_cast_scale",
    "prepare_flatten",
    "prepare_unflatten",
    "PreparedFlatten",
    "PreparedUnflatten",
    "adasum_stats",
    "adasum_chunk_stats",
    "adasum_reduce_chunks",
    "adasum_chunk_counts",
    "adasum_combine",
    "check_segments",
    "norm_powers",
    "norm_partials",
    "clip_scales",
    "clip_partials",
    "clip_buffers",
    "NORM_ROW",
    "quantize_flatten",
    "dequantize_sum",
    "wire_scale_count",
    "WIRE_BLOCK",
    "WIRE_DTYPES",
    "packed_boundaries",
    "scratch_buffer",
    "ADASUM_NORM_FLOOR",
    "ADASUM_CHUNK",
    "ADASUM_FP32_LIMIT",
    "ALIGN_BYTES",
    "triton_available",
    "triton_unavailable_reason",
    "resolve_backend",
    "check_backend",
    "check_scale",
    "check_disjoint",
    "capturing",
    "refuse_in_capture",
    "metadata_guard",
    "SUPPORTED_DTYPES",
    "SIXTEEN_BIT_DTYPES",
    "kept_launch",
    "count_launches",
    "LAUNCH_OUTCOMES",
    "compiled_launch_arguments",
    "allow_cpu_launches",
]


def flatten_cast_scale(
    tensors: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    *,
    dtype: torch.dtype = torch.float32,
    scale: Union[float, torch.Tensor] = 1.0,
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
        scale: a finite factor applied in fp32 (fp64 when fp64 is involved):
            a Python number, or a one-element fp32/fp64 tensor on the
            buffer's device, read on the device at each call (no host sync
            with Triton; the torch backend reads it to the host). A tensor's
            finiteness is not checked: that would need its value on the host.
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
            ``offsets``, an ``out`` of the wrong size, dtype, device or shape,
            or an ``out`` that shares memory with an input. Nothing is
            written when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Steady state: the first call with a layout (these tensors at these
    addresses, this ``out`` object, these offsets) prepares its launch and
    keeps it; later calls with the same layout only compare each tensor's
    address, size, dtype and contiguity, then launch; contiguous tensors
    that only moved are checked for overlap and the kept launch is
    re-pointed (see ``_prepared.py``).

    Examples:
        >>> grads = [torch.ones(2, 3, dtype=torch.float16), torch.full((4,), 2.0)]
        >>> flatten_cast_scale(grads, scale=0.5).tolist()
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    """
    scale = _checks.scale_argument(scale)
    launch = _prepared.lookup_launch("flatten", backend, out, tensors, offsets)
    if launch is None:
        tensors, out, launch, _ = _prepare_flatten(tensors, out, dtype, offsets, backend,
                                                   keep=out is not None, scale=scale)
    else:
        _checks.check_scale_device(scale, out.device)
    flag = launch(tensors, out, scale, check_finite)
    return (out, flag) if check_finite else out


def _prepare_flatten(tensors, out, dtype, offsets, backend: str, keep: bool, scale=1.0):
    """Validate a flatten call (with its ``scale``) and prepare its launch
    (kept for later calls with ``keep``): ``(tensors, out, launch, backend
    name)``, ``out`` made here when None."""
    tensors = _checks.check_tensors(tensors, "tensors")
    starts, size = _checks.segment_starts(tensors, offsets, "tensors")
    if out is None:
        _checks.check_dtype(dtype, "dtype")
        device = tensors[0].device if tensors else torch.device("cpu")
        if tensors:
            _checks.check_not_meta(tensors[0], "tensors[0]")
    else:
        _checks.check_out(out, tensors, size, exact=offsets is None)
        _checks.check_disjoint(out, "out", tensors, "tensors")
        dtype, device = out.dtype, out.device
    chosen = backend_for(backend, device)
    _checks.check_scale_device(scale, device)
    if out is None:
        out = torch.empty(size, dtype=dtype, device=device)
    launch = chosen.prepare_flatten(tensors, starts, _checks.extents(starts, out.numel()), out)
    if keep:  # a buffer made here is never passed again: nothing to keep
        _prepared.keep_launch("flatten", backend, chosen.name, out, tensors, offsets, starts,
                              launch)
    return tensors, out, launch, chosen.name


def prepare_flatten(
    tensors: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    *,
    dtype: torch.dtype = torch.float32,
    offsets: Optional[Sequence[int]] = None,
    backend: str = "auto",
) -> PreparedFlatten:
    """A handle that runs ``flatten_cast_scale(tensors, out, ...)`` again and
    again with no per-tensor work: for a loop that always gathers the same
    tensors (gradients that stay where they are, a fixed list of buffers).

    Everything is validated here, as ``flatten_cast_scale`` validates its
    first call; ``handle(scale=1.0, check_finite=False)`` then fills ``out``
    from the tensors' current values and returns what ``flatten_cast_scale``
    returns. The handle keeps the tensors and the buffer (``handle.tensors``,
    ``handle.out``): the tensor objects must keep their storage (no ``set_``,
    ``resize_`` or ``.data =`` on them). A call checks only what its launch
    needs to stay in bounds: ``out``'s address and, on Triton (whose launch
    table holds the tensors' addresses), the tensors' addresses; a moved one
    raises. Gradients set to None and made again each step are new tensors:
    call ``flatten_cast_scale`` for them (it recognises them each call).

    Args:
        tensors: as ``flatten_cast_scale``; the handle keeps them.
        out: as ``flatten_cast_scale``; None makes the buffer once, here.
        dtype: the buffer's dtype when ``out`` is None.
        offsets: as ``flatten_cast_scale``.
        backend: as ``flatten_cast_scale``.

    Returns:
        A ``PreparedFlatten``.

    Raises:
        TypeError, ValueError, RuntimeError: as ``flatten_cast_scale``, here;
            the handle's own errors at each call are listed on
            ``PreparedFlatten.__call__``.

    Examples:
        >>> grads = [torch.ones(2, 3, dtype=torch.float16), torch.full((4,), 2.0)]
        >>> flatten = prepare_flatten(grads, torch.empty(10))
        >>> _ = grads[1].fill_(3.0)
        >>> flatten(scale=0.5).tolist()
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 1.5]
    """
    tensors, out, launch, name = _prepare_flatten(tensors, out, dtype, offsets, backend,
                                                  keep=False)
    return PreparedFlatten(tensors, out, launch, name)


def unflatten_cast_scale(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: Union[float, torch.Tensor] = 1.0,
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
        scale: a finite factor (fp32 math, fp64 when fp64 is involved), or
            a one-element fp32/fp64 tensor on ``flat``'s device, as in
            ``flatten_cast_scale``.
        accumulate: add into the destinations instead of overwriting them.
        offsets: where each tensor's segment starts in ``flat``; default packed.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError/ValueError: as ``flatten_cast_scale``; ``flat`` too small
            for the segments; ``flat`` sharing memory with a destination, or
            destinations sharing memory with each other or within themselves.
            Nothing is written when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Steady state: as ``flatten_cast_scale``, the launch is kept per ``flat``
    object and layout.

    Examples:
        >>> grads = [torch.zeros(2, 2, dtype=torch.float16), torch.zeros(3)]
        >>> unflatten_cast_scale(torch.arange(7.0), grads, scale=2.0)
        >>> grads[1]
        tensor([ 8., 10., 12.])
    """
    scale = _checks.scale_argument(scale)
    launch = _prepared.lookup_launch("unflatten", backend, flat, tensors, offsets)
    if launch is None:
        tensors, launch, _ = _prepare_unflatten(flat, tensors, offsets, backend, keep=True)
    _checks.check_scale_device(scale, flat.device)
    launch(flat, tensors, scale, bool(accumulate))


def _prepare_unflatten(flat, tensors, offsets, backend: str, keep: bool):
    """Validate an unflatten call and prepare its launch (kept for later
    calls with ``keep``): ``(tensors, launch, backend name)``."""
    _checks.check_flat(flat, "flat")
    tensors = _checks.check_tensors(tensors, "tensors")
    if tensors and tensors[0].device != flat.device:
        raise ValueError(f"tensors are on {tensors[0].device} but flat is on {flat.device}")
    starts, size = _checks.segment_starts(tensors, offsets, "tensors")
    if flat.numel() < size:
        raise ValueError(f"flat has {flat.numel()} elements but the segments need {size}")
    _checks.check_disjoint(flat, "flat", tensors, "tensors")
    _checks.check_outputs_disjoint(tensors, "tensors")
    chosen = backend_for(backend, flat.device)
    launch = chosen.prepare_unflatten(flat, tensors, starts)
    if keep:
        _prepared.keep_launch("unflatten", backend, chosen.name, flat, tensors, offsets, starts,
                              launch, outputs=True)
    return tensors, launch, chosen.name


def prepare_unflatten(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    offsets: Optional[Sequence[int]] = None,
    backend: str = "auto",
) -> PreparedUnflatten:
    """A handle that runs ``unflatten_cast_scale(flat, tensors, ...)`` again
    and again with no per-tensor work: for a loop that always writes the same
    tensors (fp32 master weights back into the model's 16-bit parameters,
    a reduced buffer into gradients that stay where they are).

    Everything is validated here, as ``unflatten_cast_scale`` validates its
    first call; ``handle(scale=1.0, accumulate=False)`` then writes ``flat``'s
    current values. The contract and the per-call checks are
    ``prepare_flatten``'s, with ``flat`` for ``out``.

    Args:
        flat: as ``unflatten_cast_scale``; the handle keeps it.
        tensors: the destinations, as ``unflatten_cast_scale``; the handle keeps them.
        offsets: as ``unflatten_cast_scale``.
        backend: as ``unflatten_cast_scale``.

    Returns:
        A ``PreparedUnflatten``.

    Raises:
        TypeError, ValueError, RuntimeError: as ``unflatten_cast_scale``,
            here; the handle's own errors at each call are listed on
            ``PreparedUnflatten.__call__``.

    Examples:
        >>> params = [torch.zeros(2, 2, dtype=torch.float16), torch.zeros(3)]
        >>> master = torch.arange(7.0)
        >>> write_back = prepare_unflatten(master, params)
        >>> master += 1
        >>> write_back()
        >>> params[1]
        tensor([5., 6., 7.])
    """
    tensors, launch, name = _prepare_unflatten(flat, tensors, offsets, backend, keep=False)
    return PreparedUnflatten(tensors, flat, launch, name)


def adasum_chunk_counts(segments: Sequence[int]) -> List[int]:
    """How many AdaSum chunks each segment has: ``ceil(length / ADASUM_CHUNK)``.

    Raises:
        TypeError: a boundary that is not an int.

    Examples:
        >>> adasum_chunk_counts([0, 5, 5, ADASUM_CHUNK + 5])
        [1, 0, 1]
    """
    return _chunk_counts(_checks.boundary_list(segments))


def check_segments(segments: Sequence[int], size: Optional[int] = None) -> List[int]:
    """The boundaries ``segments`` as a list of ints, checked: from 0 to ``size``
    (default: its last entry), never decreasing.

    Raises:
        TypeError: a boundary that is not an int.
        ValueError: not from 0 to ``size``, or decreasing.

    Examples:
        >>> check_segments([0, 3, 3, 5], 5)
        [0, 3, 3, 5]
    """
    return _checks.check_boundaries(segments, size)


def _chunk_partials(rows: int, device: torch.device) -> torch.Tensor:
    # never an empty allocation: a Triton launch must get a real pointer
    return torch.empty(max(rows, 1), 3, dtype=torch.float64, device=device)[:rows]


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
        a: a 1-D contiguous buffer of a floating dtype.
        b: a buffer of ``a``'s dtype, device and size.
        segments: ``n + 1`` non-decreasing boundaries from 0 to ``a.numel()``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError/ValueError: as for the flatten kernels; bad ``segments``.

    Examples:
        >>> a, b = torch.tensor([3.0, 4.0, 1.0]), torch.tensor([1.0, 0.0, 2.0])
        >>> adasum_stats(a, b, [0, 2, 3])
        tensor([[ 3., 25.,  1.],
                [ 2.,  1.,  4.]], dtype=torch.float64)
    """
    _checks.check_pair(a, b)
    boundaries = _checks.check_boundaries(segments, a.numel())
    chosen = backend_for(backend, a.device)
    counts = _chunk_counts(boundaries)
    partials = _chunk_partials(sum(counts), a.device)
    out = torch.zeros(len(boundaries) - 1, 3, dtype=torch.float64, device=a.device)
    chosen.chunk_stats(a, b, boundaries, partials)
    chosen.reduce_chunks(partials, counts, out)
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

    Examples:
        >>> a = torch.ones(ADASUM_CHUNK + 2)
        >>> adasum_chunk_stats(a, 2 * a, [0, ADASUM_CHUNK + 2])[:, 0].tolist()
        [32768.0, 4.0]
    """
    _checks.check_pair(a, b)
    boundaries = _checks.check_boundaries(segments, a.numel())
    chosen = backend_for(backend, a.device)
    out = torch.zeros(sum(_chunk_counts(boundaries)), 3, dtype=torch.float64, device=a.device)
    chosen.chunk_stats(a, b, boundaries, out)
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

    Examples:
        >>> rows = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
        >>> adasum_reduce_chunks(rows, [0, ADASUM_CHUNK + 1])
        tensor([[5., 7., 9.]], dtype=torch.float64)
    """
    boundaries = _checks.check_boundaries(segments)
    counts = _chunk_counts(boundaries)
    if not isinstance(partials, torch.Tensor) or partials.dtype != torch.float64 \
            or partials.shape != (sum(counts), 3):
        raise ValueError(f"partials must be a float64 tensor of shape ({sum(counts)}, 3) "
                         f"for these segments")
    chosen = backend_for(backend, partials.device)
    partials = partials.contiguous()
    out = torch.zeros(len(boundaries) - 1, 3, dtype=torch.float64, device=partials.device)
    chosen.reduce_chunks(partials, counts, out)
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
        a: a 1-D contiguous buffer of a floating dtype.
        b: a buffer of ``a``'s dtype, device and size.
        segments: ``n + 1`` boundaries, as for ``adasum_stats``.
        stats: float64 ``[n, 3]`` on the buffers' device.
        out: where to write (may be ``a`` or ``b``); default a new buffer.

    Raises:
        TypeError/ValueError: bad buffers, ``segments``, ``stats`` or ``out``.

    Examples:
        >>> a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
        >>> adasum_combine(a, b, [0, 2], adasum_stats(a, b, [0, 2]))  # orthogonal: a + b
        tensor([1., 1.])
    """
    _checks.check_pair(a, b)
    boundaries = _checks.check_boundaries(segments, a.numel())
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float64 \
            or stats.shape != (len(boundaries) - 1, 3) or stats.device != a.device:
        raise ValueError(f"stats must be a float64 tensor of shape ({len(boundaries) - 1}, 3) "
                         f"on {a.device}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != a.dtype
                            or out.device != a.device or out.shape != a.shape
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {a.dtype} tensor of shape {tuple(a.shape)} "
                         f"on {a.device}")
    chosen = backend_for(backend, a.device)
    if out is None:
        out = torch.empty_like(a)
    chosen.combine(a, b, boundaries, stats.contiguous(), out)
    return out
