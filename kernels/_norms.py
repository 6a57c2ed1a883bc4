"""The norm family's public functions: the clipping norm of flat buffers, and
the scales it gives (the semantics are in ``norm/__init__.py``).

Each function validates its arguments (raising before anything is launched),
picks the backend for the buffers' device and dispatches to it, as the
façade's other functions do; ``kernels/__init__.py`` exports them. The
reducers reach them through ``fusedreduce.clipping``.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple, Union

import torch

from . import _checks
from ._backends import backend_for

__all__ = ["norm_powers", "norm_partials", "clip_scales", "clip_partials", "clip_buffers"]

Scale = Union[None, float, torch.Tensor]


def _checked_buffers(buffers) -> Tuple[torch.Tensor, ...]:
    buffers = _checks.check_tensors(buffers, "buffers")
    if not buffers:
        raise ValueError("buffers must hold at least one tensor")
    # check_tensors saw the layouts and dtypes: what is left, in one pass (this
    # runs every clipped step); only a failure walks the list to name the culprit
    if not all(b.dim() == 1 and b.is_contiguous() for b in buffers):
        for i, b in enumerate(buffers):
            _checks.check_flat(b, f"buffers[{i}]")
    return buffers


def _positive(value, name: str, inf_means: str) -> float:
    """``value`` as a float: a positive number, ``math.inf`` meaning ``inf_means``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:  # NaN fails too
        raise ValueError(f"{name} must be positive (math.inf {inf_means}), got {value}")
    return float(value)


def _checked_norm_type(norm_type) -> float:
    return _positive(norm_type, "norm_type", "for the max norm")


