"""The norm family on torch ops: the fallback, and the CPU's path.

A partial is one ``NORM_ROW``-element row's norm: the row's
``torch.linalg.vector_norm`` over a ``(rows, NORM_ROW)`` view (each row a
separate reduction, so the thread count cannot change its order), in fp64.
The finish raises the whole partials vector to the ``p``-th power in one op
and adds each buffer's slice of it (its max for the max norm). The power is
taken on the whole vector, never on a share: torch's vectorised ``pow`` and
its scalar tail round differently, so where an element sits in the tensor
could change its bits.

A share of the rows (the clipping norm split across ranks) must give each of
its rows the bits the whole call gives it. On the CPU a row's reduction is
the same however many rows one call takes. On a GPU it is not: torch spreads
a row over more threads when there are fewer rows (seen on an H100). There
the rows are taken in windows of ``WINDOW_ROWS`` that start at fixed rows of
each buffer, whatever the share: a share computes every window it overlaps
whole and keeps its own rows, so every row is reduced by the same call, at
the same address, in both.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from .._common import NORM_ROW, postscale_vectors, share_bounds


def _row_counts(buffers: Sequence[torch.Tensor]) -> List[int]:
    return [-(-b.numel() // NORM_ROW) for b in buffers]


def _row_norms_into(out: torch.Tensor, part: torch.Tensor, norm_type: float) -> None:
    """Each ``NORM_ROW``-element row's norm of ``part`` (the last row may be
    shorter) into ``out``, one element per row, cast to its dtype."""
    size = part.numel()
    whole = size - size % NORM_ROW
    compute = torch.float32 if part.element_size() < 4 else None  # no 16-bit overflow
    if whole:
        out[:whole // NORM_ROW].copy_(torch.linalg.vector_norm(
            part[:whole].view(-1, NORM_ROW), norm_type, dim=1, dtype=compute))
    if size > whole:
        out[-1:].copy_(torch.linalg.vector_norm(part[whole:], norm_type, dtype=compute)
                       .reshape(1))


#: rows per window on a GPU (see the module docstring): 4M elements, so a
#: share reads at most two windows beyond its own rows per buffer
WINDOW_ROWS = 2048


def rows_in_windows(device: torch.device) -> bool:
    """Whether ``norm_partials`` takes a buffer's rows in fixed windows on
    ``device`` (see the module docstring): everywhere but the CPU."""
    return device.type != "cpu"


def _windows(start: int, stop: int, count: int, windowed: bool) -> List[Tuple[int, int]]:
    """The row ranges one reduction each takes to cover rows ``[start, stop)``
    of a buffer of ``count`` rows."""
    if not windowed:
        return [(start, stop)]
    return [(a, min(a + WINDOW_ROWS, count))
            for a in range(start - start % WINDOW_ROWS, stop, WINDOW_ROWS)]


def norm_partials(buffers: Sequence[torch.Tensor], norm_type: float,
                  share: Tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Every row's norm, as one fp64 vector, for the rows of share ``(index,
    count)`` (``share_bounds`` of the rows in buffer order); the other rows'
    entries are zero."""
    counts = _row_counts(buffers)
    total = sum(counts)
    lo, hi = share_bounds(total, share)
    device = buffers[0].device
    windowed = rows_in_windows(device)
    partials = (torch.empty if (lo, hi) == (0, total) else torch.zeros)(
        total, dtype=torch.float64, device=device)
    first = 0
    for buffer, count in zip(buffers, counts):
        start, stop = max(lo - first, 0), min(hi - first, count)
        for a, b in _windows(start, stop, count, windowed) if start < stop else ():
            rows = buffer[a * NORM_ROW:b * NORM_ROW]
            if start <= a and b <= stop:
                _row_norms_into(partials[first + a:first + b], rows, norm_type)
            else:  # a window the share's edge cuts: computed whole, its share's rows kept
                window = torch.empty(b - a, dtype=torch.float64, device=device)
                _row_norms_into(window, rows, norm_type)
                keep = slice(max(a, start), min(b, stop))
                partials[first + keep.start:first + keep.stop].copy_(
                    window[keep.start - a:keep.stop - a])
        first += count
    return partials


#: a buffer's row partials are added in blocks of this many, then the blocks'
#: sums: each addition one thread's, however many threads torch has
SUM_BLOCK = 1024


def _fixed_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows.sum()`` in an order the thread count cannot change: torch splits
    a single sum longer than its grain among threads, a sum per row never."""
    if rows.numel() <= SUM_BLOCK:
        return rows.sum()
    pad = -rows.numel() % SUM_BLOCK
    blocks = torch.cat([rows, rows.new_zeros(pad)]) if pad else rows
    return blocks.view(-1, SUM_BLOCK).sum(dim=1).sum()


def partials_powers(partials: torch.Tensor, buffers: Sequence[torch.Tensor],
                    norm_type: float) -> torch.Tensor:
    """Each buffer's sum of its rows' norms to the ``norm_type`` (their max
    for ``math.inf``)."""
    if norm_type != math.inf:
        partials = partials.pow(norm_type)
    powers = []
    first = 0
    for count in _row_counts(buffers):
        rows = partials[first:first + count]
        if not count:
            powers.append(torch.zeros((), dtype=torch.float64, device=partials.device))
        else:
            powers.append(rows.max() if norm_type == math.inf else _fixed_sum(rows))
        first += count
    return torch.stack(powers)


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each buffer's sum of powers, as one fp64 vector (see the family)."""
    return partials_powers(norm_partials(buffers, norm_type), buffers, norm_type)


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None,
                norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from the buffers' ``powers`` (see the family)."""
    device = powers.device
    post, signed = postscale_vectors(tuple(postscales), device)
    if norm_type == math.inf:
        total = (powers * post).max()
    else:
        total = (powers * post.pow(norm_type)).sum().pow(1.0 / norm_type)
    if isinstance(loss_scale, torch.Tensor):
        # not read on the host: a scale that is not finite and > 0 gives a NaN
        # norm (and NaN gradients, or error_if_nonfinite's raise), never
        # zeroed or flipped ones
        loss = loss_scale.to(device, torch.float64).reshape(())
        good = (loss > 0) & torch.isfinite(loss)
        total = torch.where(good, total / loss, total.new_tensor(math.nan))
    elif loss_scale is not None:
        total = total / float(loss_scale)
    total = total.to(norm_dtype)
    # torch's coefficient, in the norm's dtype as torch takes it
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return total, list((signed * coefficient.double()).unbind(0))


def clip_partials(partials: torch.Tensor, buffers: Sequence[torch.Tensor],
                  postscales: Sequence[float], max_norm: float, norm_type: float,
                  loss_scale=None,
                  norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' powers from their ``norm_partials``."""
    return clip_scales(partials_powers(partials, buffers, norm_type), postscales, max_norm,
                       norm_type, loss_scale, norm_dtype)


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float, loss_scale=None,
                 norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_partials`` of all of the buffers' ``norm_partials``."""
    return clip_partials(norm_partials(buffers, norm_type), buffers, postscales, max_norm,
                         norm_type, loss_scale, norm_dtype)


__all__ = ["norm_partials", "partials_powers", "norm_powers", "clip_scales", "clip_partials",
           "clip_buffers"]
