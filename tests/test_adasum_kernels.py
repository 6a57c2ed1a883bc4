"""adasum_stats / adasum_combine: AdaSum's algebra and numerics, both backends.

For two gradients of one tensor, AdaSum(a, b) = ca·a + cb·b with
ca = 1 - a·b/(2‖a‖²), cb = 1 - a·b/(2‖b‖²), a coefficient being 1 where its
squared norm is below sqrt(float64 tiny). Each segment of a flat buffer is
one tensor, with coefficients of its own.

Buffers are described by small cases (segment lengths, dtype, seed) and built
inside the test, so Hypothesis shrinks lengths and counts, not thousands of
values. The Triton backend runs under its interpreter (``conftest.py``), one
numpy program per 1024-element block: sizes stay at a few thousand elements.

How results are compared, and why:

- the reference is float64 with exactly rounded sums (``math.fsum``);
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
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fusedreduce.kernels import (ADASUM_CHUNK, ADASUM_FP32_LIMIT, ADASUM_NORM_FLOOR,
                                 adasum_chunk_counts, adasum_chunk_stats, adasum_combine,
                                 adasum_reduce_chunks, adasum_stats)
from reference import round_to

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
EPS64 = torch.finfo(torch.float64).eps
# the spec's floor, written out here rather than read from the library
NORM_FLOOR = math.sqrt(sys.float_info.min)
F32 = torch.finfo(torch.float32)
SQRT_F32_MAX = math.sqrt(F32.max)
# elements per example: interpreted Triton runs each 1024-element block as one numpy
# program (tens of ms on a loaded machine), and each segment costs one more program
BUDGET = 2_600


# ---------------------------------------------------------------- cases

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
        gen = torch.Generator().manual_seed(self.seed * 7919 + salt)
        return (torch.randn(self.size, generator=gen, dtype=torch.float64) * scale).to(self.dtype)

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


def _adasum(a, b, bounds, backend, out=None):
    stats = adasum_stats(a, b, bounds, backend=backend)
    return adasum_combine(a, b, bounds, stats, out=out, backend=backend)


# ---------------------------------------------------------------- float64 reference

def reference_stats(a, b, bounds) -> torch.Tensor:
    """Per segment (a·b, ‖a‖², ‖b‖²), each an exactly rounded sum of float64 products."""
    x, y = a.double().tolist(), b.double().tolist()
    rows = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        xs, ys = x[lo:hi], y[lo:hi]
        rows.append([math.fsum(p * q for p, q in zip(xs, ys)), math.fsum(p * p for p in xs),
                     math.fsum(q * q for q in ys)])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def _coefficient(dot: float, norm2: float) -> float:
    return 1.0 if norm2 < NORM_FLOOR else 1.0 - dot / (2.0 * norm2)


def _per_element(values, bounds) -> torch.Tensor:
    """One float64 value per segment, repeated over the segment's elements."""
    lengths = torch.tensor([hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])])
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float64), lengths)


def reference_adasum(a, b, bounds):
    """(AdaSum(a, b) in float64, the tolerance of each element of a kernel's result)."""
    stats = reference_stats(a, b, bounds).tolist()
    ca = _per_element([_coefficient(d, na) for d, na, _ in stats], bounds)
    cb = _per_element([_coefficient(d, nb) for d, _, nb in stats], bounds)
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
    assert actual.dtype in DTYPES
    error = (actual.double() - expected).abs()
    bad = ~(error <= tolerance)  # NaN counts as bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off; first at {i}: got "
            f"{actual[i].item()!r}, want {expected[i].item()!r} +- {tolerance[i].item():.3g}")


# ---------------------------------------------------------------- algebra

@given(case=cases)
def test_adasum_matches_the_float64_reference(backend, case):
    a, b = case.randn(1), case.randn(2)
    out = _adasum(a, b, case.bounds, backend)
    assert out.dtype == case.dtype and out.shape == a.shape
    expected, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, expected, tolerance, f"{case}")


@given(case=cases)
def test_adasum_of_a_gradient_with_itself_is_that_gradient(backend, case):
    g = case.randn(1)
    out = _adasum(g, g.clone(), case.bounds, backend)
    _, tolerance = reference_adasum(g, g, case.bounds)
    assert_within(out, g.double(), tolerance, f"{case}")


