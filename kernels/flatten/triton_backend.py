"""The flatten family on Triton: gather many tensors into one flat buffer and back.

One launch serves any number of tensors. The host builds two int64 arrays per
layout (:func:`build_table`), uploads them once and keeps them on the device::

    table: [ src_bytes | numel | extent | flat_start | kind ]  a column per segment
    work:  [ segment << 32 | block ]                           an entry per program

Tensors that move (``Layout.rebind``) change only ``table``'s first and last
columns; ``work``, as long as the program count, never changes, so a re-pointed
launch uploads 40 bytes per segment.

The scale is not in the table: it travels with each launch as two 32-bit
words of its float64 bits (``scale_words``), arguments Triton does not
specialize on, so a new scale neither rebuilds the table nor compiles. A
scale held in a one-element fp32/fp64 tensor on the device (a loss scale's
inverse, a clip coefficient) is read by every program instead
(``SCALE_TENSOR``): no host read, and the launch stays the same from step to
step.

Every program copies one ``BLOCK`` of one segment, so a 1-element bias and a
25M-element weight cost the same per program and no program idles on mixed
sizes. A tensor's address is a byte offset from one ``base`` pointer (a tensor
of the call), because a loaded *offset* can carry a ``tl.multiple_of`` hint and
a loaded raw address cannot, and only hinted accesses become 128-bit.

A hint is a promise about every value, so the table stores offsets rounded
down to the alignment (``src_bytes`` to 16 bytes, ``flat_start`` to 16 bytes'
worth of flat elements): the promise always holds. The remainders sit in
``kind`` (dtype code | src remainder << 8 | flat remainder << 16 | a flag at
bit 24 for an unaligned flat buffer). A full block of a segment with nothing
above bit 8 of ``kind`` set takes the unmasked, vectorized fast path;
everything else takes the masked path, which adds the remainders back.

Element math is in fp32, or fp64 when either side of the copy is fp64; 16-bit
results are rounded from an fp32 value (as torch's own casts do).

``prepare_flatten`` and ``prepare_unflatten`` are this backend's side of the
kernels' backend protocol (``kernels/_backends.py``): the same arguments as
the torch fallback's, already validated by the façade; the launches they
return are kept per layout. Their Triton-only staging (a kept contiguous copy
of a strided tensor, a pseudo-segment that zeroes the buffer's leading gap,
the uint8 flag) happens here.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .._common import ALIGN_BYTES
from .._launcher import CompiledLaunch
from .._triton_common import downcast, scale_of, scale_words, to_device, upcast

BLOCK = 2048
NUM_WARPS = 4

# dtype codes in the table's ``kind`` column
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
# set in ``kind`` when the flat buffer itself is not 16-byte aligned
UNALIGNED_FLAT = 1 << 24
# the KINDS constexpr is a bitmask of the codes a launch holds; mixed launches
# always use ALL_KINDS, so a model's dtype mix costs one specialization
ALL_KINDS = 15


@triton.jit
def _flag_nonfinite(x, flag, CHECK_FINITE: tl.constexpr):
    if CHECK_FINITE:
        # NaN fails every comparison, so ``|x| < inf`` is false exactly for inf and NaN
        if tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=0) > 0:
            # every writer stores the same 1: the race is benign and the flag exact
            tl.store(flag, 1)


@triton.jit
def _segment(table, work, n_segments, BLOCK: tl.constexpr, FLAT_VEC: tl.constexpr):
    """This program's segment and block, read from the tables, hints applied.

    The hints must be applied here, on the loads: ``tl.multiple_of`` on a value
    returned from a multi-result call marks the call, and so every result.
    """
    item = tl.load(work + tl.program_id(0))
    seg = item >> 32
    start = tl.multiple_of((item - (seg << 32)) * BLOCK, BLOCK)
    src_bytes = tl.multiple_of(tl.load(table + seg), 16)
    numel = tl.load(table + n_segments + seg)
    extent = tl.load(table + 2 * n_segments + seg)
    flat_start = tl.multiple_of(tl.load(table + 3 * n_segments + seg), FLAT_VEC)
    kind = tl.load(table + 4 * n_segments + seg)
    return seg, start, src_bytes, numel, extent, flat_start, kind


@triton.jit
def _gather(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
            SRC: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK: tl.constexpr):
    # element math in fp64 when either side is fp64, else fp32 (a static branch:
    # both conditions are compile-time constants)
    if (SRC == tl.float64) or (out.dtype.element_ty == tl.float64):
        _gather_in(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                   SRC, tl.float64, CHECK_FINITE, BLOCK)
    else:
        _gather_in(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                   SRC, tl.float32, CHECK_FINITE, BLOCK)


@triton.jit
def _gather_in(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
               SRC: tl.constexpr, COMPUTE: tl.constexpr, CHECK_FINITE: tl.constexpr,
               BLOCK: tl.constexpr):
    OUT: tl.constexpr = out.dtype.element_ty
    scale = scale.to(COMPUTE)
    lanes = tl.arange(0, BLOCK)
    src_rem = (kind >> 8) & 255
    flat_rem = (kind >> 16) & 255
    # Each branch ends in its own store and check: a value flowing out of both
    # branches would force one register layout on both loads, and the masked
    # load's layout would cost the fast one its vectorization.
    if ((kind >> 8) == 0) & (start + BLOCK <= numel):
        src = (base + src_bytes).to(tl.pointer_type(SRC), bitcast=True) + start
        x = upcast(tl.load(src + lanes), COMPUTE)
        tl.store(out + flat_start + start + lanes, downcast(x * scale, OUT))
        _flag_nonfinite(x, flag, CHECK_FINITE)
    else:
        src = (base + src_bytes + src_rem).to(tl.pointer_type(SRC), bitcast=True)
        offs = start + lanes
        x = upcast(tl.load(src + offs, mask=offs < numel, other=0.0), COMPUTE)
        # elements in [numel, extent) are layout padding: written as +0 (not
        # 0 * scale, which is -0 for a negative scale)
        tl.store(out + flat_start + flat_rem + offs,
                 downcast(tl.where(offs < numel, x * scale, 0.0), OUT), mask=offs < extent)
        _flag_nonfinite(x, flag, CHECK_FINITE)


@triton.jit
def _gather_code(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                 CODE: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK: tl.constexpr):
    # the source dtype of a DTYPE_CODES code, chosen statically (Triton before
    # 3.5 has no constexpr functions to map the code to a dtype)
    if CODE == 0:
        _gather(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                tl.float16, CHECK_FINITE, BLOCK)
    elif CODE == 1:
        _gather(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                tl.bfloat16, CHECK_FINITE, BLOCK)
    elif CODE == 2:
        _gather(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                tl.float32, CHECK_FINITE, BLOCK)
    else:
        _gather(base, src_bytes, out, flat_start, start, numel, extent, kind, scale, flag,
                tl.float64, CHECK_FINITE, BLOCK)


@triton.jit(do_not_specialize=["scale_high", "scale_low"])
def _flatten_kernel(table, work, base, out, flag, n_segments, scale_high, scale_low, scale_ptr,
                    KINDS: tl.constexpr, CHECK_FINITE: tl.constexpr,
                    BLOCK: tl.constexpr, OUT_VEC: tl.constexpr, SCALE_TENSOR: tl.constexpr):
    seg, start, src_bytes, numel, extent, flat_start, kind = _segment(table, work, n_segments,
                                                                      BLOCK, OUT_VEC)
    scale = scale_of(scale_ptr, scale_high, scale_low, SCALE_TENSOR)
    code = kind & 255
    # single-dtype launches compile one branch; mixed launches pick per segment
    for CODE in tl.static_range(4):
        if ((KINDS >> CODE) & 1) != 0:
            if (KINDS == (1 << CODE)) or (code == CODE):
                _gather_code(base, src_bytes, out, flat_start, start, numel, extent, kind,
                             scale, flag, CODE, CHECK_FINITE, BLOCK)


@triton.jit
def _scatter(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
             DST: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    # as in _gather: fp64 math when either side is fp64
    if (DST == tl.float64) or (flat.dtype.element_ty == tl.float64):
        _scatter_in(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                    DST, tl.float64, ACCUMULATE, BLOCK)
    else:
        _scatter_in(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                    DST, tl.float32, ACCUMULATE, BLOCK)


@triton.jit
def _scatter_in(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                DST: tl.constexpr, COMPUTE: tl.constexpr, ACCUMULATE: tl.constexpr,
                BLOCK: tl.constexpr):
    scale = scale.to(COMPUTE)
    lanes = tl.arange(0, BLOCK)
    dst_rem = (kind >> 8) & 255
    flat_rem = (kind >> 16) & 255
    if ((kind >> 8) == 0) & (start + BLOCK <= numel):
        dst = (base + dst_bytes).to(tl.pointer_type(DST), bitcast=True) + start
        y = upcast(tl.load(flat + flat_start + start + lanes), COMPUTE) * scale
        if ACCUMULATE:
            y += upcast(tl.load(dst + lanes), COMPUTE)
        tl.store(dst + lanes, downcast(y, DST))
    else:
        dst = (base + dst_bytes + dst_rem).to(tl.pointer_type(DST), bitcast=True)
        offs = start + lanes
        mask = offs < numel
        y = upcast(tl.load(flat + flat_start + flat_rem + offs, mask=mask, other=0.0),
                    COMPUTE) * scale
        if ACCUMULATE:
            y += upcast(tl.load(dst + offs, mask=mask, other=0.0), COMPUTE)
        tl.store(dst + offs, downcast(y, DST), mask=mask)


@triton.jit
def _scatter_code(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                  CODE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    # as _gather_code: the destination dtype of a code, chosen statically
    if CODE == 0:
        _scatter(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                 tl.float16, ACCUMULATE, BLOCK)
    elif CODE == 1:
        _scatter(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                 tl.bfloat16, ACCUMULATE, BLOCK)
    elif CODE == 2:
        _scatter(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                 tl.float32, ACCUMULATE, BLOCK)
    else:
        _scatter(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                 tl.float64, ACCUMULATE, BLOCK)


@triton.jit(do_not_specialize=["scale_high", "scale_low"])
def _unflatten_kernel(table, work, base, flat, n_segments, scale_high, scale_low, scale_ptr,
                      KINDS: tl.constexpr, ACCUMULATE: tl.constexpr,
                      BLOCK: tl.constexpr, FLAT_VEC: tl.constexpr, SCALE_TENSOR: tl.constexpr):
    seg, start, dst_bytes, numel, extent, flat_start, kind = _segment(table, work, n_segments,
                                                                      BLOCK, FLAT_VEC)
    scale = scale_of(scale_ptr, scale_high, scale_low, SCALE_TENSOR)
    code = kind & 255
    for CODE in tl.static_range(4):
        if ((KINDS >> CODE) & 1) != 0:
            if (KINDS == (1 << CODE)) or (code == CODE):
                _scatter_code(base, dst_bytes, flat, flat_start, start, numel, kind, scale,
                              CODE, ACCUMULATE, BLOCK)


def kinds_mask(dtypes) -> int:
    """The KINDS constexpr for a launch over tensors of these dtypes."""
    codes = {DTYPE_CODES[d] for d in dtypes}
    return 1 << codes.pop() if len(codes) == 1 else ALL_KINDS


def _pick_base(tensors, flat):
    """The tensor whose first byte is the base of all byte offsets: a non-empty,
    16-byte aligned one if any (an unaligned base only costs vectorization)."""
    candidates = [t for t in tensors if t.numel() > 0] or [flat]
    for t in candidates:
        if t.data_ptr() % ALIGN_BYTES == 0:
            return t
    return candidates[0]


def build_table(tensors, starts, extents, flat, base):
    """The int64 launch ``table`` and ``work`` list (see the module docstring),
    and the program count.

    ``starts[i]``/``extents[i]``: where segment i begins in ``flat`` and how many
    flat elements its programs cover (>= numel; the excess is written as zero
    by the gather). Segments covering nothing get no programs.
    """
    n = len(tensors)
    base_addr = base.data_ptr()
    flat_vec = ALIGN_BYTES // flat.element_size()
    # an unaligned flat buffer sends every block down the masked path
    flat_unaligned = UNALIGNED_FLAT if flat.data_ptr() % ALIGN_BYTES else 0
    table = np.empty(5 * n, dtype=np.int64)
    blocks = np.empty(n, dtype=np.int64)
    for i, (t, start, extent) in enumerate(zip(tensors, starts, extents)):
        src_bytes = t.data_ptr() - base_addr
        flat_rem = start % flat_vec
        table[i] = src_bytes - src_bytes % ALIGN_BYTES
        table[n + i] = t.numel()
        table[2 * n + i] = extent
        table[3 * n + i] = start - flat_rem
        table[4 * n + i] = (DTYPE_CODES[t.dtype] | (src_bytes % ALIGN_BYTES) << 8
                            | flat_rem << 16 | flat_unaligned)
        blocks[i] = -(-max(extent, t.numel()) // BLOCK)
    programs = int(blocks.sum())
    segment_of = np.repeat(np.arange(n, dtype=np.int64), blocks)
    first_block = np.repeat(np.cumsum(blocks) - blocks, blocks)
    work = (segment_of << 32) | (np.arange(programs, dtype=np.int64) - first_block)
    return table, work, programs


def scale_arguments(scale, placeholder: torch.Tensor):
    """``(high, low, scale_ptr, SCALE_TENSOR)`` for a Python or a tensor scale;
    a float's ``scale_ptr`` is ``placeholder`` (never read)."""
    if isinstance(scale, torch.Tensor):
        return 0, 0, scale, True
    high, low = scale_words(scale)
    return high, low, placeholder, False


