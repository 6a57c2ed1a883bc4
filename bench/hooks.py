"""DDP hook benchmark: a ResNet-50 step with each fusedreduce hook against DDP's own all-reduce.

On ``--world-size`` local gloo ranks (the CPU), one training step (zero_grad,
forward, backward of ResNet-50 on a small batch; DDP has reduced the gradients
by the time backward returns) with:

- ``compute_only``: the plain model, no DDP: the floor, for reading the others.
- ``ddp``: ``DistributedDataParallel(model, bucket_cap_mb=25)`` without a hook:
  the baseline every ratio is taken against.
- ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
  ``adasum_hook``: the same DDP with ``fusedreduce.hooks``' hook (state None).
- ``torch_fp16_compress_hook``: torch's
  ``ddp_comm_hooks.default_hooks.fp16_compress_hook``.

Every method has its own model, all created up front, and runs two untimed
steps first (DDP puts the whole model in one bucket on its first iteration and
rebuilds the buckets after it). Times are the median over ``--repeats`` rounds;
in each round every method runs once, in an order rotating from round to
round, each call started after a barrier and timed as the slowest rank's wall
time. ``ratio_to_ddp`` is a method's time over DDP's: above 1 is slower.
"""
from __future__ import annotations

import argparse
import time
from typing import List

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import hooks

from . import common
from .models import resnet50

BUCKET_CAP_MB = 25.0
HOOKS = {
    "allreduce_hook": hooks.allreduce_hook,
    "fp16_compress_hook": hooks.fp16_compress_hook,
    "bf16_compress_hook": hooks.bf16_compress_hook,
    "adasum_hook": hooks.adasum_hook,
    "torch_fp16_compress_hook": default_hooks.fp16_compress_hook,
}
METHODS = ("compute_only", "ddp") + tuple(HOOKS)
BASELINE = "ddp"
RESULT_FIELDS = ("method", "world_size", "n_tensors", "n_elements", "time_ms", "ratio_to_ddp")
TABLE = [("ranks", "world_size", "d"), ("method", "method", ""), ("ms/step", "time_ms", ".1f"),
         ("x ddp", "ratio_to_ddp", ".3f")]


def _model(method: str, width: int) -> torch.nn.Module:
    model = resnet50(width=width)
    if method == "compute_only":
        return model
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    if method in HOOKS:
        ddp.register_comm_hook(None, HOOKS[method])
    return ddp


def _rank_body(rank, world_size, config):
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(config["batch"], 3, config["image"], config["image"], generator=gen)
    labels = torch.randint(0, 1000, (config["batch"],), generator=gen)
    models = {method: _model(method, config["width"]) for method in config["methods"]}

    def step(net):
        def run():
            net.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(net(batch), labels).backward()
        return run

    fns = {method: step(net) for method, net in models.items()}
    for fn in fns.values():  # the one-bucket first iteration; the timer warms up again
        fn()
    times = common.time_across_ranks(fns, config["repeats"])
    params = list(models[config["methods"][0]].parameters())
    return {"times": times, "n_tensors": len(params),
            "n_elements": sum(p.numel() for p in params)}


def measure(world_size: int, config: dict) -> List[dict]:
    outcome = common.run_on_ranks(_rank_body, world_size, config)
    record = outcome[0]  # the times are already the slowest rank's
    times = record["times"]
    return [{"method": method, "world_size": world_size, "n_tensors": record["n_tensors"],
             "n_elements": record["n_elements"], "time_ms": times[method],
             "ratio_to_ddp": times[method] / times[BASELINE]}
            for method in config["methods"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a quarter-width ResNet-50 and tiny images: seconds, not minutes")
    parser.add_argument("--world-size", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2], help="comma-separated rank counts (default 2)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed steps per method, median kept (default 7)")
    parser.add_argument("--methods", type=common.csv_choices(METHODS), default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (ddp is always "
                             f"run: it is the baseline)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    methods = [m for m in METHODS if m in args.methods or m == BASELINE]
    config = {"width": 16 if args.quick else 64, "batch": 2, "image": 32 if args.quick else 64,
              "repeats": args.repeats, "methods": methods}
    machine = common.machine_info(torch.device("cpu"), "gloo")
    common.warn_if_busy(machine)
    started = time.perf_counter()
    results: List[dict] = []
    for world_size in args.world_size:
        common.log(f"{world_size} ranks ...")
        results += measure(world_size, config)
    print(f"# {common.machine_summary(machine)}")
    print(f"# ResNet-50 width {config['width']}: {results[0]['n_tensors']} tensors, "
          f"{results[0]['n_elements']:,} fp32 elements; DDP buckets {BUCKET_CAP_MB:g} MiB; "
          f"step: batch {config['batch']} x 3 x {config['image']} x {config['image']} per "
          f"rank; median of {config['repeats']}, slowest rank")
    print(common.format_table(results, TABLE, group_by=("world_size",)))
    print(f"# {time.perf_counter() - started:.1f} s")
    if args.json:
        common.write_json(args.json, machine, dict(config, benchmark="hooks",
                                                   world_sizes=args.world_size), results)
    return 0
