"""The AdaSum benchmark runs end to end and writes well-formed results.

No timing is asserted: these tests prove the benchmark works, never that one
method is faster than another.
"""
import torch

from bench_utils import assert_exits_cleanly_and_prints, check_record, quick_run_fixture
from fusedreduce import BucketPlan, communication_dtype
from fusedreduce.bench.adasum_bench import ROLES
from fusedreduce.bench.models import resnet50_shapes_for_size

METHODS = ["all_reduce", "grad_reducer", "adasum", "adasum_in_place", "tree_exchanges"]
SIZE = 30_000


quick_run = quick_run_fixture(
    "adasum", ["adasum", "--quick", "--world-size", "2", "--sizes", str(SIZE), "--repeats", "2",
               "--no-progress"], "``adasum --quick`` run on 2 gloo ranks")


def test_quick_adasum_benchmark_exits_cleanly_and_prints_a_table(quick_run):
    process, _ = quick_run
    assert_exits_cleanly_and_prints(process, METHODS)


def test_quick_adasum_benchmark_results_are_complete_and_positive(quick_run):
    _, record = quick_run
    results = check_record(record, ["adasum"])
    assert record["machine"]["dist_backend"] == "gloo"
    assert record["machine"]["torch"] == torch.__version__
    assert record["config"]["collectives"]["parts"] == ["adasum"]
    assert [r["method"] for r in results] == METHODS
    for result in results:
        assert result["role"] == ROLES[result["method"]]
        assert result["world_size"] == 2 and result["size"] == SIZE
        assert result["n_tensors"] == 161
        assert result["bytes"] == 4 * result["n_elements"]
        assert result["bytes_sent_per_rank"] > 0 and result["ratio_to_ring_bytes"] > 0


def test_adasum_bytes_are_counted_and_match_the_two_rank_tree(quick_run):
    # at 2 ranks each rank sends the half of every bucket it gives away and, in
    # the all-gather, the half it kept: every bucket's bytes once; then the
    # 16-byte agreement check (its ring share at 2 ranks is all of it) and the
    # statistics: 3 fp64 per AdaSum chunk, at least one chunk per tensor
    _, record = quick_run
    grads = [torch.empty(shape) for shape in resnet50_shapes_for_size(SIZE)]
    plan = BucketPlan(grads, bucket_cap_mb=25.0, comm_dtype=communication_dtype)
    adasum = next(r for r in record["results"] if r["method"] == "adasum")
    assert adasum["bytes_sent_source"] == "counted"
    statistics = adasum["bytes_sent_per_rank"] - sum(b.nbytes for b in plan.buckets) - 16
    assert statistics % (3 * 8) == 0
    assert statistics >= 3 * 8 * len(grads)

    # in place: one flat fp32 buffer, no agreement check; the tree's traffic
    # without the math is the same traffic
    in_place, exchanges = (next(r for r in record["results"] if r["method"] == m)
                           for m in ("adasum_in_place", "tree_exchanges"))
    statistics = in_place["bytes_sent_per_rank"] - 4 * in_place["n_elements"]
    assert statistics % (3 * 8) == 0 and statistics >= 3 * 8 * len(grads)
    assert exchanges["bytes_sent_per_rank"] == in_place["bytes_sent_per_rank"]

