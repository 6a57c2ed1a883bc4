"""Compressed wire formats and the deterministic sum (``wire_dtype``,
``deterministic``, ``error_feedback``) on four gloo ranks: flat
(``local_size=1``) and as two nodes of two (``local_size=2``).

Values are checked against the float64 mean of every rank's gradients, with
a bound derived from each format: a blockwise code errs by at most half a
step of its block's scale (int8: ``absmax / 254``), e4m3 by ``2**-4`` of the
block's absmax (3 mantissa bits; subnormal steps are far below that), bf16
by ``2**-8``; the sum adds one such error per rank's term (or per node's
partial sum) and one more for the re-quantized sum sent back. Rank
functions never assert: they return what they saw.
"""
import pytest
import torch

from harness import record_collectives, run_ranks
from fusedreduce import DistributedGradReducer, kernels
from test_node_reduction import train

WORLD = 4
SHAPES = [(300, 7), (5,), (1029,), (2, 3, 4)]
#: per format, a code's error as a fraction of its block's absmax
UNIT = {torch.int8: 1 / 254, torch.float8_e4m3fn: 2.0 ** -4, torch.bfloat16: 2.0 ** -8,
        torch.float32: 0.0}


def _grads(rank, step=0):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) * (1 + i) for i, s in enumerate(SHAPES)]


def _params(dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype, requires_grad=True) for s in SHAPES]


def _reduce_twice(rank, cap_mb=25.0, **options):
    """Two calls on the same gradients: the second shows error feedback's
    residual (or, without it, that a call repeats its bits)."""
    reducer = DistributedGradReducer(_params(), bucket_cap_mb=cap_mb, **options)
    first = [g.clone() for g in reducer(_grads(rank))]
    second = [g.clone() for g in reducer(_grads(rank))]
    residuals = getattr(reducer._engine.collective, "residuals", {})
    return first, second, {k: r.abs().sum().item() for k, r in residuals.items()}


CASES = {
    "deterministic flat": dict(deterministic=True),
    "deterministic two-level": dict(deterministic=True, local_size=2),
    "deterministic flat, a bucket per tensor": dict(deterministic=True, cap_mb=1 / 2 ** 20),
    "deterministic two-level, small buckets": dict(deterministic=True, local_size=2,
                                                   cap_mb=0.004),
    "int8 flat": dict(wire_dtype=torch.int8),
    "int8 two-level": dict(wire_dtype=torch.int8, local_size=2),
    "e4m3 flat": dict(wire_dtype=torch.float8_e4m3fn),
    "e4m3 two-level": dict(wire_dtype=torch.float8_e4m3fn, local_size=2),
    "bf16 flat": dict(wire_dtype=torch.bfloat16),
    "bf16 two-level": dict(wire_dtype=torch.bfloat16, local_size=2),
    "int8 error feedback": dict(wire_dtype=torch.int8, error_feedback=True),
    "int8 two-level error feedback": dict(wire_dtype=torch.int8, local_size=2,
                                          error_feedback=True),
}


