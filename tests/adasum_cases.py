"""What the AdaSum kernel tests share: cases, value builders, the tolerance model.

For two gradients of one tensor, AdaSum(a, b) = ca·a + cb·b with
ca = 1 - a·b/(2‖a‖²), cb = 1 - a·b/(2‖b‖²), a coefficient being 1 where its
squared norm is below sqrt(float64 tiny). Each segment of a flat buffer is
one tensor, with coefficients of its own.

Buffers are described by small cases (segment lengths, dtype, seed) and built
inside the test, so Hypothesis shrinks lengths and counts, not thousands of
values. The Triton backend runs under its interpreter (``conftest.py``), one
numpy program per 1024-element block: sizes stay at a few thousand elements.

How results are compared, and why:

- the reference is float64 with exactly rounded sums (``math.fsum``,
  ``reference.adasum_stats``);
- the kernel's statistics are fp64 sums of products; n additions (and, for
  fp64 data, the products) each round by at most eps64, so a statistic is off
  by at most (n + 1)·eps64·Σ|xy|;
- the combine then rounds each coefficient, each product and the sum in the
  compute dtype (fp32, fp64 for fp64 buffers), ≤ 4·eps_c·(|ca·x| + |cb·y|),
  and the result once more to the buffer's dtype, ≤ eps_d·|result|; a
  statistic's error moves a coefficient by ≤ 2(n + 1)·eps64·Σ|xy|/‖a‖², which
  is below eps32 but not below eps64; results in the subnormal range carry an
  absolute error of one subnormal step;
- fusing and determinism are compared bit for bit: both are promises about the
  exact same arithmetic, not about accuracy.

Values are drawn on the CPU and moved to the test device
(``device_mode.DEVICE()``); the reference, its tolerance and the comparisons
work on CPU copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
from hypothesis import strategies as st

import device_mode
from device_mode import on_cpu
from fusedreduce.kernels import adasum_combine, adasum_stats
from reference import NORM_FLOOR, adasum_coefficient
from reference import adasum_stats as reference_stats

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
EPS64 = torch.finfo(torch.float64).eps
# elements per example: interpreted Triton runs each 1024-element block as one numpy
# program (tens of ms on a loaded machine), and each segment costs one more program
BUDGET = 2_600


# ---------------------------------------------------------------- cases

def values(n, dtype, seed, salt, scale=1.0) -> torch.Tensor:
    """``n`` standard normal values times ``scale``, drawn in float64 and rounded to ``dtype``
    on the CPU (the same values on every device), then moved to the test device."""
    gen = torch.Generator().manual_seed(seed * 7919 + salt)
    return device_mode.to_device((torch.randn(n, generator=gen, dtype=torch.float64)
                                  * scale).to(dtype))


@dataclass(frozen=True)
class Case:
    """Segment lengths (0 allowed), a buffer dtype and a seed for the values."""

    lengths: Tuple[int, ...]
    dtype: torch.dtype
    seed: int

    @property
    def bounds(self) -> List[int]:
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        return bounds

    @property
    def size(self) -> int:
        return self.bounds[-1]

    def randn(self, salt: int = 0, scale: float = 1.0) -> torch.Tensor:
        return values(self.size, self.dtype, self.seed, salt, scale)

    def segments(self):
        return zip(self.bounds[:-1], self.bounds[1:])


def _fit(lengths):
    """Trim the lengths to the element budget, keeping at least one segment."""
    kept, total = [], 0
    for n in lengths:
        n = min(n, BUDGET - total)
        kept.append(n)
        total += n
    return tuple(kept)


# up to 1300 elements: segments of one or two 1024-element Triton blocks, ragged tails
lengths_st = st.lists(st.one_of(st.integers(0, 40), st.integers(0, 1300)),
                      min_size=1, max_size=4).map(_fit)
cases = st.builds(Case, lengths=lengths_st, dtype=st.sampled_from(DTYPES),
                  seed=st.integers(0, 2 ** 20))
fp32_cases = st.builds(Case, lengths=lengths_st, dtype=st.just(torch.float32),
                       seed=st.integers(0, 2 ** 20))


def kernel_adasum(a, b, bounds, backend, out=None):
    """AdaSum(a, b) by the kernels: ``adasum_stats`` then ``adasum_combine``."""
    stats = adasum_stats(a, b, bounds, backend=backend)
    return adasum_combine(a, b, bounds, stats, out=out, backend=backend)


# ---------------------------------------------------------------- float64 reference

def _per_element(per_segment, bounds) -> torch.Tensor:
    """One float64 value per segment, repeated over the segment's elements."""
    lengths = torch.tensor([hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])])
    return torch.repeat_interleave(torch.tensor(per_segment, dtype=torch.float64), lengths)


def reference_adasum(a, b, bounds):
    """(AdaSum(a, b) in float64, the tolerance of each element of a kernel's result),
    both on the CPU."""
    a, b = on_cpu(a), on_cpu(b)
    stats = reference_stats(a, b, bounds).tolist()
    ca = _per_element([adasum_coefficient(d, na) for d, na, _ in stats], bounds)
    cb = _per_element([adasum_coefficient(d, nb) for d, _, nb in stats], bounds)
    x, y = a.double(), b.double()
    result = ca * x + cb * y
    return result, _tolerance(a, b, bounds, stats, ca * x, cb * y, result)


def _tolerance(a, b, bounds, stats, ax, by, result) -> torch.Tensor:
    """The rounding budget of the module docstring, element by element."""
    dtype = a.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    eps_c, eps_d = torch.finfo(compute).eps, torch.finfo(dtype).eps
    x, y = a.double().tolist(), b.double().tolist()
    shift_a, shift_b = [], []
    for (lo, hi), (_, na, nb) in zip(zip(bounds[:-1], bounds[1:]), stats):
        spread = 2 * (hi - lo + 1) * EPS64 * math.fsum(abs(p * q) for p, q in
                                                        zip(x[lo:hi], y[lo:hi]))
        shift_a.append(0.0 if na < NORM_FLOOR else spread / na)
        shift_b.append(0.0 if nb < NORM_FLOOR else spread / nb)
    coefficient_error = _per_element(shift_a, bounds) * a.double().abs() \
        + _per_element(shift_b, bounds) * b.double().abs()
    subnormal_steps = torch.finfo(compute).tiny * eps_c + torch.finfo(dtype).tiny * eps_d
    return coefficient_error + 4 * eps_c * (ax.abs() + by.abs()) + eps_d * result.abs() \
        + subnormal_steps


def assert_within(actual, expected, tolerance, what=""):
    """Every element of ``actual`` within ``tolerance`` of the float64 ``expected``."""
    actual, expected, tolerance = on_cpu(actual), on_cpu(expected), on_cpu(tolerance)
    assert actual.dtype in DTYPES
    error = (actual.double() - expected).abs()
    bad = ~(error <= tolerance)  # NaN counts as bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off; first at {i}: got "
            f"{actual[i].item()!r}, want {expected[i].item()!r} +- {tolerance[i].item():.3g}")
