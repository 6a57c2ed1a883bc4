"""``fusedreduce-bench sharded``: every method runs, and its memory is counted right.

One ``sharded --quick`` run on 2 gloo ranks (tiny models, both dtypes) is
shared by the tests. No timing is asserted beyond positive, finite figures;
the byte counts are checked against what AdamW must hold: the exact totals
over the ranks, each rank's share of the sharded state within the bound
the plan's padding allows, and the communication buffers each method keeps.
"""
import importlib.util
import math
import sys

import pytest
import torch

from bench_utils import check_record, positive_finite, run_bench_once
from harness import run_ranks
from fusedreduce.bench import cli, sharded_bench
from fusedreduce.bench.models import linear_stack_shapes_for_size, transformer_shapes_for_size

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORLD_SIZE = 2
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}
STEP_BYTES = 4  # AdamW's step count: one 0-d fp32 tensor per parameter (or slice)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``sharded --quick`` run on 2 gloo ranks: (process, JSON record, PNG path)."""
    # one timed step per method: the tests read counts and the report's shape,
    # never a time beyond "positive and finite"
    args = ["sharded", "--quick", "--world-sizes", str(WORLD_SIZE), "--repeats", "1",
            "--no-progress"]
    if HAS_MATPLOTLIB:
        args += ["--plot", "{dir}/sharded.png"]
    process, record, directory = run_bench_once(tmp_path_factory, "sharded", args)
    return process, record, directory / "sharded.png"


def _by_case(record):
    """{(model, dtype): {method: result}} of the run."""
    cases = {}
    for result in record["results"]:
        cases.setdefault((result["model"], result["dtype"]), {})[result["method"]] = result
    return cases


def _elementwise(result, rank):
    """A rank's per-element state bytes: the state less its 0-d tensors."""
    memory = result["memory_per_rank"]
    return memory["state"][rank] - memory["state_scalars"][rank]


def test_quick_sharded_exits_cleanly_and_prints_every_method_per_case(quick_run):
    process, _, _ = quick_run
    assert process.returncode == 0, process.stderr
    for model in sharded_bench.DEFAULT_MODELS:
        for dtype in sharded_bench.DTYPES:
            assert f"## {model} {dtype}:" in process.stdout
    for method in sharded_bench.METHODS:
        assert process.stdout.count(f" {method} ") == 4, method
    assert "not run" not in process.stdout  # every configuration runs on gloo CPU ranks
    assert "# buckets: DDP 25 MiB, DistributedOptimizer 10 MiB" in process.stdout


def test_every_configuration_ran_with_positive_finite_times(quick_run):
    _, record, _ = quick_run
    results = check_record(record, ["sharded"])
    assert record["config"]["world_sizes"] == [WORLD_SIZE]
    assert record["machine"]["dist_backend"] == "gloo"
    cases = _by_case(record)
    assert set(cases) == {(m, d) for m in sharded_bench.DEFAULT_MODELS for d in sharded_bench.DTYPES}
    for methods in cases.values():
        assert list(methods) == list(sharded_bench.METHODS)
        unsharded = methods["fused_adamw"]["time_ms"]
        for result in methods.values():
            assert result["not_run"] is None
            assert result["world_size"] == WORLD_SIZE
            assert result["role"] == sharded_bench.ROLES[result["method"]]
            assert math.isclose(result["time_vs_unsharded"], result["time_ms"] / unsharded)
    for result in results:
        assert result["n_tensors"] == (161 if result["model"] == "resnet50" else 147)
        assert result["bytes"] == result["n_elements"] * ELEMENT_SIZE[result["dtype"]]


def test_unsharded_adamw_holds_two_moments_in_the_parameters_dtype_on_every_rank(quick_run):
    _, record, _ = quick_run
    for methods in _by_case(record).values():
        for method in ("ddp_adamw", "fused_adamw"):
            result = methods[method]
            memory = result["memory_per_rank"]
            assert memory["state"] == [2 * result["bytes"] + STEP_BYTES * result["n_tensors"]] \
                * WORLD_SIZE
            assert memory["master"] == [0] * WORLD_SIZE
            assert memory["grads"] == memory["params"] == [result["bytes"]] * WORLD_SIZE
            assert result["state_master_bytes"] == result["state_bytes"]


