"""A step-time model for data-parallel gradient reduction across nodes.

The alpha-beta cost of ring collectives, with the bus-bandwidth convention of
nccl-tests: per rank, an all-reduce moves ``2(n-1)/n`` of the buffer over its
busiest link, a reduce-scatter or an all-gather ``(n-1)/n``, an all-to-all
``(n-1)/n``. A strategy is a list of phases (a collective over the world,
over the ranks of one node, or across nodes between the ranks of one local
index) and a list of kernel passes (flatten, quantize, dequantize-sum,
unflatten). A phase costs its latency (a per-call base plus one step latency
per ring step, inside or across nodes, as NCCL's ``src/graph/tuning.cc``
counts them) plus the time of its busiest link: the node's fabric per rank
(NVLink per GPU; loopback on the simulated cluster) or one NIC (the node's
egress bytes shared by its NICs). A kernel pass costs the bytes it moves
(read + written) over a measured pass bandwidth. Phases and passes add up:
nothing overlaps (an upper bound for a pipelined implementation), and step
time is the reduction's passes and communication plus a given compute time.

Everything here is arithmetic on numbers (torch is imported only for the
library's ``WIRE_BLOCK``): ``docs/benchmarks/model.md`` derives each formula;
``model_bench`` measures and prints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Sequence, Tuple

from fusedreduce.kernels import WIRE_BLOCK

#: bytes of one fp32 gradient element
FP32 = 4
#: DDP's default bucket_cap_mb (25 MiB)
DDP_BUCKET_BYTES = 25 * 2 ** 20

#: bytes on the wire per gradient element: the codes, plus one fp32 scale per
#: block of the library's ``WIRE_BLOCK`` (128) elements
WIRE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float8_e4m3fn": 1.0 + FP32 / WIRE_BLOCK,
              "int8": 1.0 + FP32 / WIRE_BLOCK}

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
SCOPES = ("world", "intra", "cross")


def bus_factor(kind: str, n: int) -> float:
    """The share of a rank's buffer each rank sends in a ring (or pairwise)
    collective of ``n`` ranks: nccl-tests' busbw / algbw."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def ring_steps(kind: str, n: int) -> int:
    """Latency steps of the collective over ``n`` ranks: ``2(n-1)`` for a ring
    all-reduce, ``n-1`` for a ring reduce-scatter or all-gather (NCCL's
    ``nsteps``); an all-to-all sends to every peer at once: one step."""
    if n <= 1:
        return 0
    if kind == "all_to_all":
        return 1
    return int(round(bus_factor(kind, n) * n))


@dataclass(frozen=True)
class Links:
    """A cluster's figures: what each link gives, and what a kernel pass gives.

    Bandwidths in bytes per second (GB/s = 1e9), latencies in seconds.
    ``intra_bw`` is the bus bandwidth of one rank's link into its node's
    fabric; ``nic_bw`` one NIC's, and a node has ``nics_per_node`` of them;
    ``call_latency`` is paid once per collective call, ``intra_latency`` /
    ``inter_latency`` once per ring step inside a node / crossing nodes;
    ``flatten_bw`` / ``unflatten_bw`` are a flatten-like / unflatten-like
    pass's bytes moved (read + written) per second.

    Raises:
        ValueError: a count below 1, a bandwidth not positive and finite, a
            latency negative or infinite.
    """
    name: str
    ranks_per_node: int
    intra_bw: float
    nic_bw: float
    nics_per_node: int
    call_latency: float
    intra_latency: float
    inter_latency: float
    flatten_bw: float
    unflatten_bw: float
    sources: Dict[str, str] = field(default_factory=dict, compare=False)
    #: a collective kind's own bus bandwidth inside the node, where it differs
    #: from ``intra_bw`` (gloo's CPU collectives on the simulated cluster)
    intra_kind_bw: Dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nics_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("intra_bw", "nic_bw", "flatten_bw", "unflatten_bw"):
            if not getattr(self, name) > 0 or math.isinf(getattr(self, name)):
                raise ValueError(f"{name} must be a positive finite number, "
                                 f"got {getattr(self, name)!r}")
        for name in ("call_latency", "intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0 or math.isinf(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number >= 0, "
                                 f"got {getattr(self, name)!r}")

    def with_kernels(self, flatten_bw: float, unflatten_bw: float, source: str) -> "Links":
        """The same links with other kernel pass bandwidths (``source`` says whence)."""
        sources = {**self.sources, "flatten_bw": source, "unflatten_bw": source}
        return replace(self, flatten_bw=flatten_bw, unflatten_bw=unflatten_bw,
                       sources=sources)


