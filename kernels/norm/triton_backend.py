"""The norm family on Triton: two launches per call, whatever the number of buffers.

``_row_powers_kernel`` gives every ``ROWS_PER_PROGRAM`` consecutive
``NORM_ROW``-element rows of a buffer one program. Each row's sum of
``|x| ** p`` (its max ``|x|`` for the max norm) is taken in fp32 (fp64 for
fp64 buffers) and the program adds its rows in order in fp64, into its own
slot of a ``partials`` vector: no atomics, each slot written once. One launch
per buffer dtype (a reducer's buckets usually share one). ``_finish_kernel``
is one program: it adds each buffer's partials in order (block by block into
a vector, then one fixed tree), and with ``FINISH`` goes on to the norm,
torch's coefficient and each buffer's scale, all on the device: the host
neither waits nor reads. Taking several rows per program keeps that one
program's walk short next to the rows' (it reads one partial per
``ROWS_PER_PROGRAM * NORM_ROW`` elements), however large the model.

The host keeps, per layout (the buffers' addresses, sizes and dtypes), the
tables the kernels read: for each dtype group ``[offset | numel | first
partial]`` per buffer (``offset`` in elements from the group's first buffer,
the base pointer of the launch) and ``work`` (``buffer << 32 | piece`` per
program), and for the finish ``[first partial | partials]`` per buffer. They
are uploaded once; a call allocates its outputs and launches, nothing else.
A layout kept for a share of the partials (the clipping norm split across
ranks) holds the programs of that share only: the others stay zero.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import List, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .._checks import refuse_in_capture
from .._common import NORM_ROW, postscale_vectors, share_bounds
from .._launcher import launch_for
from .._triton_common import scale_from_words, scale_words, to_device, upcast

NUM_WARPS = 4
#: consecutive rows one program of ``_row_powers_kernel`` sums
ROWS_PER_PROGRAM = 8
#: partials the finishing program adds per step
FINISH_BLOCK = 1024
#: layouts kept per process (a reducer alternates between at most two)
KEPT = 16
# the NORM constexpr: which power the kernels sum
NORM_MAX, NORM_ONE, NORM_TWO, NORM_P = 0, 1, 2, 3


def norm_code(norm_type: float) -> int:
    if norm_type == math.inf:
        return NORM_MAX
    return {1.0: NORM_ONE, 2.0: NORM_TWO}.get(norm_type, NORM_P)


@triton.jit
def _max_nan(a, b):
    """``max(a, b)``, NaN if either is."""
    return tl.where(b != b, b, tl.where(b > a, b, a))


@triton.jit
def _row_power(x, p, NORM: tl.constexpr):
    """One row's sum of ``|x| ** p`` (max ``|x|`` for ``NORM == 0``), ``x``
    already absolute and widened, ``p`` in ``x``'s dtype."""
    if NORM == 0:
        # tl.max may drop a NaN; the max norm must not
        nan = tl.sum(tl.where(x != x, 1, 0), axis=0) > 0
        return tl.where(nan, float("nan"), tl.max(x, axis=0))
    elif NORM == 1:
        return tl.sum(x, axis=0)
    elif NORM == 2:
        return tl.sum(x * x, axis=0)
    else:
        # |x| ** p; log2(0) = -inf gives 0, inf and NaN stay themselves
        return tl.sum(tl.exp2(p * tl.log2(x)), axis=0)


# p comes as the words of its float64 bits: a float argument is fp32 in a
# compiled kernel, and fp64's |x| ** p and total ** (1 / p) need p's own bits
@triton.jit(do_not_specialize=["p_high", "p_low"])
def _row_powers_kernel(base, table, work, partials, n_buffers, p_high, p_low,
                       NORM: tl.constexpr, COMPUTE: tl.constexpr, ROW: tl.constexpr,
                       ROWS: tl.constexpr):
    item = tl.load(work + tl.program_id(0))
    buf = item >> 32
    piece = item - (buf << 32)
    offset = tl.load(table + buf)
    numel = tl.load(table + n_buffers + buf)
    first = tl.load(table + 2 * n_buffers + buf)
    lanes = tl.arange(0, ROW)
    p = scale_from_words(p_high, p_low).to(COMPUTE)
    total = tl.zeros([1], dtype=tl.float64)
    for r in range(ROWS):  # a constexpr bound: the same loop compiled and interpreted
        idx = (piece * ROWS + r) * ROW + lanes
        x = tl.abs(upcast(tl.load(base + offset + idx, mask=idx < numel, other=0.0), COMPUTE))
        s = _row_power(x, p, NORM).to(tl.float64)
        if NORM == 0:
            total = _max_nan(total, s)
        else:
            total = total + s
    tl.store(partials + first + piece + tl.arange(0, 1), total)