class Layout:
    """What every launch of one layout shares: the device table, the program
    count, the base tensor's place and the staging of non-contiguous tensors.

    The kernels read and write through one address per tensor, so a
    non-contiguous tensor goes through a kept contiguous staging tensor (a
    fixed address the table can hold).
    """

    def __init__(self, tensors, starts, extents, flat, zero_lead: bool):
        self.staged_indices = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        self.staging = [torch.empty(tensors[i].shape, dtype=tensors[i].dtype,
                                    device=tensors[i].device) for i in self.staged_indices]
        seen = list(tensors)
        for i, s in zip(self.staged_indices, self.staging):
            seen[i] = s
        starts, extents = list(starts), list(extents)
        lead = (starts[0] if seen else flat.numel()) if zero_lead else 0
        if lead > 0:
            # an empty pseudo-segment whose programs zero the buffer's leading gap
            seen, starts, extents = [flat[:0]] + seen, [0] + starts, [lead] + extents
        # the base of all byte offsets: the flat buffer when it is 16-byte
        # aligned (always, for a fresh allocation), else an aligned tensor of
        # the call (an unaligned base only costs vectorization)
        # At launch the base is found again: the call's flat buffer, one of the
        # call's tensors (by index), or a kept staging tensor.
        self.base_index, self.base_kept = None, None
        if flat.data_ptr() % ALIGN_BYTES == 0 and flat.numel() > 0:
            base = flat
        else:
            base = _pick_base(seen, flat)
            if any(base is s for s in self.staging):
                self.base_kept = base
            else:
                self.base_index = next((i - (lead > 0) for i, t in enumerate(seen)
                                        if t is base), None)
        self.n_segments = len(seen)
        self.kinds = kinds_mask(t.dtype for t in seen)
        self.host_table, work, self.programs = build_table(seen, starts, extents, flat, base)
        self.table = to_device(self.host_table, flat.device)
        self.work = to_device(work, flat.device)
        self.flat_vec = ALIGN_BYTES // flat.element_size()
        # moved tensors are re-pointed (``rebind``) when every offset is from the
        # flat buffer, whose address the kept layout pins: the call's tensors
        # are the table's rows ``address_rows``
        self.base_is_flat = base is flat
        self.base_addr = base.data_ptr()
        n, first, count = self.n_segments, int(lead > 0), len(tensors)
        self.address_rows = slice(first, first + count)
        self.kind_rows = slice(4 * n + first, 4 * n + first + count)
        self.kind_fixed = self.host_table[self.kind_rows] & ~np.int64(255 << 8)

    def rebind(self, addresses: np.ndarray, flat_address: int) -> None:
        """Point the table at the call's tensors now at ``addresses`` (int64),
        their offsets taken from the flat buffer now at ``flat_address``:
        their rows' aligned offsets and their remainders in ``kind`` (see
        ``build_table``); every other column, and ``work``, depends on the
        layout alone. A new device table, never the old one rewritten:
        launches queued before may still read it."""
        self.base_addr = flat_address
        src = addresses - flat_address
        remainder = src & (ALIGN_BYTES - 1)  # two's complement: 0..15, as Python's %
        table = self.host_table.copy()
        table[self.address_rows] = src - remainder
        table[self.kind_rows] = self.kind_fixed | (remainder << 8)
        self.host_table = table
        self.table = to_device(table, self.table.device)

    def accepts_flat_at(self, address: int) -> bool:
        """Whether the flat buffer can move to ``address``: the table assumes
        an aligned flat buffer (no ``UNALIGNED_FLAT`` bit)."""
        return address % ALIGN_BYTES == 0

    def binding(self):
        """The tables the launch reads now and the flat buffer's address they
        count from (see ``_prepared.Prepared.rebind``)."""
        return self.host_table, self.table, self.base_addr

    def bind(self, binding) -> None:
        """Read the tables ``binding()`` returned again: neither is ever
        rewritten, so they still hold what they held."""
        self.host_table, self.table, self.base_addr = binding

    def base(self, tensors, flat):
        """The tensor of this call at the table's base address, as bytes."""
        if self.base_kept is not None:
            base = self.base_kept
        elif self.base_index is not None:
            base = tensors[self.base_index]
        else:
            base = flat
        return triton.reinterpret(base, tl.uint8)


