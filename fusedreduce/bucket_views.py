"""Gradients as views of their bucket's buffer (DDP's ``gradient_as_bucket_view``).

Each parameter's ``.grad`` is a view of its segment of a flat buffer laid out
as its bucket (``BucketPlan`` offsets), so backward accumulates every gradient
in place, already fused:

- a gradient whose dtype is its bucket's communication dtype lives in the
  communication buffer itself: it is never copied, the all-reduce runs on it
  and the result is scaled in place;
- the other gradients (16-bit ones reduced in fp32, say) live in one buffer
  per dtype with the same layout; moving them to the communication buffer and
  back is one contiguous cast per *run* (consecutive segments of one dtype;
  one run per bucket for a model of one dtype) instead of a pointer table.

The element math is the kernels' (``flatten_cast_scale`` / ``unflatten_cast_scale``
on whole runs, or the same rounding by an in-place ``mul_`` where source and
destination are one buffer), so results are bitwise those of the default
mode. A ``.grad`` that is not its view when a bucket is reduced (backward
made a fresh one after ``zero_grad(set_to_none=True)``, or the caller
assigned one) is copied into the view, and ``.grad`` points at the view again;
a parameter without a gradient gets its zeroed view.

Only buckets whose parameters are all contiguous are viewed (a view has the
contiguous strides of its segment); the others keep the default path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import kernels
from .buckets import Bucket, BucketPlan


@dataclass
class Run:
    """Consecutive segments of one gradient dtype, over one stretch of the bucket."""

    dtype: torch.dtype
    source: torch.Tensor  # the gradients' buffer over the run (the comm buffer's own slice
    comm: torch.Tensor    # when ``dtype`` is the bucket's), and the comm buffer's slice


class BucketViews:
    """The viewed buckets of a plan: their buffers, the ``.grad`` views, the runs.

    Args:
        parameters: the parameters in plan order.
        plan: the reducer's plan.
        buffers: one communication buffer per bucket (``plan.new_buffer``),
            zeroed here; a buffer may be longer than its bucket (a spare
            element for the non-finite count).
        backend: the kernels' backend for the cast passes.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], plan: BucketPlan,
                 buffers: Sequence[torch.Tensor], backend: str) -> None:
        self.parameters, self.backend = list(parameters), backend
        self.views: List[Optional[torch.Tensor]] = [None] * len(self.parameters)
        self.runs: Dict[int, List[Run]] = {}
        self.grad_buffers: Dict[tuple, torch.Tensor] = {}
        with torch.no_grad():
            for bucket, buffer in zip(plan.buckets, buffers):
                if all(self.parameters[i].is_contiguous() for i in bucket.tensor_indices):
                    buffer.zero_()
                    self.runs[bucket.index] = self._layout(bucket, buffer)

    def viewed(self, bucket: Bucket) -> bool:
        return bucket.index in self.runs

    def _layout(self, bucket: Bucket, buffer: torch.Tensor) -> List[Run]:
        sources = {bucket.dtype: buffer}
        for i in bucket.tensor_indices:
            dtype = self.parameters[i].dtype
            if dtype not in sources:
                sources[dtype] = self.grad_buffers[bucket.index, dtype] = torch.zeros(
                    bucket.size, dtype=dtype, device=bucket.device)
        firsts = []  # (dtype, first element) of each run of one gradient dtype
        for i, start, numel in zip(bucket.tensor_indices, bucket.offsets, bucket.numels):
            p = self.parameters[i]
            self.views[i] = sources[p.dtype].narrow(0, start, numel).view(p.shape)
            if not firsts or firsts[-1][0] != p.dtype:
                firsts.append((p.dtype, start))
        # runs tile the bucket: each ends where the next begins (gaps are zeros)
        ends = [start for _, start in firsts[1:]] + [bucket.size]
        return [Run(dtype, sources[dtype].narrow(0, lo, hi - lo), buffer.narrow(0, lo, hi - lo))
                for (dtype, lo), hi in zip(firsts, ends)]

    def adopt(self, bucket: Bucket) -> None:
        """Make each ``.grad`` of ``bucket`` its view, copying in any gradient that is not."""
        with torch.no_grad():
            for i in bucket.tensor_indices:
                p, view = self.parameters[i], self.views[i]
                grad = p.grad
                if grad is view:
                    continue
                if grad is None:
                    view.zero_()
                    if not p.requires_grad:
                        continue  # frozen: contributes zeros, keeps no gradient
                else:
                    view.copy_(grad)
                p.grad = view

    def gather(self, bucket: Bucket, prescale: float,
               check_finite: bool) -> Optional[torch.Tensor]:
        """Bring ``bucket``'s gradients into its communication buffer, times
        ``prescale``; with ``check_finite`` the 0-d bool "an input was inf/NaN"."""
        flags = []
        with torch.no_grad():
            for run in self.runs[bucket.index]:
                if run.dtype == bucket.dtype:
                    if check_finite:
                        flags.append(~torch.isfinite(run.comm).all())
                    if prescale != 1.0:
                        run.comm.mul_(prescale)
                else:
                    result = kernels.flatten_cast_scale(
                        [run.source], run.comm, scale=prescale, check_finite=check_finite,
                        backend=self.backend)
                    if check_finite:
                        flags.append(result[1])
        if not check_finite:
            return None
        return torch.stack(flags).any() if len(flags) > 1 else flags[0]

    def scatter(self, bucket: Bucket, postscale) -> None:
        """Write the reduced buffer back into the gradients, times ``postscale``
        (a number, or a one-element tensor on the device: the clip's)."""
        with torch.no_grad():
            for run in self.runs[bucket.index]:
                if run.dtype == bucket.dtype:
                    if isinstance(postscale, torch.Tensor):
                        # in the buffer's dtype, as the kernels take a scale
                        run.comm.mul_(postscale.to(run.comm.dtype))
                    elif postscale != 1.0:
                        run.comm.mul_(postscale)
                else:
                    kernels.unflatten_cast_scale(run.comm, [run.source], scale=postscale,
                                                 backend=self.backend)
