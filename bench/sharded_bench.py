"""``fusedreduce-bench sharded``: sharded optimizers against DDP: step time and memory per rank.

One training step (``zero_grad()``, forward, backward, ``step()``) of AdamW
on the same gloo CPU ranks, for a ResNet-50 (``models.ResNet50``), a
GPT-2-style decoder (``Decoder``, the parameter list of
``models.transformer_shapes``) and, with ``--models linear-stack``, a stack
of few large tensors (``models.LinearStack``: 3 blocks of ``Linear(d, 4d)``
and ``Linear(4d, d)``, d=512 at 6.3M parameters), each scaled to the
``--sizes`` entry, with float32 or bfloat16 parameters, under seven methods:

- ``ddp_adamw`` (baseline): ``DistributedDataParallel(model)`` and
  ``torch.optim.AdamW``; every ``ratio`` is its time over the method's.
- ``ddp_zero_adamw`` (baseline): DDP and
  ``ZeroRedundancyOptimizer(params, optimizer_class=AdamW)`` (whole
  parameters assigned to ranks; the owner broadcasts them after its step).
- ``fsdp2_adamw`` (baseline): ``fully_shard(block, reshard_after_forward=False)``
  on every residual or decoder block, then on the model, and AdamW over the
  DTensor parameters.
- ``fused_adamw`` (ours): ``DistributedOptimizer(AdamW)``: fused all-reduces
  during backward; the unsharded figure the sharded one is read against.
- ``fused_sharded_adamw`` (ours): ``DistributedOptimizer(AdamW, shard=True)``:
  reduce-scatter per bucket during backward, AdamW on this rank's part (fp32
  master copies of bfloat16 parameters), all-gather in ``step()``.
- ``fused_sharded_overlap_adamw`` (ours): the same with
  ``overlap_param_gather=True``: ``step()`` leaves the all-gathers in flight
  and each bucket is written when the next forward reaches its layers.
- ``fused_sharded_grads_adamw`` (ours): ``shard=True, shard_gradients=True``
  (ZeRO-2): as ``fused_sharded_adamw``, and each bucket's ``.grad`` tensors
  are released once it has read them; only this rank's share keeps one.

Each library keeps its default buckets (DDP 25 MiB, ``DistributedOptimizer``
10 MiB) unless ``--bucket-mb`` gives both one cap. Every method has its own model with the same initial weights and
every rank its own batch, the same for every method. Each method runs two
untimed steps; the methods are then timed round-robin, two steps in a row
after a barrier (the deferred all-gathers of the second finished inside the
timed region), the slowest rank's wall time; ``time_ms`` is the median, per
step.

Memory per rank is counted, not measured: the bytes of the tensors each rank
holds after a step (a DTensor's local shard), the largest over the ranks:
``state_bytes`` (the optimizer's ``state``; ``ZeroRedundancyOptimizer``'s
local optimizer's), ``master_bytes`` (``fused_sharded_adamw``'s
``opt.sharded.masters``; no other method keeps any), ``grad_bytes`` (the
``.grad`` tensors), ``param_bytes`` and ``buffer_bytes`` (the communication
buffers the method keeps from one step to the next: ``held_buffer_bytes``;
None for FSDP2, which makes its buffers within each step);
``state_master_bytes`` is the largest per-rank sum of the first two, and
``held_bytes`` the largest per-rank sum of all five (None without a buffer
count), ``held_vs_ddp`` that over ``ddp_adamw``'s. Activations and what
lives only within a step (FSDP2's unsharded parameters and buffers, the
buckets in flight) are not counted; they are in ``peak_bytes``, measured:
the most the rank's CPU allocator held during one more step, from torch's
profiler (``peak_bytes``), the largest rank's, and ``peak_vs_ddp`` that over
``ddp_adamw``'s. For ``fused_sharded_adamw``,
``full_state_bytes`` is the tensors of its (collective) ``state_dict()``:
the whole state with the fp32 master weights, what one rank would hold
unsharded with the same numerics; for
float32 it equals ``fused_adamw``'s state. The memory aim holds when the
sharded rank holds at most ``(full_state_bytes + padding) / world_size`` plus
every 0-d state tensor (AdamW's step counts, one per parameter slice a rank
owns), ``padding`` being the plan's padding elements at the per-element bytes
of the full state. The time aim: within 10% of ``fused_adamw``'s step.

Checkpoints, for ``fused_sharded_adamw``: ``checkpoint_own_bytes`` is the
tensors of the largest rank's ``sharded_state_dict()`` (one file per rank),
``checkpoint_own_vs_whole`` that over ``full_state_bytes`` (what the
collective ``state_dict()`` gives every rank), ``checkpoint_own_ms`` and
``checkpoint_whole_ms`` the median time of each call (``--repeats``
calls after one untimed, each after a barrier and the slowest rank's,
round-robin with the others, as the steps are timed), and ``checkpoint_load_own_ms`` and
``checkpoint_load_whole_ms`` the same of loading each back from files
``torch.save`` wrote once to a temporary directory:
``load_sharded_state_dict`` of every rank's file (read with ``mmap=True``)
and ``load_state_dict(torch.load(...))`` of the whole dict's (rank 0's).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from fusedreduce import DistributedOptimizer
from fusedreduce.kernels import resolve_backend

from . import common, output_files, plot, ranks, timing
from .models import (TENSOR_LISTS, Bottleneck, MLPBlock, linear_stack_for_size,
                     linear_stack_shapes_for_size, n_elements, resnet50_for_size,
                     transformer_shapes_for_size)

NAME = "sharded"
METHODS = ("ddp_adamw", "ddp_zero_adamw", "fsdp2_adamw", "fused_adamw", "fused_sharded_adamw",
           "fused_sharded_overlap_adamw", "fused_sharded_grads_adamw")
ROLES = {"ddp_adamw": "baseline", "ddp_zero_adamw": "baseline", "fsdp2_adamw": "baseline",
         "fused_adamw": "ours", "fused_sharded_adamw": "ours",
         "fused_sharded_overlap_adamw": "ours", "fused_sharded_grads_adamw": "ours"}
BASELINE = "ddp_adamw"
UNSHARDED = "fused_adamw"
SHARDED = "fused_sharded_adamw"
SHARDED_OVERLAP = "fused_sharded_overlap_adamw"
SHARDED_GRADS = "fused_sharded_grads_adamw"
#: the methods with shard=True
SHARDED_METHODS = (SHARDED, SHARDED_OVERLAP, SHARDED_GRADS)
MODELS = ("resnet50", "transformer", "linear-stack")
#: what runs without --models
DEFAULT_MODELS = ("resnet50", "transformer")
#: each model's parameter shapes at a size
MODEL_SHAPES = {**TENSOR_LISTS, "linear-stack": linear_stack_shapes_for_size}
DTYPES = ("float32", "bfloat16")
DEFAULT_WORLD_SIZES, QUICK_WORLD_SIZES = [2, 3, 4], [2]
DEFAULT_SIZES, QUICK_SIZES = [4_000_000], [30_000]
DEFAULT_REPEATS, QUICK_REPEATS = 5, 2
#: the time aim: the sharded step within this factor of the unsharded one
TIME_AIM = 1.10
# per rank: a batch of 2 images (image x image pixels) or 2 sequences of `tokens`
BATCH = 2
SHAPES = {"image": 32, "tokens": 64}
QUICK_SHAPES = {"image": 16, "tokens": 16}
TIMER = "perf_counter after a barrier, the slowest rank's, round-robin"
COUNTING = ("bytes of the tensors held after a step (DTensor: the local shard) and of the "
            "communication buffers kept between steps, the largest rank's; activations and "
            "what lives only within a step not counted")


class DecoderBlock(nn.Module):
    """Pre-norm attention and MLP, in ``models.transformer_shapes``' parameter order."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        # 64-wide heads where the width allows, else one head (the parameters are the same)
        self.heads = d // 64 if d % 64 == 0 else 1

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    """A GPT-2-style decoder whose parameters are ``models.transformer_shapes(d, n_layers,
    vocab)``: token embedding (tied to the output), the blocks, a final layer norm.
    No position embedding: it is not in that list, and causal attention trains without."""

    def __init__(self, vocab: int, d: int, n_layers: int = 12) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(DecoderBlock(d) for _ in range(n_layers)))
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens):
        return self.ln(self.blocks(self.embed(tokens))) @ self.embed.weight.t()


