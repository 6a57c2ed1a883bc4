"""The benchmark command line: ``all --quick`` on 2 gloo workers, JSON, plot, errors, torchrun.

No timing is asserted: these tests prove that the command runs and writes
well-formed, positive figures, never that one method is faster than another.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from bench_utils import check_record, run_bench_once
from harness import ROOT, run_torchrun
from fusedreduce.bench import (cli, cluster, collectives_bench, common, kernels_bench, model_bench,
                               output_files)

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BENCHMARKS = ["kernels", "reduce", "step", "adasum"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory):
    """One ``all --quick`` run at a tiny size on 2 gloo workers: (process, record, PNG path)."""
    args = ["all", "--quick", "--world-size", "2", "--sizes", "20K", "--repeats", "2"]
    if HAS_MATPLOTLIB:
        args += ["--plot", "{dir}/all.png"]
    process, record, directory = run_bench_once(tmp_path_factory, "all", args)
    return process, record, directory / "all.png"


def test_quick_all_exits_cleanly_and_prints_every_table(quick_all):
    process, _, _ = quick_all
    assert process.returncode == 0, process.stderr
    for benchmark in BENCHMARKS:
        assert f"## {benchmark}:" in process.stdout
    assert "## baseline vs ours" in process.stdout
    # not a terminal: one progress line per case on stderr instead of a bar
    assert "[1/" in process.stderr and "collectives: step" in process.stderr


def test_quick_all_writes_the_documented_json_with_positive_figures(quick_all):
    _, record, _ = quick_all
    results = check_record(record, BENCHMARKS)
    machine, config = record["machine"], record["config"]
    assert machine["device"] == "cpu" and machine["gpu"] is None
    assert machine["kernel_backend"] == "torch" and machine["dist_backend"] == "gloo"
    assert machine["cores"] >= 1
    assert config["command"] == "all" and config["quick"] is True
    assert config["launcher"] == "spawn"
    assert config["kernels"]["sizes"] == [20_000] and config["kernels"]["repeats"] == 2
    assert config["collectives"]["world_size"] == 2
    assert config["collectives"]["parts"] == ["reduce", "step", "adasum"]
    for result in results:
        assert result["size"] == 20_000
        assert result["world_size"] == (1 if result["benchmark"] == "kernels" else 2)
    methods = {(r["benchmark"], r["method"]) for r in results}
    assert {("kernels", "fusedreduce"), ("reduce", "fused_reducer"), ("step", "ddp"),
            ("step", "allreduce_hook"), ("adasum", "adasum")} <= methods


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the bench extra) is not installed")
def test_quick_all_writes_a_png(quick_all):
    process, _, png = quick_all
    assert process.returncode == 0, process.stderr
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_fails_before_measuring_and_says_what_to_install(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail

    def measured(*args, **kwargs):
        raise AssertionError("measured before checking for matplotlib")

    monkeypatch.setattr(kernels_bench, "run", measured)
    monkeypatch.setattr(collectives_bench, "run", measured)
    json_path = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["all", "--quick", "--plot", str(tmp_path / "out.png"),
                  "--json", str(json_path)])
    assert "pip install matplotlib" in str(exit_.value.code)
    assert not json_path.exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the bench extra) is not installed")
def test_the_plot_has_a_panel_per_case_from_any_results(tmp_path):
    from fusedreduce.bench import plot
    results = [{"benchmark": "kernels", "case": "c", "method": m, "role": role,
                "n_elements": n, "gbps": g}
               for m, role in (("copy", "reference"), ("fusedreduce", "ours"))
               for n, g in ((1000, 1.5), (10_000, 3.0))]
    path = tmp_path / "sub" / "plot.png"
    plot.write_plot(str(path), results, "title")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_the_console_script_is_installed_and_shares_the_modules_help(capsys):
    scripts = [e for e in metadata.entry_points(group="console_scripts")
               if e.name == "fusedreduce-bench"]
    assert [e.value for e in scripts] == ["fusedreduce.bench.cli:main"]
    with pytest.raises(SystemExit) as exit_:
        scripts[0].load()(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert command in help_text


def test_python_dash_m_bench_runs_from_a_checkout():
    process = subprocess.run([sys.executable, "-m", "bench", "all", "--help"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.startswith("usage: python -m bench all")
    for option in ("--quick", "--world-size", "--device", "--dtype", "--sizes", "--json",
                   "--plot"):
        assert option in process.stdout


@pytest.mark.parametrize("text, sizes", [("256K,1M,25.6M", [256_000, 1_000_000, 25_600_000]),
                                         ("1000", [1000]), ("2g", [2_000_000_000]),
                                         ("1_000k, 3M", [1_000_000, 3_000_000])])
def test_sizes_are_element_counts_with_decimal_suffixes(text, sizes):
    assert common.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "0", "1M,", "-5", "1.5X", "M"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="element counts"):
        common.parse_sizes(text)


def test_size_labels_read_back_as_the_same_count():
    for n in (999, 20_000, 256_000, 1_000_000, 25_600_000, 2_000_000_000):
        assert common.parse_sizes(common.format_count(n)) == [n]


@pytest.mark.parametrize("argv, message", [
    (["collectives", "--world-size", "1"], "at least 2 ranks"),
    (["kernels", "--repeats", "0"], None),
])
def test_impossible_requests_stop_before_measuring(monkeypatch, argv, message, capsys):
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    if message:
        assert message in str(exit_.value.code)
    else:
        assert exit_.value.code == 2  # argparse's usage error


# a value the model or cluster command cannot use: (argv, the option named)
BAD_MODEL_AND_CLUSTER = [
    (["model", "--nodes", "0"], "--nodes"), (["model", "--nodes", "1,,2"], "--nodes"),
    (["model", "--kernel-gbps", "0"], "--kernel-gbps"),
    (["model", "--kernel-gbps", "nan"], "--kernel-gbps"),
    (["model", "--nics-per-node", "0"], "--nics-per-node"),
    (["model", "--compute-ms", "-1"], "--compute-ms"),
    (["model", "--compute-ms", "inf"], "--compute-ms"),
    (["model", "--check-cluster", "--check-size", "1M,2M"], "--check-size"),
    (["model", "--patterns", ","], "--patterns"),
    (["model", "--repeats", "0"], "--repeats"),
    (["model", "--check-cluster", "--rate", "fast"], "--rate"),
    (["cluster", "probe", "--probe-mb", "inf"], "--probe-mb"),
    (["cluster", "probe", "--nodes", "0"], "--nodes"),
    (["cluster", "probe", "--nodes", "255"], "--nodes"),
    (["cluster", "probe", "--ranks-per-node", "0"], "--ranks-per-node"),
    (["cluster", "run", "no_such_script.py"], "SCRIPT"),
    # an output file that cannot be written is refused before anything runs
    (["cluster", "probe", "--json", os.path.dirname(__file__)], "--json"),
    (["model", "--json", os.path.join(__file__, "figures.json")], "--json"),
    (["kernels", "--json", os.path.join(__file__, "figures.json")], "--json"),
    (["sharded", "--plot", os.path.join(__file__, "figures.png")], "--plot"),
]


@pytest.mark.parametrize("argv, option", BAD_MODEL_AND_CLUSTER,
                         ids=[" ".join(argv) for argv, _ in BAD_MODEL_AND_CLUSTER])
def test_bad_model_and_cluster_values_are_refused_naming_the_option(monkeypatch, capsys, argv,
                                                                     option):
    def measured(*args, **kwargs):
        raise AssertionError(f"{argv} got past its checks")
    # nothing is measured, and no cluster made, when a check is missing
    monkeypatch.setattr(model_bench, "measure_kernels", measured)
    monkeypatch.setattr(model_bench, "check_cluster", measured)
    monkeypatch.setattr(kernels_bench, "run", measured)
    monkeypatch.setattr(cluster.Cluster, "up", measured)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    said = capsys.readouterr().err if exit_.value.code == 2 else str(exit_.value.code)
    assert option in said, said


def test_an_output_file_in_missing_directories_is_accepted_and_written(tmp_path):
    path = str(tmp_path / "runs" / "today" / "figures.json")
    assert output_files.output_file(path) == path
    assert not os.path.exists(os.path.dirname(path))  # made when written, not when parsed
    common.write_json(path, {}, {}, [])
    assert json.loads(open(path).read()) == {"machine": {}, "config": {}, "results": []}


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        cli.main(["kernels", "--device", "cuda"])


def test_the_summary_puts_each_of_ours_beside_the_fastest_baseline():
    def row(method, role, ms):
        return {"benchmark": "reduce", "case": "c", "size": 1, "method": method, "role": role,
                "n_elements": 10, "time_ms": ms, "gbps": 1 / ms}

    rows = cli.summary_rows([row("per_tensor", "baseline", 9.0),
                             row("torch_buckets", "baseline", 3.0),
                             row("fused_reducer", "ours", 2.0)])
    assert [(r["baseline"], r["ours"], r["speedup"]) for r in rows] == [
        ("torch_buckets", "fused_reducer", 1.5)]


def test_under_torchrun_the_ranks_join_the_launch_and_rank_0_alone_reports(tmp_path):
    path = tmp_path / "torchrun.json"
    process = run_torchrun(
        ["--standalone", "--nproc_per_node", "2", "-m", "fusedreduce.bench", "all", "--quick",
         "--sizes", "20K", "--lists", "resnet50", "--repeats", "1", "--no-progress", "--json",
         str(path)], cwd=tmp_path, timeout=600)
    assert process.returncode == 0, process.stderr
    assert process.stdout.count("## baseline vs ours") == 1
    record = json.loads(path.read_text())
    results = check_record(record, BENCHMARKS)
    assert record["config"]["launcher"] == "torchrun"
    assert record["config"]["collectives"]["world_size"] == 2
    assert {r["list"] for r in results if r["benchmark"] == "kernels"} == {"resnet50"}
