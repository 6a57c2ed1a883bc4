"""The ranks' side of test_cuda.py: data, models and rank functions.

test_cuda.py starts three runs of ranks once per session: one rank
(NCCL on the GPU; gloo on the CPU when the logic is checked without one), two
gloo ranks sharing the GPU, and two gloo ranks for AdaSum's tree (whose
point-to-point messages of CUDA tensors travel through host memory). Each
runs a table of jobs (``run_each``); the parent judges what comes back.

Every function takes the device *kind* (``"cuda"`` or ``"cpu"``) as an
argument, so the same code runs under ``pytest --device cuda`` and on CPU gloo
ranks. Rank functions never assert (a rank that raised would leave the others
waiting in a collective): they return plain data, every tensor moved to the
CPU so that results unpickle anywhere, and a job that raises returns its
traceback, so one failure hides no other. The inputs are made on the CPU from
seeds, then moved: the parent rebuilds any rank's inputs bit for bit.
"""
from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from fusedreduce import (DistributedGradReducer, DistributedOptimizer, adasum_allreduce,
                         broadcast_tensors, hooks)
from fusedreduce.hooks import HookState
from fusedreduce.kernels import ADASUM_CHUNK

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOAT_DTYPES = (F16, BF16, F32, F64)
#: a bucket cap of one byte, in MiB: every tensor in a bucket of its own
ONE_BYTE_MB = 1 / 2 ** 20
LR = 0.05
STEPS = 4


def rank_device(kind: str) -> torch.device:
    """This rank's device: its current GPU (``run_on_local_ranks`` sets it for
    NCCL; both gloo ranks share GPU 0), or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_cpu(value):
    """``value`` with every tensor in it detached and copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def run_each(rank, world_size, kind, jobs):
    """``fn(rank, world_size, kind, *args)`` for each named ``(fn, args)`` of
    ``jobs``; a job that raises gives its traceback instead of a result."""
    out = {}
    for name, (fn, args) in jobs.items():
        try:
            out[name] = to_cpu(fn(rank, world_size, kind, *args))
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            out[name] = traceback.format_exc()
    return out


# ------------------------------------------------------------------ gradients

#: (shape, dtype, transposed): every float dtype, a 0-element and a 1-element
#: tensor, sizes across Triton's 2048-element blocks, non-contiguous views
GRAD_SPECS = [((3, 5), F16, False), ((257,), BF16, False), ((2049,), F32, False),
              ((4, 4, 3), F64, True), ((0,), F32, False), ((1,), F16, False),
              ((7, 9), BF16, True), ((1001,), F64, False), ((33, 65), F32, True)]


