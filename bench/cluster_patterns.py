"""Gradient-reduction communication patterns timed on gloo ranks, phase by phase.

A pattern is built once per rank from the process groups (``Groups``: the
world, this rank's node, and the ranks of its local index on every node) and
a flat fp32 gradient buffer, and returns a step: a call that reduces the
buffer (the sum over every rank) and returns the seconds of each of its
collectives, each timed from a barrier, and the sum. ``PATTERNS`` (plain
``torch.distributed`` calls), ``LIBRARY_PATTERNS`` (the library's reducer) and
``SHARDED_PATTERNS`` (its sharded optimizer's step) are the tables the runner
reads.

- ``fused_fp32``: one all-reduce of the buffer over the world.
- ``two_level_fp32``: reduce-scatter inside the node, all-reduce of this
  rank's 1/L part across nodes, all-gather inside the node.
- ``two_level_<wire>`` (``bfloat16``, ``float8_e4m3fn``, ``int8``):
  reduce-scatter in fp32 inside the node; the part quantized by the library's
  ``quantize_flatten`` (bf16, or int8/e4m3 codes with one fp32 scale per
  ``WIRE_BLOCK`` elements), codes and scales packed per destination (as int32
  words) and exchanged across nodes by one all-to-all; the received chunks
  dequantized and summed by ``dequantize_sum`` (fp32, its fixed pairwise
  order); the summed chunk quantized again and all-gathered across nodes in
  the wire format; dequantized; all-gathered inside the node in fp32. The
  kernel passes between the collectives are not timed.
- ``library_*``: ``DistributedGradReducer`` called on the buffer cut into
  gradients, with ``local_size``, ``wire_dtype`` or ``deterministic``: one
  phase, the whole call, kernel passes included. ``*_gather_fp32``: the
  wire's summed chunks gathered back in fp32 (``WireSum.gather_wire`` off
  during the call) instead of in the wire format.
- ``library_sharded*``: ``DistributedOptimizer(shard=True)`` on parameters
  shaped like those gradients, with ``local_size`` and ``wire_dtype``: one
  phase, backward and ``step()`` (the reduce-scatter, SGD on the part and the
  parameters' all-gather).
- ``reduce_scatter_fp32``: the native reduce-scatter of the buffer over the
  world, then its all-gather: what ``deterministic=True`` replaces.
- ``step_*`` (``cluster_step``): a whole training step, DDP against the
  library's optimizer; no sum to check.

``GROUPS`` names the sets the command line takes (``--patterns gather``).

``run_patterns`` runs on every rank of a cluster (``Cluster.run``): it counts
the bytes each node's link sent during each step (``tx_bytes`` of the node's
interface, read from ``/proc/self/net/dev``, which follows the rank's network
namespace) and returns, on rank 0, every step's slowest-rank phase times.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fusedreduce import DistributedGradReducer, DistributedOptimizer
from fusedreduce.kernels import WIRE_BLOCK, dequantize_sum, quantize_flatten, wire_scale_count
from fusedreduce.wire_collectives import WireSum

from .cluster_step import STEP_PATTERNS

Step = Callable[[], Tuple[Dict[str, float], torch.Tensor]]


@dataclass
class Groups:
    """This rank's place: its node's group and its local index's group across nodes."""
    rank: int
    world_size: int
    local_size: int
    intra: object
    cross: object

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size


