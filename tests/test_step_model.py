"""The step-time model (``fusedreduce.bench.step_model``), its command
(``fusedreduce-bench model``) and its check against the simulated cluster.

The arithmetic is checked against byte counts derived by hand in each test;
the cluster check (root, as the other cluster tests) measures the patterns on
2 nodes of 2 gloo ranks and asserts the model's stated error bound.
"""
from __future__ import annotations

import argparse
import json
import math

import pytest

from fusedreduce.bench import cli, cluster, cluster_patterns, model_bench, step_model
from fusedreduce.bench.step_model import Links, bus_factor, predict, ring_steps
from fusedreduce.local_ranks import run_on_local_ranks

REASON = cluster.unavailable_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=REASON or "")

NUMEL = 128 * 1000  # a whole number of int8 blocks (WIRE_BLOCK = 128) on every rank
INT8 = 1 + 4 / 128  # bytes per element on an int8 wire: the code and its share of a scale


def links(local: int = 2, nics: int = 1, **figures) -> Links:
    values = dict(name="test", ranks_per_node=local, intra_bw=10e9, nic_bw=1e9,
                  nics_per_node=nics, call_latency=0.0, intra_latency=0.0,
                  inter_latency=0.0, flatten_bw=5e9, unflatten_bw=5e9)
    values.update(figures)
    return Links(**values)


def test_bus_factors_and_steps_follow_nccl_tests_convention():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == 0.75
    assert bus_factor("all_to_all", 8) == 7 / 8
    assert bus_factor("all_reduce", 1) == 0.0
    assert [ring_steps("all_reduce", n) for n in (1, 2, 4)] == [0, 2, 6]
    assert [ring_steps("all_gather", n) for n in (1, 2, 4)] == [0, 1, 3]
    assert ring_steps("all_to_all", 4) == 1


# node egress per step in units of NUMEL elements, derived by hand for 2 ranks
# per node and one NIC per node (the simulated cluster's shape), N = 2 x nodes:
# - flat fp32 ring: 2(N-1)/N x 4 bytes (it leaves each node once);
# - two-level fp32: L ranks x 2(n-1)/n x 4/L bytes = 2(n-1)/n x 4;
# - two-level bf16 / int8: all-to-all + all-gather of the wire part across
#   nodes: L x 2(n-1)/n x w/L = 2(n-1)/n x w, w = 2 or 1 + 4/128;
# - flat int8: all-to-all sends (N-L)/N of each rank's codes off the node
#   (L ranks: L(N-L)/N), the ring all-gather (N-1)/N of them.
EGRESS = {
    "fused_fp32": {1: 0.0, 2: 6.0, 4: 7.0},
    "ddp": {1: 0.0, 2: 6.0, 4: 7.0},
    "two_level_fp32": {1: 0.0, 2: 4.0, 4: 6.0},
    "two_level_bfloat16": {1: 0.0, 2: 2.0, 4: 3.0},
    "two_level_int8": {1: 0.0, 2: INT8, 4: 1.5 * INT8},
    "two_level_float8_e4m3fn": {1: 0.0, 2: INT8, 4: 1.5 * INT8},
    "flat_int8": {1: 0.0, 2: (1.0 + 0.75) * INT8, 4: (1.5 + 7 / 8) * INT8},
    "flat_bfloat16": {1: 0.0, 2: (1.0 + 0.75) * 2, 4: (1.5 + 7 / 8) * 2},
}


@pytest.mark.parametrize("name", sorted(EGRESS))
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_bytes_leaving_a_node_match_the_hand_derived_counts(name, nodes):
    record = predict(name, NUMEL, nodes, links())
    assert record["node_egress_bytes"] == pytest.approx(EGRESS[name][nodes] * NUMEL)


