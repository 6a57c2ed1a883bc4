"""The ranks' side of test_hooks.py: models, data, rank functions, the job tables.

test_hooks.py starts gloo ranks once per world size, runs a table of jobs on
them (``TWO_RANK_JOBS``, ``FOUR_RANK_JOBS``, through ``run_each``) and checks
what comes back against its float64 references. The rank functions are
pickled by reference, so each spawned rank imports the module that defines
them (tests/ is on the children's sys.path): here they live apart from the
test module's references, checks and fixtures, which the ranks never use.

A job's rank function returns plain data (gradients, parameters, a log of the
buckets a hook saw, error messages); ``run_each`` turns a job's exception into
its traceback, so that one failure hides no other. A little over 300 lines:
the two job tables and everything they run belong together.
"""
import contextlib
import copy
import functools
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fusedreduce import adasum_allreduce, hooks, rank_agreement
from fusedreduce.hooks import HookState

HOOKS = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
         "bf16": hooks.bf16_compress_hook, "adasum": hooks.adasum_hook}
LR = 0.05


# ------------------------------------------------------------------ models and data


class Net(nn.Module):
    """A tanh MLP whose layers may each have their own dtype, plus an optional
    side branch that ``forward`` uses only when asked (for find_unused_parameters)."""

    def __init__(self, widths, dtypes=None, branch=False):
        super().__init__()
        torch.manual_seed(0)
        dtypes = dtypes or [torch.float32] * (len(widths) - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o).to(d)
                                    for i, o, d in zip(widths, widths[1:], dtypes))
        self.branch = nn.Linear(widths[0], widths[-1]) if branch else None

    def forward(self, x, use_branch=False):
        y = x
        for k, layer in enumerate(self.layers):
            y = layer(y.to(layer.weight.dtype))
            if k < len(self.layers) - 1:
                y = torch.tanh(y)
        y = y.float()
        return y + self.branch(x) if use_branch else y


SMALL = {"widths": [6, 32, 16, 2]}
#: > 1 MiB: DDP's rebuilt buckets start with a 1 MiB one, so a small cap only
#: splits a model larger than that
LARGE = {"widths": [32, 512, 512, 256, 4]}
#: fp16, bf16 and fp32 as asked, and an fp64 layer for the hooks' fp64 paths
MIXED = {"widths": [6, 40, 24, 16, 12, 2],
         "dtypes": [torch.float16, torch.bfloat16, torch.float16, torch.float64, torch.float32]}


def _batch(rank, step, micro, widths):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, widths[0], generator=gen), torch.randn(8, widths[-1], generator=gen)


def _uses_branch(cfg, rank, step):
    """The side branch: used by every rank, by rank 0 only, or by nobody."""
    if not cfg["model"].get("branch"):
        return False
    return step % 3 == 1 or (step % 3 == 2 and rank == 0)


def _loss(model, rank, step, micro, cfg):
    x, y = _batch(rank, step, micro, cfg["model"]["widths"])
    return ((model(x, _uses_branch(cfg, rank, step)) - y) ** 2).mean()


def _local_grads(model, rank, step, cfg):
    """What rank ``rank`` contributes to DDP's buckets this step (accumulated over
    micro-batches; zeros for parameters it did not use)."""
    model.zero_grad(set_to_none=True)
    for micro in range(cfg["micro"]):
        _loss(model, rank, step, micro, cfg).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for p in model.parameters()]


def _config(model, steps=3, micro=1, **extra):
    return dict(model=model, steps=steps, micro=micro, **extra)


# ------------------------------------------------------------------ rank functions


def _recording(hook, log):
    """``hook`` plus a record of each bucket and of the future it returns.

    functools.wraps keeps the name and annotations, so DDP's checks still see
    the real hook's.
    """
    @functools.wraps(hook)
    def recorded(state, bucket):
        buffer = bucket.buffer()
        future = hook(state, bucket)
        entry = {"index": bucket.index(), "numel": buffer.numel(), "dtype": buffer.dtype,
                 # torch.futures.Future or the C++ future it wraps (what
                 # Work.get_future().then returns, as in torch's own hooks)
                 "is_future": isinstance(future, torch._C.Future),
                 "done_at_return": future.done()}
        log.append(entry)
        pointer = buffer.data_ptr()

        def inspect_result(fut):
            result = fut.value()
            entry.update(shape=tuple(result.shape), result_dtype=result.dtype,
                         in_place=result.data_ptr() == pointer)
            return result

        return future.then(inspect_result)
    return recorded