@dataclass(frozen=True)
class Phase:
    """One collective: ``kind`` over ``scope`` on ``nbytes`` per rank, ``calls`` times
    (the buffer split into that many equal calls, as DDP's buckets)."""
    kind: str
    scope: str
    nbytes: float
    calls: int = 1


@dataclass(frozen=True)
class Traffic:
    """What one phase puts on each link, per step: bytes through one rank's
    link into the node's fabric, bytes through one NIC, and latency steps."""
    intra_bytes: float
    nic_bytes: float
    intra_steps: int
    inter_steps: int


def traffic(phase: Phase, nodes: int, links: Links) -> Traffic:
    """The bytes and steps of ``phase`` on ``nodes`` nodes of ``links``' shape.

    - ``intra`` (the L ranks of each node, every node at once): each rank's link
      carries ``factor(L)`` of the buffer; nothing leaves the node.
    - ``cross`` (the ``nodes`` ranks of one local index, every index at once):
      each rank sends ``factor(nodes)`` of the buffer off the node, so the node
      sends L times that, shared by its NICs.
    - ``world`` (all N = nodes x L ranks, numbered node by node): a ring
      passes every rank's link with ``factor(N)`` of the buffer and leaves each
      node once, so the node sends ``factor(N)`` of it, shared by its NICs
      (NCCL spreads its rings over the NICs); an all-to-all sends ``(N-L)/N``
      of every rank's buffer off the node and ``(L-1)/N`` inside it.
    """
    if phase.scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {phase.scope!r}")
    size = phase.nbytes / phase.calls
    local = links.ranks_per_node
    world = nodes * local
    intra = nic = 0.0
    intra_steps = inter_steps = 0
    if phase.scope == "intra":
        intra = bus_factor(phase.kind, local) * size
        intra_steps = ring_steps(phase.kind, local)
    elif phase.scope == "cross":
        nic = local * bus_factor(phase.kind, nodes) * size / links.nics_per_node
        inter_steps = ring_steps(phase.kind, nodes)
    elif phase.kind == "all_to_all":
        intra = (local - 1) / world * size
        nic = local * (world - local) / world * size / links.nics_per_node
        inter_steps = ring_steps(phase.kind, world) if nodes > 1 else 0
        intra_steps = ring_steps(phase.kind, world) if nodes == 1 else 0
    else:
        intra = bus_factor(phase.kind, world) * size
        nic = bus_factor(phase.kind, world) * size / links.nics_per_node if nodes > 1 else 0.0
        steps = ring_steps(phase.kind, world)
        inter_steps = ring_steps(phase.kind, nodes)
        intra_steps = steps - inter_steps
    return Traffic(intra * phase.calls, nic * phase.calls, intra_steps * phase.calls,
                   inter_steps * phase.calls)


def phase_seconds(phase: Phase, nodes: int, links: Links) -> float:
    """Latency plus the busiest link's time (0 for a phase that moves nothing)."""
    moved = traffic(phase, nodes, links)
    if moved.intra_bytes == 0 and moved.nic_bytes == 0:
        return 0.0
    latency = (phase.calls * links.call_latency + moved.intra_steps * links.intra_latency
               + moved.inter_steps * links.inter_latency)
    intra_bw = links.intra_kind_bw.get(phase.kind, links.intra_bw)
    return latency + max(moved.intra_bytes / intra_bw, moved.nic_bytes / links.nic_bw)