def test_zero_and_fsdp2_split_the_state_exactly_between_the_ranks(quick_run):
    _, record, _ = quick_run
    for methods in _by_case(record).values():
        zero, fsdp2 = methods["ddp_zero_adamw"], methods["fsdp2_adamw"]
        n_tensors, nbytes = zero["n_tensors"], zero["bytes"]
        # ZeRO: each whole parameter's state on one rank; gradients and parameters whole
        assert sum(_elementwise(zero, r) for r in range(WORLD_SIZE)) == 2 * nbytes
        assert sum(zero["memory_per_rank"]["state_scalars"]) == STEP_BYTES * n_tensors
        assert zero["memory_per_rank"]["grads"] == [nbytes] * WORLD_SIZE
        # FSDP2: DTensor shards of parameters, gradients and moments; a step count
        # per parameter on every rank
        memory = fsdp2["memory_per_rank"]
        assert sum(memory["params"]) == sum(memory["grads"]) == nbytes
        assert sum(_elementwise(fsdp2, r) for r in range(WORLD_SIZE)) == 2 * nbytes
        assert memory["state_scalars"] == [STEP_BYTES * n_tensors] * WORLD_SIZE
        for result in (zero, fsdp2):
            assert result["state_master_vs_unsharded"] < 0.6


def test_fused_sharded_state_and_masters_per_rank_are_a_world_size_share(quick_run):
    _, record, _ = quick_run
    for (_, dtype), methods in _by_case(record).items():
        sharded, unsharded = methods["fused_sharded_adamw"], methods["fused_adamw"]
        memory = sharded["memory_per_rank"]
        n, n_tensors = sharded["n_elements"], sharded["n_tensors"]
        sixteen_bit = dtype != "float32"
        # the moments in fp32 whatever the parameters' dtype; each element on one rank
        assert sum(_elementwise(sharded, r) for r in range(WORLD_SIZE)) == 8 * n
        assert sum(memory["master"]) == (4 * n if sixteen_bit else 0)
        # every rank's part: at most its share of the elements and of the padding
        # (per bucket, at the end), plus a step count per parameter slice it owns
        share = (n + sharded["padding_elements"]) / WORLD_SIZE
        for r in range(WORLD_SIZE):
            assert _elementwise(sharded, r) <= 8 * share
            assert memory["master"][r] <= (4 * share if sixteen_bit else 0)
            assert memory["state_scalars"][r] <= STEP_BYTES * n_tensors
        unsharded_elementwise = unsharded["state_bytes"] - STEP_BYTES * n_tensors
        if not sixteen_bit:
            assert sharded["state_bytes"] <= (unsharded_elementwise + 8 * sharded[
                "padding_elements"]) / WORLD_SIZE + STEP_BYTES * n_tensors
        # parameters and gradients stay whole (ZeRO-1 memory: .grad is full-sized)
        assert memory["params"] == memory["grads"] == [sharded["bytes"]] * WORLD_SIZE
        # the whole state_dict(): the unsharded state, plus fp32 masters of 16-bit parameters
        full = (12 if sixteen_bit else 8) * n + STEP_BYTES * n_tensors
        assert sharded["full_state_bytes"] == full
        if not sixteen_bit:
            assert sharded["full_state_bytes"] == unsharded["state_bytes"]
        assert sharded["full_state_scalar_bytes"] == STEP_BYTES * n_tensors
        assert sharded["memory_aim_met"] is True
        assert sharded["state_master_bytes"] <= sharded["state_master_bound_bytes"]
        assert 0.99 < sharded["state_master_vs_full_per_rank"] < 1.05


