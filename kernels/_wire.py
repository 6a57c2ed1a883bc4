"""The wire family's public functions: a flat buffer quantized in the flatten
pass, and the exchanged chunks dequantized and summed (the semantics are in
``wire/__init__.py``).

Each function validates its arguments (raising before anything is written),
picks the backend for the device and dispatches to it, as the façade's other
functions do; ``kernels/__init__.py`` exports them. ``quantize_flatten`` runs
every step on the same gradients, so its launch is prepared once per layout
and kept (``_prepared.py``), as ``flatten_cast_scale``'s.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _checks, _prepared
from ._backends import backend_for
from ._checks import share_bytes
from ._common import WIRE_BLOCK, WIRE_BLOCK_RANGE, WIRE_DTYPES, WIRE_LEVELS

__all__ = ["wire_scale_count", "quantize_flatten", "dequantize_sum"]


def _check_block(block) -> int:
    block = _checks.as_index(block, "block")
    low, high = WIRE_BLOCK_RANGE
    if not low <= block <= high or block & (block - 1):
        raise ValueError(f"block must be a power of two from {low} to {high}, got {block}")
    return block


def _check_wire_dtype(dtype, name: str) -> None:
    if dtype not in WIRE_DTYPES:
        raise TypeError(f"{name} must be one of {', '.join(map(str, WIRE_DTYPES))}; got {dtype}")


def wire_scale_count(numel: int, wire_dtype: torch.dtype, block: int = WIRE_BLOCK) -> int:
    """How many fp32 block scales a buffer of ``numel`` codes of ``wire_dtype``
    needs: ``numel // block`` for the blockwise ``int8`` and
    ``float8_e4m3fn``, 0 for ``float32`` and ``bfloat16``.

    Raises:
        TypeError: ``wire_dtype`` is not one of ``WIRE_DTYPES``, or ``numel``
            or ``block`` not an int.
        ValueError: a negative ``numel``, a ``block`` that is not a power of
            two in range, or (blockwise) ``numel`` not a multiple of ``block``.

    Examples:
        >>> wire_scale_count(1024, torch.int8, block=256)
        4
        >>> wire_scale_count(1000, torch.bfloat16)
        0
    """
    numel = _checks.as_index(numel, "numel")
    _check_wire_dtype(wire_dtype, "wire_dtype")
    block = _check_block(block)
    if numel < 0:
        raise ValueError(f"numel must not be negative, got {numel}")
    if wire_dtype not in WIRE_LEVELS:
        return 0
    if numel % block:
        raise ValueError(f"a {wire_dtype} buffer holds whole blocks: numel={numel} is not a "
                         f"multiple of block={block}")
    return numel // block


def _check_vector(t, name: str, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    """``t`` must be a 1-D contiguous ``dtype`` tensor of ``numel`` elements on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.layout != torch.strided or t.device != device \
            or t.dim() != 1 or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"{name} must be a 1-D contiguous {dtype} tensor of {numel} elements "
                         f"on {device}, got {t.dtype} of shape {tuple(t.shape)} on {t.device}")


