"""What every Triton backend shares: widening on load, rounding on store, a
float64 scale carried in two 32-bit words, launch tables moved to the device.

Imported only where Triton is (the Triton backends). Element math is in fp32,
or fp64 when fp64 is involved; 16-bit results are always rounded from an fp32
value, as torch's own casts do, so the two backends agree.
"""
from __future__ import annotations

import struct

import numpy as np
import torch
import triton
import triton.language as tl


def scale_words(scale: float):
    """The float64 ``scale`` as two signed 32-bit words (high, low): kernel
    arguments that carry its exact bits and never change the launch signature."""
    bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    low = bits & 0xFFFFFFFF
    return bits >> 32, low - (1 << 32) if low >= 1 << 31 else low


@triton.jit
def scale_from_words(high, low):
    """The float64 scale from its two 32-bit words (``scale_words``)."""
    bits = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def scale_of(scale_ptr, high, low, SCALE_TENSOR: tl.constexpr):
    """A launch's float64 scale: from the device tensor, or from its words."""
    if SCALE_TENSOR:
        return tl.load(scale_ptr).to(tl.float64)
    return scale_from_words(high, low)


def to_device(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """A launch table on ``device``; to a GPU from pinned memory, without
    waiting (the copy is ordered before the launches that read it)."""
    host = torch.from_numpy(table)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@triton.jit
def upcast(x, COMPUTE: tl.constexpr):
    # bf16 is the top half of an fp32: widen it on the bits, which is exact on
    # the GPU and in the interpreter alike (whose bf16 -> fp32 cast mangles
    # subnormals)
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True).to(COMPUTE)
    return x.to(COMPUTE)


@triton.jit
def round_to_bf16(y):
    # fp32 -> bf16, round to nearest even, done on the bits: Triton's interpreter
    # truncates in ``.to(tl.bfloat16)``, the GPU rounds; this is exact on both.
    bits = y.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(y != y, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def downcast(y, DST: tl.constexpr):
    # 16-bit results are always rounded from an fp32 value (fp64 goes via fp32),
    # as torch's own fp64 -> fp16/bf16 casts do, so both backends agree.
    if DST == tl.bfloat16:
        return round_to_bf16(y.to(tl.float32))
    if DST == tl.float16:
        return y.to(tl.float32).to(DST)
    return y.to(DST)