def decoder_for_size(n: int) -> Decoder:
    """A ``Decoder`` with about ``n`` parameters (147 tensors at any size)."""
    vocab, d = transformer_shapes_for_size(n)[0]
    return Decoder(vocab, d)


def _model(name: str, size: int) -> nn.Module:
    if name == "linear-stack":
        return linear_stack_for_size(size)
    return resnet50_for_size(size) if name == "resnet50" else decoder_for_size(size)


def rank_batch(name: str, model: nn.Module, dtype: torch.dtype, rank: int, config: dict):
    """(inputs, labels) of this rank: a different batch per rank, the same for every method."""
    gen = torch.Generator().manual_seed(rank)
    if name == "resnet50":
        image = config["image"]
        return (torch.randn(BATCH, 3, image, image, generator=gen).to(dtype),
                torch.randint(0, model.num_classes, (BATCH,), generator=gen))
    if name == "linear-stack":  # `tokens` vectors, each classified into `width` classes
        shape = (BATCH, config["tokens"])
        return (torch.randn(*shape, model.width, generator=gen).to(dtype),
                torch.randint(0, model.width, shape, generator=gen))
    tokens = torch.randint(0, model.vocab, (BATCH, config["tokens"] + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def batch_loss(net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``net`` on a ``rank_batch``, in fp32."""
    logits = net(inputs).float()  # the loss in fp32 whatever the parameters' dtype
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(method: str, name: str, size: int, dtype: torch.dtype,
          bucket_mb: Optional[float] = None):
    """(model, module to call, optimizer) of ``method``, with the same weights
    on every rank; ``bucket_mb``: DDP's and ``DistributedOptimizer``'s bucket
    cap in MiB (None: each library's default). Needs a process group.

    Examples:
        >>> model, net, optimizer = build("ddp_adamw", "resnet50", QUICK_SIZES[0],
        ...                               torch.float32, 25.0)  # doctest: +SKIP
    """
    torch.manual_seed(0)
    model = _model(name, size).to(dtype)
    adamw = torch.optim.AdamW
    ddp = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
    ours = {} if bucket_mb is None else {"param_pack_thd": int(bucket_mb * 2 ** 20)}
    if method == "ddp_adamw":
        return model, DistributedDataParallel(model, **ddp), adamw(model.parameters())
    if method == "ddp_zero_adamw":
        return (model, DistributedDataParallel(model, **ddp),
                ZeroRedundancyOptimizer(model.parameters(), optimizer_class=adamw))
    if method == "fsdp2_adamw":
        for block in model.modules():
            if isinstance(block, (Bottleneck, DecoderBlock, MLPBlock)):
                fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        return model, model, adamw(model.parameters())
    return model, model, DistributedOptimizer(
        adamw(model.parameters()), shard=method in SHARDED_METHODS,
        overlap_param_gather=method == SHARDED_OVERLAP, shard_gradients=method == SHARDED_GRADS,
        **ours)


# ------------------------------------------------------------------ counting

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # this rank's partition
    return [v for entry in optimizer.state.values() for v in entry.values()
            if isinstance(v, torch.Tensor)]


def held_buffer_bytes(net: nn.Module, optimizer: torch.optim.Optimizer) -> Optional[int]:
    """The bytes of the communication buffers a method keeps between steps:
    ``DistributedOptimizer.buffer_bytes``; DDP's gradient buckets (one buffer
    per bucket, in the gradients' dtype, from DDP's logging data); None for
    FSDP2, whose buffers are made and released within each step."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.buffer_bytes
    if isinstance(net, DistributedDataParallel):
        sizes = str(net._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(size) for size in re.findall(r"\d+", sizes))
    return None


#: the profiler range around the step whose peak ``peak_bytes`` reads
PEAK_RANGE = "fusedreduce_bench_measured_step"


def _persistent(memory: Dict[str, Optional[int]]) -> int:
    """What a rank holds through a step (``count_memory``'s entries less ``.grad``,
    which ``zero_grad()`` frees as the step starts)."""
    return memory["state"] + memory["master"] + memory["params"] + (memory["buffers"] or 0)


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 pointed at /dev/null (native code writes there
    directly, not through ``sys.stderr``), restored on leaving."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(step: Callable[[], None], persistent: int) -> Optional[int]:
    """The most this rank's CPU allocator held during one ``step()``:
    ``persistent`` (counted: allocated before and held throughout) plus the
    peak of what the step allocated on top, from torch's profiler
    (``profile_memory``). The step runs twice under the profiler and the
    second is read, so each block it frees was allocated, and seen, within
    the profile. Gloo's own scratch is not the allocator's and is not in it.
    None where the profiler gives no such events."""
    from torch.profiler import ProfilerActivity, profile, record_function
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # the profiler's native start and stop lines, and its warning about the
    # blocks the first step frees (allocated before the profile), would
    # otherwise fill stderr on every rank for every method
    with _native_stderr_silenced():
        prof.start()
        step()
    try:
        with record_function(PEAK_RANGE):
            step()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    try:
        events = list(prof.profiler.kineto_results.events())
    except AttributeError:
        return None
    window = next((e for e in events if e.name() == PEAK_RANGE), None)
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    if window is None or not changes:
        return None
    alive, top = 0, None
    for at, nbytes in changes:
        if at > window.end_ns():
            break
        if at >= window.start_ns() and top is None:
            top = alive  # what the step starts with
        alive += nbytes
        if top is not None:
            top = max(top, alive)
    return persistent + (alive if top is None else top)


def count_memory(model: nn.Module, net: nn.Module,
                 optimizer: torch.optim.Optimizer) -> Dict[str, Optional[int]]:
    """This rank's bytes: optimizer state (0-d tensors also apart), master weights,
    gradients, parameters, communication buffers kept between steps (None:
    not held)."""
    state = _state_tensors(optimizer)
    sharded = getattr(optimizer, "sharded", None)
    params = list(model.parameters())
    return {"state": _nbytes(state),
            "state_scalars": _nbytes(t for t in state if _local(t).dim() == 0),
            "master": _nbytes(s.tensor for s in sharded.masters) if sharded else 0,
            "grads": _nbytes(p.grad for p in params if p.grad is not None),
            "params": _nbytes(params),
            "buffers": held_buffer_bytes(net, optimizer)}


def _full_state(optimizer: DistributedOptimizer) -> Dict[str, int]:
    """The sharded optimizer's whole state (collective: every rank calls it), its
    0-d tensors, and the plan's padding elements."""
    tensors = [v for entry in optimizer.state_dict()["state"].values() for v in entry.values()
               if isinstance(v, torch.Tensor)]
    buckets = optimizer.reducer.plan.buckets
    return {"full_state_bytes": _nbytes(tensors),
            "full_state_scalar_bytes": _nbytes(t for t in tensors if t.dim() == 0),
            "padding_elements": sum(b.size - sum(b.numels) for b in buckets),
            "n_buckets": len(buckets)}


def _tensors_in(value) -> List[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def checkpoint_costs(optimizer: DistributedOptimizer, repeats: int) -> Dict[str, float]:
    """The cost of a checkpoint's optimizer state: the whole ``state_dict()``
    (collective; the same bytes on every rank) against this rank's own
    ``sharded_state_dict()``, and loading each back from its files (written
    once with ``torch.save`` to a temporary directory: the whole dict by
    rank 0, read by every rank with ``torch.load`` into ``load_state_dict``;
    every rank's own into ``load_sharded_state_dict``): the median ms of
    ``repeats`` calls each, timed as the steps are
    (``timing.time_across_ranks``: the slowest rank's, round-robin), and the
    bytes of the tensors this rank's ``sharded_state_dict()`` returns."""
    whole, own = optimizer.state_dict(), optimizer.sharded_state_dict()
    own_bytes = _nbytes(_tensors_in(own))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory = [tempfile.mkdtemp(prefix="fusedreduce-bench-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    torch.save(own, os.path.join(directory[0], f"optim.{rank}.pt"))
    files = [os.path.join(directory[0], f"optim.{r}.pt") for r in range(world_size)]
    whole_file = os.path.join(directory[0], "optim.pt")
    if rank == 0:
        torch.save(whole, whole_file)
    dist.barrier()
    calls = {"whole_ms": optimizer.state_dict, "own_ms": optimizer.sharded_state_dict,
             "load_whole_ms": lambda: optimizer.load_state_dict(
                 torch.load(whole_file, map_location="cpu", weights_only=True)),
             "load_own_ms": lambda: optimizer.load_sharded_state_dict(files)}
    try:
        samples = timing.time_across_ranks(calls, repeats, torch.device("cpu"))
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
    costs = {name: timing.summary_ms(times)["time_ms"] for name, times in samples.items()}
    return {**costs, "own_bytes": own_bytes}


# ------------------------------------------------------------------ on the ranks

def cases(config: dict) -> List[dict]:
    """Every ``{"model", "dtype", "size"}`` one launch of ranks measures, in run order."""
    return [{"model": m, "dtype": d, "size": s}
            for m in config["models"] for d in config["dtypes"] for s in config["sizes"]]


def _agreed(error: Optional[str]) -> Optional[str]:
    """The first rank's error, on every rank (None when every rank succeeded), so that
    all ranks leave out the same methods and issue the same collectives."""
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def rank_measure(rank: int, world_size: int, case: dict, config: dict) -> dict:
    """Build, warm up, time and count every method of ``case`` on this rank."""
    name, dtype = case["model"], common.DTYPES[case["dtype"]]
    device = torch.device("cpu")
    fns: Dict[str, Callable[[], None]] = {}
    steps: Dict[str, Callable[[], None]] = {}
    built, not_run = {}, {}
    for method in METHODS:
        error = None
        try:
            model, net, optimizer = build(method, name, case["size"], dtype,
                                          config.get("bucket_mb"))
            inputs, labels = rank_batch(name, model, dtype, rank, config)

            def step(net=net, optimizer=optimizer, inputs=inputs, labels=labels):
                optimizer.zero_grad()
                batch_loss(net, inputs, labels).backward()
                optimizer.step()

            # the first step: DDP's one-bucket iteration, FSDP2's lazy init, the state made
            step()
        except Exception as exc:  # noqa: BLE001 - recorded as not run, with the reason
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        error = _agreed(error)
        if error is None:
            def two_steps(step=step, optimizer=optimizer):
                # two in a row: a deferred all-gather overlaps the next step's
                # forward; the last one is finished inside the timed region
                step()
                step()
                getattr(optimizer, "finish_param_gather", lambda: None)()

            def finished_step(step=step, optimizer=optimizer):
                step()
                getattr(optimizer, "finish_param_gather", lambda: None)()

            fns[method], built[method] = two_steps, (model, net, optimizer)
            steps[method] = finished_step
        else:
            not_run[method] = error
    samples = timing.time_across_ranks(fns, config["repeats"], device) if fns else {}
    samples = {method: [ms / 2 for ms in times] for method, times in samples.items()}
    memory = {method: count_memory(*built[method]) for method in built}
    for method in built:  # after the counts: the profiled steps leave the same tensors
        memory[method]["peak"] = peak_bytes(steps[method], _persistent(memory[method]))
    full = _full_state(built[SHARDED][2]) if SHARDED in built else None
    checkpoint = checkpoint_costs(built[SHARDED][2], config["repeats"]) \
        if SHARDED in built else None
    shapes = MODEL_SHAPES[name](case["size"])
    return {"samples": samples, "memory": memory, "full": full, "checkpoint": checkpoint,
            "not_run": not_run,
            "n_tensors": len(shapes), "n_elements": n_elements(shapes),
            "element_size": torch.empty((), dtype=dtype).element_size()}


def _rank_body(rank: int, world_size: int, config: dict) -> List[dict]:
    progress = common.Progress(**dict(config["progress"], enabled=rank == 0
                                      and config["progress"]["enabled"]))
    outputs = []
    for case in cases(config):
        label = (f"sharded: {case['model']} {common.format_count(case['size'])} "
                 f"{case['dtype']}, {world_size} ranks")
        with progress.step(label):
            outputs.append(rank_measure(rank, world_size, case, config))
    return outputs


# ------------------------------------------------------------------ records

#: what every record holds beyond ``common.result``'s keys (None where it does not apply)
EXTRA_KEYS = ("model", "dtype", "time_vs_unsharded", "state_bytes", "master_bytes",
              "grad_bytes", "param_bytes", "buffer_bytes", "held_bytes", "held_vs_ddp",
              "peak_bytes", "peak_vs_ddp",
              "state_master_bytes", "state_master_vs_unsharded",
              "memory_per_rank", "full_state_bytes", "full_state_scalar_bytes",
              "padding_elements", "n_buckets", "state_master_vs_full_per_rank",
              "state_master_bound_bytes", "memory_aim_met", "time_aim_met",
              "checkpoint_own_bytes", "checkpoint_own_vs_whole", "checkpoint_own_ms",
              "checkpoint_whole_ms", "checkpoint_load_own_ms", "checkpoint_load_whole_ms",
              "not_run")


def records(outcome: Dict[int, dict], case: dict) -> List[dict]:
    """The result records of one case from every rank's ``rank_measure``."""
    first, world_size = outcome[0], len(outcome)
    samples = first["samples"]  # every rank holds the same (slowest-rank) times
    count = first["n_elements"]
    label = f"{case['model']} {case['dtype']}, {world_size} ranks"

    def per_rank(method: str) -> Dict[str, List[int]]:
        return {key: [outcome[r]["memory"][method][key] for r in sorted(outcome)]
                for key in first["memory"][method]}

    def state_master(method: str) -> int:
        memory = per_rank(method)
        return max(s + m for s, m in zip(memory["state"], memory["master"]))

    def held(method: str) -> Optional[int]:
        memory = per_rank(method)
        if any(b is None for b in memory["buffers"]):
            return None
        return max(sum(parts) for parts in zip(memory["state"], memory["master"],
                                                memory["grads"], memory["params"],
                                                memory["buffers"]))

    def median(method: str) -> Optional[float]:
        return timing.summary_ms(samples[method])["time_ms"] if method in samples else None

    out = []
    for method in METHODS:
        record = {key: None for key in EXTRA_KEYS}
        record.update(
            benchmark=NAME, case=label, size=case["size"], method=method, role=ROLES[method],
            baseline=BASELINE, world_size=world_size, n_tensors=first["n_tensors"],
            n_elements=count, bytes=count * first["element_size"], time_ms=None,
            time_ms_min=None, gbps=None, ratio=None, model=case["model"], dtype=case["dtype"])
        if method in first["not_run"]:
            record["not_run"] = first["not_run"][method]
            out.append(record)
            continue
        record.update(timing.summary_ms(samples[method]))
        record["gbps"] = record["bytes"] / (record["time_ms"] * 1e6)
        if median(BASELINE) is not None:
            record["ratio"] = median(BASELINE) / record["time_ms"]
        if median(UNSHARDED) is not None:
            record["time_vs_unsharded"] = record["time_ms"] / median(UNSHARDED)
            record["state_master_vs_unsharded"] = state_master(method) / state_master(UNSHARDED)
        memory = per_rank(method)
        record.update(state_bytes=max(memory["state"]), master_bytes=max(memory["master"]),
                      grad_bytes=max(memory["grads"]), param_bytes=max(memory["params"]),
                      state_master_bytes=state_master(method), memory_per_rank=memory,
                      buffer_bytes=None if None in memory["buffers"] else max(memory["buffers"]),
                      held_bytes=held(method))
        if record["held_bytes"] is not None and BASELINE not in first["not_run"] \
                and held(BASELINE):
            record["held_vs_ddp"] = record["held_bytes"] / held(BASELINE)
        if None not in memory["peak"]:
            record["peak_bytes"] = max(memory["peak"])
            if BASELINE not in first["not_run"] and None not in per_rank(BASELINE)["peak"]:
                record["peak_vs_ddp"] = record["peak_bytes"] / max(per_rank(BASELINE)["peak"])
        if method in SHARDED_METHODS and first["full"] is not None:
            record.update(first["full"])  # the same state either way
            record.update(_aims(record, world_size))
        if method == SHARDED and first.get("checkpoint") is not None:
            costs = [outcome[r]["checkpoint"] for r in sorted(outcome)]
            record.update(checkpoint_own_bytes=max(c["own_bytes"] for c in costs),
                          checkpoint_own_ms=max(c["own_ms"] for c in costs),
                          checkpoint_whole_ms=max(c["whole_ms"] for c in costs),
                          checkpoint_load_own_ms=max(c["load_own_ms"] for c in costs),
                          checkpoint_load_whole_ms=max(c["load_whole_ms"] for c in costs))
            record["checkpoint_own_vs_whole"] = \
                record["checkpoint_own_bytes"] / record["full_state_bytes"]
        out.append(record)
    return out


def _aims(record: dict, world_size: int) -> dict:
    """``fused_sharded_adamw``'s figures against the aims (see the module's docstring)."""
    full, scalars = record["full_state_bytes"], record["full_state_scalar_bytes"]
    per_element = (full - scalars) / record["n_elements"]
    bound = (full + record["padding_elements"] * per_element) / world_size + scalars
    time_ratio = record["time_vs_unsharded"]
    return {"state_master_vs_full_per_rank": record["state_master_bytes"] * world_size / full,
            "state_master_bound_bytes": math.floor(bound),
            "memory_aim_met": record["state_master_bytes"] <= bound,
            "time_aim_met": None if time_ratio is None else time_ratio <= TIME_AIM}


def run(config: dict, progress: common.Progress) -> List[dict]:
    """Every world size of ``config``, each in its own spawned gloo ranks: the records."""
    results: List[dict] = []
    for world_size in config["world_sizes"]:
        outcome = ranks.run_on_ranks(_rank_body, world_size,
                                     dict(config, progress=progress.state()))
        for i, case in enumerate(cases(config)):
            progress.done += 1
            results += records({rank: outputs[i] for rank, outputs in outcome.items()},
                               case)
    return results


# ------------------------------------------------------------------ report

def _ms(value: float) -> str:
    return format(value, ".4g")


def _mb(value: float) -> str:
    return f"{value / 1e6:,.3f}"


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


COLUMNS: List[common.Column] = [
    ("ranks", "world_size", "d"), ("method", "method", ""), ("ms", "time_ms", _ms),
    ("min ms", "time_ms_min", _ms), ("x ddp", "ratio", ".2f"),
    ("t/t unsh", "time_vs_unsharded", ".3f"), ("state MB", "state_bytes", _mb),
    ("master MB", "master_bytes", _mb), ("grads MB", "grad_bytes", _mb),
    ("params MB", "param_bytes", _mb), ("bufs MB", "buffer_bytes", _mb),
    ("held MB", "held_bytes", _mb), ("held x ddp", "held_vs_ddp", ".3f"),
    ("peak MB", "peak_bytes", _mb), ("peak x ddp", "peak_vs_ddp", ".3f"),
    ("st+mst MB", "state_master_bytes", _mb),
    ("x unsh", "state_master_vs_unsharded", ".3f"),
    ("x full/ws", "state_master_vs_full_per_rank", ".4f"),
    ("bound MB", "state_master_bound_bytes", _mb), ("mem aim", "memory_aim_met", _yes),
    ("time aim", "time_aim_met", _yes), ("ckpt MB", "checkpoint_own_bytes", _mb),
    ("ckpt x whole", "checkpoint_own_vs_whole", ".3f"), ("ckpt ms", "checkpoint_own_ms", _ms),
    ("whole ms", "checkpoint_whole_ms", _ms), ("load ms", "checkpoint_load_own_ms", _ms),
    ("whole load ms", "checkpoint_load_whole_ms", _ms)]
NOTES = (
    "ms: median step (zero_grad, forward, backward, step; timed two in a row, halved, so that "
    "a deferred all-gather overlaps the second forward and the last one is waited for), the "
    "slowest rank's; x ddp: "
    "ddp_adamw's time over the method's (above 1: faster); t/t unsh: the method's time over "
    f"fused_adamw's (time aim: sharded <= {TIME_AIM:.2f}).\n"
    "MB (1e6 bytes) per rank, the largest rank's: optimizer state, master weights, .grad, "
    "parameters, communication buffers kept between steps (bufs; '-': FSDP2 makes them within "
    "each step); held: the five together; held x ddp: held over ddp_adamw's; peak: the most "
    "the rank's CPU allocator held during a step (torch's profiler; activations and what lives "
    "only within the step included, gloo's own scratch not), peak x ddp over ddp_adamw's; "
    "st+mst: state + master; x unsh: st+mst over fused_adamw's; x full/ws: "
    "st+mst over 1/world_size of the sharded optimizer's whole state_dict() (fp32 masters "
    "included; 1.0 = an exact share); bound: (whole state + padding) / world_size + the 0-d "
    "step counts (mem aim: st+mst <= bound).\n"
    "Checkpoints (fused_sharded_adamw): ckpt MB: the tensors of the largest rank's "
    "sharded_state_dict() (its own part, on the host); ckpt x whole: that over the whole "
    "state_dict(), which every rank holds while it is put together; ckpt ms and whole ms: the "
    "median time (each call the slowest rank's) of sharded_state_dict() and of the collective "
    "state_dict(); "
    "load ms and whole load ms: of load_sharded_state_dict(every rank's file) and of "
    "load_state_dict(torch.load(the whole dict's file)).")


def print_report(results: Sequence[dict], machine: dict, config: dict, elapsed: float) -> None:
    print(f"# {common.machine_summary(machine)}")
    print(f"# AdamW steps on gloo CPU ranks (torch threads per rank: cores // ranks, at "
          f"least 1); {config['repeats']} timed pairs of steps per method after two untimed steps")
    if config.get("buckets"):
        print(f"# buckets: {config['buckets']}")
    print("# " + NOTES.replace("\n", "\n# "))
    for key in dict.fromkeys((r["model"], r["dtype"], r["size"]) for r in results):
        rows = [r for r in results if (r["model"], r["dtype"], r["size"]) == key]
        print(f"\n## {key[0]} {key[1]}: {rows[0]['n_elements']:,d} parameters in "
              f"{rows[0]['n_tensors']} tensors (--sizes {common.format_count(key[2])})")
        print(common.format_table(rows, COLUMNS, group_by=("world_size",)))
    for r in results:
        if r.get("not_run"):
            print(f"# not run: {r['method']}, {r['case']}: {r['not_run']}")
    print(f"\n# {elapsed:.1f} s in all")


def write_plot(path: str, results: Sequence[dict], title: str) -> None:
    """Per model and dtype: step time and state + master bytes per rank against world size."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["dtype"], r["size"]) for r in results))
    world_sizes = sorted({r["world_size"] for r in results})
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.8 * len(panels)), squeeze=False)
    for (time_ax, memory_ax), key in zip(axes, panels):
        rows = [r for r in results if (r["model"], r["dtype"], r["size"]) == key
                and r["time_ms"] is not None]
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = sorted((r for r in rows if r["method"] == method),
                          key=lambda r: r["world_size"])
            style = plot.LINE_STYLES[ROLES[method]]
            ranks_ = [r["world_size"] for r in mine]
            time_ax.plot(ranks_, [r["time_ms"] for r in mine], style, marker="o", label=method)
            memory_ax.plot(ranks_, [r["state_master_bytes"] / 1e6 for r in mine], style,
                           marker="o", label=method)
        for ax, what in ((time_ax, "step ms (median)"),
                         (memory_ax, "optimizer state + master MB per rank")):
            ax.set_xlabel("ranks")
            ax.set_xticks(world_sizes)
            ax.set_ylim(bottom=0)
            ax.set_ylabel(what)
            ax.set_title(f"{key[0]} {key[1]}, {common.format_count(key[2])}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # room for the title
    fig.savefig(output_files.make_parents(path), format="png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ command line

def _world_sizes(text: str) -> List[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated world sizes of at least 2, got {text!r}")
    return sizes


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        NAME, help="sharded optimizers: DDP+AdamW, ZeRO, FSDP2 and DistributedOptimizer "
                   "(shard=False/True): step time and optimizer memory per rank (gloo ranks)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny models ({common.format_count(QUICK_SIZES[0])} parameters), "
                             f"2 ranks, {QUICK_REPEATS} repeats: well under a minute on 2 cores")
    parser.add_argument("--world-sizes", type=_world_sizes, metavar="N,N",
                        help="spawn this many gloo workers, in turn (default 2,3,4; --quick 2)")
    parser.add_argument("--models", type=common.csv_choices(MODELS),
                        default=list(DEFAULT_MODELS),
                        help=f"comma-separated, of {','.join(MODELS)} (default "
                             f"{','.join(DEFAULT_MODELS)}); linear-stack: few large tensors "
                             "(at --sizes 6.3M, six 512x2048 linears)")
    parser.add_argument("--dtypes", type=common.csv_choices(DTYPES), default=list(DTYPES),
                        help="parameter dtypes, comma-separated (default float32,bfloat16)")
    parser.add_argument("--sizes", type=common.parse_sizes,
                        help="parameters per model, comma-separated, suffixes K/M/G (default "
                             f"{common.format_count(DEFAULT_SIZES[0])}, --quick "
                             f"{common.format_count(QUICK_SIZES[0])}; ResNet-50 is 25.6M)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help=f"timed steps per method, median kept (default {DEFAULT_REPEATS}, "
                             f"--quick {QUICK_REPEATS})")
    parser.add_argument("--bucket-mb", type=float, metavar="MB",
                        help="one bucket cap in MiB for DDP and DistributedOptimizer (default: "
                             "each library's own, DDP 25, DistributedOptimizer 10); small caps "
                             "show at this size what many buckets do in a large model")
    parser.add_argument("--json", type=output_files.output_file,
                                  metavar="PATH", help="write machine, config and results here")
    parser.add_argument("--plot", type=output_files.output_file, metavar="PATH.png",
                        help="write a PNG of step time and state + master bytes against ranks "
                             "(needs matplotlib: pip install matplotlib)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or per-case lines on stderr")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        plot.require_matplotlib()  # before any measurement
    if ranks.torchrun_env():
        raise SystemExit("sharded spawns its own gloo workers for each world size: run it "
                         "without torchrun")
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"--repeats must be positive, got {args.repeats}")
    if args.bucket_mb is not None and not 0 < args.bucket_mb < float("inf"):
        raise SystemExit(f"--bucket-mb must be a positive number, got {args.bucket_mb}")
    world_sizes = args.world_sizes or (QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES)
    config = {"command": NAME, "quick": args.quick, "launcher": "spawn", "backend": "gloo",
              "world_sizes": world_sizes, "models": args.models, "dtypes": args.dtypes,
              "sizes": args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES),
              "repeats": args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS),
              "batch": BATCH, **(QUICK_SHAPES if args.quick else SHAPES),
              "optimizer": "torch.optim.AdamW (defaults)",
              "buckets": "DDP 25 MiB, DistributedOptimizer 10 MiB (each library's default)"
              if args.bucket_mb is None else f"{args.bucket_mb:g} MiB, DDP and "
                                             f"DistributedOptimizer alike",
              "bucket_mb": args.bucket_mb,
              "threads": "torch threads per rank: cores // ranks, at least 1",
              "timer": TIMER, "memory": COUNTING}
    device = torch.device("cpu")
    machine = common.machine_info(device, resolve_backend("auto", device), "gloo")
    progress = common.Progress(len(world_sizes) * len(cases(config)),
                               enabled=not args.no_progress)
    common.warn_if_busy(machine)
    started = time.perf_counter()
    results = run(config, progress)
    elapsed = time.perf_counter() - started
    print_report(results, machine, config, elapsed)
    if args.json:
        common.write_json(args.json, machine, config, results)
        common.log(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, results, common.machine_summary(machine))
        common.log(f"wrote {args.plot}")
    return 0
