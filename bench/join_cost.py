"""What a training step costs under ``Join``, beside the same step outside it.

    python -m fusedreduce.bench.join_cost [--size 25.6M] [--batch 32] [--image 128]
        [--world-size 1] [--blocks 6] [--block-steps 10] [--scaler] [--device auto|cuda|cpu]
        [--json PATH]

``Join`` (torch's uneven-inputs context, docs/guides/optimizer.md) adds to
each step while every rank still has data, the steady state of an epoch:

- ``ddp`` under ``model.join()``: a one-element all-reduce before each forward
  (DDP's own notification);
- ``DistributedOptimizer`` under ``Join([optimizer])``: the same all-reduce
  before each communicating pass;
- with ``shard=True`` also a read of that all-reduce's count to the host
  (``uneven_inputs.someone_ran_out``), so that the ranks agree on the
  hyperparameters only at steps that a rank which ran out shadows. On a GPU
  that read waits for the device, so the host can no longer issue the next
  step's launches while this one runs: this benchmark is where that cost
  shows.

Each method (``ddp``, ``distributed_optimizer``, ``sharded_optimizer``: the
models, batch and SGD of ``one_gpu_step``, ResNet-50 scaled to ``--size``)
is timed in alternating blocks of ``--block-steps`` steps, plain and then
under its ``Join`` (entered and left once per block, so its final all-reduce
is in the block's time, spread over its steps), ``--blocks`` of each; the
table gives the median block's ms per step, plain and joined, and their
ratio. On a GPU the step is synchronised only at the block's ends, as a
training loop is, so a host that waits inside the step shows. One GPU runs
one NCCL rank (``--world-size 1``); on the CPU, gloo ranks. With
``--scaler`` a ``torch.amp.GradScaler`` steps every method
(``Join([optimizer], grad_scaler=scaler)`` for ours): inside a sharded
``Join`` the scaler then hands ``step()`` its scale and inf check, which
``step()`` reads to the host, instead of skipping it (``join_scaling``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import DistributedOptimizer
from . import common, output_files
from .models import resnet50_for_size
from .ranks import run_on_ranks

METHODS = ("ddp", "distributed_optimizer", "sharded_optimizer")
BUCKET_CAP_MB = 25.0
WARMUP = 3


def _build(method: str, config: dict, device: torch.device, batch, labels):
    """``(step, joined)``: the method's training step, and a function giving a
    new ``Join`` context around its steps."""
    torch.manual_seed(0)  # every method starts from the same weights
    model = resnet50_for_size(config["size"]).to(device)
    params = list(model.parameters())
    scaler = torch.amp.GradScaler(device.type, enabled=config["scaler"])
    if method == "ddp":
        net = DistributedDataParallel(
            model, bucket_cap_mb=BUCKET_CAP_MB,
            device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(params, lr=0.01)
        joined: Callable[[], object] = net.join
    else:
        net = model
        optimizer = DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                         param_pack_thd=int(BUCKET_CAP_MB * 2 ** 20),
                                         find_unused_parameters=False,
                                         shard=method == "sharded_optimizer")

        def joined():
            return Join([optimizer], grad_scaler=scaler if config["scaler"] else None)

    def step():
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(net(batch), labels)).backward()
        scaler.step(optimizer)
        scaler.update()
    return step, joined


def _block(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """ms per step over ``steps`` steps, synchronised at the ends only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / steps


def rank_body(rank: int, world_size: int, config: dict) -> dict:
    """Every method's blocks on this rank, plain and joined, in ms per step."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    image = config["image"]
    batch = torch.randn(config["batch"], 3, image, image, generator=gen).to(device)
    classes = resnet50_for_size(config["size"]).num_classes
    labels = torch.randint(0, classes, (config["batch"],), generator=gen).to(device)
    samples: Dict[str, Dict[str, List[float]]] = {}
    for method in METHODS:
        step, joined = _build(method, config, device, batch, labels)
        for _ in range(WARMUP):
            step()
        with joined():
            for _ in range(WARMUP):
                step()
        plain: List[float] = []
        under_join: List[float] = []
        for _ in range(config["blocks"]):
            plain.append(_block(step, config["block_steps"], device))
            with joined():
                under_join.append(_block(step, config["block_steps"], device))
        samples[method] = {"plain": plain, "join": under_join}
    return {"device": str(device), "samples": samples}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.join_cost",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_step_options(parser)
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks (NCCL needs one GPU each; gloo shares the CPU)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind per method")
    parser.add_argument("--block-steps", type=int, default=10, help="steps per block")
    parser.add_argument("--scaler", action="store_true",
                        help="a GradScaler steps every method")
    args = parser.parse_args(argv)
    for name in ("world_size", "blocks", "block_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    on_gpu = common.one_device(args.device).type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu and args.world_size > torch.cuda.device_count():
        parser.error(f"--world-size {args.world_size}: NCCL needs a GPU per rank, "
                     f"{torch.cuda.device_count()} here")
    config = {"size": args.size[0], "batch": args.batch, "image": args.image,
              "blocks": args.blocks, "block_steps": args.block_steps, "backend": backend,
              "scaler": args.scaler}
    # gloo ranks share the cores (ranks.run_on_ranks): more torch threads
    # than cores would make the ranks' waits for each other the figure
    record = run_on_ranks(rank_body, args.world_size, config)[0]
    print(f"# {args.world_size} rank(s) ({backend}) on {record['device']}: ResNet-50 of "
          f"{args.size[0]:,} parameters, batch {args.batch}x3x{args.image}x{args.image}, fp32, "
          f"SGD{', GradScaler' if args.scaler else ''}; rank 0's median of {args.blocks} "
          f"blocks of {args.block_steps} steps each")
    print(f"{'method':24s} {'plain ms':>9s} {'Join ms':>9s} {'Join / plain':>13s}")
    rows = {}
    for method, got in record["samples"].items():
        plain, joined = statistics.median(got["plain"]), statistics.median(got["join"])
        rows[method] = {"plain_ms": plain, "join_ms": joined, "ratio": joined / plain}
        print(f"{method:24s} {plain:9.2f} {joined:9.2f} {joined / plain:13.3f}")
    if args.json:
        with output_files.open_output(args.json) as f:
            json.dump({"config": config, "device": record["device"], "rows": rows,
                       "samples": record["samples"]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
