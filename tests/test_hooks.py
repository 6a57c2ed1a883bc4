"""fusedreduce.hooks registered on DistributedDataParallel over local gloo ranks.

Starting ranks costs seconds (DDP's first construction alone imports
torch._dynamo in every process) and a DDP step of these models milliseconds,
so all the two-rank work runs in one spawn and all the four-rank work in
another, each once per session (shared by xdist workers through a file); every
test then checks its own entry. Each entry runs DDP without a hook (which
validates the harness itself) and every hook.

Each step the workers also compute every rank's *local* gradient with a plain
copy of the model at the same parameters (the same ops, so bitwise what DDP put
in its buckets). The parent process checks the hooked gradients against a
float64 reference built from those local gradients, with error bounds derived
from the precision each hook computes in, and checks that all ranks hold
bitwise the same gradients and parameters.
"""
import contextlib
import copy
import functools
import inspect
import math
import os
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fusedreduce import adasum_allreduce, hooks
from fusedreduce.hooks import HookState
from harness import run_ranks

HOOKS = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
         "bf16": hooks.bf16_compress_hook, "adasum": hooks.adasum_hook}
#: (label, hook name or None for DDP's own all-reduce, HookState kwargs or None[,
#: a model replacing the test's])
EVERY_HOOK = [("ddp", None, None)] + [(name, name, None) for name in HOOKS]
LR = 0.05
SIXTEEN_BIT = (torch.float16, torch.bfloat16)
#: the reference's AdaSum floor: a coefficient is 1 below sqrt(float64 tiny)
NORM_FLOOR = math.sqrt(torch.finfo(torch.float64).tiny)
#: seconds, generous for a loaded machine: a hung collective fails a test, not the suite
TIMEOUT = 300


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


# ------------------------------------------------------------------ the worker


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


def _train(rank, world_size, runs, cfg):
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


def _run_each(rank, world_size, jobs):
    """``fn(rank, world_size, *args)`` for each named ``(fn, args)`` in one spawn;
    a job that raises gives its traceback, so one failure hides no other."""
    out = {}
    for name, (fn, args) in jobs.items():
        try:
            out[name] = fn(rank, world_size, *args)
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            out[name] = traceback.format_exc()
    return out


def _results_of(results, name, members=None):
    """The member ranks' results of config ``name``; fails with a rank's traceback."""
    per_rank = [results[r][name] for r in (members or range(len(results)))]
    for rank, result in enumerate(per_rank):
        if isinstance(result, str):
            pytest.fail(f"config {name!r} raised on rank {rank}:\n{result}", pytrace=False)
    return per_rank


# ------------------------------------------------------------------ float64 references


