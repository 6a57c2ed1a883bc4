"""Non-finite gradients: how every rank comes to know of any rank's inf or NaN.

Two settlements, one per kind of reduction, because what every rank holds
after the collective differs:

- summed buckets (``record_nonfinite``): each rank's flatten writes 1 into
  a spare element after the bucket when its inputs held an inf or NaN, the
  all-reduce sums the spare with the bucket, so it counts the ranks that
  did, at no extra collective; ``found_nonfinite`` is whether any count is
  non-zero.
- owned parts (``OwnedNonfinite``): a rank holds the reduced sum only on
  its part, so it looks at what it will write (the part's extremes,
  postscaled: a finite sum can still round to inf in a 16-bit ``.grad``),
  and the ranks' flags are summed in the small all-reduce that settles the
  unused parameters. A rank that learns of another's plants a NaN into an
  element of a ``.grad`` it does not own (``plant_nan``): ``GradScaler``,
  which reads only the local ``.grad``, then skips the step on every rank,
  and no rank's step reads that element.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from .allreduce import PendingBucket
from .buckets import BucketPlan


def record_nonfinite(engine, pending: Sequence[PendingBucket]) -> None:
    """Summed buckets: ``engine.found_nonfinite`` from ``pending``'s spare
    counts (with ``check_finite``)."""
    if engine.check_finite:
        counts = [p.nonfinite_ranks for p in pending]
        engine.found_nonfinite = (torch.stack(counts) != 0).any() if counts else \
            torch.zeros((), dtype=torch.bool)


def overflow_at(grad_dtype: torch.dtype, bucket_dtype: torch.dtype) -> float:
    """The magnitude from which a ``bucket_dtype`` value rounds to inf when cast
    to ``grad_dtype`` (half an ulp above its largest finite value; inf when
    the cast cannot overflow)."""
    narrow, wide = torch.finfo(grad_dtype), torch.finfo(bucket_dtype)
    if narrow.max >= wide.max:
        return math.inf
    return narrow.max + math.ldexp(narrow.eps, math.frexp(narrow.max)[1] - 1) / 2


class OwnedNonfinite:
    """The settlement of owned parts.

    Args:
        parameters: the reducer's parameters; ``order``: plan slot -> index.
        plan: the sharded plan; ``owned``: per bucket, this rank's elements.
        grads_released: ``shard_gradients``: parameters this rank does not
            own keep no ``.grad`` (one is made for the NaN).
    """

    def __init__(self, parameters: Sequence[torch.Tensor], order: Sequence[int],
                 plan: BucketPlan, owned: Sequence[Tuple[int, int]],
                 grads_released: bool) -> None:
        self.parameters = parameters
        # released: the parameters this rank does not own keep no .grad, so
        # where none has one, one is made for the NaN
        self._nan_without_grad = _nan_in_zero_grad if grads_released else _no_nan
        self._sites = _sites_not_owned(parameters, order, plan, owned)
        overflow = [min((overflow_at(plan.specs[slot].dtype, b.dtype)
                         for slot in b.tensor_indices), default=math.inf)
                    for b in plan.buckets]
        self._overflow = [overflow[b.index] for b in plan.buckets
                          if owned[b.index][1] > owned[b.index][0]]
        self._bounds = None

    def flag(self, parts: Sequence[torch.Tensor], postscales: Sequence) -> torch.Tensor:
        """1 (int32, 0-d) if a value this rank writes from ``parts`` times
        ``postscales`` is not finite in its gradient's dtype, else 0."""
        extremes: List[torch.Tensor] = []
        for part, postscale in zip(parts, postscales):
            if part.numel():
                # what GradScaler will read: the part's extremes as written
                extremes.append(torch.stack(torch.aminmax(part)).double() * postscale)
        if not extremes:
            return torch.zeros((), dtype=torch.int32)
        values = torch.cat(extremes)
        if self._bounds is None:
            self._bounds = torch.tensor(self._overflow, dtype=torch.float64,
                                        device=values.device).repeat_interleave(2)
        nonfinite = (~torch.isfinite(values) | (values.abs() >= self._bounds)).any()
        return nonfinite.to(torch.int32)

    def plant_nan(self, found: torch.Tensor) -> None:
        """Where ``found`` (a 0-d bool tensor), a NaN in one element of a
        ``.grad`` that this rank does not own: it tells GradScaler of another
        rank's non-finite gradient without changing this rank's step. Where
        such a ``.grad`` exists the NaN is chosen on the device (no host read,
        so on a GPU the host goes on issuing work); only where none does
        (``shard_gradients`` released them all) is ``found`` read, to make a
        ``.grad`` for it."""
        for index, element in self._sites:
            grad = self.parameters[index].grad
            if grad is not None:
                grad[element] = torch.where(found.to(grad.device), float("nan"), grad[element])
                return
        if self._sites and bool(found):
            self._nan_without_grad(self.parameters, self._sites)


def _nan_in_zero_grad(parameters: Sequence[torch.Tensor],
                      sites: Sequence[Tuple[int, tuple]]) -> None:
    """The NaN in a zero ``.grad`` made for the smallest parameter with a site
    (the parameters this rank does not own keep no ``.grad``)."""
    index, element = min(sites, key=lambda site: parameters[site[0]].numel())
    grad = parameters[index].grad = torch.zeros_like(parameters[index])
    grad[element] = float("nan")


def _no_nan(parameters: Sequence[torch.Tensor], sites: Sequence[Tuple[int, tuple]]) -> None:
    """Gradients kept whole: a parameter without a ``.grad`` had no gradient
    on any rank (or is frozen), and keeps None."""


def _sites_not_owned(parameters, order, plan: BucketPlan,
                     owned: Sequence[Tuple[int, int]]) -> List[Tuple[int, tuple]]:
    """(parameter index, element index) of one element per tensor that this
    rank does not own, in plan order: where a NaN can tell GradScaler of
    another rank's non-finite gradient without touching this rank's step."""
    sites = []
    for bucket in plan.buckets:
        lo, hi = owned[bucket.index]
        for slot, offset, numel in zip(bucket.tensor_indices, bucket.offsets, bucket.numels):
            element = 0 if offset < lo or offset >= hi else hi - offset
            if numel and element < numel:
                index = order[slot]
                shape = parameters[index].shape
                sites.append((index, tuple(int(i) for i in np.unravel_index(element, shape))
                              if shape else ()))
    return sites
