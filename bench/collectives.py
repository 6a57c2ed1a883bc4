"""Collective benchmark: the fused reducer against per-tensor all_reduce and DDP, on N local ranks.

Two kinds of measurement, each on ``--world-size`` local processes (gloo on the
CPU, NCCL when there is a GPU per rank):

Gradient reduction alone (ResNet-50's 161 gradient tensors, fp32, mean):

- ``per_tensor``: one ``dist.all_reduce`` per gradient, then ``/ world_size``.
- ``torch_buckets``: what DDP does by hand: 25 MiB buckets packed with
  ``_flatten_dense_tensors``, one all-reduce each, unpacked with copies.
- ``fused_reducer``: ``DistributedGradReducer(params)(grads)``: fused
  flatten/cast/scale, one all-reduce per 25 MiB bucket, fused unflatten; new
  output tensors every call (the API's contract), persistent flat buffers.

A training step (forward + backward of ResNet-50 on a small batch, gradients
reduced by the time backward returns):

- ``compute_only``: no communication, the floor.
- ``ddp``: ``DistributedDataParallel(model, bucket_cap_mb=25)``.
- ``fused_overlap``: the plain model with ``DistributedGradReducer.register_hooks()``:
  buckets all-reduced during backward, the same 25 MiB cap.

Times are the median over ``--repeats`` calls (after a warm-up), each call
started after a barrier and timed as the slowest rank's wall time.
"""
from __future__ import annotations

import argparse
import time
from typing import List

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fusedreduce import DistributedGradReducer

from . import common
from .models import resnet50

BUCKET_CAP_MB = 25.0
REDUCE_METHODS = ("per_tensor", "torch_buckets", "fused_reducer")
STEP_METHODS = ("compute_only", "ddp", "fused_overlap")
RESULT_FIELDS = ("kind", "method", "world_size", "n_tensors", "n_elements", "bytes", "time_ms",
                 "ratio_to_baseline", "baseline")


def _torch_buckets(grads: List[torch.Tensor], world_size: int) -> None:
    cap = int(BUCKET_CAP_MB * 2 ** 20)
    bucket: List[torch.Tensor] = []
    size = 0

    def flush():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(reduced)

    for g in grads:
        if bucket and size + g.numel() * g.element_size() > cap:
            flush()
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        flush()


def _rank_body(rank, world_size, config):
    torch.manual_seed(0)
    model = resnet50(width=config["width"])
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    reducer = DistributedGradReducer(params, bucket_cap_mb=BUCKET_CAP_MB)

    def per_tensor():
        for g in grads:
            dist.all_reduce(g)
            g.div_(world_size)

    reduce_times = common.time_across_ranks(
        {"per_tensor": per_tensor, "torch_buckets": lambda: _torch_buckets(grads, world_size),
         "fused_reducer": lambda: reducer(grads)}, config["repeats"])

    batch = torch.randn(config["batch"], 3, config["image"], config["image"], generator=gen)
    labels = torch.randint(0, 1000, (config["batch"],), generator=gen)
    plain = resnet50(width=config["width"])
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        resnet50(width=config["width"]), bucket_cap_mb=BUCKET_CAP_MB)
    hooked = resnet50(width=config["width"])
    DistributedGradReducer(list(hooked.parameters()),
                           bucket_cap_mb=BUCKET_CAP_MB).register_hooks()

    def step(net):
        def run():
            net.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(net(batch), labels).backward()
        return run

    step_times = common.time_across_ranks(
        {"compute_only": step(plain), "ddp": step(ddp_model), "fused_overlap": step(hooked)},
        config["steps"])
    n = sum(p.numel() for p in params)
    return {"reduce": reduce_times, "step": step_times, "n_tensors": len(params),
            "n_elements": n}


def measure(world_size: int, config: dict) -> List[dict]:
    outcome = common.run_on_ranks(_rank_body, world_size, config)
    record = outcome[0]
    nbytes = record["n_elements"] * 4
    results = []
    for kind, methods, baseline in (("reduce", REDUCE_METHODS, "per_tensor"),
                                    ("step", STEP_METHODS, "ddp")):
        times = record[kind]
        for method in methods:
            results.append({"kind": kind, "method": method, "world_size": world_size,
                            "n_tensors": record["n_tensors"], "n_elements": record["n_elements"],
                            "bytes": nbytes, "time_ms": times[method],
                            "ratio_to_baseline": times[baseline] / times[method],
                            "baseline": baseline})
    return results


TABLE = [("world", "world_size", "d"), ("kind", "kind", ""), ("method", "method", ""),
         ("ms", "time_ms", ".1f"), ("speed-up vs", "baseline", ""),
         ("x", "ratio_to_baseline", ".2f")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a quarter-width ResNet-50 and tiny images: seconds, not minutes")
    parser.add_argument("--world-size", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 4], help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed reductions per method, median kept (default 7)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed training steps per method, median kept (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    config = {"width": 16 if args.quick else 64, "batch": 2, "image": 32 if args.quick else 64,
              "repeats": args.repeats, "steps": args.steps}
    machine = common.machine_info(torch.device("cpu"), "gloo")
    started = time.perf_counter()
    results: List[dict] = []
    for world_size in args.world_size:
        common.log(f"{world_size} ranks ...")
        results += measure(world_size, config)
    print(f"# {machine['cpu']} ({machine['cpu_count']} cores); torch {machine['torch']}; gloo; "
          f"ResNet-50 width {config['width']}: {results[0]['n_tensors']} tensors, "
          f"{results[0]['n_elements']:,} fp32 elements; step: batch {config['batch']} x "
          f"{config['image']}x{config['image']} per rank")
    print(common.format_table(results, TABLE, group_by=("world_size", "kind")))
    print(f"# {time.perf_counter() - started:.1f} s")
    if args.json:
        common.write_json(args.json, machine, dict(config, benchmark="collectives",
                                                   world_sizes=args.world_size), results)
    return 0
