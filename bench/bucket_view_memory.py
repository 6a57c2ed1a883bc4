"""Step time and peak memory of gradients as bucket views, against DDP's own option.

    python -m fusedreduce.bench.bucket_view_memory [--size 25.6M] [--steps 6] [--rounds 3]

A training step of ResNet-50 (``models.py``, scaled to ``--size``; a
2 x 3 x 32 x 32 batch per rank, fp32, 2 gloo ranks, one torch thread each,
``zero_grad(set_to_none=False)``) under four methods:

- ``ddp`` and ``ddp_bucket_view``: ``DistributedDataParallel(bucket_cap_mb=25,
  gradient_as_bucket_view=False/True)``;
- ``fused`` and ``fused_bucket_view``: the plain model with
  ``DistributedGradReducer(bucket_cap_mb=25).register_hooks(gradient_as_bucket_view=False/True)``.

Peak memory cannot be told apart when several models share a process, so
every method runs in fresh rank processes of its own, ``--rounds`` times, the
methods' order rotating: the figure is the rank's peak resident memory
(``ru_maxrss``) after its steps minus its peak before the model was built,
the larger of the two ranks'. Step time: the median of ``--steps`` steps after
two untimed ones, the slower rank's. Prints one line per method, every
round's figures side by side.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import DistributedGradReducer
from fusedreduce.local_ranks import run_on_local_ranks

from .common import parse_sizes
from .models import resnet50_for_size

METHODS = ("ddp", "ddp_bucket_view", "fused", "fused_bucket_view")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_step(rank: int, world_size: int, method: str, size: int, steps: int):
    """(median step ms, peak MB added) of ``method`` on this rank."""
    torch.set_num_threads(1)
    before = _peak_mb()
    torch.manual_seed(0)
    model = resnet50_for_size(size)
    net = model
    if method.startswith("ddp"):
        net = DistributedDataParallel(model, bucket_cap_mb=25,
                                      gradient_as_bucket_view=method == "ddp_bucket_view")
    else:
        DistributedGradReducer(list(model.parameters()), bucket_cap_mb=25).register_hooks(
            gradient_as_bucket_view=method == "fused_bucket_view")
    gen = torch.Generator().manual_seed(rank)
    images = torch.randn(2, 3, 32, 32, generator=gen)
    labels = torch.randint(0, model.num_classes, (2,), generator=gen)
    times = []
    for _ in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        net.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(images), labels).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3, _peak_mb() - before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.bucket_view_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=lambda text: parse_sizes(text)[0], default=25_600_000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results = {method: [] for method in METHODS}
    for round_ in range(args.rounds):
        shift = round_ % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            ranks = run_on_local_ranks(rank_step, 2, method, args.size, args.steps,
                                       timeout=1800)
            results[method].append((max(r[0] for r in ranks), max(r[1] for r in ranks)))
    for method in METHODS:
        steps = " ".join(f"{ms:7.1f}" for ms, _ in results[method])
        peaks = " ".join(f"{mb:6.0f}" for _, mb in results[method])
        print(f"{method:18s} step ms {steps}   peak MB added {peaks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
