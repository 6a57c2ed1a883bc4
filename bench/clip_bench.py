"""Gradient clipping after the reduction: fused into the write-back, against torch's.

Every rank holds a model's gradient list (ResNet-50's 161 tensors and a
12-block transformer's 147, ``bench/models.py``, scaled to the ``--sizes``
entry) in the ``--dtype``, averages it with ``DistributedGradReducer`` (25 MiB
buckets) and clips the result to a total 2-norm of 1:

- ``reduce_only`` (role ``reference``, no clipping): ``reducer(grads)``, the
  floor both clipping methods stand on;
- ``torch_clip`` (baseline): ``reducer(grads)``, then
  ``torch.nn.utils.clip_grad_norm_(outputs, 1.0, foreach=True)``: a norm per
  tensor and a multiply per tensor, one more read and write of every gradient;
- ``fused_clip`` (ours): ``DistributedGradReducer(..., max_grad_norm=1.0)``:
  the norm from the reduced flat buffers, the coefficient applied in the
  unflatten that writes the outputs anyway.

``clip_ms`` is a method's median minus ``reduce_only``'s: what clipping
costs; ``ratio`` is ``torch_clip``'s time over the method's.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from fusedreduce import DistributedGradReducer

from . import common, timing
from .models import TENSOR_LISTS

NAME = "clip"
BUCKET_CAP_MB = 25.0
MAX_NORM = 1.0
MODELS = ("resnet50", "transformer")
METHODS = ("reduce_only", "torch_clip", "fused_clip")
ROLES = {"reduce_only": "reference", "torch_clip": "baseline", "fused_clip": "ours"}
BASELINE = "torch_clip"
FIXED_DTYPE = None  # the gradients take --dtype


def _gradients(model: str, size: int, dtype: torch.dtype, device: torch.device,
               seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device, dtype)
            for shape in TENSOR_LISTS[model](size)]


def rank_measure(rank: int, world_size: int, device: torch.device, case: dict,
                 config: dict) -> dict:
    """Time the methods for every model on this rank; the times are the slowest rank's."""
    dtype = common.DTYPES[case["dtype"]]
    out = {}
    for model in MODELS:
        grads = _gradients(model, case["size"], dtype, device, seed=rank)
        plain = DistributedGradReducer(grads, bucket_cap_mb=BUCKET_CAP_MB)
        clipping = DistributedGradReducer(grads, bucket_cap_mb=BUCKET_CAP_MB,
                                          max_grad_norm=MAX_NORM)

        def torch_clip(plain=plain, grads=grads):
            torch.nn.utils.clip_grad_norm_(plain(grads), MAX_NORM, foreach=True)

        samples = timing.time_across_ranks(
            {"reduce_only": lambda plain=plain, grads=grads: plain(grads),
             "torch_clip": torch_clip,
             "fused_clip": lambda clipping=clipping, grads=grads: clipping(grads)},
            config["repeats"], device)
        out[model] = {"samples": samples, "n_tensors": len(grads),
                      "n_elements": sum(g.numel() for g in grads)}
    out["itemsize"] = dtype.itemsize
    return out


def records(outcome: Dict[int, dict], case: dict, config: dict) -> List[dict]:
    """The result records of one case from every rank's ``rank_measure``."""
    measured, world_size = outcome[0], len(outcome)  # the slowest rank's times everywhere
    results = []
    for model in MODELS:
        record = measured[model]
        label = f"{model} {case['dtype']} mean + clip to norm {MAX_NORM:g}, {world_size} ranks"
        floor = timing.summary_ms(record["samples"]["reduce_only"])["time_ms"]
        for method in METHODS:
            result = common.result(NAME, label, case["size"], method, ROLES[method], BASELINE,
                                   world_size, record["n_tensors"], record["n_elements"],
                                   record["n_elements"] * measured["itemsize"],
                                   record["samples"], dtype=case["dtype"])
            result["clip_ms"] = result["time_ms"] - floor
            results.append(result)
    return results
