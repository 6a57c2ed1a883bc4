"""The wire family on Triton: quantize in the flatten pass, dequantize and sum.

``prepare_quantize`` is one launch for any number of tensors. Its programs
own *tiles* of the flat buffer, ``GROUPS`` blocks of ``block`` elements each
(a ``(GROUPS, block)`` array in registers), not segments: a block scale needs
the block's every element, and blocks cross tensor bounds. A program loops
over the segments that overlap its tile (``tiles``: the first and the
past-the-last segment of each tile, worked out on the host once per layout),
loads each one's part masked, casts and scales it, adds the residual, then
finds each block's absmax, writes the codes, the block scales and the new
residual. The segment table, the base pointer, the staging of
non-contiguous tensors and the re-pointing of moved tensors are the flatten
family's (``flatten.triton_backend.Layout``).

float8_e4m3fn is encoded and decoded on the bits, with integer arithmetic
(round to nearest even, subnormals included), not with Triton's ``fp8e4nv``
casts, which need sm_89 or newer: the same code, and the same bits, on
every GPU (sm_80 included) and in the interpreter, which has no fp8 type.
int8 rounds to nearest even by adding and subtracting ``1.5 * 2^23``.

Both kernels compile with ``enable_fp_fusion=False``: a product followed by
a sum (``x * scale + residual``, ``v - code * s``, the dequantized rows
added) contracted into an FMA would round once instead of twice and differ
from the torch backend's bits. Divisions are ``div_rn`` (IEEE), not the
approximate division Triton emits for ``/`` (Triton 3.2 compiles it to
``div.rn.ftz``, which flushes fp32 subnormals: blocks of values below 2^-126
are the one place where that Triton can differ from the fallback).

``dequantize_sum`` loads a tile of every rank's row at once (``R`` is a
constexpr, rounded up to a power of two with rows of -0.0) and halves the
rows level by level, adding neighbours: exactly the bottom-up pairwise order
of ``wire/__init__.py``. (A recursive jit function would unroll the tree too,
but Triton 3.2's dependency hashing never returns from one.)
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .._common import WIRE_LEVELS
from .._launcher import CompiledLaunch
from .._triton_common import round_to_bf16, scale_of, to_device, upcast
from ..flatten.triton_backend import Layout, rebindable, scale_arguments

NUM_WARPS = 4
#: elements per program, at least one block
TILE = 2048
#: the WIRE constexpr: which format a launch writes or reads
WIRE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
#: rounds an fp32 value of magnitude below 2^22 to an integer, to nearest even
ROUNDER = tl.constexpr(12582912.0)
OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


@triton.jit
def _encode_e4m3(y):
    """e4m3fn bits (uint8) of fp32 ``y`` with ``|y| <= 448``, rounded to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # normal: drop 20 of the 23 mantissa bits with round to nearest even (a
    # carry into the exponent is right), then rebias the exponent 127 -> 7
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6: a multiple of 2^-9, found by rounding |y| * 2^9 (exact) to an integer
    subnormal = ((magnitude.to(tl.float32, bitcast=True) * 512.0 + ROUNDER) - ROUNDER)
    code = tl.where(magnitude < 0x3C800000, subnormal.to(tl.int32), normal)
    return (sign | code).to(tl.uint8)


