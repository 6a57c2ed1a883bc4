"""Demo: two local gloo workers reduce a model's gradients through the fused path.

Run ``python -m fusedreduce.demo``. Each worker computes the gradients of a small
convolutional network on its own shard of a batch, averages them across workers
with ``all_reduce_plan`` (fused flatten/cast/scale kernels, one collective per
bucket), and checks the result against a float64 per-tensor reference. It prints
the check and the time of the fused reduction next to per-tensor ``all_reduce``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .buckets import BucketPlan
from .collectives import all_reduce_plan


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


def _worker(rank: int, world_size: int, init_file: str, width: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    # the workers share this machine's cores: don't oversubscribe them
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
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
    if rank == 0:
        n = sum(g.numel() for g in grads)
        print(f"fusedreduce demo: {world_size} gloo workers, {len(grads)} gradient tensors, "
              f"{n / 1e6:.2f}M elements, {len(plan)} bucket(s), kernels backend: "
              f"{'triton' if grads[0].is_cuda else 'torch (CPU)'}")
        print(f"  fused mean all-reduce  : {fused_ms:8.2f} ms (median of {repeats})")
        print(f"  per-tensor all_reduce  : {per_tensor_ms:8.2f} ms "
              f"({per_tensor_ms / fused_ms:.2f}x the fused time)")
        verdict = "EQUAL" if worst <= tolerance and identical else "DIFFERENT"
        print(f"  vs float64 reference   : {verdict} (max relative error {worst:.2e}, "
              f"tolerance {tolerance:.1e}; bitwise identical on all ranks: {identical})")
    dist.destroy_process_group()
    if worst > tolerance or not identical:
        raise SystemExit(1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=64, help="channels of the first conv")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world_size, os.path.join(tmp, "rendezvous"), args.width,
                                args.repeats), nprocs=args.world_size)


if __name__ == "__main__":
    main()
