"""The clipping benchmark (``clip``) runs end to end and writes well-formed results.

No timing is asserted: these tests prove the benchmark works, never that one
method is faster than another.
"""
import math
import subprocess
import sys

from bench_utils import assert_exits_cleanly_and_prints, check_record, quick_run_fixture
from harness import ROOT, TIMEOUT

METHODS = ["reduce_only", "torch_clip", "fused_clip", "fused_clip_split"]
WRITE_BACK = ["write_back", "write_back_torch_clip", "write_back_fused_clip",
              "write_back_fused_clip_split"]
UNSCALE = ["torch_clip_unscale", "fused_clip_unscale"]
MEASURE = ["write_back_torch_norm", "write_back_torch_clip_inf", "write_back_fused_measure"]

quick_run = quick_run_fixture(
    "clip", ["clip", "--quick", "--world-size", "2", "--sizes", "30K", "--repeats", "2",
             "--dtype", "float32,bfloat16", "--no-progress"],
    "``clip --quick`` run on 2 gloo ranks with small gradient lists")


def test_quick_clip_benchmark_exits_cleanly_and_prints_every_method(quick_run):
    process, _ = quick_run
    assert_exits_cleanly_and_prints(process,
                                    METHODS + WRITE_BACK + UNSCALE + MEASURE
                                    + ["clip ms", "launches", "norm measured"])


def test_quick_clip_benchmark_writes_the_documented_json(quick_run):
    _, record = quick_run
    results = check_record(record, ["clip"])
    assert record["config"]["command"] == "clip"
    assert record["config"]["collectives"]["parts"] == ["clip"]
    # two models x two dtypes: with the collective (four methods), under a
    # GradScaler (two: fp32 and bf16 gradients can be unscaled), without the
    # collective (four), the norm measured without the collective (three)
    assert len(results) == 2 * 2 * (4 + 2 + 4 + 3)
    cases = list(dict.fromkeys(r["case"] for r in results))
    assert [c.split()[0] for c in cases] == ["resnet50"] * 4 + ["transformer"] * 4 + \
        ["resnet50"] * 4 + ["transformer"] * 4
    for case in cases:
        group = [r for r in results if r["case"] == case]
        launches = [r["launches"] for r in group]
        assert all(type(n) is int and n > 0 for n in launches), launches
        if case.endswith("norm measured"):
            assert [r["method"] for r in group] == MEASURE
            assert [r["role"] for r in group] == ["baseline", "baseline", "ours"]
            assert all(r["baseline"] == "write_back_torch_norm" for r in group)
            # counted, not timed: torch's idiom multiplies every gradient by 1
            assert launches[2] < launches[1], launches
            floor = next(r for r in results if r["method"] == "write_back"
                         and case.startswith(r["case"]))
            for r in group:
                assert math.isclose(r["clip_ms"], r["time_ms"] - floor["time_ms"])
            continue
        if case.endswith("+ GradScaler.unscale_"):
            assert [r["method"] for r in group] == UNSCALE
            assert [r["role"] for r in group] == ["baseline", "ours"]
            assert all(r["baseline"] == "torch_clip_unscale" for r in group)
            # both unscale in GradScaler's pass; torch's clip adds its multiplies
            assert launches[1] < launches[0], launches
            unclipped = next(r for r in results if r["method"] == "reduce_only"
                             and case.startswith(r["case"]))
            for r in group:
                assert math.isclose(r["clip_ms"], r["time_ms"] - unclipped["time_ms"])
            continue
        alone = case.endswith("write-back only")
        assert [r["method"] for r in group] == (WRITE_BACK if alone else METHODS)
        assert [r["role"] for r in group] == ["reference", "baseline", "ours", "ours"]
        assert all(r["baseline"] == group[1]["method"] for r in group)
        floor = group[0]["time_ms"]
        assert group[0]["clip_ms"] == 0
        # counted, not timed: torch's clipping adds a multiply per gradient
        # (the CPU counts ops dispatched; the per-tensor casts of the norms too),
        # the fused one a few per bucket (split or not)
        assert launches[0] < launches[2] < launches[1], launches
        assert launches[0] < launches[3] < launches[1], launches
        for r in group:
            assert math.isclose(r["clip_ms"], r["time_ms"] - floor)
            assert r["n_tensors"] == (161 if case.startswith("resnet50") else 147)
            assert r["bytes"] == r["n_elements"] * (4 if r["dtype"] == "float32" else 2)


def test_clip_runs_on_one_rank_where_the_collective_benchmarks_need_two():
    # a machine with one GPU can measure clipping: the all-reduce is then a copy
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench", "clip", "--quick", "--world-size", "1",
         "--sizes", "30K", "--repeats", "1", "--no-progress"], cwd=ROOT, capture_output=True,
        text=True, timeout=TIMEOUT)
    assert_exits_cleanly_and_prints(process, METHODS + WRITE_BACK + ["1 ranks"])
