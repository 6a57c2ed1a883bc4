"""Training step: DDP's own all-reduce against the reducer's hooks and fusedreduce's DDP hooks.

One training step (zero_grad, forward, backward of ResNet-50, ``bench/models.py``
scaled to the ``--sizes`` entry, on a small batch; the gradients are reduced
by the time backward returns), fp32, with:

- ``ddp`` (baseline): ``DistributedDataParallel(model, bucket_cap_mb=25)``
  without a hook; every ``ratio`` is its time over the method's.
- ``ddp_bucket_view`` (baseline): DDP with ``gradient_as_bucket_view=True``
  (each ``.grad`` a view of its bucket: no copy into the bucket).
- ``torch_fp16_compress_hook`` (baseline): DDP with torch's
  ``ddp_comm_hooks.default_hooks.fp16_compress_hook``.
- ``fused_overlap`` (ours): the plain model with
  ``DistributedGradReducer.register_hooks()``: buckets all-reduced during
  backward, the same 25 MiB cap, no DDP.
- ``fused_overlap_bucket_view`` (ours): the same with
  ``register_hooks(gradient_as_bucket_view=True)``.
- ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
  ``adasum_hook`` (ours): DDP with ``fusedreduce.hooks``' hook (state None).

The plain model without communication is timed too: its median is every
record's ``compute_ms``, the floor to read the others against.

Every method has its own model, all created up front, and runs two untimed
steps first (DDP puts the whole model in one bucket on its first iteration and
rebuilds the buckets after it). The methods are then timed round-robin, each
call started after a barrier and timed as the slowest rank's wall time.
``bytes`` is the gradients' size, so ``gbps`` is gradient bytes reduced per
second of a whole step.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import DistributedGradReducer, hooks

from . import common, timing
from .models import resnet50_for_size

NAME = "step"
BUCKET_CAP_MB = 25.0
HOOKS = {
    "allreduce_hook": hooks.allreduce_hook,
    "fp16_compress_hook": hooks.fp16_compress_hook,
    "bf16_compress_hook": hooks.bf16_compress_hook,
    "adasum_hook": hooks.adasum_hook,
    "torch_fp16_compress_hook": default_hooks.fp16_compress_hook,
}
METHODS = ("ddp", "ddp_bucket_view", "torch_fp16_compress_hook", "fused_overlap",
           "fused_overlap_bucket_view", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "adasum_hook")
ROLES = {method: "ours" for method in METHODS}
ROLES.update(ddp="baseline", ddp_bucket_view="baseline", torch_fp16_compress_hook="baseline")
BASELINE = "ddp"
COMPUTE_ONLY = "compute_only"
# training a model in 16 bits on a CPU is neither supported well nor what anyone does
FIXED_DTYPE = "float32"


def _model(method: str, size: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    model = resnet50_for_size(size).to(device)
    if method in ("fused_overlap", "fused_overlap_bucket_view"):
        DistributedGradReducer(list(model.parameters()), bucket_cap_mb=BUCKET_CAP_MB) \
            .register_hooks(gradient_as_bucket_view=method == "fused_overlap_bucket_view")
        return model
    if method == COMPUTE_ONLY:
        return model
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB,
                                  device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=method == "ddp_bucket_view")
    if method in HOOKS:
        ddp.register_comm_hook(None, HOOKS[method])
    return ddp


def rank_measure(rank: int, world_size: int, device: torch.device, case: dict,
                 config: dict) -> dict:
    """Time the steps on this rank (inside a process group); the times are the slowest rank's."""
    models = {method: _model(method, case["size"], device)
              for method in (COMPUTE_ONLY,) + METHODS}
    num_classes = models[COMPUTE_ONLY].num_classes
    gen = torch.Generator().manual_seed(rank)
    image = config["image"]
    batch = torch.randn(config["batch"], 3, image, image, generator=gen).to(device)
    labels = torch.randint(0, num_classes, (config["batch"],), generator=gen).to(device)

    def step(net):
        def run():
            net.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(net(batch), labels).backward()
        return run

    fns = {method: step(net) for method, net in models.items()}
    for fn in fns.values():  # the one-bucket first iteration; the timer warms up again
        fn()
    samples = timing.time_across_ranks(fns, config["repeats"], device)
    params = list(models[COMPUTE_ONLY].parameters())
    return {"samples": samples, "n_tensors": len(params),
            "n_elements": sum(p.numel() for p in params)}


def records(outcome: Dict[int, dict], case: dict, config: dict) -> List[dict]:
    """The result records of one case from every rank's ``rank_measure``."""
    record = outcome[0]  # every rank holds the same (slowest-rank) times
    samples, world_size, image = record["samples"], len(outcome), config["image"]
    label = f"resnet50 step, {config['batch']}x3x{image}x{image} per rank, {world_size} ranks"
    compute_ms = timing.summary_ms(samples[COMPUTE_ONLY])["time_ms"]
    return [common.result(NAME, label, case["size"], method, ROLES[method], BASELINE,
                          world_size, record["n_tensors"], record["n_elements"],
                          record["n_elements"] * 4, samples, dtype=FIXED_DTYPE,
                          compute_ms=compute_ms)
            for method in METHODS]
