"""The wire formats worked out in float64, step by step: what ``quantize_flatten``
and ``dequantize_sum`` must give, bit for bit. Shares no code with fusedreduce.

Every fp32 operation of the documented semantics (a product, a quotient, a sum,
a difference of fp32 values) is done here in float64 and rounded once to
fp32. That is exactly the fp32 operation: for +, -, *, / a float64 result
rounded to fp32 equals the correctly rounded fp32 result, because float64
carries at least 2 * 24 + 2 significant bits (Figueroa, "When is double
rounding innocuous?", 1995). Roundings to an integer and to e4m3 are done on
exact float64 values with Python's round-half-to-even.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

LEVELS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
F32 = torch.float32


def fp32(values: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to fp32 and back to float64."""
    return values.to(F32).to(torch.float64)


def flat_values(tensors: Sequence[torch.Tensor], starts: Sequence[int], numel: int,
                scale: float, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """``v`` as float64 holding fp32 values: ``fp32(x) * fp32(scale)`` (fp64
    inputs: ``x * scale`` in fp64, rounded once), gaps 0, plus the residual."""
    v = torch.zeros(numel, dtype=torch.float64)
    for t, start in zip(tensors, starts):
        x = t.detach().reshape(-1).to(torch.float64)
        if t.dtype == torch.float64:
            product = fp32(x * scale)
        else:
            product = fp32(fp32(x) * fp32(torch.tensor(scale, dtype=torch.float64)))
        v[start:start + x.numel()] = product
    if residual is not None:
        v = fp32(v + residual.to(torch.float64))
    return v


def round_e4m3(y: float) -> float:
    """``y`` (|y| <= 448) rounded to nearest even on e4m3's grid: 3 mantissa
    bits for |y| >= 2^-6, multiples of 2^-9 below."""
    if y == 0.0:
        return y
    exponent = max(math.frexp(abs(y))[1] - 1, -6)
    spacing = 2.0 ** (exponent - 3)
    return math.copysign(round(y / spacing) * spacing, y)  # e4m3 has a -0


def quantize(v: torch.Tensor, wire_dtype: torch.dtype, block: int):
    """``(codes as float64, scales as float64 or None, dequantized, residual)``
    for ``v`` (float64 holding fp32 values)."""
    if wire_dtype == torch.float32:
        codes = v.clone()
    elif wire_dtype == torch.bfloat16:
        codes = v.to(F32).to(torch.bfloat16).to(torch.float64)  # torch rounds to nearest even
    if wire_dtype not in LEVELS:
        deq = codes.clone()
        residual = fp32(v - deq)
        residual[~torch.isfinite(residual)] = 0.0
        return codes, None, deq, residual
    level = LEVELS[wire_dtype]
    codes, scales, deq = [], [], []
    for lo in range(0, v.numel(), block):
        values = v[lo:lo + block].tolist()
        if not all(math.isfinite(x) for x in values):
            scales.append(math.nan)
            codes += [0.0] * block
            deq += [math.nan] * block
            continue
        s = fp32(torch.tensor(max(abs(x) for x in values) / level)).item()
        scales.append(s)
        for x in values:
            y = fp32(torch.tensor(x / (s if s > 0 else 1.0))).item()
            y = max(-level, min(level, y))
            code = float(round(y)) if wire_dtype == torch.int8 else round_e4m3(y)
            codes.append(code)
            deq.append(fp32(torch.tensor(code * s)).item())
    codes = torch.tensor(codes, dtype=torch.float64)
    deq = torch.tensor(deq, dtype=torch.float64)
    residual = fp32(v - deq)
    residual[~torch.isfinite(residual)] = 0.0
    return codes, torch.tensor(scales, dtype=torch.float64), deq, residual


def dequantize(codes: torch.Tensor, scales: Optional[torch.Tensor], block: int,
               dtype: torch.dtype) -> torch.Tensor:
    """One row's values as float64: ``code * scale`` rounded to ``dtype``."""
    values = codes.to(torch.float64)
    if scales is not None:
        values = values * scales.to(torch.float64).repeat_interleave(block)
    return values.to(dtype).to(torch.float64)


def pairwise_sum(rows: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rows added as a tree that splits at the largest power of two below
    their count, each sum rounded to ``dtype``."""
    if len(rows) == 1:
        return rows[0]
    split = 1 << (len(rows) - 1).bit_length() - 1
    left, right = pairwise_sum(rows[:split], dtype), pairwise_sum(rows[split:], dtype)
    return (left + right).to(dtype).to(torch.float64)
