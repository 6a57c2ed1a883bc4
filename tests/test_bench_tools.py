"""The one-off measurement tools in bench/ run end to end (no timing asserted)."""
import os
import subprocess
import sys

import pytest

from harness import ROOT, TIMEOUT


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("source", ["git", "directory", "git, compiled launch"])
def test_versus_revision_times_this_checkout_against_another_revision_in_one_run(source,
                                                                                tmp_path):
    # "compiled launch": the host rows through Triton's real launch path, the
    # kernels compiled for sm_90 by the stand-in driver (no interpreter)
    extra = ["--launch", "compiled"] if source.endswith("compiled launch") else []
    if source == "directory":  # a machine without git gets the revision's kernels/ this way
        archive = subprocess.run(["git", "archive", "HEAD", "kernels"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
        extra = ["--from-dir", str(tmp_path)]
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.versus_revision", "HEAD", "--sizes", "20K",
         "--repeats", "2", *extra], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    out = process.stdout
    for direction in ("flatten", "unflatten"):
        line = next(line for line in out.splitlines() if f"tensors, {direction}" in line
                    and "elements" in line)
        assert "torch_foreach" in line and "HEAD" in line and "this checkout" in line
    assert "HEAD flatten:" in out and "this checkout unflatten:" in out
    assert "HEAD flatten, buffer moved:" in out and "this checkout unflatten, buffer moved:" in out
    how = "compiled for sm_90" if "--launch" in extra else "the interpreter"
    assert f"host µs per steady-state call on the Triton path ({how}" in out


@pytest.mark.timeout(TIMEOUT)
def test_host_parts_times_each_part_of_a_steady_state_call(tmp_path):
    # on the CPU: compiled for sm_90, a launcher that does nothing
    import json
    from fusedreduce.bench import host_parts
    from fusedreduce.kernels import triton_unavailable_reason
    if triton_unavailable_reason() is not None:
        pytest.skip(f"host_parts times the Triton path: {triton_unavailable_reason()}")
    out = tmp_path / "parts.json"
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.host_parts", "--size", "100K", "--calls", "20",
         "--blocks", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    figures = json.loads(out.read_text())["us"]
    for direction in ("flatten", "unflatten"):
        parts = figures[direction]
        assert list(parts) == list(host_parts.PARTS), direction
        assert all(us > 0 for us in parts.values()), parts
    for part in host_parts.PARTS:
        assert any(line.startswith(part) for line in process.stdout.splitlines()), part


@pytest.mark.timeout(TIMEOUT)
def test_bucket_view_memory_reports_every_method():
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.bucket_view_memory", "--size", "30K",
         "--steps", "1", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    for method in ("ddp", "ddp_bucket_view", "fused", "fused_bucket_view"):
        line = next(line for line in lines if line.split()[0] == method)
        step_ms, peak_mb = float(line.split()[3]), float(line.split()[-1])
        assert step_ms > 0 and peak_mb >= 0


@pytest.mark.timeout(TIMEOUT)
def test_buffer_broadcast_reports_every_method_against_ddps():
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.buffer_broadcast", "--size", "30K",
         "--rounds", "2"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    for method in ("broadcast_buffers", "ddp_coalesced", "broadcast_tensors", "per_buffer"):
        line = next(line for line in lines if line.split()[0] == method)
        assert float(line.split()[1]) > 0, line
    assert next(line for line in lines if line.startswith("ddp_coalesced")).split()[3] == "1.00x"


@pytest.mark.cuda_only
@pytest.mark.timeout(TIMEOUT)
def test_versus_revision_times_real_launches_on_the_gpu():
    # this checkout against a copy of itself: no git needed on the GPU machine
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.versus_revision", "HEAD", "--sizes", "1M",
         "--device", "cuda", "--from-dir", str(ROOT)], cwd=ROOT, capture_output=True,
        text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    for name in ("HEAD flatten, moved:", "this checkout unflatten:"):
        assert name in process.stdout


@pytest.mark.cuda_only
def test_the_device_timer_leaves_out_host_time_and_keeps_device_time():
    # a call that spends 3 ms on the host before a tiny kernel must time as the
    # kernel, and a call whose kernel spins a known time as that time: events
    # alone would give the first ~3 ms
    import time

    import torch

    from fusedreduce.bench import timing
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1, device=device)
    per_ms = timing._sleep_cycles_per_ms(device)

    def host_heavy():
        time.sleep(0.003)
        x.add_(1)

    def device_heavy():
        torch.cuda._sleep(int(2 * per_ms))

    times = timing.time_on_device({"host": host_heavy, "device": device_heavy}, 5, device)
    assert max(times["host"]) < 0.5, times["host"]
    # the spin's length follows the clock, which may move a little between calibration and use
    assert all(1.5 < t < 3.0 for t in times["device"]), times["device"]