def _check_scales(block_scales, name: str, dtype: torch.dtype, shape, device) -> None:
    """``block_scales`` for codes of ``dtype``: fp32 of ``shape``, or None / empty
    for the dtypes without scales."""
    if dtype not in WIRE_LEVELS:
        if block_scales is None or (isinstance(block_scales, torch.Tensor)
                                    and block_scales.numel() == 0):
            return
        raise ValueError(f"{name} must be None for {dtype} codes, which carry no scales")
    if block_scales is None:
        raise ValueError(f"{name} is required for {dtype} codes: one fp32 scale per block")
    if not isinstance(block_scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(block_scales).__name__}")
    if block_scales.dtype != torch.float32 or block_scales.device != device \
            or tuple(block_scales.shape) != tuple(shape) or not _rows_contiguous(block_scales):
        raise ValueError(f"{name} must be a contiguous float32 tensor of shape {tuple(shape)} "
                         f"(rows may stand apart) on {device}, got {block_scales.dtype} of "
                         f"shape {tuple(block_scales.shape)} on {block_scales.device}")


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous but for room between its rows (views of
    one buffer that holds codes and scales chunk by chunk): the last
    dimension contiguous, and each other one's stride at least what the
    dimensions inside it span, so that the elements are in order and apart."""
    span = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size > 1 and stride < span:
            return False
        if size > 1:
            span = stride * size
    return t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1


def _check_codes(codes, name: str, dims: Sequence[int]) -> None:
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(codes).__name__}")
    _check_wire_dtype(codes.dtype, f"{name}.dtype")
    if codes.layout != torch.strided or codes.dim() not in dims or not _rows_contiguous(codes):
        wanted = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be a {wanted} contiguous tensor (rows may stand apart), "
                         f"got shape {tuple(codes.shape)} with strides {codes.stride()}")


def _check_apart(named) -> None:
    """No two of the ``(name, tensor)`` one call writes or reads share memory."""
    present = [(n, t) for n, t in named if t is not None]
    for i, (name, t) in enumerate(present):
        for other_name, other in present[i + 1:]:
            if _share(t, other):
                raise ValueError(f"{name} and {other_name} share memory; pass separate buffers")


def _share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``share_bytes``, in O(1) for the codes and scales of the chunked
    layout: two ``(C, ·)`` views with one row stride in bytes whose first
    rows start less than a stride apart can only meet in neighbouring rows,
    so rows 0 and 1 of each tell (row ``i`` of one against row ``i - 1``,
    ``i`` or ``i + 1`` of the other is the same pair shifted); anything else
    is compared by ``share_bytes``."""
    if a.dim() == b.dim() == 2 and a.shape[0] == b.shape[0] > 1 and a.numel() and b.numel():
        stride = a.stride(0) * a.element_size()
        if stride == b.stride(0) * b.element_size() and \
                abs(a.data_ptr() - b.data_ptr()) < stride and \
                _rows_contiguous(a) and _rows_contiguous(b):
            return share_bytes(a[0], b[0]) or share_bytes(a[0], b[1]) or \
                share_bytes(a[1], b[0])
    return share_bytes(a, b)


