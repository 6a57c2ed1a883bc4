"""Gradient clipping on the reduced flat buffers, before they are written back.

``torch.nn.utils.clip_grad_norm_`` reads every gradient again after the
reduction (a norm per tensor) and writes every one again (a multiply per
tensor). The reducer has the reduced gradients in a few flat buffers already
and writes them back with one unflatten launch per bucket anyway, so here:

- the norm is taken from the flat buffers (their padding is zero and adds
  nothing), in rows of ``NORM_ROW`` elements: each row's sum of powers in
  fp32 (fp64 for fp64 buffers), then the rows summed in fp64, bucket by bucket
  in plan order. The order is fixed by the layout alone, so every rank (all
  hold the same reduced buffers) gets the same bits, whatever its thread
  count. The kernels are ``fusedreduce.kernels.norm``'s: on the Triton backend
  the norm, the coefficient and every bucket's scale take two launches, on the
  torch fallback a few ops per bucket;
- the norm and the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` are
  torch's, in the dtype torch returns the norm in (``norm_dtype_of``: fp32,
  or fp64 where a gradient is fp64), computed on the device; the coefficient
  is multiplied into each bucket's postscale as a one-element fp64 tensor
  the unflatten kernel reads: no host sync, no extra pass over the gradients;
- under a GradScaler the gradients are scaled: ``loss_scale`` (the scaler's
  current scale as a device tensor, ``scaler.scale(torch.ones(()))``) divides
  the norm, so the limit applies to the true gradients, and the written
  gradients keep their scale for ``scaler.step`` to unscale;
- after an all-reduce every rank holds the same buffers, so the reading can
  be shared (``split``, the reducers' ``split_norm``): each rank sums the row
  partials of its ``1 / world_size`` of them into a vector that is zero
  elsewhere, and one all-reduce of that vector (8 bytes per partial) hands
  every rank all of them. A partial plus zeros is the partial, in any order,
  so the finish sees the vector the unsplit call builds: the same bits.
"""
from __future__ import annotations

import math
import sys
import types
import warnings
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from .kernels import NORM_ROW, refuse_in_capture

#: ``split_norm=None`` splits the norm's reading where it spares each rank at
#: least this many elements (``elements - elements // world_size``), by the
#: buffers' device type; others take ``"cuda"``'s. The CPU's is measured
#: (``fusedreduce-bench clip``, 2 gloo ranks: slower sparing 2M, faster
#: sparing 12.8M); the GPU's is an estimate until measured: 64M fp32 elements
#: are about 100 µs of an H100's norm reading, several times a small NCCL
#: all-reduce's latency and the host's cost of one more collective
SPLIT_NORM_MIN_SPARED = {"cpu": 1 << 23, "cuda": 1 << 26}

__all__ = ["EMPTY_GENERATOR", "NORM_ROW", "NormSplit", "SPLIT_NORM_MIN_SPARED",
           "check_clipping", "check_error_if_nonfinite", "check_limit", "check_norm_type",
           "check_split_norm", "clip_buffers", "clip_scales", "clip_shared", "norm_dtype_of",
           "norm_powers", "max_over_ranks", "norm_over_ranks", "norm_split_for", "over_ranks",
           "raise_if_nonfinite",
           "share_norm", "stepping_grad_scaler", "warn_if_exhausted",
           "refuse_scaled_clip"]


class NormSplit(NamedTuple):
    """Who shares the reading of the norm (``clip_buffers``' ``split``): this
    process's ``rank`` in ``group`` (None: the world) of ``world_size`` ranks."""

    group: Any
    rank: int
    world_size: int


