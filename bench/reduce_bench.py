"""Gradient reduction alone: the fused reducer against per-tensor all_reduce and DDP-style buckets.

Every rank holds ResNet-50's 161 gradient tensors (``bench/models.py``, scaled
to the ``--sizes`` entry) in the ``--dtype`` and averages them:

- ``per_tensor`` (baseline): one ``dist.all_reduce`` per gradient, then ``/ world_size``.
- ``torch_buckets`` (baseline): what DDP does by hand: 25 MiB buckets packed
  with ``_flatten_dense_tensors``, one all-reduce each, unpacked with copies.
- ``fused_reducer`` (ours): ``DistributedGradReducer(params)(grads)``: fused
  flatten/cast/scale, one all-reduce per 25 MiB bucket, fused unflatten; new
  output tensors every call (the API's contract), persistent flat buffers;
  16-bit gradients are reduced in fp32 (the reducer's default).

``bytes`` is the gradients' size and ``gbps`` that over the time (the
algorithm bandwidth, nccl-tests' ``algbw``); ``ratio`` is ``per_tensor``'s
time over the method's.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fusedreduce import DistributedGradReducer

from . import common, timing
from .models import resnet50_gradients

NAME = "reduce"
BUCKET_CAP_MB = 25.0
METHODS = ("per_tensor", "torch_buckets", "fused_reducer")
ROLES = {"per_tensor": "baseline", "torch_buckets": "baseline", "fused_reducer": "ours"}
BASELINE = "per_tensor"
FIXED_DTYPE = None  # the gradients take --dtype


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


def rank_measure(rank: int, world_size: int, device: torch.device, case: dict,
                 config: dict) -> dict:
    """Time the methods on this rank (inside a process group); the times are the slowest rank's."""
    dtype = common.DTYPES[case["dtype"]]
    grads = resnet50_gradients(case["size"], dtype, device, seed=rank)
    reducer = DistributedGradReducer(grads, bucket_cap_mb=BUCKET_CAP_MB,
                                     initial_parameters="unchecked")  # per-rank tensors

    def per_tensor():
        for g in grads:
            dist.all_reduce(g)
            g.div_(world_size)

    samples = timing.time_across_ranks(
        {"per_tensor": per_tensor, "torch_buckets": lambda: _torch_buckets(grads, world_size),
         "fused_reducer": lambda: reducer(grads)}, config["repeats"], device)
    return {"samples": samples, "n_tensors": len(grads),
            "n_elements": sum(g.numel() for g in grads), "itemsize": dtype.itemsize}


def records(outcome: Dict[int, dict], case: dict, config: dict) -> List[dict]:
    """The result records of one case from every rank's ``rank_measure``."""
    record, world_size = outcome[0], len(outcome)  # every rank holds the slowest rank's times
    label = f"resnet50 {case['dtype']} mean, {world_size} ranks"
    return [common.result(NAME, label, case["size"], method, ROLES[method], BASELINE,
                          world_size, record["n_tensors"], record["n_elements"],
                          record["n_elements"] * record["itemsize"], record["samples"],
                          dtype=case["dtype"])
            for method in METHODS]
