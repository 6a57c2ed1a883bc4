"""The sharded layout and pipelines: BucketPlan(shards=n), part_ranges,
reduce_scatter_plan and all_gather_plan, against a float64 reference.

The layout is checked as a property over random tensor lists (no ranks
needed); the pipelines on 1-4 local gloo ranks, each hypothesis example one
launch that runs a batch of random cases (0-element, 1-element and odd sizes,
non-contiguous inputs, all four float dtypes, random scales, bucket caps that
cut tensors into several buckets).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedreduce import (BucketPlan, all_gather_plan, all_reduce_plan, communication_dtype,
                         part_ranges, reduce_scatter_plan)
from fusedreduce.kernels import ALIGN_BYTES
from harness import (ONE_BYTE_MB, assert_raised_before_any_collective, outcomes_and_collectives,
                     run_ranks)

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIZES = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 8, 33, 257]), st.integers(0, 3000))


@st.composite
def tensor_lists(draw, max_tensors=12):
    """(shape, dtype, transposed) per tensor: transposed ones are built as the
    transpose of a (cols, rows) tensor, so they are not contiguous."""
    n = draw(st.integers(1, max_tensors))
    specs = []
    for _ in range(n):
        if draw(st.booleans()):
            rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
            specs.append(((rows, cols), draw(st.sampled_from(DTYPES)), draw(st.booleans())))
        else:
            specs.append(((draw(SIZES),), draw(st.sampled_from(DTYPES)), False))
    return specs


def _build(specs, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for shape, dtype, transposed in specs:
        if transposed:
            t = torch.randn(shape[::-1], generator=gen, dtype=torch.float64).to(dtype).t()
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        tensors.append(t)
    return tensors


def _plan(tensors, cap_mb, shards):
    return BucketPlan(tensors, bucket_cap_mb=cap_mb, shards=shards,
                      comm_dtype=lambda d: communication_dtype(d))


# ------------------------------------------------------------------ the layout

@settings(max_examples=60, deadline=None)
@given(specs=tensor_lists(), shards=st.integers(1, 8),
       cap_mb=st.sampled_from([ONE_BYTE_MB, 0.004, 25.0]))
def test_a_sharded_bucket_is_padded_at_its_end_only_into_equal_aligned_parts(specs, shards,
                                                                            cap_mb):
    tensors = _build(specs, 0)
    plain, sharded = _plan(tensors, cap_mb, 1), _plan(tensors, cap_mb, shards)
    assert len(plain.buckets) == len(sharded.buckets)
    for a, b in zip(plain.buckets, sharded.buckets):
        align = ALIGN_BYTES // b.dtype.itemsize
        # the same segments; only the end moves, by less than one stride
        assert (a.tensor_indices, a.offsets, a.numels) == (b.tensor_indices, b.offsets, b.numels)
        assert b.size % (shards * align) == 0 and 0 <= b.size - a.size < shards * align
        assert b.part_size * shards == b.size and b.part_size % align == 0
        # every element of every tensor is in exactly one part, in order
        covered = {i: [] for i in b.tensor_indices}
        for part in range(shards):
            for r in part_ranges(b, part):
                # where the part says it is, the bucket has that tensor's element
                position = part * b.part_size + r.offset
                slot = b.tensor_indices.index(r.tensor)
                assert position == b.offsets[slot] + r.start
                assert 0 <= r.offset and r.offset + r.numel <= b.part_size
                covered[r.tensor].append((r.start, r.end))
        for i, numel in zip(b.tensor_indices, b.numels):
            spans = sorted(covered[i])
            assert sum(e - s for s, e in spans) == numel
            assert all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1))


def test_part_ranges_refuses_a_part_the_bucket_does_not_have():
    bucket = BucketPlan([torch.zeros(10)], shards=2).buckets[0]
    for part in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match="is not a part of a bucket in 2 parts"):
            part_ranges(bucket, part)


def test_shards_must_be_a_positive_int():
    for shards in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="shards must be a positive int"):
            BucketPlan([torch.zeros(3)], shards=shards)


# --------------------------------------------------------------- the pipelines

def _scatter_and_gather(rank, world_size, cases):
    """Per case: this rank's inputs untouched?, its parts, the all-gathered
    outputs, and (for comparison) all_reduce_plan's flat buffers."""
    seen = []
    for specs, cap_mb, prescale, postscale in cases:
        tensors = _build(specs, 1000 + rank)
        before = [t.clone() for t in tensors]
        plan = _plan(tensors, cap_mb, world_size)
        parts = reduce_scatter_plan(plan, tensors, prescale=prescale, postscale=postscale)
        untouched = all(torch.equal(a, b) for a, b in zip(before, tensors))
        outputs = [torch.full_like(t, float("nan")) for t in tensors]
        all_gather_plan(plan, parts, outputs)
        flats = all_reduce_plan(plan, [t.clone() for t in tensors], prescale=prescale)
        seen.append((untouched, [p.clone() for p in parts], outputs, flats))
    return seen


def _bound(inputs, i, dtype, prescale, postscale, world_size):
    """The float64 reference of tensor ``i`` and its error bound: the
    communication dtype rounds the prescaled inputs once, each of the
    world_size - 1 additions once and the postscale once (|sum| <= sum |x|)."""
    reference = sum(x[i].double() for x in inputs) * prescale * postscale
    magnitude = sum(x[i].double().abs() for x in inputs) * abs(prescale * postscale)
    comm = communication_dtype(dtype)
    return reference, (world_size + 2) * torch.finfo(comm).eps * magnitude


