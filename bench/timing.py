"""How the benchmarks time a call: round-robin on one process, across ranks, or by do_bench."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Mapping, Sequence

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_do_bench(fns: Mapping[str, Callable[[], object]]) -> Dict[str, List[float]]:
    """The times in ms of each function from ``triton.testing.do_bench`` (CUDA
    events, L2 flushed before every call, as many calls as fill 100 ms)."""
    from triton.testing import do_bench
    return {name: list(do_bench(fn, return_mode="all")) for name, fn in fns.items()}


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
