"""``fusedreduce-bench model``: predicted step time of each reduction strategy across nodes.

Predicts, with ``step_model``'s alpha-beta model, the communication and
step time of DDP, the fused fp32 all-reduce, two-level fp32, and bf16, fp8
(e4m3) and int8 wires, flat and two-level, at 1-16 nodes of 8 x H100
(NVLink inside the node, one 400 Gb/s InfiniBand NIC per GPU across nodes),
from published NCCL figures (``H100_SOURCES``, cited in
``docs/benchmarks/model.md``) and the kernel passes' bandwidth: measured
here with ``fusedreduce.kernels.flatten_cast_scale`` / ``unflatten_cast_scale``
on CUDA, else the figure measured on an H100 (``H100_KERNEL_BW``), or
``--kernel-gbps``. These are predictions, not measurements.

``--check-cluster`` (root) checks the model against the simulated cluster:
2 nodes of 2 gloo ranks over 1 Gbit/s links; it probes the links
(``Cluster.probe``: bandwidth between nodes, gloo's round trip) and the
loopback inside the nodes (each collective kind on the same buffer, every
node at once, timed round-robin with the patterns), runs
``cluster_patterns.PATTERNS`` (flat fp32, two-level fp32, two-level bf16,
e4m3 and int8 across nodes; ``--patterns library``: the library's own
``DistributedGradReducer``, flat, ``local_size=2``, with each wire and
deterministic, beside the flat all-reduce; ``gather``: each wire's chunks
gathered back in the wire format and in fp32; ``deterministic``:
``deterministic=True`` flat and two-level against the default all-reduce,
two-level fp32 and the native reduce-scatter + all-gather; ``step``: a whole
training step, DDP against the library's optimizer), and prints the model's
time for each beside the measured one (where the model has the strategy), the
error, the bytes that crossed each node's link per step and the measured ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Dict, Sequence

import torch

from fusedreduce.kernels import flatten_cast_scale, unflatten_cast_scale

from . import cluster, cluster_patterns, cluster_step, common, output_files, step_model
from .models import gradients
from .timing import summary_ms, time_interleaved

NAME = "model"

#: published figures for 8 x H100 SXM with one 400 Gb/s NDR InfiniBand NIC per GPU
H100_SOURCES = {
    "intra_bw": "360 GB/s: NCCL's ring reduce-scatter busbw on one 8 x H100 node, 357.8-362.2 "
                "GB/s at 4-8 GiB (NVIDIA/nccl issue 1047); NCCL's effective NVLink "
                "bandwidth ~370 GB/s (sjeaugey, NVIDIA/nccl-tests issue 212)",
    "nic_bw": "47 GB/s: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (AddyLaddy, "
              "NVIDIA/nccl-tests issue 290); 48-49 GB/s per CX-7 NIC (nccl-tests issue 267)",
    "nics_per_node": "8, one per GPU (assumption: the brief's 400 Gb/s per GPU, the rail "
                     "layout of NVIDIA/nccl issue 2409's 8 x CX-7 per H100 node)",
    "call_latency": "8.4 us: NCCL's base latency of Ring/Simple (src/graph/tuning.cc, "
                    "baseLatencies, master 5067397)",
    "intra_latency": "3.4 us per ring step: NVLink Ring/Simple hwLatencies (same file)",
    "inter_latency": "14 us per ring step across nodes: NET Ring/Simple hwLatencies (same file)",
    "flatten_bw": "2.69 TB/s bytes moved: our flatten of ResNet-50's 25.6M fp16 gradients into "
                  "fp32 on an H100, 57.0 us (docs/benchmarks/h100.md, Device time)",
}
#: bytes moved per second by the flatten kernel on an H100 (25.6M x 6 bytes / 57.0 us)
H100_KERNEL_BW = 25_557_032 * 6 / 57.0e-6

H100 = step_model.Links(
    name="8 x H100, NVLink + 400 Gb/s IB per GPU", ranks_per_node=8, intra_bw=360e9,
    nic_bw=47e9, nics_per_node=8, call_latency=8.4e-6, intra_latency=3.4e-6,
    inter_latency=14e-6, flatten_bw=H100_KERNEL_BW, unflatten_bw=H100_KERNEL_BW,
    sources=H100_SOURCES)

DEFAULT_SIZES = [25_557_032, 1_300_000_000]
DEFAULT_NODES = [1, 2, 4, 8, 16]
CHECK_SIZE, QUICK_CHECK_SIZE = 25_557_032, 2_000_000
ASSUMPTIONS = [
    "alpha-beta cost of ring collectives, nccl-tests' bus bandwidth convention: per rank an "
    "all-reduce moves 2(n-1)/n of the buffer, reduce-scatter / all-gather / all-to-all (n-1)/n",
    "a phase takes its latency (per call + per ring step) plus its busiest link's time: one "
    "rank's link into the node's fabric, or one NIC (the node's egress shared by its NICs)",
    "a flat ring leaves each node once: its node egress is 2(N-1)/N of the buffer, spread "
    "over the node's NICs; a flat all-to-all sends (N-L)/N of each rank's buffer off the node",
    f"wires: bf16 2 bytes/element; int8 and fp8 e4m3 1 byte + one fp32 scale per "
    f"{step_model.WIRE_BLOCK} elements (the library's WIRE_BLOCK); "
    "the all-gather back across nodes in the wire format, inside the node in fp32",
    "kernel passes cost their bytes moved (read + written) at the flatten / unflatten "
    "bandwidth; quantize costs as a flatten of the same bytes",
    "nothing overlaps: phases and passes add up (comm_pipelined_ms: phases on different "
    "links fully overlapped across buckets, a lower bound); no compute overlap with backward",
    "DDP: the same ring in 25 MiB buckets (a call latency each), a copy in and a copy out",
]


#: untimed calls before timing: a kept launch's first calls choose its way (timed)
KERNEL_WARMUP = 4


def measure_kernels(numel: int, repeats: int, device: torch.device) -> Dict[str, float]:
    """Bytes moved per second by ``flatten_cast_scale`` and ``unflatten_cast_scale`` of
    ResNet-50-shaped fp32 gradients to / from a kept fp32 buffer (read + written):
    the median call, the two timed round-robin after ``KERNEL_WARMUP`` calls each."""
    grads = gradients("resnet50", numel, torch.float32, device, seed=0)
    total = sum(g.numel() for g in grads)
    flat = torch.empty(total, device=device)
    calls = {"flatten": lambda: flatten_cast_scale(grads, flat),
             "unflatten": lambda: unflatten_cast_scale(flat, grads)}
    for call in calls.values():
        for _ in range(KERNEL_WARMUP):
            call()
    samples = time_interleaved(calls, repeats, device)
    return {name: 2 * 4 * total / (summary_ms(times)["time_ms"] / 1e3)
            for name, times in samples.items()}


# ------------------------------------------------------------ the cluster check

CHECK_PATTERNS = tuple(cluster_patterns.PATTERNS)
#: the model's strategy for each library pattern (the deterministic all-to-all has none)
LIBRARY_MODEL = {"library_flat": "fused_fp32", "library_two_level": "two_level_fp32",
                 "library_two_level_bfloat16": "two_level_bfloat16",
                 "library_two_level_float8_e4m3fn": "two_level_float8_e4m3fn",
                 "library_two_level_int8": "two_level_int8"}
#: every name ``--patterns`` takes; a group's name (``cluster_patterns.GROUPS``)
#: stands for its patterns
KNOWN_PATTERNS = CHECK_PATTERNS + tuple(dict.fromkeys(
    name for group in cluster_patterns.GROUPS.values() for name in group))


def parse_patterns(text: str) -> tuple:
    """``--patterns``' comma-separated names (a group's name, e.g. ``library``:
    its patterns), with ``fused_fp32``, the reference of the ratios, always first.

    Raises:
        argparse.ArgumentTypeError: an unknown name, or none.
    """
    names = ["fused_fp32"]
    given = [part.strip() for part in text.split(",") if part.strip()]
    if not given:
        raise argparse.ArgumentTypeError(f"expected pattern names, comma-separated, got {text!r}")
    for name in given:
        expanded = cluster_patterns.GROUPS.get(name, [name])
        for one in expanded:
            if one not in KNOWN_PATTERNS:
                raise argparse.ArgumentTypeError(
                    f"unknown pattern {one!r}: expected one of "
                    f"{', '.join(cluster_patterns.GROUPS)} or {', '.join(KNOWN_PATTERNS)}")
            if one not in names:
                names.append(one)
    return tuple(names)


def simulated_links(probe: dict, intra_seconds: Dict[str, float], intra_numel: int,
                    kernels: Dict[str, float]) -> step_model.Links:
    """The model's figures for the simulated cluster: the NIC (one per node) from the
    probe's all_reduce bus bandwidth between nodes, the loopback from each intra
    kind's time on ``intra_numel`` fp32 elements (bus bytes / seconds), half a gloo
    round trip per ring step."""
    local = probe["ranks_per_node"]
    intra = {kind: step_model.bus_factor(kind, local) * intra_numel * 4 / seconds
             for kind, seconds in intra_seconds.items()}
    sources = {"nic_bw": "Cluster.probe(): all_reduce busbw between nodes",
               "intra_bw": "the runner's loopback probe, round-robin with the patterns on "
                           "their buffer, every node at once, per kind",
               "latency": "Cluster.probe(): half of gloo's round trip per ring step"}
    return step_model.Links(
        name="simulated cluster", ranks_per_node=local,
        intra_bw=intra["all_reduce"], nic_bw=probe["inter_all_reduce"]["bus_gbit_s"] * 1e9 / 8,
        nics_per_node=1, call_latency=0.0, intra_latency=probe["local_rtt_s"] / 2,
        inter_latency=probe["inter_rtt_s"] / 2, flatten_bw=kernels["flatten"],
        unflatten_bw=kernels["unflatten"], sources=sources, intra_kind_bw=intra)


def _reference(name: str) -> Dict[str, str]:
    """The rows ``name``'s ratios are taken against: time against the flat
    all-reduce (the library's own for a library pattern), bytes against the
    fp32 two-level layout; a wire gathered back in fp32 against the same wire
    gathered in its format, a training step against DDP's."""
    if name.endswith("_gather_fp32"):
        return {"time": name[:-len("_gather_fp32")], "bytes": name[:-len("_gather_fp32")]}
    if name.startswith("step_"):
        return {"time": "step_ddp", "bytes": "step_ddp"}
    if name.startswith("library_sharded"):
        return {"time": "library_sharded", "bytes": "library_sharded"}
    if name.startswith("library_"):
        return {"time": "library_flat", "bytes": "library_two_level"}
    return {"time": "fused_fp32", "bytes": "two_level_fp32"}


def check_cluster(numel: int, repeats: int, rate: str, kernels: Dict[str, float],
                  timeout: float = 600.0, patterns: Sequence[str] = CHECK_PATTERNS) -> dict:
    """Measure ``patterns`` (``fused_fp32`` among them) on a 2 x 2 simulated cluster
    and the model's communication time for each (none where the model has no
    such strategy: deterministic, gathered in fp32, the native reduce-scatter,
    training steps; a library pattern's measured time is its whole call, kernel
    passes included, a step pattern's its whole training step).

    Raises:
        fusedreduce.bench.cluster.ClusterUnavailable: no root, no ``ip``/``tc``.
        ValueError: ``patterns`` without ``fused_fp32``.
    """
    if "fused_fp32" not in patterns:
        raise ValueError(f"patterns must include 'fused_fp32', got {tuple(patterns)}")
    local = 2
    numel = cluster_patterns.padded_numel(numel, 2 * local)
    with cluster.Cluster(nodes=2, ranks_per_node=local, rate=rate) as sim:
        probe = sim.probe()
        measured = sim.run(cluster_patterns.run_patterns, local, numel,
                           tuple(patterns) + ("loopback",), repeats, timeout=timeout)[0]
    intra = {phase.split()[0]: statistics.median(step[phase]
                                                 for step in measured["steps"]["loopback"])
             for phase in measured["steps"]["loopback"][0]}
    links = simulated_links(probe, intra, numel, kernels)
    rows = []
    for name in patterns:
        model = LIBRARY_MODEL.get(name, name if name in CHECK_PATTERNS else None)
        predicted = (step_model.predict(model, measured["numel"], 2, links)
                     if model else None)
        expected = predicted and predicted["comm_ms"]
        comm = cluster_patterns.comm_seconds(measured["steps"][name])
        median = statistics.median(comm) * 1e3
        elements = (cluster_step.parameter_count() if name in cluster_step.STEP_PATTERNS
                    else measured["numel"])
        rows.append({"strategy": name, "numel": elements,
                     "predicted_ms": expected, "measured_ms": median,
                     "measured_ms_min": min(comm) * 1e3, "measured_ms_max": max(comm) * 1e3,
                     "error": None if expected is None else expected / median - 1,
                     "predicted_egress_bytes": predicted and predicted["node_egress_bytes"],
                     "measured_egress_bytes": statistics.median(measured["tx_bytes"][name]),
                     "max_error": measured["max_error"].get(name),
                     "measured_phases_ms": {phase: statistics.median(
                         step[phase] for step in measured["steps"][name]) * 1e3
                         for phase in measured["steps"][name][0]},
                     "predicted_phases_ms": predicted and predicted["phases_ms"]})
    by_name = {row["strategy"]: row for row in rows}
    ratios = {}
    for name, row in by_name.items():
        reference = _reference(name)
        flat = by_name.get(reference["time"])
        if flat is not None and flat is not row:
            ratios[f"{name} speed-up over {flat['strategy']}"] = (flat["measured_ms"]
                                                                 / row["measured_ms"])
    for name, row in by_name.items():
        fp32 = by_name.get(_reference(name)["bytes"])
        if fp32 is not None and fp32 is not row:
            ratios[f"{name} egress bytes / {fp32['strategy']}'s"] = (
                row["measured_egress_bytes"] / fp32["measured_egress_bytes"])
    errors = [abs(row["error"]) for row in rows if row["error"] is not None]
    return {"probe": probe, "intra_seconds": intra, "links": _links_record(links),
            "repeats": repeats, "rows": rows, "ratios": ratios,
            "max_abs_error": max(errors)}


def _links_record(links: step_model.Links) -> dict:
    record = {name: getattr(links, name) for name in (
        "name", "ranks_per_node", "intra_bw", "nic_bw", "nics_per_node", "call_latency",
        "intra_latency", "inter_latency", "flatten_bw", "unflatten_bw")}
    record["intra_kind_bw"] = dict(links.intra_kind_bw)
    record["sources"] = dict(links.sources)
    return record


# ------------------------------------------------------------------- printing

def _table(rows: Sequence[dict], node_counts: Sequence[int]) -> str:
    """Strategy x nodes: communication ms / step ms, and the bytes one NIC sends."""
    table = []
    for name in dict.fromkeys(row["strategy"] for row in rows):
        line = {"strategy": name}
        for row in (r for r in rows if r["strategy"] == name):
            line[f"n{row['nodes']}"] = (f"{row['comm_ms']:.3g} / {row['step_ms']:.3g}"
                                        f" ({row['nic_bytes'] / 1e6:.3g} MB)")
        table.append(line)
    columns = [("strategy", "strategy", "")] + [
        (f"{n} node{'s' if n > 1 else ''} ({n * H100.ranks_per_node} GPUs)", f"n{n}", "")
        for n in node_counts]
    return common.format_table(table, columns)


def format_check(check: dict) -> str:
    columns = [("strategy", "strategy", ""), ("elements", "numel", ",d"),
               ("predicted ms", "predicted_ms", ".4g"), ("measured ms", "measured_ms", ".4g"),
               ("min ms", "measured_ms_min", ".4g"), ("max ms", "measured_ms_max", ".4g"),
               ("error", "error", "+.1%"),
               ("predicted MB/node", "predicted_egress_bytes", lambda v: f"{v / 1e6:.4g}"),
               ("measured MB/node", "measured_egress_bytes", lambda v: f"{v / 1e6:.4g}")]
    lines = [cluster.format_probe(check["probe"]),
             "#   loopback, every node at once: " + ", ".join(
                 f"{kind} {bw / 1e9:.3f} GB/s busbw"
                 for kind, bw in check["links"]["intra_kind_bw"].items()),
             f"# communication time per step, median of {check['repeats']} (the slowest "
             f"rank's, phase by phase); MB/node: bytes sent by each node's link per step "
             f"(tx_bytes, TCP/IP headers included)",
             common.format_table(check["rows"], columns),
             f"# largest |error|: {check['max_abs_error']:.1%}"]
    lines += [f"# {name}: {value:.3f}" for name, value in check["ratios"].items()]
    return "\n".join(lines)


def _one_size(text: str) -> int:
    """``--check-size``: one element count (a list would run its first only)."""
    sizes = common.parse_sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"expected one element count, got {text!r}")
    return sizes[0]