def train(rank, world_size, runs, cfg):
    """Train one DDP model per run for ``cfg["steps"]`` SGD steps; per step, its
    gradients (and on the group's first rank every member's local gradients).

    With ``cfg["group_ranks"]`` DDP and the hooks use a process group of those
    ranks; the others only join its creation.
    """
    torch.set_num_threads(1)
    members = cfg.get("group_ranks") or list(range(world_size))
    group = dist.new_group(members) if cfg.get("group_ranks") else None
    if rank not in members:
        return None
    out = {}
    for label, hook_name, state_kwargs, *model_spec in runs:
        run_cfg = dict(cfg, model=model_spec[0]) if model_spec else cfg
        model = Net(**run_cfg["model"])
        local = copy.deepcopy(model)
        ddp = DDP(model, process_group=group, **cfg.get("ddp", {}))
        log = []
        if hook_name is not None:
            state = None if state_kwargs is None and group is None else \
                HookState(group, **(state_kwargs or {}))
            hook = HOOKS[hook_name]
            ddp.register_comm_hook(state, _recording(hook, log) if cfg.get("record") else hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        steps = []
        for step in range(cfg["steps"]):
            with torch.no_grad():
                for copied, p in zip(local.parameters(), model.parameters()):
                    copied.copy_(p)
            local_grads = [_local_grads(local, r, step, run_cfg) for r in members]
            log.append("step")
            optimizer.zero_grad(set_to_none=True)
            for micro in range(cfg["micro"]):
                synced = micro == cfg["micro"] - 1
                with contextlib.nullcontext() if synced else ddp.no_sync():
                    _loss(ddp, rank, step, micro, run_cfg).backward()
            record = {"grads": [None if p.grad is None else p.grad.detach().clone()
                                for p in model.parameters()],
                      "local": local_grads if rank == members[0] else None,
                      "grad_storages": len({p.grad.untyped_storage().data_ptr()
                                            for p in model.parameters() if p.grad is not None})}
            if hook_name == "adasum":
                # the same per-parameter gradients through the collective API,
                # on the same kernels' backend (the backends' statistics may
                # differ in the last bits, which fp64 coefficients keep)
                record["adasum_allreduce"] = adasum_allreduce(
                    local_grads[members.index(rank)], group,
                    local_size=(state_kwargs or {}).get("local_size", 1),
                    backend=(state_kwargs or {}).get("backend", "auto"))
            steps.append(record)
            optimizer.step()
        out[label] = {"steps": steps, "params": [p.detach().clone() for p in model.parameters()],
                      "log": log}
    return out


def run_each(rank, world_size, jobs):
    """``fn(rank, world_size, *args)`` for each named ``(fn, args)`` in one spawn;
    a job that raises gives its traceback, so one failure hides no other."""
    out = {}
    for name, (fn, args) in jobs.items():
        try:
            out[name] = fn(rank, world_size, *args)
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            out[name] = traceback.format_exc()
    return out


#: HookState arguments it must refuse at construction: (kwargs, (error, a word of its message))
BAD_STATE_KWARGS = {
    "prescale_zero": ({"prescale": 0.0}, ("ValueError", "prescale")),
    "prescale_nan": ({"prescale": float("nan")}, ("ValueError", "prescale")),
    "prescale_inf": ({"prescale": float("inf")}, ("ValueError", "prescale")),
    "prescale_str": ({"prescale": "0.5"}, ("TypeError", "prescale")),
    "prescale_bool": ({"prescale": True}, ("TypeError", "prescale")),
    "local_size_zero": ({"local_size": 0}, ("ValueError", "local_size")),
    "local_size_not_dividing": ({"local_size": 3}, ("ValueError", "local_size")),
    "local_size_float": ({"local_size": 2.0}, ("ValueError", "local_size")),
    "backend_unknown": ({"backend": "cuda"}, ("ValueError", "backend")),
}


def invalid_states(rank, world_size):
    """Each bad HookState's construction error, and each bad ``state``'s error
    in the first bucket (raised on every rank, before any collective)."""
    outcome = {"construction": {}, "first_bucket": {}}
    for name, (kwargs, _) in BAD_STATE_KWARGS.items():
        try:
            HookState(**kwargs)
            outcome["construction"][name] = None
        except Exception as exc:  # noqa: BLE001 - the type is the point
            outcome["construction"][name] = (type(exc).__name__, str(exc))
    subgroup = dist.new_group([0])  # collective: every rank creates it
    try:
        outcome["subgroup"] = ("ok", HookState(subgroup).world_size)
    except Exception as exc:  # noqa: BLE001
        outcome["subgroup"] = (type(exc).__name__, str(exc))
    for name, state in {"dict": {"group": None}, "int": 3, "string": "world"}.items():
        model = DDP(Net(**SMALL))
        model.register_comm_hook(state, hooks.allreduce_hook)
        try:
            _loss(model, rank, 0, 0, _config(SMALL)).backward()
            outcome["first_bucket"][name] = None
        except Exception as exc:  # noqa: BLE001
            outcome["first_bucket"][name] = (type(exc).__name__, str(exc))
    return outcome


#: hook options that differ by rank: (hook per rank, HookState kwargs per rank,
#: the option the error must name), each with a new state (the check runs at a
#: state's first bucket; the world's kept state was used before). Each would
#: otherwise hang (a norm split on rank 0 alone, another hook's collectives)
#: or give the ranks different gradients, silently
DISAGREEING = {
    "split_norm": (("allreduce", "allreduce"),
                   ({"max_grad_norm": 1.0, "split_norm": True},
                    {"max_grad_norm": 1.0, "split_norm": False}), "split_norm"),
    "hook": (("allreduce", "bf16"), ({}, {}), "hook"),
    "prescale": (("fp16", "fp16"), ({"prescale": 0.5}, {}), "prescale"),
    "max_grad_norm": (("allreduce", "allreduce"), ({"max_grad_norm": 1.0}, {}),
                      "max_grad_norm"),
    "norm_type": (("allreduce", "allreduce"),
                  ({"max_grad_norm": 1.0}, {"max_grad_norm": 1.0, "norm_type": float("inf")}),
                  "norm_type"),
    "backend": (("allreduce", "allreduce"), ({"backend": "triton"}, {"backend": "torch"}),
                "backend"),
    "local_size": (("adasum", "adasum"), ({"local_size": 2}, {}), "local_size"),
}


def disagreeing_states(rank, world_size):
    """Per ``DISAGREEING`` case, what each rank's first backward raised (None:
    nothing); and, with options that agree, how many times in 3 steps (two
    buckets each) and after a pickling round trip the ranks were compared."""
    outcome = {}
    for name, (hook_names, kwargs, _) in DISAGREEING.items():
        state = HookState(**kwargs[rank])
        model = DDP(Net(**SMALL))
        model.register_comm_hook(state, HOOKS[hook_names[rank]])
        try:
            for step in range(2):
                _loss(model, rank, step, 0, _config(SMALL)).backward()
            outcome[name] = None
        except Exception as exc:  # noqa: BLE001 - the type and message are the point
            outcome[name] = (type(exc).__name__, str(exc))
    checks = []
    original = rank_agreement.verify_same_on_all_ranks

    def counted(*args, **kwargs):
        checks.append(kwargs.get("what"))
        return original(*args, **kwargs)

    rank_agreement.verify_same_on_all_ranks = counted
    try:
        state = HookState(max_grad_norm=1.0, split_norm=True)
        model = DDP(Net(**LARGE), bucket_cap_mb=0.25)
        log = []
        model.register_comm_hook(state, _recording(hooks.allreduce_hook, log))
        for step in range(3):
            _loss(model, rank, step, 0, _config(LARGE)).backward()
        outcome["checks_in_three_steps"] = len(checks)
        outcome["buckets"] = 1 + max(entry["index"] for entry in log)
        clone = copy.deepcopy(state)  # through __getstate__, as pickling
        model = DDP(Net(**LARGE), bucket_cap_mb=0.25)
        model.register_comm_hook(clone, hooks.allreduce_hook)
        _loss(model, rank, 0, 0, _config(LARGE)).backward()
        outcome["checks_after_a_copy"] = len(checks)
    finally:
        rank_agreement.verify_same_on_all_ranks = original
    return outcome


def adasum_hook_and_adasum_allreduce(rank, world_size, dtype, seeds=range(4)):
    """Per seed and parameter: is adasum_hook's gradient bitwise
    adasum_allreduce's of the same local gradients? On DDP's second iteration,
    once it has rebuilt its bucket in gradient-ready order (last layer first)."""
    torch.set_num_threads(1)
    same = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)
        ddp = DDP(model)
        ddp.register_comm_hook(None, hooks.adasum_hook)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank + 10 * seed),
                        dtype=dtype)
        for _ in range(2):
            ddp.zero_grad()
            ddp(x).pow(2).sum().backward()
        hooked = [p.grad.clone() for p in model.parameters()]
        ddp.zero_grad()
        model(x).pow(2).sum().backward()  # the module itself: local gradients, no DDP
        direct = adasum_allreduce([p.grad for p in model.parameters()])
        same.append([torch.equal(a, b) for a, b in zip(hooked, direct)])
    return same