def test_a_rank_s_checkpoint_file_holds_its_state_and_masters_only(quick_run):
    _, record, _ = quick_run
    for methods in _by_case(record).values():
        sharded = methods["fused_sharded_adamw"]
        # the same elements the rank holds between steps, copied to the host:
        # its share of the whole state_dict()
        assert sharded["checkpoint_own_bytes"] == sharded["state_master_bytes"]
        assert sharded["checkpoint_own_vs_whole"] == pytest.approx(
            sharded["checkpoint_own_bytes"] / sharded["full_state_bytes"])
        assert 1 / WORLD_SIZE <= sharded["checkpoint_own_vs_whole"] < 1.05 / WORLD_SIZE + 0.01
        assert all(sharded[f"checkpoint_{key}_ms"] > 0
                   for key in ("own", "whole", "load_own", "load_whole"))
        for method, row in methods.items():
            if method != "fused_sharded_adamw":
                assert row["checkpoint_own_bytes"] is None, method


def test_sharded_gradients_hold_a_share_of_the_gradients_and_the_same_state(quick_run):
    _, record, _ = quick_run
    for methods in _by_case(record).values():
        zero1, zero2 = methods["fused_sharded_adamw"], methods["fused_sharded_grads_adamw"]
        one, two = zero1["memory_per_rank"], zero2["memory_per_rank"]
        for key in ("state", "master", "params"):
            assert two[key] == one[key], key
        # ZeRO-2's buffers live only during backward and the gather, not
        # between steps
        assert one["buffers"] == [zero1["buffer_bytes"]] * WORLD_SIZE
        assert zero1["buffer_bytes"] >= 4 * zero1["n_elements"]
        assert two["buffers"] == [0] * WORLD_SIZE
        # every .grad element is held by the one rank that owns it, plus the
        # rest of the (few) parameters a part boundary cuts: together a little
        # more than one whole gradient, each rank well under it
        assert zero1["memory_per_rank"]["grads"] == [zero1["bytes"]] * WORLD_SIZE
        assert zero2["bytes"] <= sum(two["grads"]) < 1.5 * zero2["bytes"]
        assert max(two["grads"]) < 0.75 * zero2["bytes"]
        assert zero2["held_bytes"] < zero1["held_bytes"]


def test_communication_buffers_kept_between_steps_are_counted(quick_run):
    _, record, _ = quick_run
    for (_, dtype), methods in _by_case(record).items():
        n, nbytes = methods["ddp_adamw"]["n_elements"], methods["ddp_adamw"]["bytes"]
        # DDP (and ZeroRedundancyOptimizer on it): a bucket buffer per bucket in
        # the gradients' dtype, every gradient once
        for method in ("ddp_adamw", "ddp_zero_adamw"):
            assert methods[method]["memory_per_rank"]["buffers"] == [nbytes] * WORLD_SIZE
        # FSDP2 keeps none between steps: not counted, and no total
        fsdp2 = methods["fsdp2_adamw"]
        assert fsdp2["memory_per_rank"]["buffers"] == [None] * WORLD_SIZE
        assert fsdp2["buffer_bytes"] is fsdp2["held_bytes"] is fsdp2["held_vs_ddp"] is None
        # ours: fp32 buckets whatever the parameters' dtype (4 bytes per element
        # and the tensors' alignment); sharded, the parts and the all-gather
        # live in them (in place) and add nothing
        assert methods["fused_adamw"]["buffer_bytes"] >= 4 * n
        sharded = methods["fused_sharded_adamw"]
        whole = 4 * (n + sharded["padding_elements"])
        assert sharded["memory_per_rank"]["buffers"] == [whole] * WORLD_SIZE
        ddp_held = methods["ddp_adamw"]["held_bytes"]
        for method, result in methods.items():
            if method == "fsdp2_adamw":
                continue
            memory = result["memory_per_rank"]
            assert result["held_bytes"] == max(
                sum(parts) for parts in zip(memory["state"], memory["master"], memory["grads"],
                                            memory["params"], memory["buffers"])), method
            assert math.isclose(result["held_vs_ddp"], result["held_bytes"] / ddp_held)