def quantize_flatten(
    tensors: Sequence[torch.Tensor],
    codes: torch.Tensor,
    block_scales: Optional[torch.Tensor] = None,
    *,
    scale: Union[float, torch.Tensor] = 1.0,
    offsets: Optional[Sequence[int]] = None,
    residual: Optional[torch.Tensor] = None,
    block: int = WIRE_BLOCK,
    check_finite: bool = False,
    backend: str = "auto",
) -> Optional[torch.Tensor]:
    """Flatten ``tensors`` into ``codes`` of a wire dtype, in one pass.

    The flat value ``v`` of each element is what ``flatten_cast_scale`` would
    write into an fp32 buffer (element ``j`` of tensor ``i`` at
    ``offsets[i] + j``, gaps zero, times ``scale``), plus ``residual`` when
    one is given. ``codes.dtype`` picks the format: ``float32`` (``v``
    itself), ``bfloat16`` (rounded to nearest even), or the blockwise
    ``int8`` and ``float8_e4m3fn``: one fp32 scale per ``block`` elements,
    ``absmax / 127`` or ``absmax / 448``, each code ``v / scale`` rounded to
    nearest (so e4m3's ±448 never overflows). A block holding an inf or NaN
    gets the scale NaN and codes 0: it dequantizes to NaN. ``residual`` is
    updated in the same pass to ``v - dequantized`` (0 where that is not
    finite): error feedback.

    Args:
        tensors: floating tensors (fp16, bf16, fp32, fp64) on one device.
        codes: the buffer to fill, of a dtype in ``WIRE_DTYPES``: 1-D
            contiguous, or ``(C, n)`` chunks, each row contiguous but the
            rows possibly apart (views of one ``(C, bytes)`` buffer that
            holds each chunk's codes and then its scales: what one
            ``all_to_all_single`` sends), flat element ``e`` at ``codes[e //
            n, e % n]``. Its size is the packed size, or with ``offsets`` at
            least the end of the last segment. Blockwise: each row a multiple
            of ``block``.
        block_scales: for int8/e4m3, fp32 of ``wire_scale_count(n,
            codes.dtype, block)`` elements per row of ``codes`` (``n`` its
            last dimension), of the same dimensions as ``codes``, each row
            contiguous; None for float32/bfloat16.
        scale: a finite factor, or a one-element fp32/fp64 tensor on the
            device, as in ``flatten_cast_scale``.
        offsets: where each tensor starts in ``codes``; default packed.
        residual: None, or an fp32 buffer of ``codes.numel()`` elements
            added to ``v`` and overwritten with the new quantization error.
        block: elements per block scale, a power of two.
        check_finite: return a 0-d bool tensor on the device, true if any
            ``v`` is inf or NaN (every non-finite input, and any product
            that overflows fp32).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        The non-finite flag with ``check_finite=True``, else None.

    Raises:
        TypeError: not a list of dense floating tensors, ``codes`` not of a
            wire dtype, a tensor argument that is not a tensor, a bad ``scale``,
            ``check_finite`` not a bool.
        ValueError: a ``codes``, ``block_scales`` or ``residual`` of the wrong
            size, dtype, device or shape, or sharing memory with an input or
            with each other; bad ``offsets`` or ``block``. Nothing is written
            when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([4.0] * 5)]
        >>> codes, scales = torch.empty(8, dtype=torch.int8), torch.empty(1)
        >>> quantize_flatten(grads, codes, scales, block=8)
        >>> codes.tolist(), round(scales.item() * 127, 6)
        ([32, -64, 16, 127, 127, 127, 127, 127], 4.0)

        Two chunks, each its 8 codes then its scale's 4 bytes, in one buffer:

        >>> packed = torch.empty(2, 12, dtype=torch.uint8)
        >>> codes, scales = packed[:, :8].view(torch.int8), packed[:, 8:].view(torch.float32)
        >>> quantize_flatten([torch.arange(16.0)], codes, scales, block=8)
        >>> codes[1].tolist(), round(scales[1].item() * 127, 6)
        ([68, 76, 85, 93, 102, 110, 119, 127], 15.0)
    """
    scale = _checks.scale_argument(scale)
    block = _check_block(block)
    _checks.check_flag(check_finite, "check_finite")
    op = f"quantize_flatten(block={block})"
    launch = _prepared.lookup_launch(op, backend, codes, tensors, offsets)
    if launch is None:
        tensors = _checks.check_tensors(tensors, "tensors")
        _check_codes(codes, "codes", (1, 2))
        starts, size = _checks.segment_starts(tensors, offsets, "tensors")
        if tensors and codes.device != tensors[0].device:
            raise ValueError(f"codes is on {codes.device} but the tensors are on "
                             f"{tensors[0].device}")
        if (offsets is None and codes.numel() != size) or codes.numel() < size:
            need = f"{size}" if offsets is None else f"at least {size}"
            raise ValueError(f"codes has {codes.numel()} elements but the tensors need {need}")
        _check_scales(block_scales, "block_scales", codes.dtype,
                      _scales_shape(codes, block, checked=False), codes.device)
        if residual is not None:
            _check_vector(residual, "residual", torch.float32, codes.numel(), codes.device)
        _checks.check_disjoint(codes, "codes", tensors, "tensors")
        chosen = backend_for(backend, codes.device)
        launch = chosen.prepare_quantize(tensors, starts, _checks.extents(starts, codes.numel()),
                                         codes, block)
        _prepared.keep_launch(op, backend, chosen.name, codes, tensors, offsets, starts, launch)
    else:
        _check_scales(block_scales, "block_scales", codes.dtype, _scales_shape(codes, block),
                      codes.device)
        if residual is not None:
            _check_vector(residual, "residual", torch.float32, codes.numel(), codes.device)
    if block_scales is not None and block_scales.numel() == 0:
        block_scales = None
    _check_extras_apart(launch, tensors, codes, block_scales, residual)
    _checks.check_scale_device(scale, codes.device)
    return launch(tensors, codes, block_scales, residual, scale, check_finite)


def _scales_shape(codes: torch.Tensor, block: int, checked: bool = True) -> tuple:
    """The block scales' shape for ``codes``: a row of scales per row of codes
    (``checked=False``: first check that a row is whole blocks)."""
    per_row = codes.shape[-1] // block if checked else \
        wire_scale_count(codes.shape[-1], codes.dtype, block)
    return (*codes.shape[:-1], per_row)


