"""BucketPlan: grouping, caps, fusion ids, alignment, determinism, errors."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from fusedreduce import BucketPlan
from fusedreduce.buckets import TensorSpec
from fusedreduce.kernels import ALIGN_BYTES
from harness import ONE_BYTE_MB
from fusedreduce.kernels import flatten_cast_scale, unflatten_cast_scale

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _specs(shapes, dtype=torch.float32):
    return [TensorSpec(tuple(s), dtype, torch.device("cpu")) for s in shapes]


spec_lists = st.lists(
    st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.sampled_from(DTYPES),
              st.integers(0, 3)),
    min_size=0, max_size=30)


@given(spec_lists, st.floats(min_value=ONE_BYTE_MB, max_value=0.05),
       st.sampled_from([None, torch.float32, torch.bfloat16]))
def test_plan_places_every_tensor_once_within_its_group_and_cap(entries, cap_mb, comm):
    specs = [TensorSpec(tuple(shape), dtype, torch.device("cpu")) for shape, dtype, _ in entries]
    fusion_ids = [f for _, _, f in entries]
    plan = BucketPlan(specs, bucket_cap_mb=cap_mb, comm_dtype=comm, fusion_ids=fusion_ids)
    seen = sorted(i for b in plan.buckets for i in b.tensor_indices)
    assert seen == list(range(len(specs)))
    cap_bytes = int(cap_mb * 2 ** 20)
    for k, bucket in enumerate(plan.buckets):
        assert bucket.index == k
        members = bucket.tensor_indices
        assert list(members) == sorted(members)
        assert {plan.fusion_ids[i] for i in members} == {bucket.fusion_id}
        assert {plan.comm_dtypes[i] for i in members} == {bucket.dtype}
        if comm is not None:
            assert bucket.dtype == comm
        item = torch.empty((), dtype=bucket.dtype).element_size()
        payload = sum(bucket.numels) * item
        assert len(members) == 1 or payload <= cap_bytes
        # segments are aligned, disjoint, in order and inside the buffer
        end = 0
        for (start, stop), n in zip(bucket.segments(), bucket.numels):
            assert start % (ALIGN_BYTES // item) == 0
            assert start >= end and stop - start == n
            end = stop
        assert end <= bucket.size and bucket.size % (ALIGN_BYTES // item) == 0
    assert [b.tensor_indices[0] for b in plan.buckets] == \
        sorted(b.tensor_indices[0] for b in plan.buckets)
    for i, (b, slot) in enumerate(plan.location):
        assert plan.buckets[b].tensor_indices[slot] == i


@given(spec_lists, st.floats(min_value=ONE_BYTE_MB, max_value=0.05))
def test_plan_is_a_pure_function_of_shapes_dtypes_and_ids(entries, cap_mb):
    specs = [TensorSpec(tuple(shape), dtype, torch.device("cpu")) for shape, dtype, _ in entries]
    tensors = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
    ids = [f for _, _, f in entries]
    a = BucketPlan(specs, bucket_cap_mb=cap_mb, fusion_ids=ids)
    b = BucketPlan(tensors, bucket_cap_mb=cap_mb, fusion_ids=ids)
    assert a.buckets == b.buckets and a.signature() == b.signature()


def test_one_byte_cap_gives_one_bucket_per_tensor():
    plan = BucketPlan(_specs([(3,), (5, 2), (1,), (0,)]), bucket_cap_mb=ONE_BYTE_MB)
    assert [b.tensor_indices for b in plan.buckets] == [(0,), (1,), (2,), (3,)]


def test_huge_cap_gives_one_bucket_per_dtype_group():
    specs = _specs([(3,), (7,)]) + _specs([(4,)], torch.float16) + _specs([(2,)])
    plan = BucketPlan(specs, bucket_cap_mb=1e6)
    assert [b.tensor_indices for b in plan.buckets] == [(0, 1, 3), (2,)]
    assert [b.dtype for b in plan.buckets] == [torch.float32, torch.float16]
    assert len(BucketPlan(specs, bucket_cap_mb=1e6, comm_dtype=torch.float32)) == 1


def test_cap_closes_a_bucket_before_it_overflows():
    # 100 fp32 elements = 400 bytes each; a 1000-byte cap holds two
    plan = BucketPlan(_specs([(100,)] * 5), bucket_cap_mb=1000 / 2 ** 20)
    assert [b.tensor_indices for b in plan.buckets] == [(0, 1), (2, 3), (4,)]


def test_tensors_of_different_fusion_ids_never_share_a_bucket():
    plan = BucketPlan(_specs([(4,)] * 6), fusion_ids=[1, 2, 1, 2, 3, 1])
    assert [b.tensor_indices for b in plan.buckets] == [(0, 2, 5), (1, 3), (4,)]
    assert [b.fusion_id for b in plan.buckets] == [1, 2, 3]


def test_segments_are_padded_to_16_bytes():
    plan = BucketPlan(_specs([(3,), (5,), (8,)], torch.float16))
    (bucket,) = plan.buckets
    assert bucket.offsets == (0, 8, 16) and bucket.size == 24


def test_comm_dtype_callable_maps_each_dtype():
    specs = _specs([(2,)], torch.float16) + _specs([(2,)], torch.float64)
    plan = BucketPlan(specs, comm_dtype=lambda d: d if d == torch.float64 else torch.float32)
    assert plan.comm_dtypes == (torch.float32, torch.float64)
    assert len(plan) == 2


@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from(DTYPES)), max_size=12),
       st.floats(min_value=ONE_BYTE_MB, max_value=0.002))
def test_flatten_and_unflatten_through_the_plan_round_trip(entries, cap_mb):
    torch.manual_seed(len(entries))
    tensors = [torch.randn(n, dtype=torch.float64).to(d) for n, d in entries]
    plan = BucketPlan(tensors, bucket_cap_mb=cap_mb, comm_dtype=torch.float64)
    restored = [torch.full_like(t, float("nan")) for t in tensors]
    for bucket in plan.buckets:
        flat = plan.flatten(bucket, tensors)
        # padding between segments is zero, never garbage
        covered = torch.zeros(bucket.size, dtype=torch.bool)
        for start, stop in bucket.segments():
            covered[start:stop] = True
        assert torch.all(flat[~covered] == 0)
        plan.unflatten(bucket, flat, restored)
    for t, r in zip(tensors, restored):
        assert torch.equal(t, r)  # fp64 holds every input exactly


def test_plan_flatten_matches_kernel_with_the_plans_offsets():
    tensors = [torch.randn(5), torch.randn(2, 3)]
    plan = BucketPlan(tensors)
    (bucket,) = plan.buckets
    direct = flatten_cast_scale(tensors, torch.empty(bucket.size), offsets=bucket.offsets,
                                scale=2.0)
    assert torch.equal(plan.flatten(bucket, tensors, scale=2.0), direct)
    out = [torch.empty_like(t) for t in tensors]
    unflatten_cast_scale(direct, out, offsets=bucket.offsets, scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), "25", True])
def test_bad_bucket_cap_is_a_value_error(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketPlan(_specs([(2,)]), bucket_cap_mb=cap)


def test_bad_inputs_name_the_offending_index():
    with pytest.raises(TypeError, match=r"tensors\[1\].*int64"):
        BucketPlan([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match=r"tensors\[0\].*sparse"):
        BucketPlan([torch.zeros(2).to_sparse()])
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        BucketPlan([[1.0, 2.0]])
    with pytest.raises(ValueError, match="fusion_ids"):
        BucketPlan(_specs([(2,), (3,)]), fusion_ids=[1])
    with pytest.raises(TypeError, match=r"fusion_ids\[1\]"):
        BucketPlan(_specs([(2,), (3,)]), fusion_ids=[1, 1.5])
    with pytest.raises(TypeError, match=r"communication dtype.*tensors\[0\]"):
        BucketPlan(_specs([(2,)]), comm_dtype=torch.int32)


def test_check_names_the_first_mismatching_tensor():
    plan = BucketPlan([torch.zeros(2), torch.zeros(3, 4)])
    plan.check([torch.ones(2), torch.ones(3, 4)])
    with pytest.raises(ValueError, match="3 entries"):
        plan.check([torch.ones(2), torch.ones(3, 4), torch.ones(1)])
    with pytest.raises(ValueError, match=r"grads\[1\] is \(4, 3\)"):
        plan.check([torch.ones(2), torch.ones(4, 3)], "grads")
    with pytest.raises(ValueError, match=r"tensors\[0\].*float16"):
        plan.check([torch.ones(2, dtype=torch.float16), torch.ones(3, 4)])


def test_empty_plan_has_no_buckets():
    plan = BucketPlan([])
    assert len(plan) == 0 and plan.signature() == []
    assert math.isclose(plan.bucket_cap_mb, 25.0)