def check_norm_type(norm_type) -> float:
    """``norm_type`` as a float: a positive number, ``math.inf`` for the max
    norm, or a string ``float()`` reads (torch's ``clip_grad_norm_`` takes
    ``'inf'``).

    torch also takes orders of 0 and below; they are refused here. They do
    not measure a gradient's size, so they cannot limit it: a single zero
    element makes a negative order's norm 0 (nothing would ever be clipped),
    and order 0 counts the nonzero elements.

    Raises:
        TypeError: not a number or a string (a bool included).
        ValueError: a string that is not a number, or not positive (NaN
            included).

    Examples:
        >>> check_norm_type("inf")
        inf
    """
    if isinstance(norm_type, str):
        try:
            order = float(norm_type)
        except ValueError:
            raise ValueError(f"norm_type must be a number (or 'inf'), got {norm_type!r}") \
                from None
    elif isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a number, got {type(norm_type).__name__}")
    else:
        order = float(norm_type)
    if not order > 0:  # NaN fails too
        raise ValueError(f"norm_type must be positive (math.inf or 'inf' for the max norm), got "
                         f"{norm_type!r}: an order of 0 or below does not measure a gradient's "
                         f"size (one zero element makes a negative order's norm 0, order 0 "
                         f"counts the nonzero elements), so it cannot limit it")
    return order


def check_limit(limit, name: str) -> float:
    """``limit`` (the clipping argument ``name``) as a float: positive,
    ``math.inf`` measuring the norm without clipping, as torch's
    ``clip_grad_norm_(params, math.inf)``.

    Raises:
        TypeError: not a number (a bool or None included).
        ValueError: not positive (NaN included).
    """
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(limit).__name__}")
    if not limit > 0:  # NaN fails too
        raise ValueError(f"{name} must be positive (math.inf: measure the norm without "
                         f"clipping), got {limit!r}")
    return float(limit)


def check_error_if_nonfinite(error_if_nonfinite) -> None:
    """Raises ``TypeError`` unless ``error_if_nonfinite`` is True or False."""
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")


def check_clipping(max_grad_norm, norm_type, error_if_nonfinite) -> Tuple[Optional[float], float]:
    """``(max_grad_norm, norm_type)`` as floats (``max_grad_norm`` None: no
    clipping, ``math.inf``: the norm measured and nothing clipped, as torch's
    ``clip_grad_norm_(params, math.inf)``; ``norm_type`` as
    ``check_norm_type`` reads it).

    Raises:
        TypeError: a non-number ``max_grad_norm`` or ``norm_type``, or a
            non-bool ``error_if_nonfinite``.
        ValueError: ``max_grad_norm`` not positive (NaN included), or
            ``norm_type`` not positive (``math.inf`` is the max norm).
    """
    check_error_if_nonfinite(error_if_nonfinite)
    limit = None if max_grad_norm is None else check_limit(max_grad_norm, "max_grad_norm")
    return limit, check_norm_type(norm_type)


def check_split_norm(split_norm) -> None:
    """Raises ``TypeError`` unless ``split_norm`` is None, True or False."""
    if split_norm is not None and not isinstance(split_norm, bool):
        raise TypeError(f"split_norm must be None, True or False, got {split_norm!r}")


def norm_split_for(split_norm: Optional[bool], group, world_size: int, elements: int,
                   device: torch.device) -> Optional[NormSplit]:
    """The reducers' ``split_norm`` rule: the ``NormSplit`` of this rank in
    ``group``, or None where each rank reads all of the ``elements`` (on
    ``device``): see ``SPLIT_NORM_MIN_SPARED``."""
    if world_size == 1 or split_norm is False:
        return None
    if split_norm is None:
        threshold = SPLIT_NORM_MIN_SPARED.get(device.type, SPLIT_NORM_MIN_SPARED["cuda"])
        if elements - elements // world_size < threshold:
            return None
    return NormSplit(group, dist.get_rank(group), world_size)


#: torch's ``clip_grad_norm_`` warning for an exhausted parameter generator
EMPTY_GENERATOR = "`parameters` is an empty generator, no gradient clipping will occur."


def warn_if_exhausted(given, parameters: Sequence[torch.Tensor]) -> None:
    """torch's warning where ``given`` (the caller's ``parameters``) was a
    generator that gave nothing (``parameters``, its list, empty): usually a
    ``model.parameters()`` already iterated. An empty list or tuple is a
    choice and does not warn, as in torch."""
    if isinstance(given, types.GeneratorType) and not parameters:
        warnings.warn(EMPTY_GENERATOR, stacklevel=3)