def _rate(text: str) -> str:
    """``--rate``: a tc-style rate, checked before any cluster is made."""
    try:
        cluster.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        NAME, help="predicted step time of each strategy at 1-16 nodes of 8 x H100 (a model "
                   "from published NCCL figures); --check-cluster: against the simulated "
                   "cluster (root)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=common.parse_sizes,
                        help="gradient sizes in elements (default 25.6M,1.3G)")
    parser.add_argument("--nodes", type=common.parse_counts,
                        default=DEFAULT_NODES, help="node counts (default 1,2,4,8,16)")
    parser.add_argument("--kernel-gbps", type=common.positive_number(float), metavar="GB/S",
                        help="the kernel passes' bytes moved per second for the GPU "
                             "prediction (default: measured on CUDA, else the H100 figure)")
    parser.add_argument("--nics-per-node", type=common.positive_number(int), metavar="K",
                        help="400 Gb/s NICs per 8-GPU node (default 8, one per GPU)")
    parser.add_argument("--compute-ms", type=common.positive_number(float, zero=True),
                        default=0.0,
                        help="forward + backward ms added to every step (default 0: the "
                             "step time is the reduction's part)")
    parser.add_argument("--check-cluster", action="store_true",
                        help="measure the patterns on the simulated 2 x 2 cluster (root) "
                             "and print the model's error")
    parser.add_argument("--check-size", type=_one_size, metavar="N",
                        help="elements of the check's buffer (default 25.6M, --quick 2M)")
    parser.add_argument("--rate", type=_rate, default="1gbit",
                        help="the check's link rate (default 1gbit)")
    parser.add_argument("--patterns", type=parse_patterns, default=CHECK_PATTERNS,
                        metavar="NAMES",
                        help="the check's patterns, comma-separated: "
                             f"{', '.join(KNOWN_PATTERNS)}, or a group: 'library' (the "
                             "library's DistributedGradReducer), 'gather' (each wire's "
                             "way back, wire format against fp32), 'deterministic' "
                             "(against the native collectives), 'step' (a training step, "
                             "DDP against the library), 'sharded' (the sharded "
                             "optimizer's step, flat and on two levels); fused_fp32 "
                             "always runs (default: "
                             "the non-library ones)")
    parser.add_argument("--repeats", type=common.positive_number(int),
                        help="timed repeats (default 5, --quick 3)")
    parser.add_argument("--quick", action="store_true", help="small measurements")
    parser.add_argument("--json", type=output_files.output_file,
                                  metavar="PATH", help="write every figure here")