# the loss scale's and the limit's words change with them: specialising on
# their values (== 1, divisible by 16) would compile another variant when one
# lands there
@triton.jit(do_not_specialize=["p_high", "p_low", "max_high", "max_low", "loss_high",
                               "loss_low"])
def _finish_kernel(partials, ranges, powers, post, total_out, scales_out, n_buffers,
                   p_high, p_low,
                   max_high, max_low, loss_ptr, loss_high, loss_low,
                   NORM: tl.constexpr, SUM_PARTIALS: tl.constexpr, FINISH: tl.constexpr,
                   LOSS: tl.constexpr, LOSS_TENSOR: tl.constexpr, NORM64: tl.constexpr,
                   BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    p = scale_from_words(p_high, p_low)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    # while loops, not range(): Triton's interpreter before 3.7 cannot take
    # runtime values as range bounds under numpy 2; the compiled loops are the same
    b = 0
    while b < n_buffers:
        if SUM_PARTIALS:
            first = tl.load(ranges + b)
            count = tl.load(ranges + n_buffers + b)
            part = tl.zeros([BLOCK], dtype=tl.float64)
            start = 0
            while start < count:
                v = tl.load(partials + first + start + lanes, mask=start + lanes < count,
                            other=0.0)
                if NORM == 0:
                    part = _max_nan(part, v)
                else:
                    part = part + v
                start += BLOCK
            if NORM == 0:
                nan = tl.sum(tl.where(part != part, 1, 0), axis=0) > 0
                power = tl.where(nan, float("nan"), tl.max(part, axis=0))
            else:
                power = tl.sum(part, axis=0)
            tl.store(powers + b, power)
        else:
            power = tl.load(powers + b)
        if FINISH:
            # each buffer's term in lane b % BLOCK: the lanes are added in a fixed tree
            weight = tl.abs(tl.load(post + b))
            if NORM <= 1:  # the max norm and the 1-norm scale linearly
                term = power * weight
            elif NORM == 2:
                term = power * (weight * weight)
            else:
                term = power * tl.exp2(p * tl.log2(weight))
            here = lanes == b % BLOCK
            if NORM == 0:
                acc = tl.where(here, _max_nan(acc, term), acc)
            else:
                acc = tl.where(here, acc + term, acc)
        b += 1
    if FINISH:
        if NORM == 0:
            nan = tl.sum(tl.where(acc != acc, 1, 0), axis=0) > 0
            total = tl.where(nan, float("nan"), tl.max(acc, axis=0))
        else:
            total = tl.sum(acc, axis=0)
            if NORM == 2:
                total = tl.sqrt(total)
            elif NORM == 3:
                total = tl.exp2(tl.log2(total) / p)
        if LOSS:
            if LOSS_TENSOR:
                # a device scale is not read on the host: one that is not
                # finite and > 0 gives a NaN norm (and NaN gradients, or
                # error_if_nonfinite's raise) instead of zeroed or flipped ones
                loss = tl.load(loss_ptr).to(tl.float64)
                good = (loss > 0) & (loss < float("inf"))
                total = tl.where(good, total / loss, float("nan"))
            else:
                total = total / scale_from_words(loss_high, loss_low)
        # torch's coefficient in the norm's dtype (fp64 for fp64 gradients):
        # the limit comes as float64 words, and a float literal would be an
        # fp32 constant, so fp64's 1e-6 is made explicitly
        max_norm = scale_from_words(max_high, max_low)
        if NORM64:
            coefficient = max_norm / (total + tl.full([], 1e-6, tl.float64))
        else:
            total = total.to(tl.float32)
            coefficient = max_norm.to(tl.float32) / (total + 1e-6)
        tl.store(total_out, total)
        coefficient = tl.where(coefficient > 1.0, 1.0, coefficient)  # NaN stays NaN
        b = 0
        while b < n_buffers:
            tl.store(scales_out + b, tl.load(post + b) * coefficient.to(tl.float64))
            b += 1


class _Layout:
    """The kept tables of one set of buffers (see the module docstring), the
    row-summing programs of one share of their partials only."""

    def __init__(self, buffers: Sequence[torch.Tensor], share: Tuple[int, int]):
        device = buffers[0].device
        per_program = ROWS_PER_PROGRAM * NORM_ROW
        counts = [-(-b.numel() // per_program) for b in buffers]
        firsts = np.cumsum([0] + counts[:-1], dtype=np.int64)
        self.n_partials = int(sum(counts))
        lo, hi = share_bounds(self.n_partials, share)
        self.whole = (lo, hi) == (0, self.n_partials)
        # each buffer's programs inside [lo, hi), as pieces [start, stop)
        mine = [(min(max(lo - int(f), 0), c), max(min(hi - int(f), c), 0))
                for f, c in zip(firsts, counts)]
        self.ranges = to_device(np.concatenate([firsts, np.asarray(counts, dtype=np.int64)]),
                                 device)
        self.groups = []
        for dtype in dict.fromkeys(b.dtype for b in buffers):
            members = [i for i, b in enumerate(buffers) if b.dtype == dtype and counts[i]]
            work = np.concatenate([(np.int64(j) << 32) + np.arange(*mine[i], dtype=np.int64)
                                   for j, i in enumerate(members)] or [np.zeros(0, np.int64)])
            if not len(work):
                continue
            base = buffers[members[0]].data_ptr()
            size = buffers[members[0]].element_size()
            table = np.array([(buffers[i].data_ptr() - base) // size for i in members]
                             + [buffers[i].numel() for i in members]
                             + [int(firsts[i]) for i in members], dtype=np.int64)
            compute = tl.float64 if dtype == torch.float64 else tl.float32
            self.groups.append((members[0], len(members), to_device(table, device),
                                to_device(work, device), len(work), compute))


_layouts: "OrderedDict[tuple, _Layout]" = OrderedDict()
_lock = threading.Lock()


def _layout_of(buffers: Sequence[torch.Tensor], share: Tuple[int, int] = (0, 1)) -> _Layout:
    key = (share,) + tuple((b.data_ptr(), b.numel(), b.dtype, b.device) for b in buffers)
    with _lock:
        layout = _layouts.get(key)
        if layout is not None:
            _layouts.move_to_end(key)
            return layout
    refuse_in_capture(buffers[0].device, "the clipping norm of buffers no eager step used",
                      "run the step eagerly first, so that its buffers' tables are uploaded "
                      "before the capture")
    layout = _Layout(buffers, share)
    with _lock:
        _layouts[key] = layout
        while len(_layouts) > KEPT:
            _layouts.popitem(last=False)
    return layout


def _row_powers(buffers, layout: _Layout, partials: torch.Tensor, norm_type: float) -> None:
    code = norm_code(norm_type)
    p_high, p_low = scale_words(0.0 if code != NORM_P else float(norm_type))
    for base_index, n, table, work, programs, compute in layout.groups:
        launch_for(_row_powers_kernel, (programs,), num_warps=NUM_WARPS)(
            buffers[base_index], table, work, partials, n, p_high, p_low, code, compute, NORM_ROW,
            ROWS_PER_PROGRAM)


def _finish(partials, layout, powers, postscales, max_norm, norm_type, loss_scale,
            sum_partials: bool, finish: bool, norm_dtype: torch.dtype = torch.float32):
    """Launch the finishing program; ``(total, scales)`` when ``finish``."""
    device = powers.device
    n = powers.numel()
    code = norm_code(norm_type)
    p_high, p_low = scale_words(1.0 if code != NORM_P else float(norm_type))
    total = scales = None
    if finish:
        post = postscale_vectors(tuple(postscales), device)[1]  # signed
        total = torch.empty((), dtype=norm_dtype, device=device)
        scales = torch.empty(n, dtype=torch.float64, device=device)
    else:
        post = powers
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.device != device or loss_scale.numel() != 1 \
                or loss_scale.dtype not in (torch.float32, torch.float64):
            # what the kernel can read: one float on the buffers' device (as the
            # torch fallback converts it; more than one element raises there too)
            loss_scale = loss_scale.to(device, torch.float64).reshape(())
        high, low, loss_ptr, loss_tensor = 0, 0, loss_scale, True
    else:
        high, low = scale_words(1.0 if loss_scale is None else float(loss_scale))
        loss_ptr, loss_tensor = powers, False
    max_high, max_low = scale_words(float(max_norm))
    launch_for(_finish_kernel, (1,), num_warps=NUM_WARPS)(
        partials if partials is not None else powers,
        layout.ranges if layout is not None else powers, powers, post,
        total if finish else powers, scales if finish else powers, n, p_high, p_low, max_high, max_low,
        loss_ptr, high, low, code, sum_partials, finish, loss_scale is not None, loss_tensor,
        norm_dtype == torch.float64, FINISH_BLOCK)
    return total, scales


def norm_partials(buffers: Sequence[torch.Tensor], norm_type: float,
                  share: Tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Every program's sum of powers, as one fp64 vector (one launch per
    buffer dtype), for the programs of share ``(index, count)``
    (``share_bounds`` of the partials in buffer order); the others are zero."""
    layout = _layout_of(buffers, share)
    alloc = torch.empty if layout.whole else torch.zeros
    partials = alloc(layout.n_partials, dtype=torch.float64, device=buffers[0].device)
    _row_powers(buffers, layout, partials, norm_type)
    return partials


def norm_powers(buffers: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each buffer's sum of powers, as one fp64 vector (two launches)."""
    layout = _layout_of(buffers)
    device = buffers[0].device
    partials = torch.empty(layout.n_partials, dtype=torch.float64, device=device)
    powers = torch.empty(len(buffers), dtype=torch.float64, device=device)
    _row_powers(buffers, layout, partials, norm_type)
    _finish(partials, layout, powers, None, 1.0, norm_type, None, sum_partials=True,
            finish=False)
    return powers


def clip_scales(powers: torch.Tensor, postscales: Sequence[float], max_norm: float,
                norm_type: float, loss_scale=None,
                norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``(total_norm, scales)`` from the buffers' ``powers`` (one launch)."""
    total, scales = _finish(None, None, powers, postscales, max_norm, norm_type, loss_scale,
                            sum_partials=False, finish=True, norm_dtype=norm_dtype)
    return total, list(scales.unbind(0))


def clip_partials(partials: torch.Tensor, buffers: Sequence[torch.Tensor],
                  postscales: Sequence[float], max_norm: float, norm_type: float,
                  loss_scale=None,
                  norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_scales`` of the buffers' powers from their ``norm_partials``
    (one launch)."""
    layout = _layout_of(buffers)
    powers = torch.empty(len(buffers), dtype=torch.float64, device=partials.device)
    total, scales = _finish(partials, layout, powers, postscales, max_norm, norm_type,
                            loss_scale, sum_partials=True, finish=True, norm_dtype=norm_dtype)
    return total, list(scales.unbind(0))


def clip_buffers(buffers: Sequence[torch.Tensor], postscales: Sequence[float],
                 max_norm: float, norm_type: float, loss_scale=None,
                 norm_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``clip_partials`` of all of the buffers' ``norm_partials``, in two launches."""
    layout = _layout_of(buffers)
    device = buffers[0].device
    scratch = torch.empty(layout.n_partials + len(buffers), dtype=torch.float64, device=device)
    partials, powers = scratch[:layout.n_partials], scratch[layout.n_partials:]
    _row_powers(buffers, layout, partials, norm_type)
    total, scales = _finish(partials, layout, powers, postscales, max_norm, norm_type,
                            loss_scale, sum_partials=True, finish=True, norm_dtype=norm_dtype)
    return total, list(scales.unbind(0))
