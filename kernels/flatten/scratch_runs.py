"""Run by run through a kept scratch: the torch fallback's scaled copies that
round once, with one ``mul`` per run of segments instead of one per tensor.

``torch_backend`` builds a ``ScratchRuns`` once per prepared layout where the
pairs' dtypes call for it; ``segment_views`` makes the buffer's (and the
scratch's) views in the tensors' own shapes, once.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

# a scaled flatten fills the buffer in runs of segments of about this many
# elements, each run copied and then scaled while it is still in cache,
# instead of one scaling pass over the whole buffer from memory: at 25.6M
# elements 9.3 ms against 12.2 ms for ResNet-50's gradients on the 2-core VM
# (the single-tensor copy: 6.9 ms), and no slower at 4M elements
SCALE_GROUP = 1 << 20


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def segment_views(flat: torch.Tensor, starts, tensors):
    """Each tensor's segment of ``flat`` as a view in the tensor's own shape.

    One view op per tensor (creating a view costs microseconds on the CPU and a
    model has hundreds of gradients): the pairs ``(view, tensor)`` then go to
    ``copy_``/``mul`` as they are, whatever the tensor's strides.
    """
    base = flat.storage_offset()
    views = []
    for off, t in zip(starts, tensors):
        shape = t.shape
        if len(shape) == 1:
            views.append(flat.narrow(0, off, shape[0]))
        else:
            views.append(flat.as_strided(shape, contiguous_strides(tuple(shape)), base + off))
    return views


class _ReleasableScratch:
    """A kept scratch tensor whose memory can be given back between uses:
    views of it hold its storage, not its memory, so ``release`` gives the
    memory back and ``_take_memory`` (at the start of each use) takes it
    again, the views still valid."""

    def _hold(self, scratch: torch.Tensor) -> None:
        self._storage = scratch.untyped_storage()
        self._nbytes = self._storage.nbytes()

    def release(self) -> None:
        """Give the scratch's memory back (a strategy not chosen keeps none);
        the next call takes it again."""
        self._storage.resize_(0)

    def _take_memory(self) -> None:
        """The scratch's memory again, if ``release`` gave it back."""
        if self._storage.nbytes() < self._nbytes:
            self._storage.resize_(self._nbytes)


class ScratchRuns(_ReleasableScratch):
    """``dst = cast(src * scale)`` for many pairs through a kept scratch in
    the compute dtype, run by run, where one ``torch.mul(src, scale,
    out=dst)`` per pair (a type-converting ``mul`` costs several microseconds
    per call and streams slowly) or a scale of every destination apart
    would be slower; the same products, so the same bits.

    The segments go in runs of about ``SCALE_GROUP`` elements (consecutive
    segments of the buffer, gaps of up to ``MERGE_GAP`` elements included),
    each the size of the kept scratch at most. Unflattening (``__call__``),
    each run of the buffer is multiplied into the scratch (one ``mul``) and
    one ``_foreach_copy_`` writes the run's destinations while the scratch
    is still in cache: the third route of a scaled unflatten into 16 bits
    (fp32 products rounded once), and the ``scratch`` strategy into the
    buffer's own fp32/fp64 dtype. Flattening (``fill``), the run's tensors
    are copied into the scratch, scaled there and rounded into the buffer:
    the ``scratch`` strategy of a scaled flatten into 16 bits. Segments
    over ``4 * SCALE_GROUP`` elements keep their own ``mul`` (a scratch that
    large would fall out of cache).
    """

    # segments this close together share a run (the gap is multiplied too)
    MERGE_GAP = 256

    def __init__(self, flat: torch.Tensor, starts: Sequence[int], tensors, indices,
                 scratch_dtype: Optional[torch.dtype] = None):
        self.large = [i for i in indices if tensors[i].numel() > 4 * SCALE_GROUP]
        members = sorted((i for i in indices if 0 < tensors[i].numel() <= 4 * SCALE_GROUP),
                         key=lambda i: starts[i])
        runs = []  # [lo, hi, member indices]
        for i in members:
            lo, hi = starts[i], starts[i] + tensors[i].numel()
            if runs and lo - runs[-1][1] <= self.MERGE_GAP \
                    and runs[-1][1] - runs[-1][0] < SCALE_GROUP:
                runs[-1][1] = max(runs[-1][1], hi)
                runs[-1][2].append(i)
            else:
                runs.append([lo, hi, [i]])
        alias = flat.detach()
        scratch = torch.empty(max((hi - lo for lo, hi, _ in runs), default=0),
                              dtype=scratch_dtype or flat.dtype, device=flat.device)
        self._hold(scratch)
        self.runs = []
        for lo, hi, indices_ in runs:
            views = segment_views(scratch, [starts[i] - lo for i in indices_],
                                   [tensors[i] for i in indices_])
            # members that are a slice of the caller's list are passed as one
            first = indices_[0]
            picked = slice(first, first + len(indices_)) \
                if indices_ == list(range(first, first + len(indices_))) else indices_
            self.runs.append((alias.narrow(0, lo, hi - lo), scratch.narrow(0, 0, hi - lo),
                              picked, views))

    def __call__(self, dsts, srcs, scale: float) -> None:
        self._take_memory()
        for i in self.large:
            torch.mul(srcs[i], scale, out=dsts[i])
        for flat_run, scratch_run, picked, views in self.runs:
            torch.mul(flat_run, scale, out=scratch_run)
            targets = dsts[picked] if type(picked) is slice else [dsts[i] for i in picked]
            torch._foreach_copy_(targets, views)

    def fill(self, segments, tensors, scale: float) -> None:
        """The other way, for a scaled flatten into 16 bits: each run's tensors
        copied into the fp32 scratch, scaled there, rounded into the buffer
        (the elements between segments too: the launch zeroes them after)."""
        self._take_memory()
        for i in self.large:
            torch.mul(tensors[i], scale, out=segments[i])
        for flat_run, scratch_run, picked, views in self.runs:
            sources = tensors[picked] if type(picked) is slice else [tensors[i] for i in picked]
            torch._foreach_copy_(views, sources)
            scratch_run.mul_(scale)
            flat_run.copy_(scratch_run)


class WholeScratch(_ReleasableScratch):
    """``dst = cast(flat_segment * scale)`` for every destination: the whole
    buffer multiplied into a kept scratch of its dtype (one ``mul``), then
    one ``_foreach_copy_`` out of the scratch's segments. The same products
    as ``ScratchRuns`` (one rounding into each destination), in two torch
    calls whatever the layout: the ``foreach`` strategy of a scaled
    unflatten into 16 bits, which a trial keeps where it beats the runs
    (a buffer that fits in cache)."""

    def __init__(self, flat: torch.Tensor, starts: Sequence[int], tensors):
        self.flat = flat.detach()
        self.scratch = torch.empty_like(self.flat)
        self._hold(self.scratch)
        self.views = segment_views(self.scratch, starts, tensors)

    def __call__(self, tensors, scale: float) -> None:
        self._take_memory()
        torch.mul(self.flat, scale, out=self.scratch)
        torch._foreach_copy_(tensors, self.views)