@dataclass(frozen=True)
class Pass:
    """One kernel pass over memory: ``nbytes`` moved (read + written); ``flatten``
    passes (flatten, quantize, dequantize-sum) run at the flatten bandwidth,
    the others (unflatten, dequantize into the gradients) at the unflatten one."""
    name: str
    nbytes: float
    flatten: bool = True


@dataclass(frozen=True)
class Strategy:
    """A reduction: its collectives and its kernel passes for one gradient buffer."""
    name: str
    wire: str
    layout: str
    phases: Tuple[Phase, ...]
    passes: Tuple[Pass, ...]


def strategy(name: str, numel: int, nodes: int, ranks_per_node: int) -> Strategy:
    """``name``'s phases and passes for ``numel`` fp32 gradient elements.

    Names: ``ddp`` (flat ring all-reduce of fp32 in 25 MiB buckets, one copy
    in and one out), ``fused_fp32`` (one flat all-reduce of the fused flat
    buffer), ``two_level_fp32`` (reduce-scatter in the node, all-reduce of
    the 1/L part across nodes, all-gather in the node), ``flat_<wire>`` and
    ``two_level_<wire>`` for wire in bfloat16, float8_e4m3fn, int8: the
    (node's part of the) buffer quantized in the flatten pass, all-to-all of
    the codes and scales, dequantize-sum of the chunks in fp32, the summed
    chunk quantized again and all-gathered in the wire format, dequantized;
    two-level reduce-scatters in fp32 inside the node first and all-gathers
    the fp32 part inside the node last.

    Raises:
        ValueError: an unknown name, or sizes below 1.
    """
    if numel < 1 or nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"numel, nodes and ranks_per_node must be positive, got "
                         f"{numel}, {nodes}, {ranks_per_node}")
    whole = numel * FP32
    flatten, unflatten = Pass("flatten", 2 * whole), Pass("unflatten", 2 * whole, False)
    if name == "ddp":
        calls = max(1, math.ceil(whole / DDP_BUCKET_BYTES))
        return Strategy(name, "float32", "flat", (Phase("all_reduce", "world", whole, calls),),
                        (Pass("copy in", 2 * whole), Pass("copy out", 2 * whole, False)))
    if name == "fused_fp32":
        return Strategy(name, "float32", "flat", (Phase("all_reduce", "world", whole),),
                        (flatten, unflatten))
    if name == "two_level_fp32":
        part = whole / ranks_per_node
        return Strategy(name, "float32", "two_level",
                        (Phase("reduce_scatter", "intra", whole),
                         Phase("all_reduce", "cross", part),
                         Phase("all_gather", "intra", whole)),
                        (flatten, unflatten))
    if name.startswith("flat_"):
        layout, wire = "flat", name[len("flat_"):]
    elif name.startswith("two_level_"):
        layout, wire = "two_level", name[len("two_level_"):]
    else:
        layout = wire = None
    if wire not in WIRE_BYTES or wire == "float32":
        raise ValueError(f"unknown strategy {name!r}: expected one of {STRATEGIES}")
    ratio = WIRE_BYTES[wire] / FP32
    if layout == "flat":
        # every rank's whole buffer goes on the wire: quantized in the flatten
        # pass, dequantized in the unflatten pass
        scope, group, elements = "world", nodes * ranks_per_node, numel
        passes = (Pass("quantize in flatten", whole * (1 + ratio)),)
        last = (Pass("dequantize in unflatten", whole * (1 + ratio), False),)
        head = tail = ()
    else:
        # the node's fp32 sum of this rank's 1/L part goes on the wire
        scope, group, elements = "cross", nodes, numel / ranks_per_node
        part = elements * FP32
        passes = (flatten, Pass("quantize the part", part * (1 + ratio)))
        last = (Pass("dequantize the part", part * (1 + ratio), False), unflatten)
        head = (Phase("reduce_scatter", "intra", whole),)
        tail = (Phase("all_gather", "intra", whole),)
    codes = elements * WIRE_BYTES[wire]
    chunk = elements * FP32 / group  # this rank's summed chunk, fp32
    passes += (Pass("dequantize-sum", codes + chunk),
               Pass("quantize the sum", chunk * (1 + ratio))) + last
    phases = head + (Phase("all_to_all", scope, codes), Phase("all_gather", scope, codes)) + tail
    return Strategy(name, wire, layout, phases, passes)