# ------------------------------------------------------------------ the jobs


#: (label, hook name or None for DDP's own all-reduce, HookState kwargs or None[,
#: a model replacing the job's])
EVERY_HOOK = [("ddp", None, None)] + [(name, name, None) for name in HOOKS]

#: The Triton runs of the async hooks use one-bucket models: Triton's
#: interpreter patches triton.language globally for the duration of a launch,
#: so it cannot run a bucket's callback (gloo's thread) while backward flattens
#: the next bucket. Compiled Triton on a GPU has no such limit. Each model makes
#: the hook's kernels cast: fp16 <-> fp32 (allreduce), fp32 <-> fp16 (fp16),
#: fp16 <-> bf16 (bf16); adasum_hook is synchronous and takes the mixed model.
FP16 = {"widths": [6, 40, 24, 2], "dtypes": [torch.float16] * 3}
TRITON_MODELS = {"allreduce": FP16, "fp16": SMALL, "bf16": FP16, "adasum": MIXED}
MIXED_RUNS = EVERY_HOOK + [(f"{name}_triton", name, {"backend": "triton"}, model)
                           for name, model in TRITON_MODELS.items()]
PARITY_STEPS = 10

#: everything on 2 ranks, in one spawn (DDP's first construction alone imports
#: torch._dynamo, seconds per process); each test reads its own entry.
#: The invalid states go last: they leave failed backward passes behind.
TWO_RANK_JOBS = {
    "parity": (train, (EVERY_HOOK, _config(SMALL, steps=PARITY_STEPS))),
    "bucket_view": (train, (EVERY_HOOK, _config(SMALL, ddp={"gradient_as_bucket_view": True}))),
    "static_graph": (train, (EVERY_HOOK, _config(SMALL, steps=4, ddp={"static_graph": True}))),
    # two micro-batches under no_sync(), the third synced: the hooks reduce the
    # sum of the three local gradients
    "no_sync": (train, (EVERY_HOOK, _config(SMALL, micro=3))),
    "buckets": (train, (EVERY_HOOK, _config(LARGE, ddp={"bucket_cap_mb": 0.25}, record=True))),
    # the side branch is used by every rank (step 1), by rank 0 only (step 2:
    # rank 1 contributes zeros) and by nobody (steps 0 and 3)
    "find_unused": (train, (EVERY_HOOK, _config(dict(SMALL, branch=True), steps=4,
                                                 ddp={"find_unused_parameters": True}))),
    # DDP puts each dtype in buckets of its own; the Triton kernels run in
    # Triton's interpreter on the CPU (TRITON_INTERPRET=1, inherited from conftest)
    "mixed": (train, (MIXED_RUNS, _config(MIXED))),
    "fp64_adasum": (adasum_hook_and_adasum_allreduce, (torch.float64,)),
    "fp32_adasum": (adasum_hook_and_adasum_allreduce, (torch.float32,)),
    "invalid": (invalid_states, ()),
    "disagreeing": (disagreeing_states, ()),
}

FOUR_RANK_RUNS = EVERY_HOOK + [
    ("adasum_local2", "adasum", {"local_size": 2}),
    ("allreduce_prescaled", "allreduce", {"prescale": 0.5}),
    ("fp16_prescaled", "fp16", {"prescale": 1 / 16}),
]
SUBGROUP = [0, 1, 2]
FOUR_RANK_JOBS = {
    # DDP makes a bucket per dtype. With 4 ranks an fp16 all-reduce would round
    # 3 times in fp16: the allreduce_hook's bound (one fp16 rounding after an
    # fp32 sum) tells them apart
    "mixed": (train, (FOUR_RANK_RUNS, _config(MIXED))),
    # a 3-rank process group: HookState(group), and AdaSum's tree for a world
    # that is not a power of two (rank 2 joins rank 0 first)
    "subgroup": (train, (EVERY_HOOK, _config(SMALL, group_ranks=SUBGROUP))),
}