def _subnormal(dtype):
    """The spacing of ``dtype``'s subnormals: the absolute error of rounding near 0."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _mean_reference(per_rank, wire, before):
    """(reference, bound) for a mean reduced by summing ``x * before`` in ``wire``
    and multiplying by ``after = 1 / (world_size * before)``.

    Each addend rounds once to ``wire`` (relative eps, or a subnormal spacing near
    0) and each of the world_size - 1 additions once more, relative to the sum of
    magnitudes; ``after`` scales those errors and rounds once in fp32; the cast
    back to the gradient's dtype rounds once. Bounds use eps, not eps / 2.
    """
    world_size, dtype = len(per_rank), per_rank[0].dtype
    values = [g.double() for g in per_rank]
    reference = sum(values) / world_size
    magnitude = sum(v.abs() for v in values) / world_size
    after = 1.0 / (world_size * before)
    eps32 = torch.finfo(torch.float32).eps
    bound = (world_size * torch.finfo(wire).eps + 2 * eps32) * magnitude \
        + world_size * _subnormal(wire) * abs(after) \
        + torch.finfo(dtype).eps * reference.abs() + _subnormal(dtype)
    return reference, bound


def _adasum_pair(a, b, error_a, error_b, eps):
    """AdaSum(a, b) in float64 and a first-order bound on the hook's error.

    The hook combines in fp32 (``eps``) with fp64 statistics: the propagated
    input errors, the coefficients' sensitivity to them, and the rounding of
    the coefficients and of ``ca·a + cb·b``.
    """
    dot, a2, b2 = float(a @ b), float(a @ a), float(b @ b)
    norm_a, norm_b = math.sqrt(a2), math.sqrt(b2)
    err_a, err_b = float(error_a.norm()), float(error_b.norm())

    def coefficient(norm2, norm, err):
        if norm2 < NORM_FLOOR:
            return 1.0, 0.0
        sensitivity = (err_a * norm_b + norm_a * err_b) / (2 * norm2) \
            + abs(dot) * err / (norm2 * norm)
        return 1.0 - dot / (2 * norm2), sensitivity

    ca, dca = coefficient(a2, norm_a, err_a)
    cb, dcb = coefficient(b2, norm_b, err_b)
    combined = ca * a + cb * b
    error = abs(ca) * error_a + abs(cb) * error_b + dca * a.abs() + dcb * b.abs() \
        + 3 * eps * (abs(ca) * a.abs() + abs(cb) * b.abs())
    return combined, error


def adasum_reference(vectors, errors, eps):
    """The AdaSum tree over ``vectors`` (float64, one per rank), with error bounds.

    P is the largest power of two <= n; rank r >= P is combined into r - P
    (r - P on the left); then at d = 1, 2, 4, ...: v[r] = AdaSum(v[r], v[r + d])
    for every r that is a multiple of 2d.
    """
    v, e = list(vectors), list(errors)
    n = len(v)
    top = 1 << (n.bit_length() - 1)
    for r in range(top, n):
        v[r - top], e[r - top] = _adasum_pair(v[r - top], v[r], e[r - top], e[r], eps)
    distance = 1
    while distance < top:
        for r in range(0, top, 2 * distance):
            v[r], e[r] = _adasum_pair(v[r], v[r + distance], e[r], e[r + distance], eps)
        distance *= 2
    return v[0], e[0]


def _adasum_expected(per_rank, local_size):
    """AdaSum over the means of blocks of ``local_size`` consecutive ranks."""
    dtype = per_rank[0].dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    eps = torch.finfo(compute).eps
    flat = [g.double().reshape(-1) for g in per_rank]
    leaves, errors = [], []
    for start in range(0, len(flat), local_size):
        block = flat[start:start + local_size]
        leaves.append(sum(block) / local_size)
        # the block mean is an fp32 sum of exactly scaled values (power-of-two sizes)
        errors.append((local_size - 1) * eps * sum(b.abs() for b in block) / local_size)
    reference, error = adasum_reference(leaves, errors, eps)
    # factor 2: the error model is first-order
    bound = 2 * error + torch.finfo(dtype).eps * reference.abs() + _subnormal(dtype)
    return reference.view(per_rank[0].shape), bound.view(per_rank[0].shape)


def expected(hook_name, state_kwargs, per_rank):
    """(float64 reference, elementwise bound) for one parameter's reduced gradient."""
    state_kwargs = state_kwargs or {}
    dtype, world_size = per_rank[0].dtype, len(per_rank)
    if hook_name == "adasum":
        return _adasum_expected(per_rank, state_kwargs.get("local_size", 1))
    prescale = state_kwargs.get("prescale")
    if hook_name is None:  # DDP's own: divide in the bucket's dtype, sum in it
        wire, before = dtype, 1.0 / world_size
    elif hook_name == "allreduce":
        wire = torch.float32 if dtype in SIXTEEN_BIT else dtype
        before = prescale or 1.0 / world_size
    else:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[hook_name]
        before = prescale or 1.0 / world_size
    return _mean_reference(per_rank, wire, before)


# ------------------------------------------------------------------ checks in the parent


def _assert_same_on_every_rank(results, label):
    first = results[0][label]
    for rank, result in enumerate(results[1:], start=1):
        for step, (mine, theirs) in enumerate(zip(first["steps"], result[label]["steps"])):
            for i, (a, b) in enumerate(zip(mine["grads"], theirs["grads"])):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                    f"{label}: rank {rank} differs from rank 0 on gradient {i} at step {step}"
        for i, (a, b) in enumerate(zip(first["params"], result[label]["params"])):
            assert torch.equal(a, b), f"{label}: rank {rank} differs on parameter {i}"


