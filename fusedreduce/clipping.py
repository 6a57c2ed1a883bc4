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

import math
from typing import List, Optional, Sequence, Tuple

import torch

from .kernels._backends import backend_for
from .kernels._checks import refuse_in_capture
from .kernels._common import NORM_ROW

__all__ = ["NORM_ROW", "check_clipping", "clip_buffers", "clip_scales", "norm_powers",
           "raise_if_nonfinite"]


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


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float,
                backend: str = "auto") -> torch.Tensor:
    """Each buffer's sum of ``|x| ** norm_type`` (max ``|x|`` for ``math.inf``),
    as one fp64 vector on their device, in the fixed order the module describes."""
    return backend_for(backend, buffers[0].device).norm_powers(buffers, norm_type)


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None,
                backend: str = "auto") -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from the buffers' ``norm_powers`` and the
    postscale each buffer's unflatten applies: the norm of the written
    gradients divided by ``loss_scale`` (a number or a one-element tensor;
    None: 1), as a 0-d fp32 tensor like torch's ``clip_grad_norm_`` returns,
    and, per buffer, the postscale times the clip coefficient (one-element
    fp64 tensors on the device: the unflatten's scale). The gradients keep
    their loss scale: a GradScaler unscales them as usual."""
    return backend_for(backend, powers.device).clip_scales(powers, postscales, max_norm,
                                                           norm_type, loss_scale)


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float, loss_scale=None,
                 backend: str = "auto") -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' ``norm_powers``: on the Triton backend
    two launches in all, whatever the number of buffers."""
    return backend_for(backend, buffers[0].device).clip_buffers(
        buffers, postscales, max_norm, norm_type, loss_scale)


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
