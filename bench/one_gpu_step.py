"""A whole training step with each user API on one device: what a single GPU can show.

    python -m fusedreduce.bench.one_gpu_step [--size 25.6M] [--batch 32] [--image 128]
                                             [--steps 15] [--device auto|cuda|cpu] [--json PATH]

The ``collectives`` benchmarks need two ranks or more, so a machine with one
GPU cannot run them. This runs one rank (NCCL on a GPU, gloo on the CPU):
every reduction is then a copy and a scaling, and what the figures show is the
per-step work each API adds around it — flattening, launches, hooks, the
layout checks — against DDP's C++ reducer doing the same. A ResNet-50
(``bench/models.py``, scaled to ``--size`` parameters) trains on a fixed
random batch, fp32, ``zero_grad(set_to_none=True)`` (torch's default), SGD:

- ``no_communication``: the plain model (the floor);
- ``ddp``, ``ddp_bucket_view`` (baselines): ``DistributedDataParallel``
  (25 MiB buckets), without and with ``gradient_as_bucket_view``;
- ``ddp_allreduce_hook``: DDP with ``fusedreduce.hooks.allreduce_hook``;
- ``reducer_hooks``, ``reducer_hooks_bucket_view``:
  ``DistributedGradReducer.register_hooks()``, without and with
  ``gradient_as_bucket_view``;
- ``reducer_call``: after backward, ``DistributedGradReducer(params)`` called
  on the gradients (MindSpore's way), its new tensors set as ``.grad``;
- ``distributed_optimizer``: ``DistributedOptimizer`` around SGD
  (``find_unused_parameters=False``: the model uses every parameter;
  ``param_pack_thd`` of 25 MiB, DDP's bucket size, as the other rows);
- ``distributed_optimizer_graph`` (CUDA only): the same step captured whole in
  a CUDA graph after an eager warm-up (``zero_grad(set_to_none=False)``, as
  capture needs; docs/guides/cuda-graphs.md), each step one ``replay()``;
- ``sharded_optimizer``, ``sharded_gradients_optimizer``: the same
  ``DistributedOptimizer`` with ``shard=True`` (ZeRO-1; on one rank the part
  is the whole bucket, and the step's all-gather a write-back) and with
  ``shard_gradients=True`` too (ZeRO-2: no flat buffer kept between steps,
  each made again in every backward and step).

Each method gets its own model, warms up five steps, then the methods are
timed round-robin (each step synchronised, ``perf_counter``); the table gives
the median step in ms, DDP's median over the method's, and the host's
median time per step in µs (from the call until it returns, before the
synchronisation: the time the host spends issuing the step), and how many
buckets the method's fusedreduce reducer holds (issue 26's aim for a
replayed step is 20 µs of host time per bucket at most). On a GPU, two
memory columns: ``held MB``, what the method's model, gradients, optimizer
and buffers hold between steps (``torch.cuda.memory_allocated`` after the
warm-up less before the model was made), and ``peak MB``, that plus the most
one more step allocated on top (``max_memory_allocated``).

Then ``COUNTED_STEPS`` more steps of each method, untimed, count what the
fused kernels' kept launches did per step (``kernels/_prepared.py``): calls
whose tensors were where the last call's were (``same``), calls at an
address list the launch keeps a binding for (``switched``: gradients the
allocator handed back where they were a few steps ago), calls re-pointed to
new addresses after a span check (``re-pointed``) and launches prepared
afresh (``prepared``). With ``zero_grad(set_to_none=True)`` which of these a
step gets depends on the allocator; this shows it. The last two columns count
the Triton kernel launches of those calls (the clipping norm's and AdaSum's
included): sent straight to the compiled kernel's launcher (``direct``,
``kernels/_launcher.py``) or through ``JITFunction.run`` (``via_jit``); the
torch fallback launches none.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import DistributedGradReducer, DistributedOptimizer, hooks
from fusedreduce.kernels import LAUNCH_OUTCOMES, count_launches
from fusedreduce.local_ranks import run_on_local_ranks

from . import common, output_files
from .models import resnet50_for_size

METHODS = ("no_communication", "ddp", "ddp_bucket_view", "ddp_allreduce_hook", "reducer_hooks",
           "reducer_hooks_bucket_view", "reducer_call", "distributed_optimizer",
           "sharded_optimizer", "sharded_gradients_optimizer")
#: methods that need a GPU (left out on the CPU)
CUDA_METHODS = ("distributed_optimizer_graph",)
BASELINE = "ddp"
BUCKET_CAP_MB = 25.0
WARMUP = 5
#: untimed steps per method whose kept launches are counted
COUNTED_STEPS = 5


def _step(method: str, config: dict, device: torch.device, batch,
          labels) -> Tuple[Callable[[], None], Optional[int]]:
    """The method's training step, and how many buckets its fusedreduce
    reducer holds (None: none of ours)."""
    torch.manual_seed(0)  # every method starts from the same weights
    model = resnet50_for_size(config["size"]).to(device)
    params = list(model.parameters())
    net, optimizer, ours, reducer = model, None, None, None
    ddp_args = dict(bucket_cap_mb=BUCKET_CAP_MB,
                    device_ids=[device.index] if device.type == "cuda" else None)
    if method in ("ddp", "ddp_bucket_view", "ddp_allreduce_hook"):
        net = DistributedDataParallel(model, gradient_as_bucket_view=method == "ddp_bucket_view",
                                      **ddp_args)
        if method == "ddp_allreduce_hook":
            net.register_comm_hook(None, hooks.allreduce_hook)
    elif method in ("reducer_hooks", "reducer_hooks_bucket_view"):
        ours = DistributedGradReducer(params, bucket_cap_mb=BUCKET_CAP_MB).register_hooks(
            gradient_as_bucket_view=method == "reducer_hooks_bucket_view")
    elif method in ("distributed_optimizer", "distributed_optimizer_graph",
                    "sharded_optimizer", "sharded_gradients_optimizer"):
        # DDP's bucket size, as every other row (param_pack_thd's default,
        # MegEngine's 10 MiB, makes 13 buckets of this model instead of 5)
        sharded = method.startswith("sharded")
        optimizer = DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                         param_pack_thd=int(BUCKET_CAP_MB * 2 ** 20),
                                         find_unused_parameters=False, shard=sharded,
                                         shard_gradients=method == "sharded_gradients_optimizer")
        ours = optimizer.reducer
    elif method == "reducer_call":
        reducer = ours = DistributedGradReducer(params, bucket_cap_mb=BUCKET_CAP_MB)
    if optimizer is None:
        optimizer = torch.optim.SGD(params, lr=0.01)

    captured = method == "distributed_optimizer_graph"
    buckets = len(ours.plan.buckets) if ours is not None else None

    def step():
        # a capture keeps the gradients where the warm-up prepared them
        optimizer.zero_grad(set_to_none=not captured)
        torch.nn.functional.cross_entropy(net(batch), labels).backward()
        if reducer is not None:  # MindSpore's way: reduce after backward, new tensors back
            for p, g in zip(params, reducer([p.grad for p in params])):
                p.grad = g
        optimizer.step()
    if captured:
        return _captured(step, device), buckets
    return step, buckets


def _captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` warmed up on a side stream, then captured whole in a CUDA
    graph: the returned function replays it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def rank_body(rank: int, world_size: int, config: dict) -> dict:
    """Time every method on this (single) rank; the median step per method, in ms."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    image = config["image"]
    batch = torch.randn(config["batch"], 3, image, image, generator=gen).to(device)
    reference = resnet50_for_size(config["size"])
    labels = torch.randint(0, reference.num_classes, (config["batch"],), generator=gen).to(device)
    methods = methods_on(device)
    steps: Dict[str, Callable[[], None]] = {}
    buckets: Dict[str, int] = {}
    held: Dict[str, int] = {}
    for method in methods:
        before = _allocated(device)
        steps[method], n = _step(method, config, device, batch, labels)
        if n is not None:
            buckets[method] = n
        for _ in range(WARMUP):
            steps[method]()
        if before is not None:
            held[method] = _allocated(device) - before
    samples: Dict[str, list] = {method: [] for method in methods}
    host: Dict[str, list] = {method: [] for method in methods}
    for round_ in range(config["steps"]):
        shift = round_ % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            steps[method]()
            issued = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples[method].append((time.perf_counter() - start) * 1e3)
            host[method].append((issued - start) * 1e6)
    peak = {}
    for method in held:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = _allocated(device)
        steps[method]()
        torch.cuda.synchronize(device)
        peak[method] = held[method] + torch.cuda.max_memory_allocated(device) - before
    launches = {}
    for method in methods:
        with count_launches() as counts:
            for _ in range(COUNTED_STEPS):
                steps[method]()
        if counts["calls"]:
            launches[method] = {k: v / COUNTED_STEPS for k, v in counts.items()}
    return {"device": str(device), "parameters": sum(p.numel() for p in reference.parameters()),
            "samples": samples, "host_us": host, "launches_per_step": launches,
            "buckets": buckets, "held_bytes": held, "peak_bytes": peak}