def _check_against_reference(results, label, hook_name, state_kwargs, baseline="ddp"):
    """Every step's gradients within the bound of the float64 reference; a
    parameter DDP leaves without a gradient (unused everywhere) is left so."""
    failures = []
    for step, record in enumerate(results[0][label]["steps"]):
        plain = results[0][baseline]["steps"][step]["grads"] if baseline in results[0] else None
        for i, grad in enumerate(record["grads"]):
            per_rank = [record["local"][r][i] for r in range(len(record["local"]))]
            if grad is None:
                if plain is not None and plain[i] is not None:
                    failures.append(f"step {step} param {i}: no gradient, DDP has one")
                continue
            if plain is not None and plain[i] is None:
                failures.append(f"step {step} param {i}: a gradient where DDP leaves none")
            reference, bound = expected(hook_name, state_kwargs, per_rank)
            assert grad.dtype == per_rank[0].dtype and grad.shape == per_rank[0].shape
            excess = (grad.double() - reference).abs() - bound
            if excess.max() > 0:
                worst = int(excess.argmax())
                failures.append(
                    f"step {step} param {i} ({grad.dtype}): |error| "
                    f"{float((grad.double() - reference).reshape(-1)[worst].abs()):.3g} > bound "
                    f"{float(bound.reshape(-1)[worst]):.3g}")
    assert not failures, f"{label}:\n" + "\n".join(failures[:10])


def _check_adasum_is_adasum_allreduce(results, label):
    for rank, result in enumerate(results):
        for step, record in enumerate(result[label]["steps"]):
            for i, (grad, direct) in enumerate(zip(record["grads"], record["adasum_allreduce"])):
                if grad is None:  # unused on every rank: DDP leaves it, AdaSum(0, 0) = 0
                    assert not direct.any()
                    continue
                assert torch.equal(grad, direct), \
                    f"{label}: rank {rank} step {step} param {i} differs from adasum_allreduce"


def _check_all(results, runs):
    for label, hook_name, state_kwargs, *own_model in runs:
        _assert_same_on_every_rank(results, label)
        # DDP's run is the baseline for which gradients exist, on the same model
        _check_against_reference(results, label, hook_name, state_kwargs,
                                 baseline=None if own_model else "ddp")
        if hook_name == "adasum":
            _check_adasum_is_adasum_allreduce(results, label)


def _config(model, steps=3, micro=1, **extra):
    return dict(model=model, steps=steps, micro=micro, **extra)


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


def _invalid_states(rank, world_size):
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


def _adasum_hook_and_adasum_allreduce(rank, world_size, dtype, seeds=range(4)):
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


#: everything on 2 ranks, in one spawn (DDP's first construction alone imports
#: torch._dynamo, seconds per process); each test below reads its own entry.
#: The invalid states go last: they leave failed backward passes behind.
TWO_RANK_JOBS = {
    "parity": (_train, (EVERY_HOOK, _config(SMALL, steps=PARITY_STEPS))),
    "bucket_view": (_train, (EVERY_HOOK, _config(SMALL, ddp={"gradient_as_bucket_view": True}))),
    "static_graph": (_train, (EVERY_HOOK, _config(SMALL, steps=4, ddp={"static_graph": True}))),
    # two micro-batches under no_sync(), the third synced: the hooks reduce the
    # sum of the three local gradients
    "no_sync": (_train, (EVERY_HOOK, _config(SMALL, micro=3))),
    "buckets": (_train, (EVERY_HOOK, _config(LARGE, ddp={"bucket_cap_mb": 0.25}, record=True))),
    # the side branch is used by every rank (step 1), by rank 0 only (step 2:
    # rank 1 contributes zeros) and by nobody (steps 0 and 3)
    "find_unused": (_train, (EVERY_HOOK, _config(dict(SMALL, branch=True), steps=4,
                                                  ddp={"find_unused_parameters": True}))),
    # DDP puts each dtype in buckets of its own; the Triton kernels run in
    # Triton's interpreter on the CPU (TRITON_INTERPRET=1, inherited from conftest)
    "mixed": (_train, (MIXED_RUNS, _config(MIXED))),
    "fp64_adasum": (_adasum_hook_and_adasum_allreduce, (torch.float64,)),
    "fp32_adasum": (_adasum_hook_and_adasum_allreduce, (torch.float32,)),
    "invalid": (_invalid_states, ()),
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
    "mixed": (_train, (FOUR_RANK_RUNS, _config(MIXED))),
    # a 3-rank process group: HookState(group), and AdaSum's tree for a world
    # that is not a power of two (rank 2 joins rank 0 first)
    "subgroup": (_train, (EVERY_HOOK, _config(SMALL, group_ranks=SUBGROUP))),
}