def _laid_out(values: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``values`` (row-major), stored transposed in memory when asked: the same
    shape and values, non-contiguous."""
    if transposed:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    return values


def gradients(rank: int, device, nonfinite: bool = False):
    """Rank ``rank``'s gradients (``GRAD_SPECS``), built on the CPU and moved:
    a shared direction plus this rank's own noise, with exact zeros of both
    signs; ``nonfinite`` puts an inf in the third tensor."""
    shared, own = torch.Generator().manual_seed(11), torch.Generator().manual_seed(500 + rank)
    grads = []
    for i, (shape, dtype, transposed) in enumerate(GRAD_SPECS):
        value = torch.randn(shape, generator=shared, dtype=F64) \
            + 0.5 * torch.randn(shape, generator=own, dtype=F64)
        value = (value * 2.0 ** (i % 5 - 2)).reshape(-1)
        value[3::17], value[5::19] = 0.0, -0.0
        value = value.to(dtype)
        if nonfinite and i == 2:
            value[value.numel() // 2] = float("inf")
        grads.append(_laid_out(value.reshape(shape), transposed).to(device))
    return grads


#: AdaSum's inputs: tensors of several AdaSum chunks (cut between ranks by the
#: halving) between small ones, every float dtype, one non-contiguous
ADASUM_SPECS = [((7,), F64, False), ((2 * ADASUM_CHUNK + 77,), F32, False), ((3, 5), F16, True),
                ((ADASUM_CHUNK + 1,), BF16, False), ((40_000,), F64, False), ((1001,), F16, False),
                ((257,), BF16, False), ((9, 11), F32, True), ((2,), F32, False)]


def adasum_gradients(rank: int, device):
    """Per tensor a direction shared by all ranks plus this rank's noise, at a
    rank-dependent scale, so the AdaSum coefficients are far from 1; the last
    tensor is zero on odd ranks (AdaSum(g, 0) = g)."""
    shared, own = torch.Generator().manual_seed(99), torch.Generator().manual_seed(1000 + rank)
    scale = 2.0 ** (rank % 3) * (1 + 0.25 * rank)
    grads = []
    for i, (shape, dtype, transposed) in enumerate(ADASUM_SPECS):
        value = scale * (torch.randn(shape, generator=shared, dtype=F64)
                         + 0.5 * torch.randn(shape, generator=own, dtype=F64))
        if i == len(ADASUM_SPECS) - 1 and rank % 2:
            value = torch.zeros(shape, dtype=F64)
        grads.append(_laid_out(value.to(dtype), transposed).to(device))
    return grads


# ------------------------------------------------------------------ models and data


class Net(nn.Module):
    """A tanh MLP whose layers may each have their own dtype; ``seed`` sets the
    initial weights."""

    def __init__(self, widths, dtypes=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        dtypes = dtypes or [F32] * (len(widths) - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o).to(d)
                                    for i, o, d in zip(widths, widths[1:], dtypes))

    def forward(self, x):
        y = x
        for k, layer in enumerate(self.layers):
            y = layer(y.to(layer.weight.dtype))
            if k < len(self.layers) - 1:
                y = torch.tanh(y)
        return y.float()


SMALL = {"widths": [6, 32, 16, 2]}
#: DDP makes one bucket per dtype: fp16, bf16, fp64 and fp32 buckets
MIXED = {"widths": [6, 40, 24, 16, 12, 2], "dtypes": [F16, BF16, F16, F64, F32]}


def batch(rank, step, widths, device):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, widths[0], generator=gen), torch.randn(8, widths[-1], generator=gen)
    return x.to(device), y.to(device)


def loss_of(model, rank, step, widths, device):
    x, y = batch(rank, step, widths, device)
    return ((model(x) - y) ** 2).mean()


def local_gradients(model, rank, step, widths, device):
    """Rank ``rank``'s own gradients at ``model``'s parameters (a plain module:
    the same ops as DDP's forward and backward, so what DDP puts in its buckets)."""
    model.zero_grad(set_to_none=True)
    loss_of(model, rank, step, widths, device).backward()
    return [p.grad.clone() for p in model.parameters()]


def _ddp(model, device):
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ------------------------------------------------------------------ jobs


#: DistributedGradReducer configurations: (name, keyword arguments, nonfinite
#: inputs on the last rank). degree=4 makes the scale differ from 1 with one rank.
REDUCER_CONFIGS = [
    ("mean", {}, False),
    ("mean_torch", {"backend": "torch"}, False),
    ("degree4", {"degree": 4}, False),
    ("sum", {"mean": False}, False),
    ("bf16_wire", {"reduce_dtype": BF16}, False),
    ("fp16_wire_checked", {"reduce_dtype": F16, "check_finite": True}, False),
    ("fp16_wire_checked_inf", {"reduce_dtype": F16, "check_finite": True}, True),
]


def reducer_job(rank, world_size, kind):
    """Per configuration: the reduced gradients, ``found_nonfinite`` and the
    results' devices; and whether the inputs were left alone."""
    device = rank_device(kind)
    out = {}
    for name, kwargs, nonfinite in REDUCER_CONFIGS:
        grads = gradients(rank, device, nonfinite and rank == world_size - 1)
        before = [g.clone() for g in grads]
        # placeholders, the same on every rank (the reducer checks that)
        params = [torch.zeros(g.shape, dtype=g.dtype, device=device) for g in grads]
        reducer = DistributedGradReducer(params, **kwargs)
        # twice: the second call runs on the launches the first one prepared
        reduced = reducer(tuple(grads))
        reduced = reducer(tuple(grads))
        out[name] = {"grads": list(reduced),
                     "found_nonfinite": None if reducer.found_nonfinite is None
                     else bool(reducer.found_nonfinite),
                     "devices": sorted({str(t.device.type) for t in reduced}),
                     "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(grads, before))}
    return out


def optimizer_job(rank, world_size, kind):
    """DistributedOptimizer(SGD) on the mixed model, each rank starting from its
    own weights: the weights right after wrapping (rank 0's everywhere), per
    step the reduced gradients and every rank's local ones, the final weights."""
    device = rank_device(kind)
    widths = MIXED["widths"]
    model = Net(**MIXED, seed=rank).to(device)
    local = copy.deepcopy(model)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    initial = [p.detach().clone() for p in model.parameters()]
    steps = []
    for step in range(STEPS):
        with torch.no_grad():
            for copied, p in zip(local.parameters(), model.parameters()):
                copied.copy_(p)
        everyone = [local_gradients(local, r, step, widths, device) for r in range(world_size)]
        loss_of(model, rank, step, widths, device).backward()
        steps.append({"grads": [p.grad.detach().clone() for p in model.parameters()],
                      "local": everyone if rank == 0 else None})
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": initial, "steps": steps,
            "params": [p.detach().clone() for p in model.parameters()],
            "device": model.layers[0].weight.device.type}


def sharded_job(rank, world_size, kind):
    """DistributedOptimizer(AdamW) unsharded, with shard=True and with
    shard_gradients=True too, from the same weights, ``STEPS`` steps each:
    the weights after every step, and per step of the last mode which
    parameters kept a ``.grad`` and which this rank owns elements of. An
    fp32 model (sharded AdamW on slices steps as AdamW on the whole) and the
    mixed one (16-bit layers through fp32 masters), small buckets so that
    part boundaries cut parameters."""
    device = rank_device(kind)
    out = {}
    for model_name, spec in (("fp32", SMALL), ("mixed", MIXED)):
        for mode, options in (("unsharded", {}), ("sharded", {"shard": True}),
                              ("grads_sharded", {"shard": True, "shard_gradients": True})):
            model = Net(**spec, seed=0).to(device)
            optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                             param_pack_thd=512, **options)
            params, held = [], []
            for step in range(STEPS):
                loss_of(model, rank, step, spec["widths"], device).backward()
                if optimizer.layout is not None:
                    held.append({"held": [p.grad is not None for p in model.parameters()],
                                 "owns": [optimizer.layout.range_of(i) is not None
                                          for i in range(len(list(model.parameters())))]})
                optimizer.step()
                optimizer.zero_grad()
                params.append([p.detach().clone() for p in model.parameters()])
            out[f"{model_name}_{mode}"] = {"params": params, "held": held}
            if mode == "unsharded":
                out[f"{model_name}_placement"] = placement(optimizer.state_dict())
            if mode == "sharded":
                out[f"{model_name}_checkpoint"] = sharded_checkpoint(optimizer, spec, device)
    return out


def join_job(rank, world_size, kind):
    """Uneven inputs under ``Join([optimizer])`` on the device: rank ``r`` runs
    ``STEPS - r`` steps, unsharded and with ``shard=True`` (the join's own
    all-reduces on ``comm_device``: the GPU under NCCL, the host under gloo).
    Per mode the final weights, the step count and the weights' device."""
    from torch.distributed.algorithms.join import Join
    device = rank_device(kind)
    widths = MIXED["widths"]
    results = {}
    for mode, options in (("replicated", {}), ("sharded", {"shard": True})):
        model = Net(**MIXED, seed=0).to(device)
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), **options)
        with Join([optimizer]):
            for step in range(STEPS - rank):
                loss_of(model, rank, step, widths, device).backward()
                optimizer.step()
                optimizer.zero_grad()
        results[mode] = {"params": [p.detach().clone() for p in model.parameters()],
                         "steps": optimizer._steps, "device": next(model.parameters()).device.type}
    return results


