"""AdaSum benchmark: adasum_allreduce vs an all-reduce of the same bytes, on N local ranks.

On ``--world-size`` local processes (gloo on the CPU), each holding ResNet-50's
161 gradient tensors in fp32 (``bench/models.py``; ``--quick``: width 16):

- ``all_reduce``: one ``dist.all_reduce`` (a sum) of one flat fp32 buffer
  holding every gradient, packed beforehand: communication alone, the floor.
- ``grad_reducer``: ``DistributedGradReducer(params)(grads)``: the fused mean
  (flatten, one all-reduce per 25 MiB bucket, unflatten into new tensors).
- ``adasum``: ``adasum_allreduce(grads)``: the same 25 MiB buckets, each
  combined along the AdaSum tree (recursive halving with per-tensor
  statistics, then an all-gather), into new tensors.

Times are the median over ``--repeats`` calls after a warm-up, the methods
interleaved round-robin, each call started after a barrier and timed as the
slowest rank's wall time. ``adasum / all_reduce`` is the overhead the issue
bounds (goal: at most 1.3x).

Bytes sent per rank are counted, not modelled, for AdaSum: during one extra
``adasum_allreduce`` call every rank wraps ``torch.distributed.send`` and
``batch_isend_irecv`` (the tree's point-to-point traffic: halves, statistics,
the all-gather, a non-power-of-two rank's whole buffer) and adds up the bytes
of the tensors it sends. The two all-reduces it also issues (a 16-byte check
that the ranks agree on the tensors and, with ``local_size`` > 1, the block
mean) cannot be seen inside gloo, so each is charged what a ring all-reduce
sends, ``2(k-1)/k`` of its bytes over its k ranks. The table gives the largest
count over the ranks and compares it with a ring all-reduce of the flat
buffer, ``2(n-1)/n`` of its bytes; the baselines' own rows show that ring figure.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from fusedreduce import DistributedGradReducer, adasum_allreduce

from . import common
from .models import resnet50

BUCKET_CAP_MB = 25.0
METHODS = ("all_reduce", "grad_reducer", "adasum")


def ring_bytes(nbytes: int, ranks: int) -> float:
    """What each rank sends in a ring all-reduce of ``nbytes``: reduce-scatter + all-gather."""
    return 2 * (ranks - 1) / ranks * nbytes


class SentBytes:
    """Count the bytes this rank sends while installed (``with SentBytes() as sent``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._real: Dict[str, object] = {}

    def __enter__(self) -> "SentBytes":
        real = self._real = {name: getattr(dist, name)
                             for name in ("send", "batch_isend_irecv", "all_reduce")}

        def send(tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size()
            return real["send"](tensor, *args, **kwargs)

        def batch_isend_irecv(ops):
            # P2POp insists on torch's own isend, so the batch is where sends show
            self.total += sum(op.tensor.numel() * op.tensor.element_size()
                              for op in ops if op.op is dist.isend)
            return real["batch_isend_irecv"](ops)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            ranks = dist.get_world_size(group)
            self.total += ring_bytes(tensor.numel() * tensor.element_size(), ranks)
            return real["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        dist.send, dist.batch_isend_irecv, dist.all_reduce = (send, batch_isend_irecv,
                                                              all_reduce)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._real.items():
            setattr(dist, name, fn)


def _rank_body(rank, world_size, config):
    torch.manual_seed(0)
    params = list(resnet50(width=config["width"]).parameters())
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    reducer = DistributedGradReducer(params, bucket_cap_mb=BUCKET_CAP_MB)
    times = common.time_across_ranks(
        {"all_reduce": lambda: dist.all_reduce(flat), "grad_reducer": lambda: reducer(grads),
         "adasum": lambda: adasum_allreduce(grads, bucket_cap_mb=BUCKET_CAP_MB)},
        config["repeats"])
    with SentBytes() as sent:
        adasum_allreduce(grads, bucket_cap_mb=BUCKET_CAP_MB)
    return {"times": times, "sent": sent.total, "n_tensors": len(params),
            "n_elements": flat.numel()}


def measure(world_size: int, config: dict) -> List[dict]:
    outcome = common.run_on_ranks(_rank_body, world_size, config)
    record = outcome[0]  # every rank holds the same times: the max over ranks
    nbytes = record["n_elements"] * 4
    ring = ring_bytes(nbytes, world_size)
    adasum_sent = max(r["sent"] for r in outcome.values())
    times = record["times"]
    results = []
    for method in METHODS:
        sent, source = (adasum_sent, "counted") if method == "adasum" else (ring, "ring model")
        results.append({"method": method, "world_size": world_size,
                        "n_tensors": record["n_tensors"], "n_elements": record["n_elements"],
                        "bytes": nbytes, "time_ms": times[method],
                        "ratio_to_all_reduce": times[method] / times["all_reduce"],
                        "bytes_sent_per_rank": sent, "bytes_sent_source": source,
                        "ratio_to_ring_bytes": sent / ring})
    return results


TABLE = [("world", "world_size", "d"), ("method", "method", ""), ("ms", "time_ms", ".1f"),
         ("x all_reduce", "ratio_to_all_reduce", ".2f"),
         ("MB sent/rank", "bytes_sent_per_rank", ",.2f"), ("how", "bytes_sent_source", ""),
         ("x ring", "ratio_to_ring_bytes", ".4f")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a quarter-width ResNet-50 (1.6M elements): seconds, not minutes")
    parser.add_argument("--world-size", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 4], help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed calls per method, median kept (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    config = {"width": 16 if args.quick else 64, "repeats": args.repeats}
    machine = common.machine_info(torch.device("cpu"), "gloo")
    common.warn_if_busy(machine)
    started = time.perf_counter()
    results: List[dict] = []
    for world_size in args.world_size:
        common.log(f"{world_size} ranks ...")
        results += measure(world_size, config)
    print(f"# {common.machine_summary(machine)}")
    print(f"# gloo; ResNet-50 width {config['width']}: {results[0]['n_tensors']} fp32 "
          f"gradients, {results[0]['n_elements']:,} elements ({results[0]['bytes'] / 2 ** 20:.1f} "
          f"MiB); {BUCKET_CAP_MB:g} MiB buckets; median of {config['repeats']}, slowest rank")
    print(common.format_table([dict(r, bytes_sent_per_rank=r["bytes_sent_per_rank"] / 1e6)
                               for r in results], TABLE, group_by=("world_size",)))
    print(f"# {time.perf_counter() - started:.1f} s")
    if args.json:
        common.write_json(args.json, machine, dict(config, benchmark="adasum",
                                                   bucket_cap_mb=BUCKET_CAP_MB,
                                                   world_sizes=args.world_size), results)
    return 0
