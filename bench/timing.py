"""How the benchmarks time a call: round-robin on one process, across ranks, or on the GPU alone."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Mapping, Sequence

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_launches(fn: Callable[[], object], device: torch.device) -> int:
    """What one call of ``fn`` launches: on a GPU, the device kernels, copies
    and fills it runs (the profiler's CUDA events); on the CPU, the torch ops
    it dispatches from Python (the profiler's outermost ``aten::`` events; a
    foreach op is one). Either way, the per-op work the host does for it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def summary_ms(samples: Sequence[float]) -> Dict[str, float]:
    """``time_ms`` (the median call, which every derived figure uses) and
    ``time_ms_min`` (the fastest: the least disturbed when other work shares the machine)."""
    return {"time_ms": statistics.median(samples), "time_ms_min": min(samples)}


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeats: int,
                     device: torch.device) -> Dict[str, List[float]]:
    """``repeats`` wall times in ms of each function.

    The functions are timed round-robin, one call of each per round with the
    starting function rotating, rather than each in one burst: on a small,
    shared machine the noise drifts over seconds, and interleaving spreads it
    over every function instead of penalising whichever ran in a bad second.
    Callers warm the functions up first.
    """
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


#: bytes written between timed calls so that no call finds its data in L2 (an
#: H100 has 50 MB, an H200 60 MB)
L2_FLUSH_BYTES = 256 << 20
#: the longest spin queued ahead of a timed call (a host cost beyond a quarter of
#: it would show in the device figure; no fused call comes near)
MAX_SPIN_MS = 50.0


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per ms, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles // 10)  # clocks up from idle
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / max(start.elapsed_time(end), 1e-3)


def time_on_device(fns: Mapping[str, Callable[[], object]], repeats: int,
                   device: torch.device) -> Dict[str, List[float]]:
    """``repeats`` device times in ms per function: its GPU work alone, the host's
    launch cost excluded.

    Each timed call is queued behind a spin kernel that keeps the GPU busy for
    several times the call's host cost, so every kernel of the call is already
    queued when the start event runs: the events measure the device executing
    the call (kernels back to back, their gaps included) and never the GPU
    idling while Python prepares a launch. Timing with events alone, as
    ``triton.testing.do_bench`` does, adds whatever host time the call spends
    beyond the GPU's work before it: for a fused call over a model's 161
    tensors that is most of a 4M-element call's figure. The L2 cache is flushed
    before each call; functions are timed round-robin. The host cost is a
    separate figure (``host_cost.py``); a loop of calls runs at the larger of
    the two.
    """
    names = list(fns)
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    host_s = {}
    for name in names:  # each call's host cost, warm, queue empty, to size its spin
        fns[name]()
        synchronize(device)
        start = time.perf_counter()
        fns[name]()
        host_s[name] = min(time.perf_counter() - start, MAX_SPIN_MS / 4e3)
        synchronize(device)
    per_ms = _sleep_cycles_per_ms(device)
    events = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            flush.zero_()
            # 4x the host cost and 50 us more: enough to queue the call while the GPU spins
            torch.cuda._sleep(int((4 * host_s[name] * 1e3 + 0.05) * per_ms))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
        synchronize(device)  # the queue never holds more than one round
    return {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}


def time_across_ranks(fns: Mapping[str, Callable[[], object]], repeats: int,
                      device: torch.device) -> Dict[str, List[float]]:
    """``repeats`` times in ms per function, each the slowest rank's, round-robin.

    Every function runs once first as a warm-up. Each timed call starts after a
    barrier; its time is all-reduced with MAX, so every rank returns the same
    figures.
    """
    import torch.distributed as dist
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for name in names:
        fns[name]()
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            samples[name].append(float(elapsed) * 1e3)
    return samples
