"""adasum_combine's precision, the ends of the fp32 range, edges and bad input, both backends.

The combine works in fp32 while the coefficients stay within
ADASUM_FP32_LIMIT and in fp64 beyond it (and always for fp64 buffers); fp32
gradients near fp32's smallest normal or the square root of its largest still
give accurate results, their statistics being fp64; empty segments and buffers
are accepted; and every AdaSum kernel function refuses bad buffers, segments,
statistics, chunk partials and ``out`` with the documented error. Accuracy is
judged by the float64 reference and tolerance model of ``adasum_cases.py``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from adasum_cases import Case, assert_within, fp32_cases, kernel_adasum, reference_adasum
from fusedreduce.kernels import (ADASUM_FP32_LIMIT, adasum_chunk_counts, adasum_chunk_stats,
                                 adasum_combine, adasum_reduce_chunks, adasum_stats)
from reference import round_to

F32 = torch.finfo(torch.float32)
SQRT_F32_MAX = math.sqrt(F32.max)


# ---------------------------------------------------------------- the combine's precision

def _cancelling_case(magnitude):
    """Statistics whose coefficients are both about ``magnitude`` and differ by
    about ``magnitude · 2^-30``, for x = 1 and y = -1: AdaSum is ca - cb, while
    rounding ca and cb to fp32 (24 bits) makes them equal and the result 0."""
    dot, a2, b2 = -2.0 * magnitude, 1.0, 1.0 + 2.0 ** -30
    ca = 1.0 - dot / (2.0 * a2)  # the kernels' fp64 formula, in Python's fp64
    cb = 1.0 - dot / (2.0 * b2)
    assert ca != cb and torch.tensor([ca, cb]).float().unique().numel() == 1
    return (dot, a2, b2), ca, cb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_uses_fp64_beyond_the_fp32_limit_and_fp32_below_it(backend, dtype):
    # three segments of 3 elements, one call: coefficients ~2^66 (beyond the
    # limit), ~2^62 and exactly at the limit's scale (within it)
    magnitudes = [4 * ADASUM_FP32_LIMIT, ADASUM_FP32_LIMIT / 4, ADASUM_FP32_LIMIT / 2]
    cases = [_cancelling_case(m) for m in magnitudes]
    bounds = [0, 3, 6, 9]
    a, b = torch.ones(9, dtype=dtype), -torch.ones(9, dtype=dtype)
    stats = torch.tensor([s for s, _, _ in cases], dtype=torch.float64)
    out = adasum_combine(a, b, bounds, stats, backend=backend)
    eps_d, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    for i, (_, ca, cb) in enumerate(cases):
        got = out[3 * i:3 * i + 3].double()
        exact = ca - cb  # exact in fp64 (Sterbenz: cb <= ca <= 2 cb), and ~2^-30 of ca
        if max(abs(ca), abs(cb)) > ADASUM_FP32_LIMIT:
            # fp64 branch: ca·1 + cb·(-1) is exact in fp64, so the only error
            # is the rounding to the buffer's dtype (via fp32 for bf16):
            # eps32/2 + eps_d/2 relative, within eps_d
            assert torch.equal(got, round_to(torch.full((3,), exact, dtype=torch.float64),
                                             dtype)), (i, got, exact)
            assert bool(((got - exact).abs() <= eps_d * abs(exact)).all())
        else:
            # fp32 branch: ca and cb are rounded to fp32 first (eps32/2 each,
            # the budget's 4·eps32·(|ca·x| + |cb·y|) covers it); here both round
            # to the same fp32 value, so the result is exactly 0 where fp64 gives
            # ~2^-30·|ca|: the coefficients went through fp32
            assert bool((got == 0).all()), (i, got)
            assert abs(exact) <= 4 * eps32 * (abs(ca) + abs(cb))


def test_float64_buffers_are_combined_in_float64_at_any_coefficient(backend):
    for magnitude in (2.0 ** 10, 2.0 ** 70):
        stats, ca, cb = _cancelling_case(magnitude)
        out = adasum_combine(torch.ones(2, dtype=torch.float64),
                             -torch.ones(2, dtype=torch.float64), [0, 2],
                             torch.tensor([stats], dtype=torch.float64), backend=backend)
        assert out.tolist() == [ca - cb] * 2


# ---------------------------------------------------------------- numerical range

def _float32_magnitude(case, salt, magnitude):
    """fp32 values of random sign with |x| in [magnitude, 8·magnitude) (normal for tiny)."""
    gen = torch.Generator().manual_seed(case.seed * 131 + salt)
    spread = 1 + 7 * torch.rand(case.size, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(case.size, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * spread * magnitude).float()


REGIMES = {"float32_tiny": (F32.tiny, F32.tiny), "sqrt_float32_max": (SQRT_F32_MAX / 8,) * 2}


@pytest.mark.parametrize("regime", list(REGIMES))
@given(case=fp32_cases, parallel=st.booleans())
def test_float32_adasum_is_accurate_at_the_ends_of_the_float32_range(backend, regime, case,
                                                                     parallel):
    # Horovod's stability tests: ‖a‖² of fp32 data ~1e-38 or ~1e19 is far out
    # of fp32's range (1e-76, 1e40), so the statistics must not be fp32
    low, high = REGIMES[regime]
    a = _float32_magnitude(case, 1, low)
    b = a * 3 if parallel else _float32_magnitude(case, 2, high)
    out = kernel_adasum(a, b, case.bounds, backend)
    assert bool(torch.isfinite(out).all())
    expected, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, expected, tolerance, f"{regime} {case}")


def test_float32_adasum_of_a_tiny_and_a_sqrt_max_gradient_is_their_average(backend):
    v = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    a, b = (F32.tiny * v).float(), (SQRT_F32_MAX / 4 * v).float()
    out = kernel_adasum(a, b, [0, 4], backend)
    expected, tolerance = reference_adasum(a, b, [0, 4])
    assert bool(torch.isfinite(out).all()), out
    assert_within(out, expected, tolerance)


# ---------------------------------------------------------------- edges and errors

def test_empty_segments_and_an_empty_buffer(backend):
    empty = torch.empty(0)
    assert adasum_stats(empty, empty, [0], backend=backend).shape == (0, 3)
    stats = adasum_stats(empty, empty, [0, 0, 0], backend=backend)
    assert torch.equal(stats, torch.zeros(2, 3, dtype=torch.float64))
    assert adasum_combine(empty, empty, [0, 0, 0], stats, backend=backend).shape == (0,)
    assert adasum_combine(empty, empty, torch.tensor([0]), stats[:0], backend=backend).numel() == 0

    case = Case((0, 7, 0, 0, 3, 0), torch.float32, 11)
    a, b = case.randn(1), case.randn(2)
    stats = adasum_stats(a, b, case.bounds, backend=backend)
    assert torch.equal(stats[[0, 2, 3, 5]], torch.zeros(4, 3, dtype=torch.float64))
    expected, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(adasum_combine(a, b, case.bounds, stats, backend=backend), expected, tolerance)


def _buffers():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(10, generator=gen), torch.randn(10, generator=gen)


GOOD = [0, 4, 10]
STATS_ERRORS = [
    # (what, a, b, segments) -> error type, message fragment
    ("segments not from 0", None, None, [1, 4, 10], ValueError, "segments"),
    ("segments not to the end", None, None, [0, 4, 9], ValueError, "segments"),
    ("segments past the end", None, None, [0, 4, 11], ValueError, "segments"),
    ("decreasing segments", None, None, [0, 6, 4, 10], ValueError, "decrease"),
    ("no boundaries", None, None, [], ValueError, "segments"),
    ("a fractional boundary", None, None, [0, 4.5, 10], TypeError, "segments"),
    ("a shorter than b", torch.zeros(9), None, [0, 9], ValueError, "match"),
    ("a of another dtype", torch.zeros(10, dtype=torch.float64), None, GOOD, ValueError, "match"),
    ("integer a", torch.zeros(10, dtype=torch.int32), None, GOOD, TypeError, "a.dtype"),
    ("2-D b", None, torch.zeros(2, 5), GOOD, ValueError, "1-D"),
    ("strided b", None, torch.zeros(20)[::2], GOOD, ValueError, "contiguous"),
    ("sparse a", torch.zeros(10).to_sparse(), None, GOOD, TypeError, "dense"),
    ("a list for a", [0.0] * 10, None, GOOD, TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("what,a,b,segments,error,fragment", STATS_ERRORS,
                         ids=[e[0] for e in STATS_ERRORS])
def test_bad_buffers_or_segments_are_refused_by_both_kernels(backend, what, a, b, segments,
                                                             error, fragment):
    good_a, good_b = _buffers()
    a = good_a if a is None else a
    b = good_b if b is None else b
    with pytest.raises(error, match=fragment):
        adasum_stats(a, b, segments, backend=backend)
    with pytest.raises(error, match=fragment):
        adasum_combine(a, b, segments, torch.zeros(max(len(segments) - 1, 0), 3,
                                                   dtype=torch.float64), backend=backend)


COMBINE_ERRORS = [
    ("stats with a row too many", {"stats": torch.zeros(3, 3, dtype=torch.float64)}, "stats"),
    ("stats of 2 columns", {"stats": torch.zeros(2, 2, dtype=torch.float64)}, "stats"),
    ("float32 stats", {"stats": torch.zeros(2, 3)}, "stats"),
    ("stats as a list", {"stats": [[0.0] * 3] * 2}, "stats"),
    ("out of another dtype", {"out": torch.empty(10, dtype=torch.float64)}, "out"),
    ("out too short", {"out": torch.empty(9)}, "out"),
    ("out of another shape", {"out": torch.empty(2, 5)}, "out"),
    ("strided out", {"out": torch.empty(20)[::2]}, "out"),
]


@pytest.mark.parametrize("what,override,fragment", COMBINE_ERRORS,
                         ids=[e[0] for e in COMBINE_ERRORS])
def test_bad_stats_or_out_are_refused_by_combine(backend, what, override, fragment):
    a, b = _buffers()
    arguments = {"stats": adasum_stats(a, b, GOOD, backend=backend), "out": None}
    arguments.update(override)
    with pytest.raises((ValueError, TypeError), match=fragment):
        adasum_combine(a, b, GOOD, arguments["stats"], out=arguments["out"], backend=backend)


def test_chunk_functions_refuse_bad_input(backend):
    a, b = _buffers()
    with pytest.raises(ValueError, match="segments"):
        adasum_chunk_stats(a, b, [0, 4, 9], backend=backend)
    with pytest.raises(ValueError, match="match"):
        adasum_chunk_stats(a, b[:9], [0, 9], backend=backend)
    with pytest.raises(ValueError, match="partials"):
        adasum_reduce_chunks(torch.zeros(3, 3, dtype=torch.float64), [0, 4, 10], backend=backend)
    with pytest.raises(ValueError, match="partials"):
        adasum_reduce_chunks(torch.zeros(2, 3), [0, 4, 10], backend=backend)
    with pytest.raises(ValueError, match="decrease"):
        adasum_reduce_chunks(torch.zeros(2, 3, dtype=torch.float64), [0, 4, 3], backend=backend)
    with pytest.raises(TypeError, match="segments"):
        adasum_chunk_counts([0, 2.5])