def _wire_ranks(rank, world_size):
    results = {name: _reduce_twice(rank, **options) for name, options in CASES.items()}
    # the all-gather back in fp32 instead of int8
    reducer = DistributedGradReducer(_params(), wire_dtype=torch.int8)
    reducer._engine.collective.gather_wire = False
    results["int8, fp32 gather"] = ([g.clone() for g in reducer(_grads(rank))], None, {})
    # a NaN on rank 1 only: seen on every rank, and its block is NaN
    checker = DistributedGradReducer(_params(), wire_dtype=torch.int8, check_finite=True)
    grads = _grads(rank)
    if rank == 1:
        grads[2][5] = float("nan")
    out = checker(grads)
    # the memory counted: the fp32 buffer, the int8 codes and the chunks
    # received, their fp32 block scales (both), error feedback's fp32 residual
    counted = DistributedGradReducer(_params(), wire_dtype=torch.int8, error_feedback=True)
    counted(_grads(rank))
    size = sum(b.size for b in counted.plan.buckets)
    results["bytes"] = (counted.buffer_bytes,
                        4 * size + 2 * size + 2 * 4 * size // kernels.WIRE_BLOCK + 4 * size)
    results["nan"] = (bool(checker.found_nonfinite), bool(out[2][5].isnan()),
                      int(out[2].isnan().sum()), bool(out[0].isnan().any()))
    results["kept views"] = _kept_views(rank)
    results["hooks and calls"] = _hooks_and_calls(rank)
    results["collectives per call"] = _collectives_per_call(rank)  # last: it patches dist
    return results


def _collectives_per_call(rank):
    """The collectives a steady-state call of an int8 reducer issues, flat
    and on two levels (``all_gather*``: whichever torch offers)."""
    reducers = {"flat": DistributedGradReducer(_params(), wire_dtype=torch.int8),
                "two-level": DistributedGradReducer(_params(), wire_dtype=torch.int8,
                                                    local_size=2)}
    for reducer in reducers.values():
        reducer(_grads(rank))
    events, seen = [], {}
    record_collectives(events)
    for name, reducer in reducers.items():
        events.clear()
        reducer(_grads(rank, 1))
        seen[name] = sorted("all_gather" if e.startswith("all_gather") else e for e in events)
    return seen


def _kept_views(rank):
    """Whether a bucket's level buffers are made once and kept from call to
    call, as views of its buffer, and made again for a buffer elsewhere."""
    reducer = DistributedGradReducer(_params(), wire_dtype=torch.int8, local_size=2)
    collective, bucket = reducer._engine.collective, reducer.plan.buckets[0]
    buffer = reducer._write_back.buffers_for_calls()[0]
    reducer(_grads(rank))
    first = collective.level_buffers(bucket, buffer)
    reducer(_grads(rank, 1))
    kept = collective.level_buffers(bucket, buffer) is first
    other = buffer.clone()
    moved = collective.level_buffers(bucket, other)
    return (kept, first[0].whole.data_ptr() == buffer.data_ptr(),
            moved[0].whole.data_ptr() == other.data_ptr())


def _hooks_and_calls(rank):
    """Backward with bucket views and the call path, by turns: two buffers
    per bucket (the views' and the calls'), the same inputs, so the same
    bits each time."""
    params = _params()
    reducer = DistributedGradReducer(params, wire_dtype=torch.int8, local_size=2)
    reducer.register_hooks(gradient_as_bucket_view=True)
    same = []
    for step in range(2):
        grads = _grads(rank, step)
        sum((p * g).sum() for p, g in zip(params, grads)).backward()
        hooked = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        called = reducer(grads)
        same.append(all(torch.equal(a, b) for a, b in zip(hooked, called)))
    return same


@pytest.fixture(scope="module")
def wire_ranks():
    return run_ranks(_wire_ranks, WORLD)


def _bound(wire, mean_of):
    """The bound on the mean's error (see the module): one code error per
    rank's term and one for the sum sent back, each at most the unit times
    its block's absmax, which is at most the largest magnitude of the
    bucket (a block spans tensors: its absmax may be a neighbour's); fp32
    rounding of the sum and of the scales' products on top."""
    eps = torch.finfo(torch.float32).eps
    terms = sum(max(float(t.abs().max()) for t in _grads(r)) for r in range(WORLD))
    total = max(float(m.abs().max()) for m in mean_of) * WORLD
    return (UNIT[wire] * (terms + total) + (WORLD + 2) * eps * terms) / WORLD


def _mean():
    per_rank = [_grads(r) for r in range(WORLD)]
    return [sum(g[i].double() for g in per_rank) / WORLD for i in range(len(SHAPES))]


@pytest.mark.parametrize("name", [n for n in CASES if "error feedback" not in n])
def test_wire_mean_is_within_the_formats_bound_of_the_float64_mean(wire_ranks, name):
    wire = CASES[name].get("wire_dtype", torch.float32)
    mean = _mean()
    for results in wire_ranks:
        got = results[name][0]
        for i, (g, e) in enumerate(zip(got, mean)):
            assert (g.double() - e).abs().max().item() <= _bound(wire, mean), \
                f"{name}: gradient {i}"


def test_int8_with_the_all_gather_in_fp32_is_within_the_bound_and_differs(wire_ranks):
    mean = _mean()
    for results in wire_ranks:
        got = results["int8, fp32 gather"][0]
        for g, e in zip(got, mean):
            assert (g.double() - e).abs().max().item() <= _bound(torch.int8, mean)
        assert not all(torch.equal(a, b) for a, b in zip(got, results["int8 flat"][0]))


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_holds_the_same_bits(wire_ranks, name):
    for results in wire_ranks:
        for call in (0, 1):
            assert all(torch.equal(a, b) for a, b in
                       zip(results[name][call], wire_ranks[0][name][call])), name


@pytest.mark.parametrize("name", [n for n in CASES if "error feedback" not in n])
def test_a_repeated_reduction_repeats_its_bits(wire_ranks, name):
    first, second, residuals = wire_ranks[0][name]
    assert not residuals
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_deterministic_sum_is_the_same_bits_flat_two_level_and_for_any_bucket_cap(wire_ranks):
    flat = wire_ranks[0]["deterministic flat"][0]
    for name in ("deterministic two-level", "deterministic flat, a bucket per tensor",
                 "deterministic two-level, small buckets"):
        assert all(torch.equal(a, b) for a, b in zip(flat, wire_ranks[0][name][0])), name


def test_error_feedback_keeps_a_residual_and_adds_it_to_the_next_step(wire_ranks):
    for name in ("int8 error feedback", "int8 two-level error feedback"):
        first, second, residuals = wire_ranks[0][name]
        assert residuals and all(r > 0 for r in residuals.values())
        # the first call has no residual yet: the plain int8 result
        plain = wire_ranks[0][name.replace(" error feedback", "").replace("int8", "int8 flat")
                              if "two-level" not in name else "int8 two-level"][0]
        assert all(torch.equal(a, b) for a, b in zip(first, plain))
        assert not all(torch.equal(a, b) for a, b in zip(first, second))
        # the two steps' errors partly cancel: their sum is closer to twice
        # the mean than twice one step's result
        mean = _mean()
        with_feedback = sum((f.double() + s.double() - 2 * e).abs().sum()
                            for f, s, e in zip(first, second, mean))
        without = sum((2 * f.double() - 2 * e).abs().sum() for f, e in zip(first, mean))
        assert with_feedback < without


def test_buffer_bytes_counts_the_wire_buffers_and_the_residual(wire_ranks):
    for results in wire_ranks:
        got, expected = results["bytes"]
        assert got == expected


def test_a_nan_on_one_rank_is_found_on_every_rank_and_poisons_its_block_only(wire_ranks):
    for found, element_nan, nans, other_tensor in (r["nan"] for r in wire_ranks):
        assert found and element_nan and not other_tensor
        assert 0 < nans <= kernels.WIRE_BLOCK  # its block's elements of that tensor


def test_a_buckets_level_buffers_are_made_once_and_follow_a_buffer_elsewhere(wire_ranks):
    for results in wire_ranks:
        assert results["kept views"] == (True, True, True)


def test_backward_with_bucket_views_and_calls_by_turns_give_the_same_bits(wire_ranks):
    for results in wire_ranks:
        assert results["hooks and calls"] == [True, True]


def test_each_level_is_one_all_to_all_and_one_all_gather_scales_and_codes_together(
        wire_ranks):
    # int8's block scales travel in the codes' collectives (each costs a latency)
    for results in wire_ranks:
        assert results["collectives per call"] == {
            "flat": ["all_gather", "all_to_all_single"],
            "two-level": ["all_gather"] * 2 + ["all_to_all_single"] * 2}


# ---------------------------------------------------------------- the optimizer
def test_optimizer_with_int8_wire_on_two_nodes_keeps_replicas_equal_with_or_without_views():
    options = dict(wire_dtype=torch.int8, local_size=2)
    plain = run_ranks(train, WORLD, dict(options, find_unused_parameters=True))
    views = run_ranks(train, WORLD, dict(options, gradient_as_bucket_view=True))
    first = plain[0]["params"]
    for got in plain:
        assert got["collective"] == "WireSum" and got["unused grads"] == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], first))
    for got in views:
        # the views' buffer holds what the flatten pass would quantize: the same bits
        assert all(torch.equal(a, b) for a, b in zip(got["params"], first))