def prepare_flatten(tensors: Sequence[torch.Tensor], starts: Sequence[int],
                    extents: Sequence[int], out: torch.Tensor) -> Callable:
    """The launch that fills ``out``: segment ``i`` at ``starts[i]``, ``extents[i]``
    elements long (the part past the tensor zeroed), every other element zeroed.

    The launch is ``(tensors, out, scale, check_finite) -> flag or None`` for
    tensors and a buffer of the prepared layout: the launch table stays on the
    device, the scale travels as kernel arguments, so a launch copies nothing
    to the device and never waits for it.
    """
    layout = Layout(tensors, starts, extents, out, zero_lead=True)
    staged, staging = layout.staged_indices, layout.staging
    # positional: every parameter of _flatten_kernel, constexprs included
    kernel = CompiledLaunch(_flatten_kernel, (layout.programs,), num_warps=NUM_WARPS)

    def launch(tensors, out, scale, check_finite):
        if staged:
            torch._foreach_copy_(staging, [tensors[i] for i in staged])
        flag = torch.zeros(1, dtype=torch.uint8, device=out.device) if check_finite else None
        if layout.programs:
            high, low, scale_ptr, scale_tensor = scale_arguments(scale, layout.table)
            kernel(layout.table, layout.work, layout.base(tensors, out), out,
                   flag if flag is not None else layout.table, layout.n_segments, high, low,
                   scale_ptr, layout.kinds, flag is not None, BLOCK, layout.flat_vec,
                   scale_tensor)
        return flag.view(torch.bool)[0] if flag is not None else None
    launch.kernel = kernel
    return rebindable(launch, layout)