@triton.jit
def _decode_e4m3(code):
    """The fp32 value of e4m3fn bits (uint8): exact; 0x7F and 0xFF are NaN."""
    c = code.to(tl.int32)
    exponent = (c >> 3) & 15
    mantissa = c & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,
                         normal.to(tl.float32, bitcast=True))
    # the sign goes on as a bit: a negation is 0 - x on some Tritons, which
    # turns the code -0 into +0
    value = (magnitude.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32,
                                                                          bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _segment_values(table, base, seg, n_segments, offs, v, scale, CODE: tl.constexpr):
    """``v`` with the elements of segment ``seg`` in ``offs`` replaced by
    ``x * scale``: fp32 math, fp64 for an fp64 source (rounded once)."""
    src_bytes = tl.load(table + seg)
    numel = tl.load(table + n_segments + seg)
    kind = tl.load(table + 4 * n_segments + seg)
    start = tl.load(table + 3 * n_segments + seg) + ((kind >> 16) & 255)
    j = offs - start
    inside = (j >= 0) & (j < numel)
    if CODE == 0:
        src = (base + src_bytes + ((kind >> 8) & 255)).to(tl.pointer_type(tl.float16),
                                                          bitcast=True)
    elif CODE == 1:
        src = (base + src_bytes + ((kind >> 8) & 255)).to(tl.pointer_type(tl.bfloat16),
                                                          bitcast=True)
    elif CODE == 2:
        src = (base + src_bytes + ((kind >> 8) & 255)).to(tl.pointer_type(tl.float32),
                                                          bitcast=True)
    else:
        src = (base + src_bytes + ((kind >> 8) & 255)).to(tl.pointer_type(tl.float64),
                                                          bitcast=True)
    x = tl.load(src + j, mask=inside, other=0.0)
    if CODE == 3:
        product = (x * scale).to(tl.float32)
    else:
        product = upcast(x, tl.float32) * scale.to(tl.float32)
    return tl.where(inside, product, v)


@triton.jit(do_not_specialize=["scale_high", "scale_low"])
def _quantize_kernel(table, tiles, base, codes, scales, residual, flag, n_segments, numel,
                     row, code_stride, scale_stride,
                     scale_high, scale_low, scale_ptr, KINDS: tl.constexpr, WIRE: tl.constexpr,
                     LEVEL: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, CHUNKED: tl.constexpr,
                     CHECK_FINITE: tl.constexpr, SCALE_TENSOR: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    blocks = tile * GROUPS + tl.arange(0, GROUPS)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    live = offs < numel
    # chunked codes: flat element e at row e // row, column e % row
    at = (offs // row) * code_stride + offs % row if CHUNKED else offs
    scale = scale_of(scale_ptr, scale_high, scale_low, SCALE_TENSOR)
    v = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    # a while loop: Triton 3.2's interpreter cannot take loaded bounds in range()
    seg = tl.load(tiles + 2 * tile)
    end = tl.load(tiles + 2 * tile + 1)
    while seg < end:
        code = tl.load(table + 4 * n_segments + seg) & 255
        for CODE in tl.static_range(4):
            if ((KINDS >> CODE) & 1) != 0:
                if (KINDS == (1 << CODE)) or (code == CODE):
                    v = _segment_values(table, base, seg, n_segments, offs, v, scale, CODE)
        seg += 1
    if HAS_RESIDUAL:
        v = v + tl.load(residual + offs, mask=live, other=0.0)
    finite = tl.abs(v) < float("inf")  # false for inf and NaN
    if CHECK_FINITE:
        if tl.max(tl.max(tl.where(finite, 0, 1), axis=1), axis=0) > 0:
            tl.store(flag, 1)  # every writer stores the same 1
    if WIRE == 0:
        tl.store(codes + at, v, mask=live)
        deq = v
    elif WIRE == 1:
        coded = round_to_bf16(v)
        tl.store(codes + at, coded, mask=live)
        deq = upcast(coded, tl.float32)
    else:
        bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0
        absmax = tl.max(tl.where(finite, tl.abs(v), 0.0), axis=1)
        s = tl.where(bad, float("nan"), tl.math.div_rn(absmax, tl.full(absmax.shape, LEVEL,
                                                                        tl.float32)))
        row_blocks = row // BLOCK
        scale_at = (blocks // row_blocks) * scale_stride + blocks % row_blocks if CHUNKED \
            else blocks
        tl.store(scales + scale_at, s, mask=blocks * BLOCK < numel)
        # an all-zero block (s = 0) divides by 1: codes 0, not 0/0
        y = tl.math.div_rn(v, tl.where(s > 0, s, 1.0)[:, None])
        y = tl.minimum(tl.maximum(y, -LEVEL), LEVEL)
        if WIRE == 2:
            q = tl.where(bad[:, None], 0.0, (y + ROUNDER) - ROUNDER)
            tl.store(codes + at, q.to(tl.int8), mask=live)
        else:
            bits = tl.where(bad[:, None], 0, _encode_e4m3(y)).to(tl.uint8)
            tl.store(codes + at, bits, mask=live)
            q = _decode_e4m3(bits)
        deq = q * s[:, None]
    if HAS_RESIDUAL:
        error = v - deq
        # a non-finite block, or a bf16 code rounded to inf, leaves no error behind
        tl.store(residual + offs, tl.where(tl.abs(error) < float("inf"), error, 0.0), mask=live)


@triton.jit(do_not_specialize=["n", "n_blocks", "total", "total_blocks"])
def _dequantize_sum_kernel(codes, scales, out, n, n_blocks, total, total_blocks, code_rank,
                           code_chunk, scale_rank, scale_chunk, WIRE: tl.constexpr,
                           R: tl.constexpr, RANKS: tl.constexpr, LEVELS: tl.constexpr,
                           BLOCK: tl.constexpr, GROUPS: tl.constexpr, CHUNKED: tl.constexpr):
    """Every row's tile dequantized into a ``(RANKS, GROUPS, BLOCK)`` array
    (``RANKS``: ``R`` rounded up to a power of two, the rows past ``R`` -0.0,
    which adds nothing, not even to a -0.0), then ``LEVELS`` halvings, each
    adding rows ``2i`` and ``2i + 1``: the bottom-up pairwise order, an odd
    last row carried up unchanged (plus -0.0)."""
    tile = tl.program_id(0).to(tl.int64)
    blocks = tile * GROUPS + tl.arange(0, GROUPS)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    rows = tl.arange(0, RANKS)
    n = n.to(tl.int64)
    total = total.to(tl.int64)
    # chunk c of C (each n elements, n_blocks scales) at c * code_chunk / scale_chunk
    at = (offs // n) * code_chunk + offs % n if CHUNKED else offs
    scale_at = (blocks // n_blocks) * scale_chunk + blocks % n_blocks if CHUNKED else blocks
    present = (rows < R)[:, None, None] & (offs < total)[None, :, :]
    c = tl.load(codes + (rows[:, None, None] * code_rank + at[None, :, :]), mask=present,
                other=0)
    COMPUTE: tl.constexpr = out.dtype.element_ty
    if WIRE == 3:
        value = _decode_e4m3(c).to(COMPUTE)
    else:
        value = upcast(c, COMPUTE)
    if WIRE >= 2:
        s = tl.load(scales + (rows[:, None] * scale_rank + scale_at[None, :]),
                    mask=(rows < R)[:, None] & (blocks < total_blocks)[None, :], other=0.0)
        value = value * s.to(COMPUTE)[:, :, None]
    value = tl.where(present, value, -0.0)
    for level in tl.static_range(LEVELS):
        value = tl.sum(tl.reshape(value, (RANKS >> (level + 1), 2, GROUPS, BLOCK)), axis=1)
    tl.store(out + offs, tl.reshape(value, (GROUPS, BLOCK)), mask=offs < total)


def _groups(block: int, rows: int = 1) -> int:
    """Blocks per program: ``TILE`` elements of each of ``rows`` rows."""
    return max(1, TILE // (block * rows))


def _tile_segments(starts, numels, numel: int, tile: int) -> np.ndarray:
    """``[first, end]`` per tile: the segments that overlap it (int64, flat)."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = starts + np.asarray(numels, dtype=np.int64)
    lows = np.arange(0, numel, tile, dtype=np.int64)
    first = np.searchsorted(ends, lows, side="right")
    last = np.searchsorted(starts, lows + tile, side="left")
    return np.stack([first, np.maximum(first, last)], axis=1).reshape(-1)


def prepare_quantize(tensors: Sequence[torch.Tensor], starts: Sequence[int],
                     extents: Sequence[int], codes: torch.Tensor, block: int) -> Callable:
    """The launch ``(tensors, codes, block_scales, residual, scale, check_finite)
    -> flag or None`` (see the torch backend's): one program per tile."""
    layout = Layout(tensors, starts, extents, codes, zero_lead=False)
    staged, staging = layout.staged_indices, layout.staging
    groups = _groups(block)
    numels = [t.numel() for t in tensors]
    programs = -(-codes.numel() // (groups * block))
    tiles = to_device(_tile_segments(starts, numels, codes.numel(), groups * block),
                      codes.device)
    wire = WIRE_CODES[codes.dtype]
    level = WIRE_LEVELS.get(codes.dtype, 1.0)
    kernel = CompiledLaunch(_quantize_kernel, (programs,), **OPTIONS)
    chunked = codes.dim() == 2 and codes.shape[0] > 1
    row = codes.shape[-1] if chunked else max(codes.numel(), 1)

    def launch(tensors, codes, block_scales, residual, scale, check_finite):
        if staged:
            torch._foreach_copy_(staging, [tensors[i] for i in staged])
        flag = torch.zeros(1, dtype=torch.uint8, device=codes.device) if check_finite else None
        if programs:
            high, low, scale_ptr, scale_tensor = scale_arguments(scale, layout.table)
            written = codes.view(torch.uint8) if wire == 3 else codes
            kernel(layout.table, tiles, layout.base(tensors, codes), written,
                   layout.table if block_scales is None else block_scales,
                   layout.table if residual is None else residual,
                   layout.table if flag is None else flag, layout.n_segments, codes.numel(),
                   row, codes.stride(0), 0 if block_scales is None else block_scales.stride(0),
                   high, low, scale_ptr, layout.kinds, wire, level, block, groups,
                   residual is not None, chunked, flag is not None, scale_tensor)
        return flag.view(torch.bool)[0] if flag is not None else None
    launch.kernel = kernel
    return rebindable(launch, layout)


def dequantize_sum(codes: torch.Tensor, block_scales: Optional[torch.Tensor],
                   out: torch.Tensor, block: int) -> None:
    """``out`` = the ``R`` rows of ``codes`` dequantized and summed in the fixed order."""
    codes = codes if codes.dim() == 3 else codes.unsqueeze(1)
    scales = None if block_scales is None else \
        (block_scales if block_scales.dim() == 3 else block_scales.unsqueeze(1))
    ranks, chunks, n = codes.shape
    padded = 1 << (ranks - 1).bit_length()
    groups = _groups(block, padded)
    programs = -(-(chunks * n) // (groups * block))
    if not programs:
        return
    wire = WIRE_CODES[codes.dtype]
    _dequantize_sum_kernel[(programs,)](
        codes.view(torch.uint8) if wire == 3 else codes,
        out if scales is None else scales, out, n, max(n // block, 1), chunks * n,
        max(chunks * n // block, 1), codes.stride(0), codes.stride(1),
        0 if scales is None else scales.stride(0), 0 if scales is None else scales.stride(1),
        wire, ranks, padded, padded.bit_length() - 1, block, groups, chunks > 1, **OPTIONS)