def placement(state_dict):
    """The device type of every tensor of a state dict's state, by (index, key)."""
    return {(index, key): value.device.type for index, entry in state_dict["state"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


def sharded_checkpoint(optimizer, spec, device):
    """Every rank's sharded_state_dict() (host copies) loaded into a sharded
    optimizer with another bucket cap, on the device: whether its whole
    state equals the saved optimizer's, and whether the loaded state sits
    on the device; where the whole state_dict()'s tensors sit, and whether
    state_dict(cpu_offload=True) holds the same values, all on the host."""
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, optimizer.sharded_state_dict())
    whole = optimizer.state_dict()
    offloaded = optimizer.state_dict(cpu_offload=True)
    on_host = all(offloaded["state"][index][key].device.type == "cpu" and
                  torch.equal(value.cpu(), offloaded["state"][index][key])
                  for index, entry in whole["state"].items() for key, value in entry.items()
                  if isinstance(value, torch.Tensor))
    loaded = DistributedOptimizer(torch.optim.AdamW(Net(**spec, seed=1).to(device).parameters(),
                                                    lr=LR), param_pack_thd=300, shard=True)
    loaded.load_sharded_state_dict(shards)
    again = loaded.state_dict()
    equal = again["param_groups"] == whole["param_groups"] and all(
        torch.equal(value, again["state"][index][key]) if isinstance(value, torch.Tensor)
        else value == again["state"][index][key]
        for index, entry in whole["state"].items() for key, value in entry.items())
    on_device = all(value.device.type == torch.device(device).type
                    for entry in loaded.state.values() for key, value in entry.items()
                    if isinstance(value, torch.Tensor) and key != "step")
    # the whole dict from the host: each rank moves its own part onto the device
    from_host = DistributedOptimizer(torch.optim.AdamW(
        Net(**spec, seed=2).to(device).parameters(), lr=LR), param_pack_thd=300, shard=True)
    from_host.load_state_dict(offloaded)
    again = from_host.state_dict()
    host_dict_loads = all(
        torch.equal(value, again["state"][index][key]) if isinstance(value, torch.Tensor)
        else value == again["state"][index][key]
        for index, entry in whole["state"].items() for key, value in entry.items()) and all(
        value.device.type == torch.device(device).type
        for entry in from_host.state.values() for key, value in entry.items()
        if isinstance(value, torch.Tensor) and key != "step")
    return {"equal": equal, "on_device": on_device, "offloaded": on_host,
            "host_dict_loads": host_dict_loads, "placement": placement(whole)}


def broadcast_values(rank, device):
    """Rank ``rank``'s tensors for the broadcast: every float dtype (one
    non-contiguous), an empty one, integer and bool buffers."""
    gen = torch.Generator().manual_seed(70 + rank)
    floats = [(torch.randn(n, generator=gen, dtype=F64) * (rank + 1)).to(d)
              for n, d in ((1000, F16), (3, BF16), (2049, F32), (17, F64), (0, F32))]
    floats.append(_laid_out(torch.randn(6, 10, generator=gen).to(BF16), True))
    others = [torch.randint(-1000, 1000, (13,), generator=gen),
              torch.randint(0, 2, (5,), generator=gen).bool()]
    return [t.to(device) for t in floats + others]


def broadcast_job(rank, world_size, kind):
    """``broadcast_tensors`` from the last rank, then from rank 0, in place."""
    device = rank_device(kind)
    out = {}
    for src in sorted({world_size - 1, 0}, reverse=True):
        tensors = broadcast_values(rank, device)
        broadcast_tensors(tensors, src)
        out[src] = tensors
    return out


HOOKS = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
         "bf16": hooks.bf16_compress_hook, "adasum": hooks.adasum_hook,
         "torch_allreduce": default_hooks.allreduce_hook}


