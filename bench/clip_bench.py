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
- ``fused_clip`` (ours): ``DistributedGradReducer(..., max_grad_norm=1.0,
  split_norm=False)``: the norm from the reduced flat buffers, the
  coefficient applied in the unflatten that writes the outputs anyway;
- ``fused_clip_split`` (ours): the same with ``split_norm=True``: each rank
  reads ``1 / world_size`` of the buffers for the norm, and one all-reduce of
  the row sums shares them.

Under mixed precision the same clipping sits beside ``GradScaler.unscale_``
(for fp32 and bf16 gradients: GradScaler refuses fp16 ones), in cases
labelled "+ GradScaler.unscale_": ``torch_clip_unscale`` (baseline; the
reducer, ``scaler.unscale_``, then ``clip_grad_norm_``, as torch's AMP recipe
orders them) and ``fused_clip_unscale`` (``max_grad_norm`` with the scaler's
scale as ``loss_scale``, then ``scaler.unscale_``: the unscaling stays
GradScaler's own pass, since no public API lets it be folded in).

``clip_ms`` is a method's median minus ``reduce_only``'s: what clipping
costs; ``ratio`` is ``torch_clip``'s time over the method's; ``launches`` is
what one call launches (``timing.count_launches``: device kernels on a GPU,
torch ops dispatched from Python on the CPU).

On a few CPU cores the all-reduce's noise is larger than clipping's cost, so
the same three are timed again on the write-back alone, without the
collective (each rank's reduced buffers stand in, ``BucketPlan`` as the
reducer lays them out): ``write_back`` (the unflatten with the mean's
postscale), ``write_back_torch_clip`` (that, then ``clip_grad_norm_``) and
``write_back_fused_clip`` (the norm of the buffers and the coefficient,
``clipping.clip_buffers``, then the unflatten with the coefficient in its
scale) and ``write_back_fused_clip_split`` (the same, the norm split across
the ranks: its all-reduce of row sums is the one collective there), in cases
labelled "write-back only".

Measuring the norm without clipping (``max_grad_norm=math.inf``, for logging
it) is timed the same way, in cases labelled "write-back only, norm
measured": ``write_back_torch_norm`` (baseline: the write-back, then
``torch.nn.utils.get_total_norm(outputs, foreach=True)``, torch's read-only
norm), ``write_back_torch_clip_inf`` (the write-back, then torch's idiom
``clip_grad_norm_(params, math.inf, foreach=True)``, which also multiplies
every gradient by 1) and ``write_back_fused_measure`` (``clip_buffers`` with
an infinite limit, then the unflatten with its scales).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch

from fusedreduce import BucketPlan, DistributedGradReducer, communication_dtype
from fusedreduce.clipping import NormSplit, clip_buffers

from . import common, timing
from .models import gradients

NAME = "clip"
BUCKET_CAP_MB = 25.0
MAX_NORM = 1.0
MODELS = ("resnet50", "transformer")
METHODS = ("reduce_only", "torch_clip", "fused_clip", "fused_clip_split")
ROLES = {"reduce_only": "reference", "torch_clip": "baseline", "fused_clip": "ours",
         "fused_clip_split": "ours"}
BASELINE = "torch_clip"
WRITE_BACK = {"write_back": "reduce_only", "write_back_torch_clip": "torch_clip",
              "write_back_fused_clip": "fused_clip",
              "write_back_fused_clip_split": "fused_clip_split"}
UNSCALE = {"torch_clip_unscale": "baseline", "fused_clip_unscale": "ours"}
MEASURE = {"write_back_torch_norm": "baseline", "write_back_torch_clip_inf": "baseline",
           "write_back_fused_measure": "ours"}
#: the loss scale of the GradScaler cases (a power of two: unscaling is exact)
LOSS_SCALE = 2.0 ** 16
FIXED_DTYPE = None  # the gradients take --dtype


def _gradient_holders(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """Stand-in parameters: ``clip_grad_norm_`` clips their ``.grad``."""
    return [torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape).requires_grad_()
            for g in grads]


def _clip_as_torch_does(holders: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """``clip_grad_norm_(foreach=True)`` on ``grads`` (as the holders' ``.grad``)."""
    for holder, grad in zip(holders, grads):
        holder.grad = grad
    torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)


