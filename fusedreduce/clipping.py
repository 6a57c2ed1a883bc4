"""Gradient clipping on the reduced flat buffers, before they are written back.

``torch.nn.utils.clip_grad_norm_`` reads every gradient again after the
reduction (a norm per tensor) and writes every one again (a multiply per
tensor). The reducer has the reduced gradients in a few flat buffers already
and writes them back with one unflatten launch per bucket anyway, so here:

- the norm is taken from the flat buffers (their padding is zero and adds
  nothing), in rows of ``NORM_ROW`` elements: each row's norm in the buffer's
  dtype, then the rows' p-th powers summed in fp64, bucket by bucket in plan
  order. The order is fixed by the layout alone, so every rank (all hold the
  same reduced buffers) gets the same bits, whatever its thread count;
- the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` is torch's,
  computed in fp32 on the device, and multiplied into each bucket's
  postscale as a one-element fp64 tensor the unflatten kernel reads: no host
  sync, no extra pass over the gradients;
- under a GradScaler the gradients are scaled: ``loss_scale`` (the scaler's
  current scale as a device tensor, ``scaler.scale(torch.ones(()))``) divides
  the norm, so the limit applies to the true gradients, and the written
  gradients keep their scale for ``scaler.step`` to unscale.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch

from .kernels._checks import refuse_in_capture

#: elements per row of the norm's fixed summation order
NORM_ROW = 2048


def check_clipping(max_grad_norm, norm_type, error_if_nonfinite) -> Tuple[Optional[float], float]:
    """``(max_grad_norm, norm_type)`` as floats (``max_grad_norm`` None: no clipping).

    Raises:
        TypeError: a non-number ``max_grad_norm`` or ``norm_type``, or a
            non-bool ``error_if_nonfinite``.
        ValueError: ``max_grad_norm`` not positive and finite, or
            ``norm_type`` not positive (``math.inf`` is the max norm).
    """
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    for name, value in (("max_grad_norm", max_grad_norm), ("norm_type", norm_type)):
        if value is None and name == "max_grad_norm":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if max_grad_norm is not None and not (0 < max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm must be positive and finite, got {max_grad_norm}")
    if not norm_type > 0:  # NaN fails too
        raise ValueError(f"norm_type must be positive (math.inf for the max norm), "
                         f"got {norm_type}")
    return (None if max_grad_norm is None else float(max_grad_norm)), float(norm_type)


def flat_norm_power(buffer: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The sum of ``|x| ** norm_type`` over ``buffer`` (its max ``|x|`` for
    ``math.inf``) as a 0-d fp64 tensor, in the fixed order the module
    describes."""
    size = buffer.numel()
    whole = size - size % NORM_ROW
    compute = torch.float32 if buffer.element_size() < 4 else None  # no 16-bit overflow
    pieces = []
    if whole:
        pieces.append(torch.linalg.vector_norm(buffer[:whole].view(-1, NORM_ROW), norm_type,
                                               dim=1, dtype=compute))
    if size > whole:
        pieces.append(torch.linalg.vector_norm(buffer[whole:], norm_type, dtype=compute)
                      .reshape(1))
    if not pieces:
        return torch.zeros((), dtype=torch.float64, device=buffer.device)
    rows = torch.cat(pieces).double() if len(pieces) > 1 else pieces[0].double()
    if norm_type == math.inf:
        return rows.max()
    return rows.pow(norm_type).sum()


def clip_scales(powers: Sequence[torch.Tensor], postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from each bucket's ``flat_norm_power`` and the
    postscale its unflatten applies: the norm of the written gradients
    divided by ``loss_scale`` (a number or a one-element tensor; None: 1),
    as a 0-d fp32 tensor like torch's ``clip_grad_norm_`` returns, and, per
    bucket, the postscale times the clip coefficient (one-element fp64 views
    of one vector on the device: the unflatten's scale). The gradients keep
    their loss scale: a GradScaler unscales them as usual."""
    device = powers[0].device
    post, signed = _postscale_vectors(tuple(postscales), device)
    stacked = torch.stack(list(powers))
    if norm_type == math.inf:
        total = (stacked * post).max()
    else:
        total = (stacked * post.pow(norm_type)).sum().pow(1.0 / norm_type)
    if loss_scale is not None:
        total = total / (loss_scale.to(device, torch.float64).reshape(())
                         if isinstance(loss_scale, torch.Tensor) else float(loss_scale))
    total = total.float()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return total, list((signed * coefficient.double()).unbind(0))


@functools.lru_cache(maxsize=64)
def _postscale_vectors(postscales: Tuple[float, ...],
                       device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The buckets' postscales, absolute and signed, as fp64 vectors on
    ``device``: the same every step, so uploaded once (a per-step upload would
    cost a host-to-device copy, and could not be captured in a CUDA graph)."""
    signed = torch.tensor(postscales, dtype=torch.float64, device=device)
    return signed.abs(), signed


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