def train(rank, world_size, kind, runs):
    """Per run ``(label, model config, hook name or None, HookState kwargs or
    None)``: DDP trained for ``STEPS`` SGD steps; per step its gradients, every
    rank's local gradients (on rank 0) and, for AdaSum, ``adasum_allreduce`` of
    this rank's local gradients; the final weights."""
    device = rank_device(kind)
    out = {}
    for label, model_cfg, hook_name, state_kwargs in runs:
        widths = model_cfg["widths"]
        model = Net(**model_cfg).to(device)
        local = copy.deepcopy(model)
        ddp = _ddp(model, device)
        if hook_name is not None:
            state = None if state_kwargs is None else HookState(**state_kwargs)
            ddp.register_comm_hook(state, HOOKS[hook_name])
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        steps = []
        for step in range(STEPS):
            with torch.no_grad():
                for copied, p in zip(local.parameters(), model.parameters()):
                    copied.copy_(p)
            everyone = [local_gradients(local, r, step, widths, device)
                        for r in range(world_size)]
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, rank, step, widths, device).backward()
            record = {"grads": [p.grad.detach().clone() for p in model.parameters()],
                      "local": everyone if rank == 0 else None}
            if hook_name == "adasum":
                # the same per-parameter gradients through the collective API
                # on the same kernels' backend
                kwargs = state_kwargs or {}
                record["adasum_allreduce"] = adasum_allreduce(
                    everyone[rank], local_size=kwargs.get("local_size", 1),
                    backend=kwargs.get("backend", "auto"))
            steps.append(record)
            optimizer.step()
        out[label] = {"steps": steps, "params": [p.detach().clone() for p in model.parameters()],
                      "device": model.layers[0].weight.device.type}
    return out