def _write_backs(grads: List[torch.Tensor], rank: int,
                 world_size: int) -> Dict[str, Callable]:
    """The write-back-only methods over the reducer's layout of ``grads``."""
    plan = BucketPlan(grads, bucket_cap_mb=BUCKET_CAP_MB,  # fp32 buffers, as the reducer's
                      comm_dtype=lambda dtype: communication_dtype(dtype, torch.float32))
    buffers = [plan.flatten(bucket, grads) for bucket in plan.buckets]
    outputs = [torch.empty_like(g) for g in grads]
    postscale = 1.0 / world_size

    def write_back():
        for bucket, buffer in zip(plan.buckets, buffers):
            plan.unflatten(bucket, buffer, outputs, scale=postscale)

    holders = _gradient_holders(grads)

    def torch_clip():
        write_back()
        _clip_as_torch_does(holders, outputs)

    def fused_clip(split=None, limit=MAX_NORM):
        _, scales = clip_buffers(buffers, [postscale] * len(buffers), limit, 2.0,
                                 split=split)
        for bucket, buffer, scale in zip(plan.buckets, buffers, scales):
            plan.unflatten(bucket, buffer, outputs, scale=scale)

    def torch_norm():
        write_back()
        torch.nn.utils.get_total_norm(outputs, 2.0, foreach=True)

    def torch_clip_inf():
        write_back()
        for holder, grad in zip(holders, outputs):
            holder.grad = grad
        torch.nn.utils.clip_grad_norm_(holders, math.inf, foreach=True)

    split = NormSplit(None, rank, world_size)
    return {"write_back": write_back, "write_back_torch_clip": torch_clip,
            "write_back_fused_clip": fused_clip,
            "write_back_fused_clip_split": lambda: fused_clip(split),
            "write_back_torch_norm": torch_norm, "write_back_torch_clip_inf": torch_clip_inf,
            "write_back_fused_measure": lambda: fused_clip(limit=math.inf)}


def _with_unscale(grads: List[torch.Tensor], plain: DistributedGradReducer,
                  holders: List[torch.Tensor], device: torch.device) -> Dict[str, Callable]:
    """The GradScaler methods: torch's AMP order (reduce, unscale, clip) and
    the fused clip of the scaled gradients followed by the unscale."""
    scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE, growth_interval=10 ** 9)
    optimizer = torch.optim.SGD(holders, lr=0.0)  # what unscale_ walks
    clipping = DistributedGradReducer(grads, bucket_cap_mb=BUCKET_CAP_MB, max_grad_norm=MAX_NORM,
                                      initial_parameters="unchecked")
    clipping.loss_scale = scaler.scale(torch.ones((), device=device))

    def unscale(outputs):
        """``outputs`` as the holders' ``.grad``, unscaled by the scaler."""
        for holder, grad in zip(holders, outputs):
            holder.grad = grad
        scaler.unscale_(optimizer)
        scaler.update()  # unscale_ runs once per update; the scale stays (no inf)

    def torch_clip_unscale():
        unscale(plain(grads))
        torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)

    return {"torch_clip_unscale": torch_clip_unscale,
            "fused_clip_unscale": lambda: unscale(clipping(grads))}


def rank_measure(rank: int, world_size: int, device: torch.device, case: dict,
                 config: dict) -> dict:
    """Time the methods for every model on this rank; the times are the slowest rank's."""
    dtype = common.DTYPES[case["dtype"]]
    out = {}
    for model in MODELS:
        grads = gradients(model, case["size"], dtype, device, seed=rank)
        # the gradients stand for the parameters: they differ by rank
        unchecked = {"bucket_cap_mb": BUCKET_CAP_MB, "initial_parameters": "unchecked"}
        plain = DistributedGradReducer(grads, **unchecked)
        clipping = DistributedGradReducer(grads, max_grad_norm=MAX_NORM, split_norm=False,
                                          **unchecked)
        split = DistributedGradReducer(grads, max_grad_norm=MAX_NORM, split_norm=True,
                                       **unchecked)

        holders = _gradient_holders(grads)

        def torch_clip(plain=plain, grads=grads, holders=holders):
            _clip_as_torch_does(holders, plain(grads))

        fns = {"reduce_only": lambda plain=plain, grads=grads: plain(grads),
               "torch_clip": torch_clip,
               "fused_clip": lambda clipping=clipping, grads=grads: clipping(grads),
               "fused_clip_split": lambda split=split, grads=grads: split(grads),
               **_write_backs(grads, rank, world_size)}
        if dtype != torch.float16:
            fns.update(_with_unscale(grads, plain, holders, device))
        samples = timing.time_across_ranks(fns, config["repeats"], device)
        # after the timed calls (warm): every rank runs each once more, alike
        launches = {name: timing.count_launches(fn, device) for name, fn in fns.items()}
        out[model] = {"samples": samples, "launches": launches, "n_tensors": len(grads),
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

        def add(suffix, method, role, baseline, floor, record=record, label=label):
            """One method's record; ``clip_ms`` is its time over ``floor``."""
            result = common.result(NAME, label + suffix, case["size"], method, role, baseline,
                                   world_size, record["n_tensors"], record["n_elements"],
                                   record["n_elements"] * measured["itemsize"],
                                   record["samples"], dtype=case["dtype"])
            result["clip_ms"] = result["time_ms"] - floor
            result["launches"] = record["launches"][method]
            results.append(result)

        floor = timing.summary_ms(record["samples"]["reduce_only"])["time_ms"]
        for method in METHODS:
            add("", method, ROLES[method], BASELINE, floor)
        for method, role in UNSCALE.items():
            if method in record["samples"]:  # fp16: GradScaler does not unscale fp16 gradients
                add(" + GradScaler.unscale_", method, role, "torch_clip_unscale", floor)
        floor = timing.summary_ms(record["samples"]["write_back"])["time_ms"]
        for method, like in WRITE_BACK.items():
            add(", write-back only", method, ROLES[like], "write_back_torch_clip", floor)
        for method, role in MEASURE.items():
            add(", write-back only, norm measured", method, role, "write_back_torch_norm", floor)
    return results
