"""Two local gloo workers reduce a model's gradients through the fused path.

Run ``python examples/fused_allreduce.py`` (``--help`` for the options). Each
worker computes the gradients of a small convolutional network on its own
shard of a batch, averages them across workers with ``all_reduce_plan`` (fused
flatten/cast/scale kernels, one collective per bucket), and checks the result
against a float64 per-tensor reference. It prints the check and the time of
the fused reduction next to per-tensor ``all_reduce``. The workers are started
by ``fusedreduce.local_ranks.run_on_local_ranks``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import BucketPlan, all_reduce_plan
from fusedreduce.local_ranks import run_on_local_ranks


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2), nn.BatchNorm2d(4 * width),
        nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * width, 1024), nn.ReLU(), nn.Linear(1024, 1000))


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _worker(rank: int, world_size: int, width: int, repeats: int) -> dict:
    torch.manual_seed(0)  # the same model on every rank
    model = make_model(width)
    torch.manual_seed(1 + rank)  # a different shard of data on each
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 1000, (8,))
    nn.functional.cross_entropy(model(images), labels).backward()
    grads = [p.grad for p in model.parameters()]

    plan = BucketPlan(grads, comm_dtype=torch.float32)
    reduced = [torch.empty_like(g) for g in grads]
    buffers = [plan.new_buffer(b) for b in plan.buckets]

    def fused():
        all_reduce_plan(plan, grads, outputs=reduced, buffers=buffers,
                        postscale=1.0 / world_size)

    def per_tensor():
        for g in grads:
            dist.all_reduce(g.clone())

    fused_ms = _median_ms(fused, repeats)
    per_tensor_ms = _median_ms(per_tensor, repeats)

    # the reference: every tensor reduced on its own, in float64
    worst = 0.0
    for g, r in zip(grads, reduced):
        ref = g.double()
        dist.all_reduce(ref)
        ref /= world_size
        # fp32 communication: each of the world_size additions and the scale
        # round once, so the error is a few fp32 ulps of the largest magnitude
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, ((r.double() - ref).abs().max().item()) / scale)
    tolerance = 4 * world_size * torch.finfo(torch.float32).eps
    # bitwise agreement across ranks: gather every rank's result and compare
    flat = torch.cat([r.reshape(-1) for r in reduced])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(gathered[0], other) for other in gathered[1:])
    return {"n_tensors": len(grads), "n_elements": sum(g.numel() for g in grads),
            "buckets": len(plan), "fused_ms": fused_ms, "per_tensor_ms": per_tensor_ms,
            "worst": worst, "tolerance": tolerance, "identical": identical}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=64, help="channels of the first conv")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    # the workers share this machine's cores: don't oversubscribe them
    threads = max(1, (os.cpu_count() or 2) // args.world_size)
    result = run_on_local_ranks(_worker, args.world_size, args.width, args.repeats,
                                threads=threads)[0]
    print(f"fused all-reduce: {args.world_size} gloo workers, {result['n_tensors']} gradient "
          f"tensors, {result['n_elements'] / 1e6:.2f}M elements, {result['buckets']} bucket(s), "
          f"kernels backend: torch (CPU)")
    print(f"  fused mean all-reduce  : {result['fused_ms']:8.2f} ms (median of {args.repeats})")
    print(f"  per-tensor all_reduce  : {result['per_tensor_ms']:8.2f} ms "
          f"({result['per_tensor_ms'] / result['fused_ms']:.2f}x the fused time)")
    ok = result["worst"] <= result["tolerance"] and result["identical"]
    print(f"  vs float64 reference   : {'EQUAL' if ok else 'DIFFERENT'} (max relative error "
          f"{result['worst']:.2e}, tolerance {result['tolerance']:.1e}; bitwise identical on "
          f"all ranks: {result['identical']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
