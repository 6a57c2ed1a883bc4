"""adasum_stats / adasum_combine: AdaSum's algebra, fusing, statistics and determinism.

Both backends, against the float64 reference of ``adasum_cases.py`` (where the
tolerance model and the reasons for it are): AdaSum's algebraic properties
within that budget; fused segments, repeated calls and an ``out`` aliasing an
input bit for bit; the statistics within their summation budget; and the norm
floor below which a coefficient is 1.

Device-aware: the buffers live on ``device_mode.DEVICE()`` (CUDA under
``pytest --device cuda``); the references are computed on CPU copies.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import device_mode
from adasum_cases import (EPS64, Case, assert_within, cases, kernel_adasum,
                          reference_adasum)
from device_mode import on_cpu
from fusedreduce.kernels import ADASUM_NORM_FLOOR, adasum_combine, adasum_stats
from reference import NORM_FLOOR
from reference import adasum_stats as reference_stats

pytestmark = pytest.mark.device_aware


# ---------------------------------------------------------------- algebra

@given(case=cases)
def test_adasum_matches_the_float64_reference(backend, case):
    a, b = case.randn(1), case.randn(2)
    out = kernel_adasum(a, b, case.bounds, backend)
    assert out.dtype == case.dtype and out.shape == a.shape
    expected, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, expected, tolerance, f"{case}")


@given(case=cases)
def test_adasum_of_a_gradient_with_itself_is_that_gradient(backend, case):
    g = case.randn(1)
    out = kernel_adasum(g, g.clone(), case.bounds, backend)
    _, tolerance = reference_adasum(g, g, case.bounds)
    assert_within(out, g.double(), tolerance, f"{case}")


@given(case=cases, data=st.data())
def test_adasum_of_orthogonal_gradients_is_their_sum(backend, case, data):
    # disjoint supports make a·b exactly 0 in every dtype, whatever the rounding
    gen = torch.Generator().manual_seed(case.seed)
    on_a = device_mode.to_device(
        torch.rand(case.size, generator=gen) < data.draw(st.floats(0.0, 1.0), label="share"))
    zero = torch.zeros((), dtype=case.dtype, device=on_a.device)
    a = torch.where(on_a, case.randn(1), zero)
    b = torch.where(on_a, zero, case.randn(2))
    out = kernel_adasum(a, b, case.bounds, backend)
    _, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, a.double() + b.double(), tolerance, f"{case}")


magnitudes = st.floats(0.25, 4.0).flatmap(lambda m: st.sampled_from([m, -m]))


@given(case=cases, alpha=magnitudes, beta=magnitudes)
def test_adasum_of_parallel_gradients_is_their_average(backend, case, alpha, beta):
    v = on_cpu(case.randn(1, scale=1.0)).double()
    a, b = (device_mode.to_device((k * v).to(case.dtype)) for k in (alpha, beta))
    out = kernel_adasum(a, b, case.bounds, backend)
    _, tolerance = reference_adasum(a, b, case.bounds)
    # a and b are αv and βv rounded to the buffer's dtype, so not exactly
    # parallel: each rounding (eps_d/2 relative) reaches the result directly
    # and through the coefficients, where it is scaled by at most |β/α| (|α/β|)
    # and multiplied back by |α| (|β|): 4·eps_d·(|α| + |β|)·|v| covers both.
    eps_d = torch.finfo(case.dtype).eps
    tolerance = tolerance + 4 * eps_d * (abs(alpha) + abs(beta)) * v.abs()
    assert_within(out, (alpha + beta) / 2 * v, tolerance, f"{case} α={alpha} β={beta}")


@given(case=cases)
def test_adasum_of_a_gradient_and_its_negation_is_zero(backend, case):
    g = case.randn(1)
    out = kernel_adasum(g, -g, case.bounds, backend)
    _, tolerance = reference_adasum(g, -g, case.bounds)
    assert_within(out, torch.zeros(case.size, dtype=torch.float64), tolerance, f"{case}")


@given(case=cases, data=st.data())
def test_adasum_with_a_zero_gradient_is_the_other_gradient_exactly(backend, case, data):
    # ‖0‖² is below the floor, so 0's coefficient is 1, and a·0 = 0 makes the
    # other's 1 too: g + 0 = g with no rounding at all. Each segment has its
    # zero on a side of its own, so one call checks both sides.
    zero_on_left = data.draw(st.lists(st.booleans(), min_size=len(case.lengths),
                                      max_size=len(case.lengths)), label="zero on the left")
    g = case.randn(1)
    left, right = g.clone(), g.clone()
    for (lo, hi), on_left in zip(case.segments(), zero_on_left):
        (left if on_left else right)[lo:hi] = 0
    assert torch.equal(kernel_adasum(left, right, case.bounds, backend), g)


@given(case=cases)
def test_adasum_is_symmetric(backend, case):
    a, b = case.randn(1), case.randn(2)
    ab = kernel_adasum(a, b, case.bounds, backend)
    ba = kernel_adasum(b, a, case.bounds, backend)
    # both sides round the same values; bitwise on CPUs, but a contracted
    # ca·x + cb·y (an FMA on GPUs) rounds the two orders differently
    _, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(ab, ba.double(), 2 * tolerance, f"{case}")


@given(case=cases, exponent=st.integers(-6, 6), negative=st.booleans())
def test_adasum_is_equivariant_to_scaling_both_gradients(backend, case, exponent, negative):
    # multiples of 1/16 in [-4, 4] are exact in every dtype, and so is their
    # product by k = ±2^e: AdaSum(ka, kb) has exactly the inputs it claims
    def dyadic(salt):
        gen = torch.Generator().manual_seed(case.seed * 31 + salt)
        return device_mode.to_device(
            (torch.randint(-64, 65, (case.size,), generator=gen) / 16).to(case.dtype))

    a, b = dyadic(1), dyadic(2)
    k = (-1.0 if negative else 1.0) * 2.0 ** exponent
    scaled = kernel_adasum(a * k, b * k, case.bounds, backend)
    plain = kernel_adasum(a, b, case.bounds, backend)
    _, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(scaled, k * plain.double(), 2 * abs(k) * tolerance, f"{case} k={k}")


# ---------------------------------------------------------------- fusing, stats, determinism

@given(case=cases)
def test_fused_segments_give_bitwise_the_results_of_one_segment_at_a_time(backend, case):
    a, b = case.randn(1), case.randn(2)
    stats = adasum_stats(a, b, case.bounds, backend=backend)
    fused = adasum_combine(a, b, case.bounds, stats, backend=backend)
    for i, (lo, hi) in enumerate(case.segments()):
        alone = adasum_stats(a[lo:hi], b[lo:hi], [0, hi - lo], backend=backend)
        assert torch.equal(alone[0], stats[i]), f"segment {i} stats"
        out = adasum_combine(a[lo:hi], b[lo:hi], [0, hi - lo], alone, backend=backend)
        assert torch.equal(out, fused[lo:hi]), f"segment {i} result"


@given(case=cases)
def test_stats_match_the_float64_reference(backend, case):
    a, b = case.randn(1), case.randn(2)
    stats = adasum_stats(a, b, case.bounds, backend=backend)
    assert stats.dtype == torch.float64 and stats.shape == (len(case.lengths), 3)
    expected = reference_stats(on_cpu(a), on_cpu(b), case.bounds)
    x, y = on_cpu(a).double(), on_cpu(b).double()
    for i, (lo, hi) in enumerate(case.segments()):
        budget = (hi - lo + 1) * EPS64
        sums = [(x[lo:hi] * y[lo:hi]).abs().sum(), (x[lo:hi] ** 2).sum(), (y[lo:hi] ** 2).sum()]
        for j, name in enumerate(("a·b", "‖a‖²", "‖b‖²")):
            assert abs(stats[i, j].item() - expected[i, j].item()) <= budget * float(sums[j]), \
                f"segment {i} {name}: {stats[i, j].item()!r} vs {expected[i, j].item()!r}"


def test_stats_of_a_segment_of_more_than_256_blocks_add_every_block(backend):
    # Triton's finishing kernel walks a segment's block sums 256 at a time
    n = 257 * 1024 + 77
    gen = torch.Generator().manual_seed(5)
    a, b = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    bounds = [0, 3, n - 5, n]
    stats = adasum_stats(device_mode.to_device(a), device_mode.to_device(b), bounds,
                         backend=backend)
    expected = reference_stats(a, b, bounds)
    # positive data: Σ|xy| is the statistic itself, so the bound is relative
    assert torch.allclose(on_cpu(stats), expected, rtol=(n + 1) * EPS64, atol=0)


# the same arithmetic twice: a few examples prove it as well as many
@settings(max_examples=10)
@given(case=cases)
def test_the_same_call_twice_gives_bitwise_the_same_result(backend, case):
    a, b = case.randn(1), case.randn(2)
    first, second = (adasum_stats(a, b, case.bounds, backend=backend) for _ in range(2))
    assert torch.equal(first, second)
    out1, out2 = (adasum_combine(a, b, case.bounds, first, backend=backend) for _ in range(2))
    assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8))


@pytest.mark.parametrize("into", ["a", "b"])
def test_combine_may_write_over_either_input(backend, into):
    case = Case((5, 0, 1500, 3), torch.bfloat16, 3)
    a, b = case.randn(1), case.randn(2)
    expected = kernel_adasum(a, b, case.bounds, backend)
    target = a if into == "a" else b
    returned = kernel_adasum(a, b, case.bounds, backend, out=target)
    assert returned is target
    assert torch.equal(target, expected)


def test_the_norm_floor_is_the_square_root_of_the_smallest_normal_float64():
    assert ADASUM_NORM_FLOOR == NORM_FLOOR


def test_a_squared_norm_below_the_floor_gets_a_coefficient_of_one(backend):
    # sqrt(floor) ≈ 1.2e-77: g² is below the floor, so AdaSum(g, g) = 2g, not g;
    # twice as large a value is above it and gets the ordinary g
    below = torch.tensor([1e-78, -2e-78], dtype=torch.float64, device=device_mode.DEVICE())
    above = torch.tensor([1e-76, -2e-76], dtype=torch.float64, device=device_mode.DEVICE())
    assert torch.equal(kernel_adasum(below, below.clone(), [0, 2], backend), 2 * below)
    assert torch.equal(kernel_adasum(above, above.clone(), [0, 2], backend), above)