def prepare_unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                      starts: Sequence[int]) -> Callable:
    """The launch ``(flat, tensors, scale, accumulate) -> None`` that writes (or
    adds) each segment of ``flat`` into its tensor, in place."""
    layout = Layout(tensors, starts, [t.numel() for t in tensors], flat, zero_lead=False)
    staged, staging = layout.staged_indices, layout.staging
    kernel = CompiledLaunch(_unflatten_kernel, (layout.programs,), num_warps=NUM_WARPS)

    def launch(flat, tensors, scale, accumulate):
        with torch.no_grad():
            if staged and accumulate:
                torch._foreach_copy_(staging, [tensors[i] for i in staged])
            if layout.programs:
                high, low, scale_ptr, scale_tensor = scale_arguments(scale, layout.table)
                kernel(layout.table, layout.work, layout.base(tensors, flat), flat,
                       layout.n_segments, high, low, scale_ptr, layout.kinds, accumulate,
                       BLOCK, layout.flat_vec, scale_tensor)
            if staged:
                torch._foreach_copy_([tensors[i] for i in staged], staging)
    launch.kernel = kernel
    return rebindable(launch, layout)


def rebindable(launch: Callable, layout: Layout) -> Callable:
    """``launch``, with ``launch.rebind(tensors, ptrs, flat_address)`` and
    ``launch.accepts_buffer_at(address)`` (see ``_prepared.py``) when its
    layout's offsets all start from the flat buffer and nothing is staged."""
    if layout.base_is_flat and not layout.staged_indices:
        launch.rebind = lambda tensors, addresses, flat_address: layout.rebind(addresses,
                                                                               flat_address)
        launch.accepts_buffer_at = layout.accepts_flat_at
        launch.binding, launch.bind = layout.binding, layout.bind
    return launch