@given(case=cases, data=st.data())
def test_adasum_of_orthogonal_gradients_is_their_sum(backend, case, data):
    # disjoint supports make a·b exactly 0 in every dtype, whatever the rounding
    gen = torch.Generator().manual_seed(case.seed)
    on_a = torch.rand(case.size, generator=gen) < data.draw(st.floats(0.0, 1.0), label="share")
    a = torch.where(on_a, case.randn(1), torch.zeros((), dtype=case.dtype))
    b = torch.where(on_a, torch.zeros((), dtype=case.dtype), case.randn(2))
    out = _adasum(a, b, case.bounds, backend)
    _, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, a.double() + b.double(), tolerance, f"{case}")


magnitudes = st.floats(0.25, 4.0).flatmap(lambda m: st.sampled_from([m, -m]))


@given(case=cases, alpha=magnitudes, beta=magnitudes)
def test_adasum_of_parallel_gradients_is_their_average(backend, case, alpha, beta):
    v = case.randn(1, scale=1.0).double()
    a, b = (alpha * v).to(case.dtype), (beta * v).to(case.dtype)
    out = _adasum(a, b, case.bounds, backend)
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
    out = _adasum(g, -g, case.bounds, backend)
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
    assert torch.equal(_adasum(left, right, case.bounds, backend), g)


@given(case=cases)
def test_adasum_is_symmetric(backend, case):
    a, b = case.randn(1), case.randn(2)
    ab = _adasum(a, b, case.bounds, backend)
    ba = _adasum(b, a, case.bounds, backend)
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
        return (torch.randint(-64, 65, (case.size,), generator=gen) / 16).to(case.dtype)

    a, b = dyadic(1), dyadic(2)
    k = (-1.0 if negative else 1.0) * 2.0 ** exponent
    scaled = _adasum(a * k, b * k, case.bounds, backend)
    plain = _adasum(a, b, case.bounds, backend)
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
    expected = reference_stats(a, b, case.bounds)
    x, y = a.double(), b.double()
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
    stats = adasum_stats(a, b, bounds, backend=backend)
    expected = reference_stats(a, b, bounds)
    # positive data: Σ|xy| is the statistic itself, so the bound is relative
    assert torch.allclose(stats, expected, rtol=(n + 1) * EPS64, atol=0)


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
    expected = _adasum(a, b, case.bounds, backend)
    target = a if into == "a" else b
    returned = _adasum(a, b, case.bounds, backend, out=target)
    assert returned is target
    assert torch.equal(target, expected)


def test_the_norm_floor_is_the_square_root_of_the_smallest_normal_float64():
    assert ADASUM_NORM_FLOOR == NORM_FLOOR


def test_a_squared_norm_below_the_floor_gets_a_coefficient_of_one(backend):
    # sqrt(floor) ≈ 1.2e-77: g² is below the floor, so AdaSum(g, g) = 2g, not g;
    # twice as large a value is above it and gets the ordinary g
    below = torch.tensor([1e-78, -2e-78], dtype=torch.float64)
    above = torch.tensor([1e-76, -2e-76], dtype=torch.float64)
    assert torch.equal(_adasum(below, below.clone(), [0, 2], backend), 2 * below)
    assert torch.equal(_adasum(above, above.clone(), [0, 2], backend), above)


# ---------------------------------------------------------------- chunks: the canonical statistics
#
# A segment's statistics are its chunk partials (ADASUM_CHUNK elements from
# the segment's start) added in chunk order. These properties are what lets
# the halving tree cut a tensor between ranks at chunk boundaries and still
# get bitwise the statistics of the whole tensor, whatever the bucket layout.
# Segments here reach two chunks and a bit; the Triton interpreter runs each
# 1024 elements of a chunk as one numpy step.