def _spawn_once(tmp_path_factory, name, world_size, jobs):
    """``run_ranks(_run_each, world_size, jobs)``, once per test session.

    pytest-xdist runs a session fixture once per worker; the first worker to
    take the lock spawns the ranks and leaves the results in the session's
    shared temporary directory for the others (xdist's documented pattern).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return run_ranks(_run_each, world_size, jobs, timeout=TIMEOUT)
    from filelock import FileLock  # a dependency of torch

    shared = tmp_path_factory.getbasetemp().parent / f"test_hooks_{name}.pickle"
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            return pickle.loads(shared.read_bytes())
        results = run_ranks(_run_each, world_size, jobs, timeout=TIMEOUT)
        shared.write_bytes(pickle.dumps(results))
        return results


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    return _spawn_once(tmp_path_factory, "two_ranks", 2, TWO_RANK_JOBS)


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    return _spawn_once(tmp_path_factory, "four_ranks", 4, FOUR_RANK_JOBS)


# ------------------------------------------------------------------ four ranks
# (first in the file: under xdist its spawn starts while another worker runs
# the two-rank one)


def test_four_ranks_mixed_dtypes_and_state_options(four_ranks):
    _check_all(_results_of(four_ranks, "mixed"), FOUR_RANK_RUNS)


# ------------------------------------------------------------------ parity


def test_ten_sgd_steps_with_each_hook_match_ddp_or_the_float64_reference(two_ranks):
    results = _results_of(two_ranks, "parity")
    _check_all(results, EVERY_HOOK)
    # allreduce_hook against DDP's own all-reduce on fp32 gradients: both
    # multiply each addend by fp32(1/world) in place and sum the same buffer
    # with gloo, so every gradient and every parameter is bitwise DDP's
    plain, hooked = results[0]["ddp"], results[0]["allreduce"]
    for step, (a, b) in enumerate(zip(plain["steps"], hooked["steps"])):
        for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga.dtype == torch.float32 and torch.equal(ga, gb), (step, i)
    for i, (pa, pb) in enumerate(zip(plain["params"], hooked["params"])):
        assert torch.equal(pa, pb), f"parameter {i} after 10 steps"


# ------------------------------------------------------------------ DDP options


def test_hooks_with_gradient_as_bucket_view(two_ranks):
    results = _results_of(two_ranks, "bucket_view")
    _check_all(results, EVERY_HOOK)
    for label, *_ in EVERY_HOOK:
        for record in results[0][label]["steps"]:
            # the gradients really are views of (one) bucket
            assert record["grad_storages"] == 1, label


def test_hooks_with_static_graph(two_ranks):
    _check_all(_results_of(two_ranks, "static_graph"), EVERY_HOOK)


def test_hooks_reduce_gradients_accumulated_under_no_sync(two_ranks):
    _check_all(_results_of(two_ranks, "no_sync"), EVERY_HOOK)


def test_hooks_with_several_buckets_rebuilt_after_the_first_iteration(two_ranks):
    results = _results_of(two_ranks, "buckets")
    _check_all(results, EVERY_HOOK)
    for label, hook_name, _ in EVERY_HOOK[1:]:
        per_step, current = [], None
        for entry in results[0][label]["log"]:
            if entry == "step":
                current = []
                per_step.append(current)
            else:
                current.append(entry)
        # the precondition of this test: one bucket on the first iteration,
        # several (a different layout) once DDP has rebuilt them
        assert len(per_step[0]) == 1 and all(len(s) > 1 for s in per_step[1:]), \
            (label, [[e["numel"] for e in s] for s in per_step])
        for entry in (e for s in per_step for e in s):
            assert entry["is_future"], label
            assert entry["shape"] == (entry["numel"],) and entry["result_dtype"] == entry["dtype"]
            assert entry["in_place"], f"{label}: the result is not the bucket's own buffer"
            if hook_name == "adasum":  # documented: runs before returning
                assert entry["done_at_return"]


def test_hooks_with_find_unused_parameters(two_ranks):
    results = _results_of(two_ranks, "find_unused")
    _check_all(results, EVERY_HOOK)
    steps = results[0]["ddp"]["steps"]
    branch = [i for i, g in enumerate(steps[0]["grads"]) if g is None]
    assert branch, "the branch must be unused at step 0"
    assert all(steps[2]["grads"][i] is not None for i in branch)


def test_hooks_on_a_mixed_fp16_bf16_fp32_model_with_both_kernel_backends(two_ranks):
    results = _results_of(two_ranks, "mixed")
    _check_all(results, MIXED_RUNS)
    dtypes = {g.dtype for g in results[0]["allreduce"]["steps"][0]["grads"]}
    assert dtypes == {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def test_hooks_on_a_three_rank_process_group(four_ranks):
    results = _results_of(four_ranks, "subgroup", SUBGROUP)
    _check_all(results, EVERY_HOOK)
    assert four_ranks[3]["subgroup"] is None


def test_adasum_hook_is_bitwise_adasum_allreduce_for_fp32_gradients(two_ranks):
    for rank, same in enumerate(_results_of(two_ranks, "fp32_adasum")):
        assert all(all(per_seed) for per_seed in same), (rank, same)


def test_adasum_hook_is_bitwise_adasum_allreduce_for_fp64_gradients(two_ranks):
    for rank, same in enumerate(_results_of(two_ranks, "fp64_adasum")):
        assert all(all(per_seed) for per_seed in same), (rank, same)


# ------------------------------------------------------------------ invalid states


def test_invalid_hook_states_fail_clearly_without_hanging(two_ranks):
    results = _results_of(two_ranks, "invalid")
    for rank, outcome in enumerate(results):
        for name, (_, (kind, word)) in BAD_STATE_KWARGS.items():
            got = outcome["construction"][name]
            assert got is not None and got[0] == kind and word in got[1], (rank, name, got)
        # a state of the wrong type: raised inside backward, on every rank
        for name, got in outcome["first_bucket"].items():
            assert got is not None and got[0] == "TypeError" and "HookState" in got[1], \
                (rank, name, got)
    assert results[0]["subgroup"] == ("ok", 1)
    assert results[1]["subgroup"][0] == "RuntimeError" and "member" in results[1]["subgroup"][1]


def test_hook_state_without_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        HookState()


# ------------------------------------------------------------------ what DDP checks


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hooks_carry_the_annotations_ddp_compares(name):
    signature = inspect.signature(HOOKS[name])
    assert list(signature.parameters) == ["state", "bucket"]
    assert signature.parameters["bucket"].annotation is dist.GradBucket
    assert signature.return_annotation == torch.futures.Future[torch.Tensor]


def test_the_bf16_hook_avoids_the_name_ddp_reserves_for_nccl():
    assert hooks.bf16_compress_hook is hooks.bfloat16_compress_hook
    assert hooks.bf16_compress_hook.__name__ not in ("bf16_compress_hook",
                                                      "bf16_compress_wrapper_hook")


def test_the_adasum_reference_tree_combines_in_the_documented_order():
    # the reference itself: orthogonal vectors add, equal ones average, and
    # with 3 ranks the third joins rank 0 first
    e1, e2 = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0],
                                                                         dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    assert torch.equal(adasum_reference([e1, e2], [zero, zero], 0.0)[0], e1 + e2)
    assert torch.equal(adasum_reference([e1, e1], [zero, zero], 0.0)[0], e1)
    # AdaSum(AdaSum(e1, e1), e2) = e1 + e2, but AdaSum(AdaSum(e1, e2), e1) is not
    assert torch.equal(adasum_reference([e1, e2, e1], [zero] * 3, 0.0)[0], e1 + e2)
    assert torch.equal(adasum_reference([e1, zero], [zero, zero], 0.0)[0], e1)