def make_groups(rank: int, world_size: int, local_size: int) -> Groups:
    """Every node's group and every local index's group (all ranks make every
    group, in the same order, as ``dist.new_group`` requires).

    Raises:
        ValueError: ``world_size`` not a multiple of ``local_size``.
    """
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size must divide world_size {world_size}, got {local_size}")
    nodes = world_size // local_size
    intra = [dist.new_group(list(range(k * local_size, (k + 1) * local_size)))
             for k in range(nodes)]
    cross = [dist.new_group(list(range(i, world_size, local_size))) for i in range(local_size)]
    return Groups(rank, world_size, local_size, intra[rank // local_size],
                  cross[rank % local_size])


def _timed(times: Dict[str, float], name: str, collective: Callable[[], object]) -> None:
    dist.barrier()
    started = time.perf_counter()
    collective()
    times[name] = times.get(name, 0.0) + time.perf_counter() - started


def _pack(codes: torch.Tensor, scales: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """Codes and scales as one int32 tensor of ``rows`` rows (one per destination),
    so one all-to-all carries both: the wire's bytes in 4-byte words, which
    gloo moved no slower than 1-byte elements (``docs/benchmarks/model.md``)."""
    parts = [codes.view(torch.uint8).view(rows, -1)]
    if scales is not None:
        parts.append(scales.view(torch.uint8).view(rows, -1))
    return torch.cat(parts, dim=1).view(torch.int32)


def _unpack(packed: torch.Tensor, wire_dtype: torch.dtype, block: int):
    """``_pack``'s inverse, row by row: codes (rows, n) of ``wire_dtype`` and
    scales (rows, n/block), None for a wire without scales."""
    packed = packed.view(torch.uint8)
    width = packed.shape[1]
    itemsize = wire_dtype.itemsize
    if wire_scale_count(block, wire_dtype, block) == 0:
        return packed.view(wire_dtype), None
    n = width * block // (itemsize * block + 4)
    codes = packed[:, :n * itemsize].contiguous().view(wire_dtype)
    scales = packed[:, n * itemsize:].contiguous().view(torch.float32)
    return codes, scales


def _quantize(values: torch.Tensor, wire_dtype: torch.dtype, block: int):
    """``values`` (fp32) as codes of ``wire_dtype`` and their block scales (None
    for bf16), by the library's ``quantize_flatten``."""
    codes = torch.empty(values.numel(), dtype=wire_dtype)
    count = wire_scale_count(values.numel(), wire_dtype, block)
    scales = torch.empty(count) if count else None
    quantize_flatten([values], codes, scales, block=block)
    return codes, scales


def fused_fp32(groups: Groups, grads: torch.Tensor) -> Step:
    buffer = torch.empty_like(grads)

    def step():
        times: Dict[str, float] = {}
        buffer.copy_(grads)
        _timed(times, "all_reduce world", lambda: dist.all_reduce(buffer))
        return times, buffer
    return step


def two_level_fp32(groups: Groups, grads: torch.Tensor) -> Step:
    part = torch.empty(grads.numel() // groups.local_size)
    out = torch.empty_like(grads)

    def step():
        times: Dict[str, float] = {}
        _timed(times, "reduce_scatter intra",
               lambda: dist.reduce_scatter_tensor(part, grads, group=groups.intra))
        _timed(times, "all_reduce cross", lambda: dist.all_reduce(part, group=groups.cross))
        _timed(times, "all_gather intra",
               lambda: dist.all_gather_into_tensor(out, part, group=groups.intra))
        return times, out
    return step


def two_level_wire(groups: Groups, grads: torch.Tensor, wire_dtype: torch.dtype,
                   block: int = WIRE_BLOCK) -> Step:
    """Reduce-scatter in fp32 inside the node; the part in ``wire_dtype`` across
    nodes (all-to-all, ``dequantize_sum``, re-quantized, all-gathered); fp32
    all-gather inside the node."""
    nodes = groups.nodes
    part = torch.empty(grads.numel() // groups.local_size)
    chunk = part.numel() // nodes
    if chunk % block:
        raise ValueError(f"the buffer's numel must be a multiple of world_size x {block}")
    total = torch.empty(chunk)
    gathered_part = torch.empty_like(part)
    out = torch.empty_like(grads)

    def step():
        times: Dict[str, float] = {}
        _timed(times, "reduce_scatter intra",
               lambda: dist.reduce_scatter_tensor(part, grads, group=groups.intra))
        send = _pack(*_quantize(part, wire_dtype, block), nodes)
        received = torch.empty_like(send)
        _timed(times, "all_to_all cross",
               lambda: dist.all_to_all_single(received, send, group=groups.cross))
        dequantize_sum(*_unpack(received, wire_dtype, block), total, block=block)
        mine = _pack(*_quantize(total, wire_dtype, block), 1)
        every = torch.empty(nodes, mine.shape[1], dtype=mine.dtype)
        _timed(times, "all_gather cross",
               lambda: dist.all_gather_into_tensor(every, mine, group=groups.cross))
        codes, scales = _unpack(every, wire_dtype, block)
        rows = gathered_part.view(nodes, chunk)
        for r in range(nodes):
            dequantize_sum(codes[r:r + 1], None if scales is None else scales[r:r + 1],
                           rows[r], block=block)
        _timed(times, "all_gather intra",
               lambda: dist.all_gather_into_tensor(out, gathered_part, group=groups.intra))
        return times, out
    return step


#: gradient tensors a flat buffer is cut into for the library's reducer
LIBRARY_TENSORS = 16


def library(groups: Groups, grads: torch.Tensor, gather_wire: bool = True,
            **options) -> Step:
    """The library's ``DistributedGradReducer(mean=False, **options)`` called on
    the buffer cut into ``LIBRARY_TENSORS`` gradients: one phase, the whole
    call (its flatten / quantize and unflatten passes included), default
    buckets (25 MiB). ``gather_wire=False``: ``WireSum.gather_wire`` off during
    the call (a class attribute, read when a bucket's chunks are gathered, which
    on gloo is inside the call), so the summed chunks travel back in fp32."""
    pieces = tuple(torch.tensor_split(grads, LIBRARY_TENSORS))
    params = [torch.nn.Parameter(torch.zeros_like(piece)) for piece in pieces]
    reducer = DistributedGradReducer(params, mean=False, **options)
    results: List[Tuple[torch.Tensor, ...]] = []

    def reduce() -> None:
        results.append(reducer(pieces))

    def reduce_gathering_fp32() -> None:
        WireSum.gather_wire = False
        try:
            reduce()
        finally:
            WireSum.gather_wire = True

    def step():
        times: Dict[str, float] = {}
        results.clear()
        _timed(times, "reducer", reduce if gather_wire else reduce_gathering_fp32)
        return times, torch.cat(results[0])
    return step


def library_sharded(groups: Groups, grads: torch.Tensor, **options) -> Step:
    """The library's ``DistributedOptimizer(SGD(lr=1), shard=True,
    reduce_method="sum", **options)`` on ``LIBRARY_TENSORS`` parameters
    shaped like the buffer's pieces: one phase, backward (whose hooks flatten
    and reduce-scatter the buckets) and ``step()`` (the part's write-back,
    SGD on it, the parameters' all-gather). The loss is ``-sum(p * g)`` with
    the parameters zeroed before each step, so after it the parameters hold
    the sum of the ranks' gradients: the step's result, checked as the
    reducer's is."""
    pieces = tuple(torch.tensor_split(grads, LIBRARY_TENSORS))
    params = [torch.nn.Parameter(torch.zeros_like(piece)) for piece in pieces]
    optimizer = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), shard=True,
                                     reduce_method="sum", **options)

    def step():
        times: Dict[str, float] = {}
        with torch.no_grad():
            torch._foreach_zero_(params)

        def train_step():
            sum((p * -g).sum() for p, g in zip(params, pieces)).backward()
            optimizer.step()
            optimizer.zero_grad()
        _timed(times, "sharded step", train_step)
        return times, torch.cat([p.detach() for p in params])
    return step


def reduce_scatter_fp32(groups: Groups, grads: torch.Tensor) -> Step:
    """The native flat reduce-scatter over the world, then the all-gather."""
    part = torch.empty(grads.numel() // groups.world_size)
    out = torch.empty_like(grads)

    def step():
        times: Dict[str, float] = {}
        _timed(times, "reduce_scatter world",
               lambda: dist.reduce_scatter_tensor(part, grads))
        _timed(times, "all_gather world", lambda: dist.all_gather_into_tensor(out, part))
        return times, out
    return step


def loopback(groups: Groups, grads: torch.Tensor) -> Step:
    """Not a reduction: each collective kind inside the node on the buffer, every
    node at once, as the patterns run them (the model's loopback figures)."""
    buffer, out = torch.empty_like(grads), torch.empty_like(grads)
    part = torch.empty(grads.numel() // groups.local_size)

    def step():
        times: Dict[str, float] = {}
        buffer.copy_(grads)
        _timed(times, "all_reduce intra", lambda: dist.all_reduce(buffer, group=groups.intra))
        _timed(times, "reduce_scatter intra",
               lambda: dist.reduce_scatter_tensor(part, grads, group=groups.intra))
        _timed(times, "all_gather intra",
               lambda: dist.all_gather_into_tensor(out, part, group=groups.intra))
        return times, None
    return step


#: pattern name -> builder(groups, grads) -> step; a step returns (phase seconds, the sum)
PATTERNS: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {
    "fused_fp32": fused_fp32,
    "two_level_fp32": two_level_fp32,
    "two_level_bfloat16": functools.partial(two_level_wire, wire_dtype=torch.bfloat16),
    "two_level_float8_e4m3fn": functools.partial(two_level_wire,
                                                 wire_dtype=torch.float8_e4m3fn),
    "two_level_int8": functools.partial(two_level_wire, wire_dtype=torch.int8),
}
#: the library's own reducer on the same buffer, two ranks per node where node-aware
LIBRARY_PATTERNS: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {
    "library_flat": library,
    "library_two_level": functools.partial(library, local_size=2),
    "library_two_level_bfloat16": functools.partial(library, local_size=2,
                                                    wire_dtype=torch.bfloat16),
    "library_two_level_float8_e4m3fn": functools.partial(library, local_size=2,
                                                         wire_dtype=torch.float8_e4m3fn),
    "library_two_level_int8": functools.partial(library, local_size=2, wire_dtype=torch.int8),
    "library_deterministic": functools.partial(library, local_size=2, deterministic=True),
}
#: the library's sharded step (ZeRO-1) on the same buffer, two ranks per node where
#: node-aware
SHARDED_PATTERNS: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {
    "library_sharded": library_sharded,
    "library_sharded_two_level": functools.partial(library_sharded, local_size=2),
    "library_sharded_two_level_reduce_scatter": functools.partial(
        library_sharded, local_size=2, gradient_collective="reduce_scatter"),
    "library_sharded_two_level_bfloat16": functools.partial(library_sharded, local_size=2,
                                                            wire_dtype=torch.bfloat16),
    "library_sharded_two_level_int8": functools.partial(library_sharded, local_size=2,
                                                        wire_dtype=torch.int8),
}
#: the wire's chunks gathered back in fp32 instead of in the wire format
GATHER_FP32_PATTERNS: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {
    f"{name}_gather_fp32": functools.partial(LIBRARY_PATTERNS[name], gather_wire=False)
    for name in ("library_two_level_bfloat16", "library_two_level_float8_e4m3fn",
                 "library_two_level_int8")}
#: deterministic=True flat, and the native collectives it stands against
DETERMINISTIC_PATTERNS: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {
    "library_flat_deterministic": functools.partial(library, deterministic=True),
    "reduce_scatter_fp32": reduce_scatter_fp32,
}
#: the sets ``--patterns`` names, each a comparison run side by side
GROUPS: Dict[str, Tuple[str, ...]] = {
    "library": tuple(LIBRARY_PATTERNS),
    "gather": tuple(name for wire in GATHER_FP32_PATTERNS
                    for name in (wire[:-len("_gather_fp32")], wire)),
    "deterministic": ("library_flat", "library_flat_deterministic", "reduce_scatter_fp32",
                      "library_two_level", "library_deterministic"),
    "step": tuple(STEP_PATTERNS),
    "sharded": tuple(SHARDED_PATTERNS),
}
#: what the runner times beside the patterns: their steps return no sum
PROBES: Dict[str, Callable[[Groups, torch.Tensor], Step]] = {"loopback": loopback}


def tx_bytes(interface: str) -> int:
    """Bytes ``interface`` has sent, in this process's network namespace."""
    with open("/proc/self/net/dev") as handle:
        for line in handle:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])
    raise ValueError(f"no interface {interface!r} in this network namespace")


def padded_numel(numel: int, world_size: int, block: int = WIRE_BLOCK) -> int:
    """``numel`` rounded up to a whole block per rank (a blockwise layout pads so)."""
    unit = world_size * block
    return -(-numel // unit) * unit


def rank_gradients(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s gradients: reproducible normal values, the same on every run."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=generator)


def run_patterns(rank: int, world_size: int, local_size: int, numel: int,
                 names: Sequence[str], repeats: int, interface: Optional[str] = "fr0",
                 check: bool = True) -> Optional[dict]:
    """On every rank: each pattern run once untimed, then ``repeats`` times
    round-robin. Rank 0 returns ``{"steps": {name: [{phase: seconds} per
    step]}, "tx_bytes": {name: [bytes the busiest node sent per step]},
    "numel": the buffer's size, ``numel`` padded by ``padded_numel``,
    "max_error": {name: max |sum - float64 sum| of the untimed step}}`` (names
    from ``PATTERNS`` and ``PROBES``; a probe has no sum to check); the phase
    seconds are the slowest rank's. ``interface=None`` counts no bytes.
    """
    groups = make_groups(rank, world_size, local_size)
    numel = padded_numel(numel, world_size)
    grads = rank_gradients(rank, numel)
    builders = {**PATTERNS, **LIBRARY_PATTERNS, **GATHER_FP32_PATTERNS,
                **DETERMINISTIC_PATTERNS, **STEP_PATTERNS, **SHARDED_PATTERNS, **PROBES}
    steps = {name: builders[name](groups, grads) for name in names}
    record: dict = {"numel": numel, "steps": {name: [] for name in names},
                    "tx_bytes": {name: [] for name in names}, "max_error": {}}
    counting = interface is not None and rank % local_size == 0
    expected = None
    for name in names:
        _, result = steps[name]()
        if check and result is not None:
            if expected is None:
                expected = sum(rank_gradients(r, numel).double() for r in range(world_size))
            record["max_error"][name] = float((result - expected).abs().max())
    del expected
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in list(names[shift:]) + list(names[:shift]):
            dist.barrier()
            before = tx_bytes(interface) if counting else 0
            times, _ = steps[name]()
            dist.barrier()
            sent = torch.tensor([float(tx_bytes(interface) - before) if counting else 0.0])
            slowest = torch.tensor([times[phase] for phase in sorted(times)])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            record["steps"][name].append(dict(zip(sorted(times), slowest.tolist())))
            record["tx_bytes"][name].append(sent.item())
    return record if rank == 0 else None


def comm_seconds(steps: List[Dict[str, float]]) -> List[float]:
    """Each step's communication time: the sum of its phases."""
    return [sum(step.values()) for step in steps]