def test_the_measured_peak_holds_at_least_what_a_step_keeps_alive_at_once(quick_run):
    _, record, _ = quick_run
    for methods in _by_case(record).values():
        ddp_peak = methods["ddp_adamw"]["peak_bytes"]
        for method, result in methods.items():
            memory = result["memory_per_rank"]
            for rank in range(WORLD_SIZE):
                # when backward ends, every gradient is alive beside the
                # parameters, the state and the buffers: the profiler's peak
                # (what the allocator held on top of those) cannot be lower
                held = sum(memory[key][rank] or 0
                           for key in ("state", "master", "grads", "params", "buffers"))
                assert memory["peak"][rank] >= held, (method, rank)
            assert result["peak_bytes"] == max(memory["peak"])
            assert math.isclose(result["peak_vs_ddp"], result["peak_bytes"] / ddp_peak)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the bench extra) is not installed")
def test_quick_sharded_writes_a_png(quick_run):
    process, _, png = quick_run
    assert process.returncode == 0, process.stderr
    assert png.read_bytes()[:8] == PNG_MAGIC


def _rank_output(n_tensors=4, n_elements=100, not_run=()):
    """One rank's ``rank_measure`` output for ``records``: fp32, 10 ms per step, whole state."""
    methods = [m for m in sharded_bench.METHODS if m not in not_run]
    memory = {"state": 816, "state_scalars": 16, "master": 0, "grads": 400, "params": 400,
              "buffers": 400, "peak": 3000}
    return {"samples": {m: [10.0, 12.0, 11.0] for m in methods},
            "memory": {m: dict(memory) for m in methods},
            "full": {"full_state_bytes": 816, "full_state_scalar_bytes": 16,
                     "padding_elements": 0, "n_buckets": 1} if "fused_sharded_adamw" in methods
            else None,
            "checkpoint": {"whole_ms": 5.0, "own_ms": 1.0, "own_bytes": 408,
                           "load_whole_ms": 7.0, "load_own_ms": 2.0}
            if "fused_sharded_adamw" in methods else None,
            "not_run": {m: "RuntimeError: not on this backend" for m in not_run},
            "n_tensors": n_tensors, "n_elements": n_elements, "element_size": 4}


def test_a_method_that_cannot_run_is_reported_with_its_reason_and_no_figures(capsys):
    case = {"model": "resnet50", "dtype": "float32", "size": 100}
    outcome = {r: _rank_output(not_run=("fsdp2_adamw",)) for r in range(2)}
    results = sharded_bench.records(outcome, case)
    fsdp2 = next(r for r in results if r["method"] == "fsdp2_adamw")
    assert fsdp2["not_run"] == "RuntimeError: not on this backend"
    assert all(fsdp2[key] is None for key in ("time_ms", "ratio", "state_bytes"))
    others = [r for r in results if r is not fsdp2]
    assert all(positive_finite(r["time_ms"]) and r["not_run"] is None for r in others)
    # the sharded optimizer here holds the whole state on each rank: it misses the aim
    sharded = next(r for r in results if r["method"] == "fused_sharded_adamw")
    assert sharded["memory_aim_met"] is False and sharded["time_aim_met"] is True
    sharded_bench.print_report(results, _machine(), {"repeats": 3}, 1.0)
    out = capsys.readouterr().out
    assert "# not run: fsdp2_adamw, resnet50 float32, 2 ranks: RuntimeError" in out
    row = next(line for line in out.splitlines() if " fused_sharded_adamw " in line)
    # the memory aim, the time aim; the checkpoint's MB, share of the whole,
    # ms and the whole's ms to save, to load
    assert row.split()[-8:] == ["NO", "yes", "0.000", "0.500", "1", "5", "2", "7"]


def _machine():
    return {"cpu_model": "cpu", "cores": 2, "gpu": None, "gpu_count": 0, "python": "3",
            "torch": torch.__version__, "triton": None, "kernel_backend": "torch",
            "dist_backend": "gloo", "loadavg_1min": None}


