"""The training-step benchmark (``hooks``) runs end to end and writes well-formed results.

No timing is asserted: these tests prove the benchmark works, never that one
method is faster than another.
"""
import torch

from bench_utils import assert_exits_cleanly_and_prints, check_record, quick_run_fixture

METHODS = ["ddp", "ddp_bucket_view", "torch_fp16_compress_hook", "fused_overlap",
           "fused_overlap_bucket_view", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "adasum_hook"]


quick_run = quick_run_fixture(
    "hooks", ["hooks", "--quick", "--world-size", "2", "--sizes", "30K", "--repeats", "2",
              "--no-progress"], "``hooks --quick`` run on 2 gloo ranks with a tiny ResNet-50")


def test_quick_hook_benchmark_exits_cleanly_and_prints_every_method(quick_run):
    process, _ = quick_run
    assert_exits_cleanly_and_prints(process, METHODS)


def test_quick_hook_benchmark_writes_the_documented_json(quick_run):
    _, record = quick_run
    results = check_record(record, ["step"])
    assert record["machine"]["dist_backend"] == "gloo"
    assert record["machine"]["torch"] == torch.__version__
    config = record["config"]
    assert config["command"] == "hooks" and config["kernels"] is None
    assert config["collectives"]["parts"] == ["step"]
    assert config["collectives"]["world_size"] == 2
    assert config["collectives"]["repeats"] == 2
    assert [r["method"] for r in results] == METHODS
    for result in results:
        assert result["world_size"] == 2
        assert result["baseline"] == "ddp"
        assert result["dtype"] == "float32"
        # ResNet-50's parameter list, at a few percent of the width
        assert result["n_tensors"] == 161
        assert result["bytes"] == 4 * result["n_elements"]
        assert result["compute_ms"] > 0
