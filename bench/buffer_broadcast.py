"""The per-step cost of keeping a model's buffers equal to rank 0's.

    python -m fusedreduce.bench.buffer_broadcast [--size 25.6M] [--rounds 200] [--world-size 2]

ResNet-50's buffers (``models.py``, scaled to ``--size``; at full size 53
BatchNorm layers: 53,120 fp32 statistics and 53 int64 counters, 0.2 MB) on
spawned gloo ranks, one torch thread each, broadcast from rank 0 by:

- ``broadcast_buffers``: ``DistributedOptimizer(..., buffers=model.buffers())``'s
  ``broadcast_buffers()``, what its ``step()`` runs (ours: one broadcast of
  their bytes, packed into a kept buffer);
- ``ddp_coalesced``: ``torch.distributed._broadcast_coalesced`` with DDP's
  250 MiB bucket, what DDP's ``broadcast_buffers=True`` runs before every
  forward (the baseline);
- ``broadcast_tensors``: ``fusedreduce.broadcast_tensors(buffers, 0)``, the
  one-shot function (checks the ranks and plans at every call);
- ``per_buffer``: one ``dist.broadcast`` per buffer.

The methods run round robin in the same ranks, each call after a barrier;
prints each method's median µs (the slower rank's) and its ratio to the
baseline's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from .common import parse_sizes

BASELINE = "ddp_coalesced"
#: DDP's bucket for its buffers' broadcast (its ``broadcast_bucket_size``, bytes)
DDP_BROADCAST_BYTES = 250 * 1024 * 1024


def rank_measure(rank: int, world_size: int, size: int, rounds: int):
    """(buffer count, bytes, {method: median µs}) on this rank."""
    from fusedreduce import DistributedOptimizer, broadcast_tensors
    from .models import resnet50_for_size

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = resnet50_for_size(size)
    buffers = list(model.buffers())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), buffers=buffers)
    methods = {
        "broadcast_buffers": opt.broadcast_buffers,
        BASELINE: lambda: dist._broadcast_coalesced(dist.group.WORLD, buffers,
                                                    DDP_BROADCAST_BYTES, 0),
        "broadcast_tensors": lambda: broadcast_tensors(buffers, 0),
        "per_buffer": lambda: [dist.broadcast(b, 0) for b in buffers],
    }
    for call in methods.values():  # warm-up: first calls plan and allocate
        call()
    times = {name: [] for name in methods}
    for _ in range(rounds):
        for name, call in methods.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    nbytes = sum(b.numel() * b.element_size() for b in buffers)
    return len(buffers), nbytes, {n: statistics.median(t) * 1e6 for n, t in times.items()}


def main(argv=None) -> None:
    from fusedreduce.local_ranks import run_on_local_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=lambda text: parse_sizes(text)[0], default=25_600_000,
                        help="ResNet-50's parameter count (25.6M: the full model)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    results = run_on_local_ranks(rank_measure, args.world_size, args.size, args.rounds,
                                 timeout=1800)
    count, nbytes, _ = results[0]
    print(f"ResNet-50 ({args.size:,} parameters) buffers: {count} tensors, {nbytes} bytes; "
          f"{args.world_size} gloo ranks, {args.rounds} rounds")
    slowest = {name: max(r[2][name] for r in results) for name in results[0][2]}
    for name, us in slowest.items():
        print(f"{name:20s} {us:10.1f} us  {us / slowest[BASELINE]:6.2f}x {BASELINE}")


if __name__ == "__main__":
    main()