def test_each_rank_link_inside_the_node_carries_the_hand_derived_bytes():
    # two-level fp32 on 2 ranks per node: reduce-scatter and all-gather, 1/2 of 4 bytes each
    assert predict("two_level_fp32", NUMEL, 2, links())["intra_bytes"] == pytest.approx(4 * NUMEL)
    # the flat ring passes every rank's link with 2(N-1)/N of the buffer: N = 16
    assert (predict("fused_fp32", NUMEL, 2, links(local=8, nics=8))["intra_bytes"]
            == pytest.approx(2 * 15 / 16 * 4 * NUMEL))
    # with a NIC per GPU, one NIC carries 1/8 of the node's egress
    record = predict("two_level_int8", NUMEL, 4, links(local=8, nics=8))
    assert record["nic_bytes"] == pytest.approx(2 * 3 / 4 * INT8 * NUMEL / 8)
    assert record["node_egress_bytes"] == pytest.approx(8 * record["nic_bytes"])


def test_the_wire_carries_the_librarys_block_scales():
    # one fp32 scale per WIRE_BLOCK = 128 codes, the library's block
    assert step_model.WIRE_BYTES["int8"] == step_model.WIRE_BYTES["float8_e4m3fn"] == INT8
    assert step_model.WIRE_BLOCK == 128


def test_wire_bytes_meet_the_issues_ratios_to_fp32():
    fp32 = predict("two_level_fp32", NUMEL, 2, links())["node_egress_bytes"]
    bf16 = predict("two_level_bfloat16", NUMEL, 2, links())["node_egress_bytes"]
    int8 = predict("two_level_int8", NUMEL, 2, links())["node_egress_bytes"]
    assert bf16 / fp32 == pytest.approx(0.5) and int8 / fp32 <= 0.27


def test_a_link_bound_phase_takes_its_bytes_over_the_link_plus_its_latency():
    figures = links(call_latency=1e-3, intra_latency=1e-4, inter_latency=1e-2)
    record = predict("fused_fp32", NUMEL, 2, figures)
    # 4 ranks: 6 ring steps, 2 of them across nodes (NCCL's nInterSteps), one call
    latency = 1e-3 + 4 * 1e-4 + 2 * 1e-2
    assert record["comm_ms"] == pytest.approx((latency + 6 * NUMEL / 1e9) * 1e3)
    # DDP splits the same ring into 25 MiB buckets, paying the latency per bucket
    big = 3 * step_model.DDP_BUCKET_BYTES // 4
    ddp, fused = predict("ddp", big, 2, figures), predict("fused_fp32", big, 2, figures)
    assert ddp["comm_ms"] - fused["comm_ms"] == pytest.approx(2 * latency * 1e3)


def test_kernel_passes_cost_their_bytes_moved_at_the_measured_bandwidth():
    # fused fp32: flatten reads and writes 4 bytes per element, unflatten the same
    record = predict("fused_fp32", NUMEL, 2, links(flatten_bw=2e9, unflatten_bw=4e9))
    assert record["kernel_ms"] == pytest.approx((8 * NUMEL / 2e9 + 8 * NUMEL / 4e9) * 1e3)
    assert record["step_ms"] == pytest.approx(record["kernel_ms"] + record["comm_ms"])


@pytest.mark.parametrize("name", step_model.STRATEGIES)
def test_more_nodes_more_elements_or_a_slower_nic_never_predict_less(name):
    figures = model_bench.H100
    times = [predict(name, NUMEL, n, figures)["comm_ms"] for n in (1, 2, 4, 8, 16)]
    assert times == sorted(times)
    assert predict(name, 2 * NUMEL, 4, figures)["step_ms"] > predict(name, NUMEL, 4,
                                                                      figures)["step_ms"]
    slower = Links(**{**figures.__dict__, "nic_bw": figures.nic_bw / 2})
    assert predict(name, NUMEL, 4, slower)["comm_ms"] >= predict(name, NUMEL, 4,
                                                                 figures)["comm_ms"]


def test_bad_strategies_and_figures_are_refused():
    with pytest.raises(ValueError, match="unknown strategy 'two_level_int4'"):
        predict("two_level_int4", NUMEL, 2, links())
    with pytest.raises(ValueError, match="nic_bw must be a positive finite number"):
        links(nic_bw=0.0)
    with pytest.raises(ValueError, match="nics_per_node must be a positive int"):
        links(nics=0)
    with pytest.raises(ValueError, match="must be positive"):
        predict("fused_fp32", 0, 2, links())


