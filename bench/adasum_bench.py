"""AdaSum: adasum_allreduce against an all-reduce of the same bytes, on N ranks.

Every rank holds ResNet-50's 161 gradient tensors (``bench/models.py``, scaled
to the ``--sizes`` entry) in the ``--dtype``:

- ``all_reduce`` (baseline): one ``dist.all_reduce`` (a sum) of one flat
  buffer holding every gradient, packed beforehand: communication alone, the
  floor; every ``ratio`` is its time over the method's.
- ``grad_reducer`` (ours): ``DistributedGradReducer(params)(grads)``: the
  fused mean (flatten, one all-reduce per 25 MiB bucket, unflatten into new
  tensors; 16-bit gradients travel in fp32).
- ``adasum`` (ours): ``adasum_allreduce(grads)``: the same 25 MiB buckets
  (16-bit gradients combined in fp32), each combined along the AdaSum tree
  (recursive halving with per-tensor statistics, then an all-gather), into
  new tensors.
- ``adasum_in_place`` (ours): ``adasum_allreduce_flat`` on a copy of the
  baseline's flat buffer in its communication dtype (its segments are the
  gradients), in place, as ``adasum_hook`` runs on a DDP bucket: the
  like-for-like match for the baseline, without ``adasum``'s packing and new
  outputs. Repeated calls combine the previous result; the work does not
  depend on the values.
- ``tree_exchanges`` (reference): ``adasum_in_place`` with
  ``exchanges_only=True``: the tree's point-to-point traffic alone (the same
  messages and bytes, no statistics or combine), the floor any AdaSum math is
  added to.

Times are the median over ``--repeats`` calls after a warm-up, the methods
interleaved round-robin, each call started after a barrier and timed as the
slowest rank's wall time. ``bytes`` is the gradients' size and ``gbps`` that
over the time.

Bytes sent per rank are counted, not modelled, for AdaSum: during one extra
``adasum_allreduce`` call (and one ``adasum_allreduce_flat`` call for the
in-place rows; ``tree_exchanges`` sends what ``adasum_in_place`` does) every
rank wraps ``torch.distributed.send`` and ``batch_isend_irecv`` (the tree's
point-to-point traffic: halves, statistics, the all-gather, a non-power-of-two
rank's whole buffer) and adds up the bytes of the tensors it sends. The two
all-reduces it also issues (a 16-byte check that the ranks agree on the
tensors and, with ``local_size`` > 1, the block mean) cannot be seen inside
gloo, so each is charged what a ring all-reduce sends, ``2(k-1)/k`` of its
bytes over its k ranks. ``bytes_sent_per_rank``
is the largest count over the ranks; ``ratio_to_ring_bytes`` compares it with a
ring all-reduce of the flat buffer, ``2(n-1)/n`` of its bytes. The baselines'
rows give the ring figure of what they reduce (``bytes_sent_source``: ``ring
model``).
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from fusedreduce import (DistributedGradReducer, adasum_allreduce, adasum_allreduce_flat,
                         communication_dtype, kernels)

from . import common, timing
from .models import resnet50_gradients

NAME = "adasum"
BUCKET_CAP_MB = 25.0
METHODS = ("all_reduce", "grad_reducer", "adasum", "adasum_in_place", "tree_exchanges")
ROLES = {"all_reduce": "baseline", "grad_reducer": "ours", "adasum": "ours",
         "adasum_in_place": "ours", "tree_exchanges": "reference"}
BASELINE = "all_reduce"
FIXED_DTYPE = None  # the gradients take --dtype


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


def rank_measure(rank: int, world_size: int, device: torch.device, case: dict,
                 config: dict) -> dict:
    """Time the methods and count AdaSum's bytes on this rank (inside a process group)."""
    dtype = common.DTYPES[case["dtype"]]
    grads = resnet50_gradients(case["size"], dtype, device, seed=rank)
    flat = torch.cat([g.reshape(-1) for g in grads])
    reducer = DistributedGradReducer(grads, bucket_cap_mb=BUCKET_CAP_MB,
                                     initial_parameters="unchecked")  # per-rank tensors
    # the in-place rows combine an fp32/fp64 flat buffer cut at the gradients
    in_place = flat.to(communication_dtype(dtype))
    segments = kernels.packed_boundaries([g.numel() for g in grads])
    samples = timing.time_across_ranks(
        {"all_reduce": lambda: dist.all_reduce(flat), "grad_reducer": lambda: reducer(grads),
         "adasum": lambda: adasum_allreduce(grads, bucket_cap_mb=BUCKET_CAP_MB),
         "adasum_in_place": lambda: adasum_allreduce_flat(in_place, segments),
         "tree_exchanges": lambda: adasum_allreduce_flat(in_place, segments,
                                                         exchanges_only=True)},
        config["repeats"], device)
    with SentBytes() as sent:
        adasum_allreduce(grads, bucket_cap_mb=BUCKET_CAP_MB)
    with SentBytes() as sent_in_place:
        adasum_allreduce_flat(in_place, segments)
    return {"samples": samples, "sent": sent.total, "sent_in_place": sent_in_place.total,
            "n_tensors": len(grads),
            "n_elements": flat.numel(), "itemsize": dtype.itemsize,
            "reducer_bytes": sum(bucket.nbytes for bucket in reducer.plan.buckets)}


def records(outcome: Dict[int, dict], case: dict, config: dict) -> List[dict]:
    """The result records of one case from every rank's ``rank_measure``."""
    record, world_size = outcome[0], len(outcome)  # every rank holds the slowest rank's times
    nbytes = record["n_elements"] * record["itemsize"]
    ring = ring_bytes(nbytes, world_size)
    in_place = (max(r["sent_in_place"] for r in outcome.values()), "counted")
    sent = {"all_reduce": (ring, "ring model"),
            "grad_reducer": (ring_bytes(record["reducer_bytes"], world_size), "ring model"),
            "adasum": (max(r["sent"] for r in outcome.values()), "counted"),
            "adasum_in_place": in_place, "tree_exchanges": in_place}
    label = f"resnet50 {case['dtype']}, {world_size} ranks"
    return [common.result(NAME, label, case["size"], method, ROLES[method], BASELINE,
                          world_size, record["n_tensors"], record["n_elements"], nbytes,
                          record["samples"], dtype=case["dtype"],
                          bytes_sent_per_rank=sent[method][0],
                          bytes_sent_source=sent[method][1],
                          ratio_to_ring_bytes=sent[method][0] / ring)
            for method in METHODS]