def _span(t: Optional[torch.Tensor]):
    return None if t is None else (t.data_ptr(), t.numel() * t.element_size())


def _check_extras_apart(launch, tensors, codes, block_scales, residual) -> None:
    """The scales and the residual share no memory with the inputs, the codes
    or each other. A kept launch remembers the addresses it last found apart
    (the inputs' layout is the launch's own), so a steady-state call with the
    same buffers and tensors where they were compares addresses only, instead
    of every tensor's bytes."""
    seen = (list(map(torch.Tensor.data_ptr, tensors)), _span(block_scales), _span(residual))
    if getattr(launch, "apart", None) == seen:
        return
    for name, extra in (("block_scales", block_scales), ("residual", residual)):
        if extra is not None:
            _checks.check_disjoint(extra, name, tensors, "tensors")
    _check_apart([("codes", codes), ("block_scales", block_scales), ("residual", residual)])
    launch.apart = seen


def dequantize_sum(codes: torch.Tensor, block_scales: Optional[torch.Tensor],
                   out: torch.Tensor, *, block: int = WIRE_BLOCK, backend: str = "auto") -> None:
    """``out`` = the sum over ``r`` of ``codes[r]`` dequantized, in one fixed order.

    ``codes`` holds ``R`` ranks' chunks of ``n`` codes (as
    ``all_to_all_single`` leaves them), ``block_scales`` their block scales;
    or ``(R, C, n)``: ``C`` chunks per rank, each summed over the ranks into
    its own ``n`` elements of ``out`` (``(1, C, n)``: ``C`` chunks
    dequantized side by side, as an all-gather leaves them).
    Each row is dequantized (``fp32(code) * scale``, in ``out``'s dtype) and
    the rows are added bottom-up pairwise, ``((d0 + d1) + (d2 + d3)) + ...``,
    an odd last row carried up a level unchanged: the tree that splits at the
    largest power of two below ``R``, so the sums of groups of a power-of-two
    size (a node's ranks), summed again, give the same bits. The result is a
    function of the codes alone: deterministic on every rank and transport.

    Args:
        codes: ``(R, n)`` or ``(R, C, n)`` codes of a dtype in
            ``WIRE_DTYPES``, ``R >= 1``; each row of ``n`` contiguous, rows
            possibly apart (see ``quantize_flatten``).
        block_scales: ``(R, n // block)`` or ``(R, C, n // block)`` fp32 for
            int8/e4m3, each row contiguous; None otherwise.
        out: ``(C * n,)`` (``C = 1`` for 2-D codes) contiguous float32 (or
            float64: dequantized and summed in fp64) on the codes' device,
            written.
        block: the elements per scale the codes were made with.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError: ``codes`` not of a wire dtype, an argument that is not a tensor.
        ValueError: shapes, dtypes or devices that do not fit, ``R == 0``, a
            bad ``block``, ``out`` sharing memory with the codes or scales.
            Nothing is written when an error is raised.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> codes = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> out = torch.empty(2)
        >>> dequantize_sum(codes, None, out)
        >>> out.tolist()
        [9.0, 12.0]
    """
    block = _check_block(block)
    _check_codes(codes, "codes", (2, 3))
    ranks, n = codes.shape[0], codes.shape[-1]
    if ranks == 0:
        raise ValueError("codes must hold at least one row (R >= 1)")
    if codes.dtype in WIRE_LEVELS and n % block:
        raise ValueError(f"a {codes.dtype} chunk holds whole blocks: n={n} is not a multiple "
                         f"of block={block}")
    _check_scales(block_scales, "block_scales", codes.dtype,
                  (*codes.shape[:-1], n // block if codes.dtype in WIRE_LEVELS else 0),
                  codes.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"out must be float32 or float64, got {out.dtype}")
    _check_vector(out, "out", out.dtype, codes[0].numel(), codes.device)
    if block_scales is not None and block_scales.numel() == 0:
        block_scales = None
    _check_apart([("out", out), ("codes", codes)])
    _check_apart([("out", out), ("block_scales", block_scales)])
    backend_for(backend, codes.device).dequantize_sum(codes, block_scales, out, block)