def main(args: argparse.Namespace) -> int:
    device = common.one_device("auto")
    repeats = args.repeats or (3 if args.quick else 5)
    sizes = args.sizes or DEFAULT_SIZES
    kernels = measure_kernels(250_000 if args.quick else 4_000_000, repeats, device)
    links = H100
    if args.kernel_gbps is not None:
        links = H100.with_kernels(args.kernel_gbps * 1e9, args.kernel_gbps * 1e9,
                                  "--kernel-gbps")
    elif device.type == "cuda":
        links = H100.with_kernels(kernels["flatten"], kernels["unflatten"],
                                  f"measured here on {torch.cuda.get_device_name(device)}")
    if args.nics_per_node is not None:
        links = dataclasses.replace(links, nics_per_node=args.nics_per_node, sources={
            **links.sources, "nics_per_node": f"{args.nics_per_node} (--nics-per-node)"})
    rows = step_model.predictions(step_model.STRATEGIES, sizes, args.nodes, links,
                                  args.compute_ms / 1e3)
    print(f"# predictions (not measurements) for {links.name}; per cell: communication ms / "
          f"step ms (MB through one NIC per step)")
    for name, source in links.sources.items():
        print(f"#   {name}: {source}")
    print(f"# kernels measured here ({device}): flatten {kernels['flatten'] / 1e9:.3g} GB/s, "
          f"unflatten {kernels['unflatten'] / 1e9:.3g} GB/s moved")
    for assumption in ASSUMPTIONS:
        print(f"# - {assumption}")
    for numel in sizes:
        print(f"\n## {common.format_count(numel)} fp32 gradient elements "
              f"({numel * 4 / 1e9:.3g} GB), compute {args.compute_ms:g} ms")
        print(_table([row for row in rows if row["numel"] == numel], args.nodes))
    check = None
    if args.check_cluster:
        numel = args.check_size or (QUICK_CHECK_SIZE if args.quick else CHECK_SIZE)
        try:
            check = check_cluster(numel, repeats, args.rate, kernels,
                                  patterns=args.patterns)
        except cluster.ClusterUnavailable as exc:
            raise SystemExit(f"model --check-cluster: {exc}") from None
        print("\n## the model against the simulated cluster (2 nodes x 2 gloo ranks)")
        print(format_check(check))
    if args.json:
        record = {"links": _links_record(links), "kernels_here": kernels,
                  "assumptions": ASSUMPTIONS, "predictions": rows, "check": check}
        with output_files.open_output(args.json) as handle:
            json.dump(record, handle, indent=1, allow_nan=False)
        common.log(f"wrote {args.json}")
    return 0