def _allocated(device: torch.device) -> Optional[int]:
    """Bytes the CUDA caching allocator has handed out (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def methods_on(device: torch.device):
    """The methods timed on ``device``: ``METHODS``, and ``CUDA_METHODS`` on a GPU."""
    return METHODS + CUDA_METHODS if device.type == "cuda" else METHODS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.one_gpu_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_step_options(parser)
    parser.add_argument("--steps", type=common.positive_number(int), default=15,
                        help="timed steps per method")
    args = parser.parse_args(argv)
    on_gpu = common.one_device(args.device).type == "cuda"
    config = {"size": args.size[0], "batch": args.batch, "image": args.image,
              "steps": args.steps, "backend": "nccl" if on_gpu else "gloo"}
    record = run_on_local_ranks(rank_body, 1, config, backend=config["backend"],
                                timeout=3600)[0]
    medians = {m: statistics.median(v) for m, v in record["samples"].items()}
    host = {m: statistics.median(v) for m, v in record["host_us"].items()}
    print(f"# one rank ({config['backend']}) on {record['device']}: ResNet-50 with "
          f"{record['parameters']:,} parameters, batch {args.batch}x3x{args.image}x{args.image}, "
          f"fp32, median of {args.steps} steps")
    memory = bool(record["held_bytes"])
    print(f"{'method':28s} {'step ms':>9s} {'ddp / this':>11s} {'host us':>9s} "
          f"{'buckets':>8s}" + (f" {'held MB':>9s} {'peak MB':>9s}" if memory else ""))
    buckets = record["buckets"]
    for method in medians:
        row = (f"{method:28s} {medians[method]:9.2f} {medians[BASELINE] / medians[method]:11.3f} "
               f"{host[method]:9.0f} {buckets.get(method, '-'):>8}")
        if memory:
            row += (f" {record['held_bytes'][method] / 1e6:9.1f}"
                    f" {record['peak_bytes'][method] / 1e6:9.1f}")
        print(row)
    if not on_gpu:
        print(f"({', '.join(CUDA_METHODS)}: CUDA only)")
    print(f"# the fused kernels' kept launches per step, over {COUNTED_STEPS} more steps "
          f"(untimed)")
    print(f"{'method':28s} " + " ".join(f"{k:>10s}" for k in LAUNCH_OUTCOMES))
    for method, counts in record["launches_per_step"].items():
        print(f"{method:28s} " + " ".join(f"{counts[k]:10.1f}" for k in LAUNCH_OUTCOMES))
    if args.json:
        with output_files.open_output(args.json) as f:
            json.dump({"config": config, "record": record, "median_ms": medians,
                       "median_host_us": host}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
