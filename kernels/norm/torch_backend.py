"""The norm family on torch ops: the fallback, and the CPU's path.

A row's sum is ``torch.linalg.vector_norm`` over a ``(rows, NORM_ROW)`` view
(each row a separate reduction, so the thread count cannot change its order),
raised to the ``p``-th power in fp64.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from .._common import NORM_ROW, postscale_vectors


def flat_norm_power(buffer: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The sum of ``|x| ** norm_type`` over ``buffer`` (its max ``|x|`` for
    ``math.inf``) as a 0-d fp64 tensor, in the family's fixed order."""
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


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each buffer's ``flat_norm_power``, as one fp64 vector."""
    return torch.stack([flat_norm_power(b, norm_type) for b in buffers])


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from the buffers' ``powers`` (see the family)."""
    device = powers.device
    post, signed = postscale_vectors(tuple(postscales), device)
    if norm_type == math.inf:
        total = (powers * post).max()
    else:
        total = (powers * post.pow(norm_type)).sum().pow(1.0 / norm_type)
    if loss_scale is not None:
        total = total / (loss_scale.to(device, torch.float64).reshape(())
                         if isinstance(loss_scale, torch.Tensor) else float(loss_scale))
    total = total.float()
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return total, list((signed * coefficient.double()).unbind(0))


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float,
                 loss_scale=None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' ``norm_powers``."""
    return clip_scales(norm_powers(buffers, norm_type), postscales, max_norm, norm_type,
                       loss_scale)


__all__ = ["flat_norm_power", "norm_powers", "clip_scales", "clip_buffers"]