def test_the_linear_stack_runs_every_method_with_its_few_large_tensors(tmp_path_factory):
    """``--models linear-stack``: issue 44's shape (six 512x2048 linears at
    6.3M parameters) at the quick size, every method timed."""
    process, record, _ = run_bench_once(
        tmp_path_factory, "sharded-linear-stack",
        ["sharded", "--quick", "--models", "linear-stack", "--dtypes", "float32",
         "--repeats", "1", "--no-progress"])
    assert process.returncode == 0, process.stderr
    assert "## linear-stack float32:" in process.stdout
    rows = [r for r in record["results"] if r["model"] == "linear-stack"]
    assert sorted(r["method"] for r in rows) == sorted(sharded_bench.METHODS)
    shapes = linear_stack_shapes_for_size(sharded_bench.QUICK_SIZES[0])
    for row in rows:
        assert row["n_tensors"] == len(shapes) == 12
        assert positive_finite(row["time_ms"]), row["method"]
    assert linear_stack_shapes_for_size(6_300_000) == [(2048, 512), (2048,), (512, 2048),
                                                      (512,)] * 3


def test_the_decoder_has_the_transformer_parameter_list():
    for n in (30_000, 4_000_000):
        model = sharded_bench.decoder_for_size(n)
        assert [tuple(p.shape) for p in model.parameters()] == transformer_shapes_for_size(n)
    model = sharded_bench.decoder_for_size(30_000)
    logits = model(torch.randint(0, model.vocab, (2, 8)))
    assert logits.shape == (2, 8, model.vocab)


def test_the_command_is_listed_and_documents_its_options(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "sharded" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["sharded", "--help"])
    help_text = capsys.readouterr().out
    for option in ("--quick", "--world-sizes", "--models", "--dtypes", "--sizes", "--repeats",
                   "--bucket-mb", "--json", "--plot"):
        assert option in help_text
    for method in sharded_bench.METHODS:
        assert method in help_text


@pytest.mark.parametrize("argv", [["--world-sizes", "1"], ["--world-sizes", "2,x"],
                                  ["--models", "vgg"], ["--dtypes", "float16"]])
def test_impossible_requests_are_refused_by_the_parser(argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sharded", *argv])
    assert exit_.value.code == 2


def _built_buckets(rank, world_size):
    """Per bucket cap (None: the defaults), DDP's cap in bytes and the
    number of DistributedOptimizer's buckets, for the quick ResNet-50."""
    seen = {}
    for cap in (None, 0.05):
        _, ddp, _ = sharded_bench.build("ddp_adamw", "resnet50", sharded_bench.QUICK_SIZES[0],
                                        torch.float32, cap)
        _, _, ours = sharded_bench.build("fused_sharded_grads_adamw", "resnet50",
                                         sharded_bench.QUICK_SIZES[0], torch.float32, cap)
        seen[cap] = (ddp.bucket_bytes_cap, len(ours.layout.plan.buckets))
    return seen


def test_bucket_mb_sets_both_libraries_bucket_cap():
    seen = run_ranks(_built_buckets, 1)[0]
    assert seen[None][0] == 25 * 2 ** 20  # each library's default
    assert seen[0.05][0] == int(0.05 * 2 ** 20)
    # the quick model fits one default bucket and spreads over several small ones
    assert seen[None][1] == 1 < seen[0.05][1]


def test_plot_without_matplotlib_and_torchrun_fail_before_measuring(monkeypatch, tmp_path):
    def measured(*args, **kwargs):
        raise AssertionError("measured before the checks")

    monkeypatch.setattr(sharded_bench, "run", measured)
    for bad in ("0", "-1", "inf"):
        with pytest.raises(SystemExit, match="--bucket-mb must be a positive number"):
            cli.main(["sharded", "--quick", "--bucket-mb", bad])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sharded", "--quick", "--plot", str(tmp_path / "out.png")])
    assert "pip install matplotlib" in str(exit_.value.code)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "localhost")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match="without torchrun"):
        cli.main(["sharded", "--quick"])