@pytest.mark.timeout(TIMEOUT)
def test_join_cost_times_each_method_plain_and_under_join(tmp_path):
    # two gloo ranks here; a GPU session runs one NCCL rank
    import json
    path = tmp_path / "join_cost.json"
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.join_cost", "--size", "60K", "--batch", "2",
         "--image", "32", "--world-size", "2", "--blocks", "2", "--block-steps", "2",
         "--scaler", "--device", "cpu", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    # Join's notification count is read through the work's future: the
    # deprecated Work.result() warns in every user's log
    assert "Work::result" not in process.stderr, process.stderr
    from fusedreduce.bench.join_cost import METHODS
    record = json.loads(path.read_text())
    assert record["config"]["scaler"] is True and "GradScaler" in process.stdout
    assert set(record["rows"]) == set(METHODS)
    for method, row in record["rows"].items():
        assert [len(record["samples"][method][k]) for k in ("plain", "join")] == [2, 2]
        assert row["plain_ms"] > 0 and row["join_ms"] > 0
        assert row["ratio"] == pytest.approx(row["join_ms"] / row["plain_ms"])
        assert any(line.split()[:1] == [method] for line in process.stdout.splitlines())
    bad = subprocess.run([sys.executable, "-m", "fusedreduce.bench.join_cost", "--blocks", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "--blocks must be at least 1" in bad.stderr


@pytest.mark.timeout(TIMEOUT)
def test_one_gpu_step_times_every_api_on_one_rank(tmp_path):
    # on the CPU here (gloo, one rank); the same command on a GPU runs NCCL
    import json
    path = tmp_path / "one_gpu_step.json"  # the name a GPU session gives it
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.one_gpu_step", "--size", "60K", "--batch", "2",
         "--image", "32", "--steps", "2", "--device", "cpu", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    from fusedreduce.bench.one_gpu_step import METHODS
    lines = process.stdout.splitlines()
    for method in METHODS:
        assert any(line.split()[:1] == [method] for line in lines), method
    record = json.loads(path.read_text())
    assert set(record["median_ms"]) == set(record["median_host_us"]) == set(METHODS)
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in record["record"]["samples"].values())
    # the host's share of a step cannot exceed the step
    for method in METHODS:
        assert all(h <= 1e3 * t for h, t in zip(record["record"]["host_us"][method],
                                                record["record"]["samples"][method]))
    assert "distributed_optimizer_graph: CUDA only" in process.stdout
    # the buckets of each method's reducer: DDP's rows hold none of ours
    buckets = record["record"]["buckets"]
    assert set(buckets) == {"reducer_hooks", "reducer_hooks_bucket_view", "reducer_call",
                            "distributed_optimizer", "sharded_optimizer",
                            "sharded_gradients_optimizer"}
    # the memory columns are the CUDA allocator's: none on the CPU
    assert record["record"]["held_bytes"] == record["record"]["peak_bytes"] == {}
    assert all(type(n) is int and n >= 1 for n in buckets.values()), buckets
    # .ci/gpu-session-summary reads the replayed step's row, absent on the CPU
    from bench_utils import gpu_session_summary
    assert "replayed step's host time: not measured (no graph row: not on a GPU)" in \
        gpu_session_summary(tmp_path)
    # what the kept launches did: the DistributedOptimizer flattens and writes
    # back every step through them, each call one of the outcomes
    counts = record["record"]["launches_per_step"]["distributed_optimizer"]
    assert counts["calls"] >= 2
    assert counts["same"] + counts["switched"] + counts["re-pointed"] + counts["prepared"] \
        == counts["calls"]
    # on the CPU the torch fallback runs: no Triton launch either way
    assert counts["direct"] == counts["via_jit"] == 0
    assert "no_communication" not in record["record"]["launches_per_step"]
    assert any(line.split()[:1] == ["distributed_optimizer"] and len(line.split()) == 8
               for line in lines)


@pytest.mark.device_aware
@pytest.mark.timeout(TIMEOUT)
def test_norm_share_times_the_norm_whole_and_as_one_ranks_share(tmp_path, device):
    # on the CPU the torch fallback's rows; under --device cuda the compiled
    # Triton kernels, device-timed: the figures issue 26's clipping aim needs
    import json

    from fusedreduce.bench.norm_share import AIM_OF_WRITE_BACK, REFERENCE
    path = tmp_path / "norm_share.json"  # the name a GPU session gives it
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.norm_share", "--sizes", "40K,100K",
         "--shares", "2,8", "--dtype", "float16,float64", "--models", "resnet50",
         "--repeats", "2", "--device", device.type, "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    assert f"the norm at most {AIM_OF_WRITE_BACK:.2f} of the write-back" in process.stdout
    from bench_utils import check_record
    results = check_record(json.loads(path.read_text()), ["norm_share"])
    methods = ["write_back", "torch_clip", "fused_norm", "fused_norm_share_2",
               "fused_norm_share_8"]
    assert len(results) == 2 * 2 * len(methods)  # two sizes, two dtypes
    for key in dict.fromkeys((r["case"], r["size"]) for r in results):
        group = [r for r in results if (r["case"], r["size"]) == key]
        assert [r["method"] for r in group] == methods
        assert [r["role"] for r in group] == ["reference", "baseline"] + ["ours"] * 3
        assert [r["world_size"] for r in group] == [1, 1, 1, 2, 8]
        reference = group[0]
        assert reference["method"] == REFERENCE and reference["of_write_back"] == 1.0
        for r in group:
            assert r["of_write_back"] == pytest.approx(r["time_ms"] / reference["time_ms"])
        # the split's one collective: a fp64 partial per row, the same for every share
        shared = [r["allreduce_bytes"] for r in group[3:]]
        assert shared[0] == shared[1] > 0 and shared[0] % 8 == 0
        assert all(r["allreduce_bytes"] == 0 for r in group[:3])
    for line in ("fused_norm_share_8", "float16 gradients, float32 buffers",
                 "float64 gradients, float64 buffers"):
        assert line in process.stdout
    # what .ci/gpu-session-summary makes of it: each share's span at the largest size
    from bench_utils import gpu_session_summary
    summary = gpu_session_summary(tmp_path)
    assert f"clipping norm over the write-back at 100,000 elements (norm_share on " \
           f"{device.type}" in summary, summary
    assert "; W=2 " in summary and "; W=8 " in summary and "aim <= 0.1: " in summary


def test_norm_share_refuses_to_time_a_wrong_norm():
    import torch

    from fusedreduce.bench import norm_share
    grads = [torch.randn(3000), torch.randn(7, 5).to(torch.bfloat16)]
    plan, buffers = norm_share.reduced_buffers(grads, torch.float32)
    fns = norm_share.methods(grads, plan, buffers, [2])
    norm_share.check_norm(fns, buffers)  # the true norm passes
    right = fns["fused_norm"]
    fns["fused_norm"] = lambda: (right()[0] * (1 + 2 * norm_share.NORM_RTOL),)
    with pytest.raises(RuntimeError, match="fused_norm gave"):
        norm_share.check_norm(fns, buffers)


#: run by the test below: each {name: [module, *args]} as ``python -m module
#: *args --help`` (``runpy``, as ``-m`` runs it), its exit code and help text
#: printed as one JSON line
_HELP_EACH = """
import contextlib, io, json, runpy, sys
seen = {}
for name, (module, *args) in json.loads(sys.argv[1]).items():
    sys.argv = [module, *args, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    seen[name] = (code, out.getvalue())
print(json.dumps(seen))
"""


@pytest.mark.timeout(TIMEOUT)
def test_every_step_of_the_gpu_session_script_names_what_exists():
    # the script runs only on a lent GPU machine, where a typo costs a
    # session's one chance: its dry run lists the steps, and each one's test
    # files must exist and each command must take its options (--help after
    # them: argparse checks every value it reads before it prints the help,
    # and every option named must be one the help lists)
    import json
    import re
    import shlex
    script = ROOT / ".ci" / "gpu-session"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    listed = subprocess.run(["bash", str(script), "run", "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    steps = dict(line.split(": ", 1) for line in listed.stdout.splitlines())
    assert list(steps)[:2] == ["capture", "clipping_properties"]
    assert {"norm_share", "one_gpu_step", "join_cost", "clip", "gpu_check",
            "cuda_suite"} <= set(steps)
    modules = {}
    for name, command in steps.items():
        words = shlex.split(command)
        assert words[:2] == ["python3", "-m"], (name, command)
        if words[2] == "pytest":
            paths = [w for w in words if w == "tests" or w.startswith("tests/")]
            assert paths and all((ROOT / p).exists() for p in paths), (name, paths)
            assert "--device" in words and words[words.index("--device") + 1] == "cuda"
            continue
        modules[name] = words[2:]
    # every command's module run as python -m runs it, in one process (one
    # import of torch instead of one per command)
    helped = subprocess.run([sys.executable, "-c", _HELP_EACH, json.dumps(modules)], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert helped.returncode == 0, helped.stderr
    helps = json.loads(helped.stdout.splitlines()[-1])
    for name, (code, text) in helps.items():
        assert code == 0, (name, text)
        for option in re.findall(r"(?<!\S)(--[a-z-]+)", steps[name]):
            # whole: argparse would take an abbreviation, and a substring
            # would find it in the full name
            assert re.search(rf"(?<![\w-]){option}(?![\w-])", text), (name, option)
    # a rerun of the steps a session names (the suite, cut off the first time)
    only = subprocess.run(["bash", str(script), "run", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_SESSION_ONLY": "clip cuda_suite"})
    assert [line.split(": ", 1)[0] for line in only.stdout.splitlines()] == ["clip",
                                                                             "cuda_suite"]
    # the older revisions the host rows compare with exist in this history
    # (a shallow clone holds none of it)
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    revisions = re.search(r'^REVISIONS="([^"]+)"', script.read_text(), re.M).group(1).split()
    for rev in revisions:
        assert f"versus_{rev}" in steps
        assert shallow == "true" or subprocess.run(
            ["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT).returncode == 0, rev


@pytest.mark.timeout(TIMEOUT)
def test_state_dict_versus_runs_each_version_s_library_alternately(tmp_path):
    import json
    out = tmp_path / "versus.json"
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.state_dict_versus", "HEAD", "--sizes", "30K",
         "--world-sizes", "2", "--models", "resnet50", "--dtypes", "bfloat16", "--runs", "2",
         "--repeats", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    row = next(line for line in process.stdout.splitlines() if line.startswith("| resnet50"))
    assert row.count("→") == 4 and "| bfloat16 | 30000 | 2 |" in row
    runs = json.loads(out.read_text())["runs"]
    for side in ("before", "after"):
        assert len(runs[side]) == 2
        for run in runs[side]:
            # each side imported the library of its own tree, with the same bench code
            assert [r["library"] for r in run] == [side]
            assert all(run[0][call] > 0 for call in
                       ("state_dict", "state_dict_to0", "sharded_state_dict",
                        "load_state_dict"))


@pytest.mark.timeout(TIMEOUT)
def test_sharded_versus_runs_the_sharded_bench_for_each_version_alternately(tmp_path):
    import json
    out = tmp_path / "versus.json"
    process = subprocess.run(
        [sys.executable, "-m", "fusedreduce.bench.sharded_versus", "HEAD", "--runs", "1",
         "--methods", "fused_sharded_grads_adamw", "--json", str(out), "--quick",
         "--models", "resnet50", "--dtypes", "bfloat16"], cwd=ROOT, capture_output=True,
        text=True, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr
    rows = [line for line in process.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and "| resnet50 | bfloat16 | 30000 | fused_sharded_grads_adamw |" \
        in rows[0]
    saved = json.loads(out.read_text())
    assert saved["bench_args"] == ["--quick", "--models", "resnet50", "--dtypes", "bfloat16"]
    (before,), (after,) = saved["runs"]["before"], saved["runs"]["after"]
    pick = {side: next(r for r in run if r["method"] == "fused_sharded_grads_adamw")
            for side, run in (("before", before), ("after", after))}
    # the after side ran this checkout's library (no buffer kept between
    # steps with shard_gradients); the table shows each side's counts (the
    # median of one run is that run's)
    assert pick["after"]["buffer_bytes"] == 0
    assert pick["before"]["grad_bytes"] > 0 and pick["after"]["grad_bytes"] > 0
    old, new = (pick[side]["held_bytes"] / 1e6 for side in ("before", "after"))
    assert f"| {old:.2f} → {new:.2f} ({new / old:.2f}x) |" in rows[0]