STRATEGIES = ("ddp", "fused_fp32", "two_level_fp32", "flat_bfloat16", "two_level_bfloat16",
              "flat_float8_e4m3fn", "two_level_float8_e4m3fn", "flat_int8", "two_level_int8")


def predict(name: str, numel: int, nodes: int, links: Links, compute_s: float = 0.0) -> dict:
    """One prediction: communication, kernel passes and step milliseconds, and
    the bytes each link carries per step (``nic_bytes``: through one NIC;
    ``node_egress_bytes``: leaving one node; ``intra_bytes``: one rank's link
    in its node).

    Raises:
        ValueError: an unknown strategy ``name`` (see ``STRATEGIES``), or a
            size below 1.

    Examples:
        >>> links = Links("2 ranks a node", ranks_per_node=2, intra_bw=10e9, nic_bw=1e9,
        ...               nics_per_node=1, call_latency=0.0, intra_latency=0.0,
        ...               inter_latency=0.0, flatten_bw=5e9, unflatten_bw=5e9)
        >>> flat = predict("fused_fp32", 1_000_000, 2, links)
        >>> flat["node_egress_bytes"] / 4e6  # 2(N-1)/N of the fp32 buffer, N = 4
        1.5
        >>> round(flat["comm_ms"], 3)  # the NIC is the busiest link: 6 MB at 1 GB/s
        6.0
    """
    plan = strategy(name, numel, nodes, links.ranks_per_node)
    moved = [traffic(phase, nodes, links) for phase in plan.phases]
    comm = sum(phase_seconds(phase, nodes, links) for phase in plan.phases)
    kernels = sum(p.nbytes / (links.flatten_bw if p.flatten else links.unflatten_bw)
                  for p in plan.passes)
    nic = sum(t.nic_bytes for t in moved)
    by_scope = {scope: sum(phase_seconds(p, nodes, links) for p in plan.phases
                           if p.scope == scope) for scope in SCOPES}
    # phases on different links overlapped perfectly across buckets: a lower bound
    pipelined = by_scope["world"] + max(by_scope["intra"], by_scope["cross"])
    return {"strategy": name, "wire": plan.wire, "layout": plan.layout, "nodes": nodes,
            "ranks": nodes * links.ranks_per_node, "numel": numel,
            "comm_ms": comm * 1e3, "comm_pipelined_ms": pipelined * 1e3,
            "kernel_ms": kernels * 1e3, "compute_ms": compute_s * 1e3,
            "step_ms": (compute_s + kernels + comm) * 1e3,
            "nic_bytes": nic, "node_egress_bytes": nic * links.nics_per_node,
            "intra_bytes": sum(t.intra_bytes for t in moved),
            "phases_ms": {f"{p.kind} {p.scope}": phase_seconds(p, nodes, links) * 1e3
                          for p in plan.phases}}


def predictions(names: Sequence[str], sizes: Sequence[int], node_counts: Sequence[int],
                links: Links, compute_s: float = 0.0) -> List[dict]:
    """``predict`` for every size, strategy and node count, in that order."""
    return [predict(name, numel, nodes, links, compute_s)
            for numel in sizes for name in names for nodes in node_counts]