def test_quick_command_prints_every_strategy_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "model.json"
    status = cli.main(["model", "--quick", "--sizes", "1M", "--nodes", "1,2",
                       "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0
    assert "predictions (not measurements)" in out and "nccl-tests issue 290" in out
    for name in step_model.STRATEGIES:
        assert f"\n{name} " in out
    record = json.loads(path.read_text())
    rows = record["predictions"]
    assert len(rows) == len(step_model.STRATEGIES) * 2 and record["check"] is None
    for row in rows:
        for key in ("comm_ms", "kernel_ms", "step_ms"):
            assert math.isfinite(row[key]) and row[key] >= 0
    assert record["kernels_here"]["flatten"] > 0


def test_fewer_nics_per_node_make_the_cross_node_phases_the_bottleneck(capsys):
    assert cli.main(["model", "--quick", "--sizes", "1M", "--nodes", "2",
                     "--nics-per-node", "1"]) == 0
    assert "nics_per_node: 1 (--nics-per-node)" in capsys.readouterr().out
    one = Links(**{**model_bench.H100.__dict__, "nics_per_node": 1})
    flat = predict("fused_fp32", 10 ** 9, 2, one)["comm_ms"]
    # one NIC carries the node's whole egress: compression across nodes pays
    assert predict("two_level_int8", 10 ** 9, 2, one)["comm_ms"] < flat / 3


#: the model's stated error on the simulated cluster's communication time
#: (docs/benchmarks/model.md): the largest error measured at 2M and 25.6M
#: elements on the 2-core VM was 26%; the bound leaves room for a loaded machine
ERROR_BOUND = 0.35


@pytest.fixture(scope="module")
def cluster_check():
    if REASON is not None:
        pytest.skip(REASON)
    kernels = {"flatten": 1e10, "unflatten": 1e10}
    # the median of 5 timed runs per pattern: with 3, one run slowed or sped by
    # the VM's neighbours moved a pattern past the bound now and then
    return model_bench.check_cluster(model_bench.QUICK_CHECK_SIZE, 5, "1gbit", kernels)


@needs_root
def test_model_predicts_the_simulated_clusters_communication_time(cluster_check):
    for row in cluster_check["rows"]:
        assert abs(row["error"]) <= ERROR_BOUND, row


@needs_root
def test_bytes_crossing_each_nodes_link_match_the_model(cluster_check):
    for row in cluster_check["rows"]:
        # tx_bytes counts TCP/IP headers and the barriers' bytes: a few % above
        ratio = row["measured_egress_bytes"] / row["predicted_egress_bytes"]
        assert 1.0 <= ratio < 1.05, row


@needs_root
def test_the_patterns_compute_the_sum(cluster_check):
    rows = {row["strategy"]: row for row in cluster_check["rows"]}
    # fp32 sums of 4 standard normals: a few ulps of |sum| < 20
    for name in ("fused_fp32", "two_level_fp32"):
        assert rows[name]["max_error"] < 1e-5, rows[name]
    # int8 quantizes twice (the part, then the summed chunk): half a step of
    # absmax/127 each time, absmax < 6 per value and < 12 per node's sum
    assert rows["two_level_int8"]["max_error"] < 4 * 12 / 127, rows["two_level_int8"]
    # bf16 and e4m3 round twice too, each within half an ulp relative: 2^-9
    # (8 mantissa bits) and 2^-4 (3 bits; codes below e4m3's normal range err
    # less) of |part| < 12, then of |sum| < 24
    assert rows["two_level_bfloat16"]["max_error"] < (12 + 24) * 2 ** -9
    assert rows["two_level_float8_e4m3fn"]["max_error"] < (12 + 24) * 2 ** -4


@needs_root
def test_the_librarys_reducer_sums_on_the_cluster(library_cluster_check):
    rows = {row["strategy"]: row for row in library_cluster_check["rows"]}
    assert set(rows) == {"fused_fp32", *(name for group in ("library", "sharded", "gather",
                                                            "deterministic")
                                         for name in cluster_patterns.GROUPS[group])}
    # the same bounds as the patterns' (test_the_patterns_compute_the_sum)
    for name in ("library_flat", "library_two_level", "library_deterministic"):
        assert rows[name]["max_error"] < 1e-5, rows[name]
    assert rows["library_two_level_int8"]["max_error"] < 4 * 12 / 127
    assert rows["library_two_level_bfloat16"]["max_error"] < (12 + 24) * 2 ** -9
    assert rows["library_two_level_float8_e4m3fn"]["max_error"] < (12 + 24) * 2 ** -4


@needs_root
def test_the_librarys_wire_bytes_across_nodes(library_cluster_check):
    rows = {row["strategy"]: row for row in library_cluster_check["rows"]}
    for name, row in rows.items():
        if row["predicted_egress_bytes"] is not None:
            ratio = row["measured_egress_bytes"] / row["predicted_egress_bytes"]
            assert 1.0 <= ratio < 1.05, row
    fp32 = rows["library_two_level"]["measured_egress_bytes"]
    # the issue's aims: bf16 <= 0.50 x, e4m3 / int8 <= 0.27 x the fp32 wire's bytes
    # (bf16 is 0.50 x exactly, + 1% for the barriers' bytes on top of fp32's)
    assert rows["library_two_level_bfloat16"]["measured_egress_bytes"] / fp32 <= 0.51
    for name in ("library_two_level_int8", "library_two_level_float8_e4m3fn"):
        assert rows[name]["measured_egress_bytes"] / fp32 <= 0.27, rows[name]
    # the deterministic fp32 all-to-all + all-gather moves the fp32 two-level's bytes
    assert rows["library_deterministic"]["measured_egress_bytes"] / fp32 == pytest.approx(
        1.0, rel=0.05)
    # two levels send 1/L of the buffer across: 2/3 of the flat ring's node egress
    assert fp32 / rows["library_flat"]["measured_egress_bytes"] == pytest.approx(
        2 / 3, rel=0.05)


@needs_root
def test_the_sharded_steps_cross_node_bytes(library_cluster_check):
    rows = {row["strategy"]: row for row in library_cluster_check["rows"]}
    fp32 = rows["library_sharded_two_level"]["measured_egress_bytes"]
    # the gradients' reduce-scatter and the parameters' all-gather cross in
    # equal fp32 halves; a wire format shrinks the gradients' half only:
    # bf16 (1 + 0.5) / 2, int8 (1 + 0.258) / 2 of the fp32 two-level bytes
    assert rows["library_sharded_two_level_bfloat16"]["measured_egress_bytes"] / fp32 \
        == pytest.approx(0.75, abs=0.03)
    assert rows["library_sharded_two_level_int8"]["measured_egress_bytes"] / fp32 \
        == pytest.approx(0.629, abs=0.03)


def _sharded_patterns(rank, world_size):
    return cluster_patterns.run_patterns(rank, world_size, 2, 40_000,
                                         tuple(cluster_patterns.SHARDED_PATTERNS), 1,
                                         interface=None)


def test_the_sharded_patterns_leave_the_sum_in_the_parameters():
    record = run_on_local_ranks(_sharded_patterns, 4)[0]
    errors = record["max_error"]
    assert errors["library_sharded"] < 1e-5 and errors["library_sharded_two_level"] < 1e-5
    # the sharded step's sum is never re-quantized: each node's fp32 sum
    # (|.| < 12: two values below 6) is rounded once, half a step of
    # absmax/127 for int8, half an ulp (2^-9 relative) for bf16, two nodes
    assert 0 < errors["library_sharded_two_level_int8"] < 2 * 12 / 254
    assert 0 < errors["library_sharded_two_level_bfloat16"] < 2 * 12 * 2 ** -9


def test_patterns_option_names_the_library_and_refuses_unknown_names():
    names = model_bench.parse_patterns("library,two_level_int8")
    assert names[0] == "fused_fp32" and "two_level_int8" in names
    assert set(cluster_patterns.LIBRARY_PATTERNS) <= set(names)
    assert set(cluster_patterns.SHARDED_PATTERNS) <= set(model_bench.parse_patterns("sharded"))
    with pytest.raises(argparse.ArgumentTypeError, match="unknown pattern 'two_level_int4'"):
        model_bench.parse_patterns("two_level_int4")