CHUNK = ADASUM_CHUNK


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float64 values as their bit patterns: -0.0 differs from 0.0."""
    return t.contiguous().view(torch.int64)


def _values(n, dtype, seed, salt):
    gen = torch.Generator().manual_seed(seed * 7919 + salt)
    return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)


# lengths on either side of one and two chunk boundaries, and short ones
chunked_lengths = st.one_of(st.integers(0, 3000), st.integers(CHUNK - 40, CHUNK + 40),
                            st.integers(2 * CHUNK - 40, 2 * CHUNK + 1500))


@given(n=chunked_lengths, before=st.lists(st.integers(0, 40), max_size=3),
       after=st.integers(0, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 20))
def test_the_stats_of_a_segment_do_not_depend_on_where_it_sits(backend, n, before, after,
                                                                 dtype, seed):
    # the same values alone in their own buffers, and shifted behind other
    # segments (every alignment) with more after them
    a, b = _values(n, dtype, seed, 1), _values(n, dtype, seed, 2)
    alone = adasum_stats(a, b, [0, n], backend=backend)
    lead = sum(before)
    total = lead + n + after
    big_a, big_b = _values(total, dtype, seed, 3), _values(total, dtype, seed, 4)
    big_a[lead:lead + n], big_b[lead:lead + n] = a, b
    bounds = [0]
    for length in before:
        bounds.append(bounds[-1] + length)
    bounds += [lead + n, total]
    placed = adasum_stats(big_a, big_b, bounds, backend=backend)
    assert torch.equal(_bits(placed[len(before)]), _bits(alone[0])), (n, before, dtype)


@given(n=st.integers(CHUNK + 1, 2 * CHUNK + 1500), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2 ** 20), data=st.data())
def test_chunk_partials_of_pieces_cut_at_chunk_boundaries_add_up_to_the_stats(backend, n,
                                                                               dtype, seed,
                                                                               data):
    a, b = _values(n, dtype, seed, 1), _values(n, dtype, seed, 2)
    whole = adasum_stats(a, b, [0, n], backend=backend)
    rows = adasum_chunk_stats(a, b, [0, n], backend=backend)
    assert rows.shape == (adasum_chunk_counts([0, n])[0], 3) == (-(-n // CHUNK), 3)
    # the pieces on either side of a chunk boundary, each in buffers of its own
    k = data.draw(st.integers(1, rows.shape[0] - 1), label="chunks in the first piece")
    cut = k * CHUNK
    first = adasum_chunk_stats(a[:cut].clone(), b[:cut].clone(), [0, cut], backend=backend)
    second = adasum_chunk_stats(a[cut:].clone(), b[cut:].clone(), [0, n - cut],
                                backend=backend)
    assert torch.equal(_bits(torch.cat([first, second])), _bits(rows))
    # as two ranks of the tree: each fills its own rows of an array of -0.0,
    # the arrays are summed, and the sum reduced in chunk order
    mine, theirs = (torch.full((rows.shape[0], 3), -0.0, dtype=torch.float64) for _ in "ab")
    mine[:k], theirs[k:] = first, second
    summed = adasum_reduce_chunks(mine + theirs, [0, n], backend=backend)
    assert torch.equal(_bits(summed), _bits(whole))
    assert torch.equal(_bits(adasum_reduce_chunks(rows, [0, n], backend=backend)), _bits(whole))
    # and the statistics are still accurate (the budget of test_stats_match_...)
    expected = reference_stats(a, b, [0, n])[0]
    x, y = a.double(), b.double()
    for j, total in enumerate([(x * y).abs().sum(), (x * x).sum(), (y * y).sum()]):
        assert abs(whole[0, j].item() - expected[j].item()) <= (n + 1) * EPS64 * float(total)


def test_chunk_sums_are_added_one_after_the_other_in_chunk_order(backend):
    # 1 + 2^-53 rounds to 1 (ties to even), so 1 then three 2^-53 one at a time
    # stays 1, while any other association (pairwise, or from the back) sees
    # 2^-53 + 2^-53 = 2^-52 and leaves 1: the first column shows the order
    tiny = 2.0 ** -53
    rows = [[1.0, tiny, 0.0], [tiny, tiny, 5.0], [tiny, tiny, -0.0], [tiny, 1.0, 2.0]]
    partials = torch.tensor(rows + [[-0.0, -0.0, -0.0], [3.0, 4.0, 5.0]], dtype=torch.float64)
    bounds = [0, 4 * CHUNK, 4 * CHUNK, 5 * CHUNK - 7, 6 * CHUNK - 7]
    got = adasum_reduce_chunks(partials, bounds, backend=backend)
    in_order = [((r0 + r1) + r2) + r3 for r0, r1, r2, r3 in zip(*rows)]
    assert got[0].tolist() == in_order
    assert in_order[0] == 1.0 != (1.0 + tiny) + (tiny + tiny)
    # an empty segment gives +0.0; a single chunk, its partial as it is (-0.0 too)
    assert torch.equal(_bits(got[1:]), _bits(torch.tensor(
        [[0.0] * 3, [-0.0] * 3, [3.0, 4.0, 5.0]], dtype=torch.float64)))


def test_torch_stats_do_not_depend_on_the_thread_count():
    # the fallback's chunk partials are batched Gram products (whole chunks)
    # and row sums (short ones): the thread count must not move a bit
    n = 5 * CHUNK + 333
    a, b = _values(n, torch.float32, 7, 1), _values(n, torch.float32, 7, 2)
    bounds = [0, 17, 2 * CHUNK + 5, 2 * CHUNK + 5, n]
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            results.append(_bits(adasum_chunk_stats(a, b, bounds, backend="torch")))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_torch_whole_chunk_partials_do_not_depend_on_batch_slot_or_alignment(dtype):
    # the fallback takes whole chunks through batched fp64 Gram products in
    # fixed scratch: a chunk must give the same bits in every slot of a batch,
    # behind any number of other chunks, from any source alignment
    from fusedreduce.kernels.adasum import torch_backend
    ours_a, ours_b = _values(3 * CHUNK, dtype, 11, 1), _values(3 * CHUNK, dtype, 11, 2)
    alone = adasum_chunk_stats(ours_a, ours_b, [0, 3 * CHUNK], backend="torch")
    for lead_chunks in range(torch_backend.GRAM_BATCH + 2):
        for odd in (0, 1, 3):
            lead = lead_chunks * CHUNK + odd
            a = torch.cat([_values(lead, dtype, lead, 3), ours_a])
            b = torch.cat([_values(lead, dtype, lead, 4), ours_b])
            bounds = [0, lead_chunks * CHUNK, lead, lead + 3 * CHUNK]
            rows = adasum_chunk_stats(a, b, bounds, backend="torch")
            first = lead_chunks + (1 if odd else 0)
            assert torch.equal(_bits(rows[first:]), _bits(alone)), (lead_chunks, odd)
    # the Gram product's three entries are the exact statistics' near neighbours
    expected = reference_stats(ours_a[:CHUNK], ours_b[:CHUNK], [0, CHUNK])[0]
    x, y = ours_a[:CHUNK].double(), ours_b[:CHUNK].double()
    for j, total in enumerate([(x * y).abs().sum(), (x * x).sum(), (y * y).sum()]):
        assert abs(alone[0, j].item() - expected[j].item()) <= CHUNK * EPS64 * float(total)


def test_triton_launch_tables_are_kept_per_layout_and_stay_right():
    # the Triton launchers keep a bucket layout's tables; a caller's list may
    # change afterwards, and a full cache evicts, without a wrong table
    pytest.importorskip("triton")
    from fusedreduce.kernels.adasum import triton_backend as triton_adasum
    segments = [0, 3, 3, 2 * CHUNK + 1]
    first, programs = triton_adasum.segment_table(segments, torch.device("cpu"), CHUNK)
    segments[-1] = 5  # the kept table belongs to the old values
    again, _ = triton_adasum.segment_table([0, 3, 3, 2 * CHUNK + 1], torch.device("cpu"),
                                               CHUNK)
    assert again is first and programs == 3
    assert first.tolist() == [0, 3, 3, 3, 0, 2 * CHUNK - 2, 0, 2 << 32, (2 << 32) | 1]
    changed, programs = triton_adasum.segment_table(segments, torch.device("cpu"), CHUNK)
    assert changed.tolist() == [0, 3, 3, 3, 0, 2, 0, 2 << 32] and programs == 2
    a, b = _values(2 * CHUNK + 1, torch.float32, 5, 1), _values(2 * CHUNK + 1, torch.float32, 5, 2)
    bounds = [0, 3, 3, 2 * CHUNK + 1]
    kept = adasum_stats(a, b, bounds, backend="triton")
    for extra in range(triton_adasum.TABLES_KEPT + 1):  # evict it
        triton_adasum.segment_table([0, extra + 1], torch.device("cpu"), CHUNK)
    assert triton_adasum.segment_table(bounds, torch.device("cpu"), CHUNK)[0] is not first
    assert torch.equal(adasum_stats(a, b, bounds, backend="triton"), kept)


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
    out = _adasum(a, b, case.bounds, backend)
    assert bool(torch.isfinite(out).all())
    expected, tolerance = reference_adasum(a, b, case.bounds)
    assert_within(out, expected, tolerance, f"{regime} {case}")


def test_float32_adasum_of_a_tiny_and_a_sqrt_max_gradient_is_their_average(backend):
    v = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    a, b = (F32.tiny * v).float(), (SQRT_F32_MAX / 4 * v).float()
    out = _adasum(a, b, [0, 4], backend)
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