def _check_vector(t, name: str, device: torch.device) -> None:
    """``t`` must be a 1-D float64 tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float64 or t.dim() != 1 or t.device != device:
        raise ValueError(f"{name} must be a 1-D float64 tensor on {device}, got "
                         f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")


def _check_clip(postscales, count: int, max_norm, loss_scale, norm_dtype) -> None:
    """The arguments every clip function shares, for ``count`` buffers."""
    if isinstance(postscales, (str, bytes)) or not isinstance(postscales, Sequence) \
            or len(postscales) != count \
            or any(isinstance(s, bool) or not isinstance(s, (int, float)) for s in postscales):
        raise ValueError(f"postscales must be a list or tuple of {count} numbers, one per "
                         f"buffer, got {postscales!r}")
    _positive(max_norm, "max_norm", "for no clipping")
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.numel() != 1:
            raise ValueError(f"loss_scale must be a one-element tensor, got shape "
                             f"{tuple(loss_scale.shape)}")
    elif loss_scale is not None and (isinstance(loss_scale, bool)
                                     or not isinstance(loss_scale, (int, float))
                                     or not 0 < loss_scale < math.inf):
        raise ValueError(f"loss_scale must be None, a finite number > 0 or a one-element "
                         f"tensor, got {loss_scale!r}")
    if norm_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"norm_dtype must be torch.float32 or torch.float64, got {norm_dtype}")


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float = 2.0, *,
                backend: str = "auto") -> torch.Tensor:
    """Each buffer's sum of ``|x| ** norm_type`` (its max ``|x|`` for
    ``math.inf``), as one float64 vector on the buffers' device.

    The order of the sum is fixed by the buffers' sizes alone (rows of
    ``NORM_ROW`` elements, each summed in fp32, or fp64 for fp64 buffers, then
    the rows added in fp64), so two processes holding the same buffers get the
    same bits, whatever their thread count; the two backends may differ in
    the last bits. ``norm_powers(bufs, p).sum() ** (1 / p)`` is the buffers'
    total p-norm. The reducers' ``max_grad_norm`` is built on it.

    Args:
        buffers: 1-D contiguous tensors of one device, any supported dtypes
            (at least one; empty ones give 0).
        norm_type: the order p, positive; ``math.inf`` for the max norm.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``resolve_backend``).

    Raises:
        TypeError: ``buffers`` not a list or tuple of tensors, an unsupported
            dtype, or ``norm_type`` not a number.
        ValueError: no buffers, a buffer not 1-D contiguous, buffers on
            different devices, or ``norm_type`` not positive.
        RuntimeError: the backend cannot run here (see ``resolve_backend``).

    Examples:
        >>> norm_powers([torch.tensor([3.0, -4.0]), torch.tensor([1.0])])
        tensor([25.,  1.], dtype=torch.float64)
        >>> norm_powers([torch.tensor([3.0, -4.0])], float("inf"))
        tensor([4.], dtype=torch.float64)
    """
    buffers = _checked_buffers(buffers)
    norm_type = _checked_norm_type(norm_type)
    return backend_for(backend, buffers[0].device).norm_powers(buffers, norm_type)


def norm_partials(buffers: Sequence[torch.Tensor], norm_type: float = 2.0,
                  share: Tuple[int, int] = (0, 1), *, backend: str = "auto") -> torch.Tensor:
    """The partials ``norm_powers`` is finished from, as one float64 vector:
    share ``(index, count)`` of them computed, the others zero.

    What a partial is belongs to the backend (a row's norm on torch, a
    program's sum of powers on Triton), and so does their number; the shares
    ``(0, n) … (n - 1, n)`` of one set of buffers add up to the whole vector
    bit for bit (a partial plus zeros is the partial), which is how the
    reducers split the norm's reading across ranks (``split_norm``): each rank
    computes its share, one all-reduce adds them, ``clip_partials`` finishes.

    Args:
        buffers: as ``norm_powers``.
        norm_type: as ``norm_powers``.
        share: ``(index, count)``, ``0 <= index < count``; ``(0, 1)``: all.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        TypeError/ValueError: as ``norm_powers``; ``share`` not two ints with
            ``0 <= index < count``.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> bufs = [torch.tensor([3.0, -4.0])]
        >>> whole = norm_partials(bufs, backend="torch")
        >>> halves = norm_partials(bufs, share=(0, 2), backend="torch") \\
        ...     + norm_partials(bufs, share=(1, 2), backend="torch")
        >>> torch.equal(whole, halves)
        True
    """
    buffers = _checked_buffers(buffers)
    norm_type = _checked_norm_type(norm_type)
    if not isinstance(share, tuple) or len(share) != 2 \
            or any(isinstance(x, bool) or not isinstance(x, int) for x in share) \
            or not 0 <= share[0] < share[1]:
        raise ValueError(f"share must be a tuple (index, count) of ints with "
                         f"0 <= index < count, got {share!r}")
    return backend_for(backend, buffers[0].device).norm_partials(buffers, norm_type, share)


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float = 2.0, loss_scale: Scale = None, *, backend: str = "auto",
                norm_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from buffers' ``norm_powers``: torch's
    ``clip_grad_norm_`` of the gradients the buffers are written back as.

    Buffer ``i`` is written back times ``postscales[i]``, so the norm is
    ``(Σ |postscales[i]|^p · powers[i]) ** (1/p)`` divided by ``loss_scale``,
    a 0-d tensor of ``norm_dtype`` (what torch returns: fp32, or fp64 for
    fp64 gradients); ``scales[i]`` is ``postscales[i]`` times the clip
    coefficient ``min(1, max_norm / (norm + 1e-6))`` (taken in ``norm_dtype``
    as torch takes it), a one-element float64 tensor on the device that an
    unflatten can take as its ``scale``. Computed on the device, no host
    read; a NaN norm gives NaN scales.

    Args:
        powers: float64 vector on the buffers' device, one entry per buffer.
        postscales: one number per buffer.
        max_norm: the limit, positive; ``math.inf`` measures without clipping.
        norm_type: the order p the powers were taken with.
        loss_scale: None, a finite number > 0, or a one-element tensor (a
            GradScaler's scale, read as float64 on the buffers' device): the
            gradients' loss scale, divided out of the norm (the scales keep
            it). A tensor is not read on the host: one that is not finite and
            > 0 makes the norm NaN.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        norm_dtype: ``torch.float32`` or ``torch.float64``.

    Raises:
        TypeError: ``powers`` not a tensor, ``max_norm`` or ``norm_type`` not
            a number.
        ValueError: ``powers`` not a 1-D float64 tensor, ``postscales`` not
            one number per power, ``max_norm`` or ``norm_type`` not positive,
            a bad ``loss_scale`` or ``norm_dtype``.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> powers = norm_powers([torch.tensor([3.0, -4.0])])  # norm 5
        >>> total, scales = clip_scales(powers, [1.0], max_norm=1.0)
        >>> round(total.item(), 4), round(scales[0].item(), 4)
        (5.0, 0.2)
    """
    if not isinstance(powers, torch.Tensor):
        raise TypeError(f"powers must be a torch.Tensor, got {type(powers).__name__}")
    _check_vector(powers, "powers", powers.device)
    norm_type = _checked_norm_type(norm_type)
    _check_clip(postscales, powers.numel(), max_norm, loss_scale, norm_dtype)
    return backend_for(backend, powers.device).clip_scales(powers, postscales, max_norm,
                                                           norm_type, loss_scale, norm_dtype)


def clip_partials(partials: torch.Tensor, buffers: Sequence[torch.Tensor],
                  postscales: Sequence[float], max_norm: float, norm_type: float = 2.0,
                  loss_scale: Scale = None, *, backend: str = "auto",
                  norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' powers, finished from all of their
    ``norm_partials`` (the shares added up): on Triton one launch.

    Args:
        partials: the whole float64 vector of ``norm_partials(buffers,
            norm_type)`` on the same backend (or its shares, added).
        buffers: the buffers ``partials`` were taken of.
        postscales: as ``clip_scales``.
        max_norm: as ``clip_scales``.
        norm_type: the order ``partials`` were taken with.
        loss_scale: as ``clip_scales``.
        backend: the backend ``partials`` were taken on.
        norm_dtype: as ``clip_scales``.

    Raises:
        TypeError/ValueError: as ``norm_powers`` and ``clip_scales``;
            ``partials`` not a 1-D float64 tensor on the buffers' device.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> bufs = [torch.tensor([3.0, -4.0])]
        >>> total, _ = clip_partials(norm_partials(bufs), bufs, [1.0], max_norm=1.0)
        >>> round(total.item(), 4)
        5.0
    """
    buffers = _checked_buffers(buffers)
    norm_type = _checked_norm_type(norm_type)
    _check_vector(partials, "partials", buffers[0].device)
    _check_clip(postscales, len(buffers), max_norm, loss_scale, norm_dtype)
    return backend_for(backend, buffers[0].device).clip_partials(
        partials, buffers, postscales, max_norm, norm_type, loss_scale, norm_dtype)


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float = 2.0, loss_scale: Scale = None, *,
                 backend: str = "auto", norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' ``norm_powers``: on the Triton backend
    two launches in all, whatever the number of buffers.

    Args:
        buffers: as ``norm_powers``.
        postscales: as ``clip_scales``.
        max_norm: as ``clip_scales``.
        norm_type: as ``norm_powers``.
        loss_scale: as ``clip_scales``.
        backend: as ``norm_powers``.
        norm_dtype: as ``clip_scales``.

    Raises:
        TypeError/ValueError: as ``norm_powers`` and ``clip_scales``.
        RuntimeError: see ``resolve_backend``.

    Examples:
        >>> total, scales = clip_buffers([torch.tensor([3.0, -4.0])], [0.5], max_norm=10.0)
        >>> round(total.item(), 4), round(scales[0].item(), 4)  # norm 2.5: not clipped
        (2.5, 0.5)
    """
    buffers = _checked_buffers(buffers)
    norm_type = _checked_norm_type(norm_type)
    _check_clip(postscales, len(buffers), max_norm, loss_scale, norm_dtype)
    return backend_for(backend, buffers[0].device).clip_buffers(
        buffers, postscales, max_norm, norm_type, loss_scale, norm_dtype)