def norm_dtype_of(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of the clipping norm of gradients of ``dtypes``, and of its
    coefficient: fp64 where any gradient is fp64, else fp32.

    torch's ``clip_grad_norm_`` takes a norm per (device, dtype) group in
    that dtype and stacks them, which promotes: fp64 beside fp32 gives an fp64
    norm. It would return an fp16 or bf16 norm for 16-bit gradients alone;
    here those get fp32 (a 16-bit norm overflows at 65504, or rounds to 3
    digits), as before. No gradients at all: fp32, torch's ``tensor(0.)``.

    Examples:
        >>> norm_dtype_of([torch.float32, torch.float64])
        torch.float64
        >>> norm_dtype_of([torch.bfloat16])
        torch.float32
    """
    return torch.float64 if torch.float64 in set(dtypes) else torch.float32


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float,
                backend: str = "auto") -> torch.Tensor:
    """Each buffer's sum of ``|x| ** norm_type`` (max ``|x|`` for ``math.inf``),
    as one fp64 vector on their device, in the fixed order the module describes."""
    return kernels.norm_powers(buffers, norm_type, backend=backend)


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None, backend: str = "auto",
                norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from the buffers' ``norm_powers`` and the
    postscale each buffer's unflatten applies: the norm of the written
    gradients divided by ``loss_scale`` (a number or a one-element tensor;
    None: 1), as a 0-d tensor of ``norm_dtype`` (``norm_dtype_of`` the
    gradients: fp32, or fp64) like torch's ``clip_grad_norm_`` returns, and,
    per buffer, the postscale times the clip coefficient (taken in
    ``norm_dtype``; one-element fp64 tensors on the device: the unflatten's
    scale). The gradients keep their loss scale: a GradScaler unscales them
    as usual."""
    return kernels.clip_scales(powers, postscales, max_norm, norm_type, loss_scale,
                               backend=backend, norm_dtype=norm_dtype)


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float, loss_scale=None,
                 backend: str = "auto", split: Optional[NormSplit] = None,
                 norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' ``norm_powers``: on the Triton backend
    two launches in all, whatever the number of buffers.

    With ``split`` (every rank of its group holding the same buffers, as after
    an all-reduce), each rank sums its own ``1 / world_size`` of the rows and
    one all-reduce of the row partials, zero outside each rank's share, gives
    every rank all of them: adding zeros is exact, so the norm and the scales
    are the bits the unsplit call gives, for ``1 / world_size`` of its reading.
    """
    if split is None or split.world_size == 1:
        return kernels.clip_buffers(buffers, postscales, max_norm, norm_type, loss_scale,
                                    backend=backend, norm_dtype=norm_dtype)
    partials, work = share_norm(buffers, norm_type, split, backend)
    work.wait()
    return clip_shared(partials, buffers, postscales, max_norm, norm_type, loss_scale, backend,
                       norm_dtype)


def share_norm(buffers: Sequence[torch.Tensor], norm_type: float, split: NormSplit,
               backend: str = "auto") -> Tuple[torch.Tensor, Any]:
    """``clip_buffers``' split, started: ``(partials, work)``, this rank's
    share of the norm's row partials (zero elsewhere) and the asynchronous
    all-reduce that adds every rank's into ``partials``; ``clip_shared`` of
    them once ``work`` is done."""
    partials = kernels.norm_partials(buffers, norm_type, (split.rank, split.world_size),
                                     backend=backend)
    return partials, dist.all_reduce(partials, group=split.group, async_op=True)


def clip_shared(partials: torch.Tensor, buffers: Sequence[torch.Tensor],
                postscales: Sequence[float], max_norm: float, norm_type: float,
                loss_scale=None, backend: str = "auto",
                norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_buffers``' result from the all-reduced ``partials`` of ``share_norm``."""
    return kernels.clip_partials(partials, buffers, postscales, max_norm, norm_type,
                                 loss_scale, backend=backend, norm_dtype=norm_dtype)


def max_over_ranks(values: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """The elementwise max of ``values`` (non-negative or NaN, as a norm's
    maxima) over the ranks of ``group``, NaN where any rank's is NaN.

    ``ReduceOp.MAX`` may drop a NaN (gloo's does, depending on which rank
    holds it), so each rank writes its values into its own row of a zero
    matrix and a sum gathers the rows: adding zeros is exact. The max is
    then taken here, where torch propagates NaN."""
    rows = values.new_zeros((world_size,) + tuple(values.shape))
    rows[dist.get_rank(group)] = values
    dist.all_reduce(rows, group=group)
    return rows.amax(dim=0)


def over_ranks(powers: torch.Tensor, norm_type: float, group, world_size: int) -> torch.Tensor:
    """Sums of ``|x| ** norm_type`` (maxima for ``math.inf``) of the elements
    each rank owns (each element owned once), combined over ``group`` into
    the same values on every rank: one all-reduce of the sums, or
    ``max_over_ranks`` of the maxima (NaN kept)."""
    if world_size > 1 and norm_type == math.inf:
        return max_over_ranks(powers, group, world_size)
    if world_size > 1:
        dist.all_reduce(powers, group=group)
    return powers


def norm_over_ranks(norms: torch.Tensor, norm_type: float, group,
                    world_size: int) -> torch.Tensor:
    """The norm of order ``norm_type`` of elements each rank owns a share of
    (each element owned once), from the norms of this rank's pieces
    (``norms``, fp64, 1-D or 0-d): the sum of their ``norm_type``-th powers
    (their max for ``math.inf``, NaN kept) combined by ``over_ranks``, the
    root taken once. The same bits on every rank.

    Examples:
        >>> norm_over_ranks(torch.tensor([3.0, 4.0], dtype=torch.float64), 2.0, None, 1)
        tensor(5., dtype=torch.float64)
    """
    if norm_type == math.inf:
        return over_ranks(norms.max(), norm_type, group, world_size)
    return over_ranks(norms.pow(norm_type).sum(), norm_type, group,
                      world_size).pow(1.0 / norm_type)


def raise_if_nonfinite(total: torch.Tensor, norm_type: float) -> None:
    """torch's ``error_if_nonfinite=True``: reads the norm on the host."""
    refuse_in_capture(total.device, "error_if_nonfinite=True (the norm is read to the host)",
                      "pass error_if_nonfinite=False; a GradScaler's skipped step, or "
                      "grad_norm checked after the replay, tells a non-finite norm")
    if not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the reduced gradients is non-finite, so "
            f"it cannot be clipped; the gradients were not written back. Pass "
            f"error_if_nonfinite=False to clip anyway (they become NaN or zero, and a "
            f"GradScaler skips the step)")


def stepping_grad_scaler(depth: int = 2, frames: int = 4) -> Optional["torch.amp.GradScaler"]:
    """The ``torch.amp.GradScaler`` whose ``step()`` called ``opt.step()``, if
    any: ``scaler.step(opt)`` reaches ``opt.step()`` through its
    ``_maybe_opt_step`` (and torch's step wrapper), a few frames up.
    ``depth``: how many frames up from here ``opt.step()``'s caller is (2:
    this is called by ``step()`` itself); ``frames``: how many frames from
    there are looked at. Reads frames only: no sync, nothing changed."""
    frame = sys._getframe(depth)
    for _ in range(frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.amp.GradScaler):
            return owner
        frame = frame.f_back
    return None


def refuse_scaled_clip(scaler: Optional["torch.amp.GradScaler"], max_grad_norm: Optional[float],
                       loss_scale, owner: str) -> None:
    """Raise where a finite ``max_grad_norm`` clipped gradients that ``scaler``
    scaled without being told the scale (``loss_scale`` None): the limit then
    applied to the scaled norm, so every step would be the scale times too
    small, silently. Reads the scaler's scale once (one host sync)."""
    if scaler is None or loss_scale is not None or max_grad_norm is None or \
            math.isinf(max_grad_norm) or not scaler.is_enabled():
        return
    scale = scaler.get_scale()
    if scale == 1.0:
        return
    raise RuntimeError(
        f"{owner}(max_grad_norm={max_grad_norm}) is stepped by a GradScaler (scale {scale:g}) "
        f"but its loss_scale is not set: the gradients were clipped while scaled, so the limit "
        f"applied to the scaled norm and the step would be {scale:g} times too small. Set "
        f"optimizer.loss_scale = scaler.scale(torch.ones((), device=...)) before each "
        f"backward (the gradients stay scaled for scaler.step), or leave max_grad_norm out "
        f"and call scaler.unscale_(optimizer) then optimizer.clip_grad_norm_(...); nothing "
        f"was stepped")
