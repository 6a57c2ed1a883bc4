"""all_reduce_plan on local gloo ranks against a float64 reference."""
import pytest
import torch

from fusedreduce import BucketPlan, all_reduce_plan
from harness import ONE_BYTE_MB, rank_errors, run_ranks

SHAPES = [(3, 5), (0,), (1,), (257,), (4, 4, 3), (1000,), (7,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.float32, torch.float16, torch.bfloat16]


def _inputs(rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(d)
            for s, d in zip(SHAPES, DTYPES)]


def _reduce_on_rank(rank, world_size, cap_mb, prescale, postscale):
    tensors = _inputs(rank)
    before = [t.clone() for t in tensors]
    plan = BucketPlan(tensors, bucket_cap_mb=cap_mb, comm_dtype=torch.float32)
    outputs = [torch.full_like(t, float("nan")) for t in tensors]
    all_reduce_plan(plan, tensors, outputs=outputs, prescale=prescale, postscale=postscale)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors)), "inputs were modified"
    return outputs, len(plan)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("cap_mb", [ONE_BYTE_MB, 25.0])
def test_fused_mean_matches_float64_reference_and_is_identical_on_all_ranks(world_size, cap_mb):
    prescale, postscale = 0.5, 2.0 / world_size
    results = run_ranks(_reduce_on_rank, world_size, cap_mb, prescale, postscale)
    buckets = results[0][1]
    assert buckets == (len(SHAPES) if cap_mb < 1e-3 else 1)
    inputs = [_inputs(r) for r in range(world_size)]
    for i, dtype in enumerate(DTYPES):
        reference = sum(inputs[r][i].double() for r in range(world_size)) * prescale * postscale
        got = results[0][0][i]
        for r in range(1, world_size):
            assert torch.equal(got, results[r][0][i]), f"rank {r} differs on tensor {i}"
        # fp32 communication: the prescale and each of the world_size - 1
        # additions round once in fp32 (|sum| <= sum |x|), then one rounding to
        # the tensor's own dtype; fp64 tensors also pass through fp32 here
        magnitude = sum(inputs[r][i].double().abs() for r in range(world_size)) \
            * abs(prescale * postscale)
        bound = (world_size + 1) * torch.finfo(torch.float32).eps * magnitude \
            + torch.finfo(dtype).eps * reference.abs() + torch.finfo(dtype).tiny
        assert torch.all((got.double() - reference).abs() <= bound), f"tensor {i} ({dtype})"


def _in_place_sum(rank, world_size):
    tensors = _inputs(rank)
    all_reduce_plan(BucketPlan(tensors, comm_dtype=torch.float64), tensors)
    return tensors


def test_default_outputs_are_the_inputs_reduced_in_place():
    results = run_ranks(_in_place_sum, 2)
    inputs = [_inputs(r) for r in range(2)]
    for i, dtype in enumerate(DTYPES):
        # fp64 communication: the sum of two values is exact after one rounding
        # to the tensor's dtype (inputs came from fp64 rounded to that dtype)
        expected = (inputs[0][i].double() + inputs[1][i].double()).to(dtype)
        assert torch.equal(results[0][i], expected)


def _mismatched_count(rank, world_size):
    tensors = _inputs(rank)
    plan = BucketPlan(tensors)
    all_reduce_plan(plan, tensors[:-1])


def test_tensors_not_matching_the_plan_fail_on_every_rank_before_communicating():
    errors = rank_errors(_mismatched_count, 2, timeout=60)
    assert all(e is not None and e[0] == "ValueError" and "entries" in e[1] for e in errors)


def _wrong_buffer(rank, world_size):
    tensors = _inputs(rank)
    plan = BucketPlan(tensors, comm_dtype=torch.float32)
    buffers = [torch.empty(b.size + 1) for b in plan.buckets]
    all_reduce_plan(plan, tensors, buffers=buffers)


def test_a_wrong_persistent_buffer_is_a_value_error():
    errors = rank_errors(_wrong_buffer, 2, timeout=60)
    assert all(e is not None and e[0] == "ValueError" and "buffers[0]" in e[1] for e in errors)


def test_without_a_process_group_the_error_says_how_to_start_one():
    tensors = [torch.ones(3)]
    with pytest.raises(RuntimeError, match="init_process_group"):
        all_reduce_plan(BucketPlan(tensors), tensors)


def _single_rank(rank, world_size):
    tensors = [torch.full((5,), 3.0, dtype=torch.float16)]
    all_reduce_plan(BucketPlan(tensors, comm_dtype=torch.float32), tensors, postscale=0.5)
    return tensors[0]


def test_a_world_of_one_applies_the_scales_without_communicating():
    (result,) = run_ranks(_single_rank, 1)
    assert torch.equal(result, torch.full((5,), 1.5, dtype=torch.float16))