def _judge(results, world_size, cases):
    for c, (specs, cap_mb, prescale, postscale) in enumerate(cases):
        inputs = [_build(specs, 1000 + r) for r in range(world_size)]
        plan = _plan(inputs[0], cap_mb, world_size)
        bounds = [_bound(inputs, i, dtype, prescale, postscale, world_size)
                  for i, (_, dtype, _) in enumerate(specs)]
        for rank in range(world_size):
            untouched, parts, outputs, flats = results[rank][c]
            assert untouched, f"case {c}: rank {rank}'s inputs were modified"
            for i, got in enumerate(outputs):
                # the all-gather gives every rank the same bits
                assert torch.equal(got, results[0][c][2][i]), f"case {c}, rank {rank}, tensor {i}"
            for bucket, part in zip(plan.buckets, parts):
                whole = flats[bucket.index][:bucket.size]
                mine = whole[rank * bucket.part_size:(rank + 1) * bucket.part_size]
                # the padding is summed zeros; at 2 ranks a sum has one order,
                # so the part is the all-reduced buffer's slice, bitwise
                if world_size <= 2:
                    assert torch.equal(part, mine * postscale), f"case {c}, bucket {bucket.index}"
                # each range of the part holds the sum of those tensor elements
                for r in part_ranges(bucket, rank):
                    reference, bound = bounds[r.tensor]
                    want = reference.reshape(-1)[r.start:r.end]
                    got = part[r.offset:r.offset + r.numel].double()
                    assert torch.all((got - want).abs() <= bound.reshape(-1)[r.start:r.end]
                                     + torch.finfo(part.dtype).tiny), f"case {c}, {r}"
        for i, (shape, dtype, _) in enumerate(specs):
            reference, bound = bounds[i]
            got = results[0][c][2][i].double()
            # the all-gather copies; the unflatten rounds once more, to the
            # tensor's own dtype
            bound = bound + torch.finfo(dtype).eps * reference.abs() + torch.finfo(dtype).tiny
            assert torch.all((got - reference).abs() <= bound), f"case {c}, tensor {i} ({dtype})"


CASE = st.tuples(tensor_lists(), st.sampled_from([ONE_BYTE_MB, 0.004, 25.0]),
                 st.sampled_from([1.0, 0.5, 0.25, 3.0]),
                 st.sampled_from([1.0, 0.5, 1 / 3, 2.0]))


@settings(max_examples=3, deadline=None)
@given(cases=st.lists(CASE, min_size=4, max_size=6), world_size=st.sampled_from([2, 3, 4]))
def test_reduce_scatter_then_all_gather_is_the_sum_on_every_rank(cases, world_size):
    results = run_ranks(_scatter_and_gather, world_size, cases)
    _judge(results, world_size, cases)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fixed_cases_on_one_and_two_ranks(world_size):
    cases = [([((3, 5), torch.float16, False), ((0,), torch.float32, False),
               ((1,), torch.bfloat16, False), ((257,), torch.float32, False),
               ((4, 7), torch.float64, True)], 25.0, 1.0, 1 / world_size),
             ([((1000,), torch.float32, False), ((9,), torch.float16, False)], ONE_BYTE_MB,
              0.5, 2.0)]
    results = run_ranks(_scatter_and_gather, world_size, cases)
    _judge(results, world_size, cases)


# ------------------------------------------------------------------ bad input

def _bad_calls(rank, world_size):
    tensors = [torch.ones(5), torch.ones(3, dtype=torch.float16)]
    plan = BucketPlan(tensors, shards=world_size)
    unsharded = BucketPlan(tensors)
    parts = [torch.zeros(b.part_size, dtype=b.dtype) for b in plan.buckets]
    outputs = [torch.zeros_like(t) for t in tensors]
    before = [t.clone() for t in outputs]
    cases = {
        "unsharded plan": lambda: reduce_scatter_plan(unsharded, tensors),
        "not a plan": lambda: reduce_scatter_plan([tensors], tensors),
        "missing tensor": lambda: reduce_scatter_plan(plan, tensors[:1]),
        "nan prescale": lambda: reduce_scatter_plan(plan, tensors, prescale=float("nan")),
        "short part": lambda: reduce_scatter_plan(plan, tensors, parts=[p[:-1] for p in parts]),
        "gather: unsharded plan": lambda: all_gather_plan(unsharded, parts, outputs),
        "gather: part of another dtype": lambda: all_gather_plan(
            plan, [p.double() for p in parts], outputs),
        "gather: wrong output": lambda: all_gather_plan(plan, parts, outputs[::-1]),
        "gather: inf scale": lambda: all_gather_plan(plan, parts, outputs, scale=float("inf")),
    }
    seen, collectives = outcomes_and_collectives(cases)
    untouched = all(torch.equal(a, b) for a, b in zip(before, outputs))
    return (seen, collectives), untouched


def test_bad_input_is_refused_before_any_collective_and_writes_nothing():
    results = run_ranks(_bad_calls, 2)
    assert all(untouched for _, untouched in results)
    assert_raised_before_any_collective([r for r, _ in results], {
        "unsharded plan": ("ValueError", "make the plan with BucketPlan(..., shards=2)"),
        "not a plan": ("TypeError", "plan must be a BucketPlan"),
        "missing tensor": ("ValueError", "tensors has 1 entries but the plan has 2"),
        "nan prescale": ("ValueError", "prescale"),
        "short part": ("ValueError", "parts[0] must be a contiguous"),
        "gather: unsharded plan": ("ValueError", "shards=1 but the group has 2 ranks"),
        "gather: part of another dtype": ("ValueError", "parts[0] must be a contiguous"),
        "gather: wrong output": ("ValueError", "outputs[0]"),
        "gather: inf scale": ("ValueError", "scale"),
    })


def test_without_a_process_group_the_error_says_how_to_start_one():
    plan = BucketPlan([torch.ones(3)], shards=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        reduce_scatter_plan(plan, [torch.ones(3)])