def hook_runs(local_size, with_baselines=True):
    """The DDP runs: DDP's own all-reduce and torch's allreduce_hook beside
    ours on an fp32 model, every hook on the mixed model, and the compress
    hooks on the torch backend too (bitwise the default backend's)."""
    adasum = {"local_size": local_size}
    runs = []
    if with_baselines:
        runs += [("ddp", SMALL, None, None), ("torch_allreduce", SMALL, "torch_allreduce", None),
                 ("allreduce", SMALL, "allreduce", None), ("fp16", SMALL, "fp16", None),
                 ("bf16", SMALL, "bf16", None),
                 ("allreduce_mixed", MIXED, "allreduce", None),
                 ("allreduce_mixed_torch", MIXED, "allreduce", {"backend": "torch"}),
                 ("fp16_mixed", MIXED, "fp16", None),
                 ("fp16_mixed_torch", MIXED, "fp16", {"backend": "torch"}),
                 ("bf16_mixed", MIXED, "bf16", None)]
    runs += [("adasum", SMALL, "adasum", adasum), ("adasum_mixed", MIXED, "adasum", adasum)]
    return runs


#: named, not "auto": the CPU check of this logic runs Triton through its interpreter
ADASUM_BACKENDS = ("triton", "torch")
ADASUM_CAPS = (25.0, ONE_BYTE_MB)


def adasum_job(rank, world_size, kind, local_size):
    """``adasum_allreduce`` of ``adasum_gradients`` per (backend, bucket cap),
    and whether the inputs were left alone."""
    device = rank_device(kind)
    grads = adasum_gradients(rank, device)
    before = [g.clone() for g in grads]
    out = {(backend, cap): adasum_allreduce(grads, local_size=local_size, bucket_cap_mb=cap,
                                            backend=backend)
           for backend in ADASUM_BACKENDS for cap in ADASUM_CAPS}
    out["inputs_unchanged"] = all(torch.equal(a, b) for a, b in zip(grads, before))
    out["devices"] = sorted({t.device.type for key, ts in out.items() if key != "inputs_unchanged"
                             for t in ts})
    return out


# ------------------------------------------------------------------ the job tables


def one_rank_jobs():
    """One rank (NCCL on the GPU): a world of one makes every reduction the
    identity times its scale."""
    return {"reducer": (reducer_job, ()), "optimizer": (optimizer_job, ()),
            "broadcast": (broadcast_job, ()), "hooks": (train, (hook_runs(1),)),
            "adasum": (adasum_job, (1,)), "sharded": (sharded_job, ()),
            "join": (join_job, ())}


def two_rank_jobs():
    """Two gloo ranks with CUDA tensors, on what gloo supports for them
    (all_reduce and broadcast): AdaSum with local_size=2 averages the block
    by an all_reduce and has no tree left to run."""
    # DDP last: its construction also gathers and broadcasts CUDA tensors, and a
    # refusal there may leave gloo's connections unusable for what follows
    return {"reducer": (reducer_job, ()), "broadcast": (broadcast_job, ()),
            "adasum": (adasum_job, (2,)), "optimizer": (optimizer_job, ()),
            "sharded": (sharded_job, ()), "join": (join_job, ()),
            "hooks": (train, (hook_runs(2),))}


def tree_jobs():
    """Two gloo ranks running AdaSum's tree (point-to-point exchanges)."""
    return {"adasum": (adasum_job, (1,)),
            "hooks": (train, (hook_runs(1, with_baselines=False),))}
