"""DistributedOptimizer on local gloo ranks: training parity with a single
process on the whole batch, parameter broadcasts, gradient accumulation,
torch integrations (isinstance, state_dict, lr_scheduler, GradScaler) and the
errors it raises on every rank.

Rank functions never assert (a rank that raised would leave the others waiting
in a collective): they return what they saw and the parent judges it. Over 300
lines because each of the six behaviours keeps its rank function beside the
test that judges it.
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import (CRASH_TIMEOUT, TIMEOUT, assert_raised_before_any_collective,
                     outcomes_and_collectives, rank_errors, record_collectives, run_ranks)
from fusedreduce import DistributedOptimizer

BATCH = 12  # rows per step; divisible by every world size used here
STEPS = 20


def _mlp(dtype):
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.4)
    return model


def _batch(step, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(BATCH, 6, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(BATCH, 3, generator=gen, dtype=torch.float64).to(dtype))


def _shard(rank, world_size, step, dtype):
    x, y = _batch(step, dtype)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return x[rows], y[rows]


def _make(name, params, lr=None, reduction="mean"):
    """SGD with momentum or Adam; a sum-reduced loss is BATCH times larger, so
    its learning rate is BATCH times smaller (else SGD diverges)."""
    if lr is None:
        lr = (0.05 if name == "sgd" else 0.01) / (BATCH if reduction == "sum" else 1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def _loss(model, x, y, reduction):
    return nn.functional.mse_loss(model(x), y, reduction=reduction)


def _perturb(model):
    """A small divergence: a large one makes this replica's gradients (averaged
    into everyone's) blow the training up."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------- parity
def _train(rank, world_size, dtype, reduce_method, kwargs):
    """Both optimizers, STEPS steps each, from the same start on every rank."""
    # sum across ranks of sum-reduced shard losses is the whole batch's sum;
    # the mean across ranks of mean-reduced shard losses is the whole batch's mean
    reduction = "mean" if reduce_method == "mean" else "sum"
    events = []
    record_collectives(events)
    seen = {}
    for name in ("sgd", "adam"):
        model = _mlp(dtype)
        opt = DistributedOptimizer(_make(name, model.parameters(), reduction=reduction),
                                   reduce_method=reduce_method, **kwargs)
        for step in range(STEPS):
            opt.zero_grad()
            events.clear()
            _loss(model, *_shard(rank, world_size, step, dtype), reduction).backward()
            opt.step()
        seen[name] = _params(model)
        seen[f"{name} all_reduces in the last backward"] = events.count("all_reduce")
    return seen


def _single_process(name, dtype, reduction):
    model = _mlp(dtype)
    opt = _make(name, model.parameters(), reduction=reduction)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(step, dtype), reduction).backward()
        opt.step()
    return _params(model)


@pytest.mark.parametrize("dtype, world_size, reduce_method, kwargs", [
    (torch.float64, 2, "mean", {}),
    (torch.float64, 2, "sum", {"param_pack": False}),
    (torch.float32, 3, "mean", {"param_pack_thd": 600}),
], ids=["fp64-2ranks-mean", "fp64-2ranks-sum-unpacked", "fp32-3ranks-mean-small-packs"])
def test_training_on_shards_matches_a_single_process_on_the_whole_batch(
        dtype, world_size, reduce_method, kwargs):
    results = run_ranks(_train, world_size, dtype, reduce_method, kwargs, timeout=TIMEOUT)
    n_params = len(list(_mlp(dtype).parameters()))
    reduction = "mean" if reduce_method == "mean" else "sum"
    for name in ("sgd", "adam"):
        for r in range(1, world_size):
            assert all(torch.equal(a, b) for a, b in zip(results[0][name], results[r][name])), \
                f"{name}: rank {r}'s replica differs from rank 0's"
        reference = _single_process(name, dtype, reduction)
        if dtype == torch.float64:
            # the only difference is the order of the batch sum (shards, then
            # ranks): a few ulps of fp64 per step, far below this over 20 steps
            rtol, atol = 1e-10, 1e-12
        else:
            # fp32: each step's gradient differs from the single process's by a
            # few ulps (another summation order); with lr <= 0.05 that moves a
            # parameter by ~1e-8 per step, ~2e-7 after 20 steps (measured). A
            # wrong reduction (a sum for a mean) is off by more than 1e-2.
            rtol, atol = 1e-5, 2e-6
        for i, (got, want) in enumerate(zip(results[0][name], reference)):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                       msg=f"{name}: parameters[{i}]")
        # nothing more: every rank had every gradient, which the buckets' own
        # all-reduces say (no count of who had which is needed)
        all_reduces = results[0][f"{name} all_reduces in the last backward"]
        if kwargs.get("param_pack") is False:
            assert all_reduces == n_params, "param_pack=False: one all-reduce per gradient"
        elif "param_pack_thd" in kwargs:
            assert 1 < all_reduces < n_params, "a small param_pack_thd splits the packs"
        else:
            assert all_reduces == 1, "the default packs this model's gradients in one bucket"


# --------------------------------------------------------------- broadcasts
def _replicas(rank, world_size):
    dtype = torch.float64
    seen = {}

    def step(model, opt, k):
        opt.zero_grad()
        _loss(model, *_shard(rank, world_size, k, dtype), "mean").backward()
        opt.step()

    # every 3 steps; rank 1 diverges right after construction and after step 4
    model = _mlp(dtype)
    opt = DistributedOptimizer(_make("sgd", model.parameters()), bcast_period=3)
    if rank == 1:
        _perturb(model)
    for k in range(1, 8):
        step(model, opt, k)
        seen[f"3: after step {k}"] = _params(model)
        if k == 4 and rank == 1:
            _perturb(model)
    # 0: once, at construction only
    model = _mlp(dtype)
    if rank == 1:
        _perturb(model)
    opt = DistributedOptimizer(_make("sgd", model.parameters()), bcast_period=0)
    seen["0: after construction"] = _params(model)
    if rank == 1:
        _perturb(model)
    for k in range(4):
        step(model, opt, k)
    seen["0: 4 steps after a later divergence"] = _params(model)
    # -1: never (replicas that differ at construction are refused:
    # tests/test_replicas.py)
    model = _mlp(dtype)
    opt = DistributedOptimizer(_make("sgd", model.parameters()), bcast_period=-1)
    if rank == 1:
        _perturb(model)
    seen["-1: after construction"] = _params(model)
    for k in range(4):
        step(model, opt, k)
    seen["-1: after 4 steps"] = _params(model)
    return seen


def test_bcast_period_broadcasts_rank_0s_parameters_at_construction_and_every_k_steps():
    results = run_ranks(_replicas, 2, timeout=TIMEOUT)
    equal = {name: all(torch.equal(a, b) for a, b in zip(results[0][name], results[1][name]))
             for name in results[0]}
    expected = {"3: after step 1": False, "3: after step 2": False, "3: after step 3": True,
                "3: after step 4": True, "3: after step 5": False, "3: after step 6": True,
                "3: after step 7": True,
                "0: after construction": True, "0: 4 steps after a later divergence": False,
                "-1: after construction": False, "-1: after 4 steps": False}
    assert equal == expected


# ------------------------------------------------------------- accumulation
def _micro_batch(rank, world_size, step, micro):
    """Micro-batch ``micro`` (of 2) of rank ``rank``'s shard at ``step``."""
    x, y = _shard(rank, world_size, step, torch.float64)
    half = x.shape[0] // 2
    rows = slice(micro * half, (micro + 1) * half)
    return x[rows], y[rows]


def _accumulating(rank, world_size):
    model = _mlp(torch.float64)
    opt = DistributedOptimizer(_make("sgd", model.parameters()), backward_passes_per_step=2)
    early = []
    for k in range(3):
        opt.zero_grad()
        for micro in range(2):
            _loss(model, *_micro_batch(rank, world_size, k, micro), "sum").backward()
            if micro == 0:
                try:
                    opt.step()
                    early.append(None)
                except RuntimeError as exc:
                    early.append(str(exc))
        opt.step()
    trained = _params(model)
    # after a pass inside no_sync() the gradients are not reduced either
    model = _mlp(torch.float64)
    opt = DistributedOptimizer(_make("sgd", model.parameters()))
    with opt.no_sync():
        _loss(model, *_micro_batch(rank, world_size, 0, 0), "sum").backward()
    try:
        opt.step()
        no_sync_error = None
    except RuntimeError as exc:
        no_sync_error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(_params(model), _params(_mlp(torch.float64))))
    return trained, early, no_sync_error, unchanged


def test_backward_passes_per_step_accumulates_like_one_pass_on_twice_the_data():
    world_size = 2
    results = run_ranks(_accumulating, world_size, timeout=TIMEOUT)
    # the reference: one process, one pass per step on every rank's two
    # micro-batches (the whole batch), averaged over the ranks like the optimizer
    model = _mlp(torch.float64)
    opt = _make("sgd", model.parameters())
    for k in range(3):
        opt.zero_grad()
        (_loss(model, *_batch(k, torch.float64), "sum") / world_size).backward()
        opt.step()
    for rank, (trained, early, no_sync_error, unchanged) in enumerate(results):
        for i, (got, want) in enumerate(zip(trained, model.parameters())):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank}, parameters[{i}]")
        assert len(early) == 3 and all(e is not None and "not reduced" in e for e in early), early
        assert no_sync_error is not None and "not reduced" in no_sync_error
        assert unchanged, "a refused step must not touch the parameters"


# ---------------------------------------------------- torch integrations
def _integrations(rank, world_size):
    dtype = torch.float64
    seen = {}
    model = _mlp(dtype)
    opt = DistributedOptimizer(_make("sgd", model.parameters(), lr=0.4))
    seen["isinstance"] = (isinstance(opt, torch.optim.SGD), isinstance(opt, torch.optim.Optimizer))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(5):
            opt.zero_grad()
            _loss(model, *_shard(rank, world_size, k, dtype), "mean").backward()
            opt.step()
            scheduler.step()
            lrs.append(opt.param_groups[0]["lr"])
    seen["lrs"] = lrs
    seen["warnings"] = [str(w.message) for w in caught]
    # a fresh replica resumes from the state dict and takes the same next step
    state = opt.state_dict()
    seen["state_dict is a plain SGD's"] = _loads_into_plain_sgd(model, state)
    twin = copy.deepcopy(model)
    twin_opt = DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=1.0))
    # a deep copy, as from a checkpoint: load_state_dict keeps tensors of the
    # right dtype and device as they are, so the twin would share (and step)
    # the original's momentum buffers
    twin_opt.load_state_dict(copy.deepcopy(state))
    seen["loaded hyperparameters"] = {k: twin_opt.param_groups[0][k] for k in ("lr", "momentum")}
    seen["loaded momentum buffers equal"] = all(
        torch.equal(opt.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])
        for p, q in zip(model.parameters(), twin.parameters()))
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        _loss(m, *_shard(rank, world_size, 9, dtype), "mean").backward()
        o.step()
    seen["resumed step identical"] = all(torch.equal(a, b) for a, b in
                                         zip(model.parameters(), twin.parameters()))
    return seen


def _loads_into_plain_sgd(model, state):
    plain = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=1.0)
    plain.load_state_dict(state)
    return plain.param_groups[0]["lr"] == state["param_groups"][0]["lr"]


def test_it_is_the_wrapped_optimizer_to_schedulers_and_state_dicts():
    results = run_ranks(_integrations, 2, timeout=TIMEOUT)
    for rank, seen in enumerate(results):
        assert seen["isinstance"] == (True, True)
        assert seen["lrs"] == [0.4, 0.2, 0.2, 0.1, 0.1], f"rank {rank}: {seen['lrs']}"
        assert not [w for w in seen["warnings"] if "lr_scheduler" in w], seen["warnings"]
        assert seen["state_dict is a plain SGD's"]
        assert seen["loaded hyperparameters"] == {"lr": 0.1, "momentum": 0.9}
        assert seen["loaded momentum buffers equal"]
        assert seen["resumed step identical"]


def _scaled_training(rank, world_size):
    model = _mlp(torch.float32)
    opt = DistributedOptimizer(_make("sgd", model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    seen = []
    for k in range(3):
        opt.zero_grad()
        loss = _loss(model, *_shard(rank, world_size, k, torch.float32), "mean")
        if k == 1 and rank == 1:
            loss = loss * float("inf")  # this rank alone overflows
        before = _params(model)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        changed = [not torch.equal(a, b) for a, b in zip(before, _params(model))]
        seen.append(dict(grads=grads, changed=changed, scale=scaler.get_scale()))
    return seen, _params(model)


def test_grad_scaler_sees_reduced_gradients_so_one_ranks_overflow_skips_the_step_everywhere():
    world_size = 2
    results = run_ranks(_scaled_training, world_size, timeout=TIMEOUT)
    (first, second, third), final = results[0]
    # step 0: the unscaled gradients are the mean of the ranks' own gradients
    local = []
    for r in range(world_size):
        model = _mlp(torch.float32)
        _loss(model, *_shard(r, world_size, 0, torch.float32), "mean").backward()
        local.append([p.grad for p in model.parameters()])
    for got, a, b in zip(first["grads"], *local):
        # fp32 sum of two values, then exact power-of-two scalings: one rounding
        torch.testing.assert_close(got, (a + b) / 2, rtol=2e-7, atol=1e-9)
    assert all(first["changed"]) and first["scale"] == 2.0 ** 10
    assert all(not torch.isfinite(g).all() for g in second["grads"])
    assert not any(second["changed"]), "the overflowing step must be skipped"
    assert second["scale"] == 2.0 ** 9
    assert all(third["changed"]) and third["scale"] == 2.0 ** 9
    for r in range(1, world_size):
        others, their_final = results[r]
        for mine, theirs in zip((first, second, third), others):
            assert mine["scale"] == theirs["scale"] and mine["changed"] == theirs["changed"]
            for a, b in zip(mine["grads"], theirs["grads"]):  # NaN where inf met -inf
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert all(torch.equal(a, b) for a, b in zip(final, their_final))


# ------------------------------------------------------------------ errors
def test_without_a_process_group_the_error_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedOptimizer(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1))


def _bad_arguments(rank, world_size):
    model = _mlp(torch.float32)
    make = lambda **kw: DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    cases = {
        "reduce_method='max'": lambda: make(reduce_method="max"),
        "reduce_method=None": lambda: make(reduce_method=None),
        "reduce_method='MEAN'": lambda: make(reduce_method="MEAN"),
        "bcast_period=-2": lambda: make(bcast_period=-2),
        "backward_passes_per_step=0": lambda: make(backward_passes_per_step=0),
        "param_pack_thd=0": lambda: make(param_pack_thd=0),
        "not an optimizer": lambda: DistributedOptimizer(model),
        "a parameter passed twice": lambda: _twice(model),
    }
    return outcomes_and_collectives(cases)


def _twice(model):
    weight = next(model.parameters())
    with warnings.catch_warnings():  # torch only warns about the duplicate
        warnings.simplefilter("ignore")
        optimizer = torch.optim.SGD([weight, weight], lr=0.1)
    return DistributedOptimizer(optimizer)


def test_bad_arguments_raise_on_every_rank_before_any_collective():
    results = run_ranks(_bad_arguments, 2, timeout=TIMEOUT)
    expected = {
        "reduce_method='max'": ("ValueError", "reduce_method"),
        "reduce_method=None": ("ValueError", "reduce_method"),
        "reduce_method='MEAN'": ("ValueError", "reduce_method"),
        "bcast_period=-2": ("ValueError", "bcast_period"),
        "backward_passes_per_step=0": ("ValueError", "backward_passes_per_step"),
        "param_pack_thd=0": ("ValueError", "param_pack_thd"),
        "not an optimizer": ("TypeError", "Optimizer"),
        "a parameter passed twice": ("ValueError", "parameters[1] is parameters[0]"),
    }
    assert_raised_before_any_collective(results, expected)


def _mismatched_parameters(rank, world_size, change):
    shapes = [(4, 3), (3,), (5,), (2, 2)]
    if rank == 1:
        shapes = change(shapes)
    weights = [torch.zeros(s, requires_grad=True) for s in shapes]
    opt = DistributedOptimizer(torch.optim.SGD(weights, lr=0.1))
    sum(w.sum() for w in weights).backward()
    opt.step()


def _with_an_extra_parameter(shapes):
    return shapes + [(7,)]


def _with_a_smaller_first_parameter(shapes):
    return [(2,)] + shapes[1:]


def test_an_extra_parameter_on_one_rank_is_a_runtime_error_on_every_rank():
    errors = rank_errors(_mismatched_parameters, 2, _with_an_extra_parameter,
                         timeout=TIMEOUT)
    assert all(e is not None and e[0] == "RuntimeError" and "parameter" in e[1]
               for e in errors), errors


def test_a_differently_shaped_parameter_on_one_rank_is_a_runtime_error_on_every_rank():
    errors = rank_errors(_mismatched_parameters, 2, _with_a_smaller_first_parameter,
                         timeout=CRASH_TIMEOUT)
    assert all(e is not None and e[0] == "RuntimeError" and "parameters[0]" in e[1]
               for e in errors), errors


#: DistributedOptimizer arguments that rank 0 alone takes: each would give
#: the ranks other gradients (a mean against a sum) or leave them waiting in
#: collectives the others never start (AdaSum's exchanges, a sharded layout,
#: another count of passes or of unused-parameter checks)
DIFFERING_OPTIONS = {
    "mean_or_sum": {"reduce_method": "sum"},
    "adasum": {"reduce_method": "adasum"},
    "shard": {"shard": True},
    "passes": {"backward_passes_per_step": 2},
    "find_unused": {"find_unused_parameters": True},
    "clipping": {"max_grad_norm": 1.0},
}


def _differing_options(rank, world_size):
    """Per ``DIFFERING_OPTIONS`` case: what each rank's first reducing backward
    raised (None: nothing), and whether the parameters stayed untouched."""
    seen = {}
    for name, options in DIFFERING_OPTIONS.items():
        weights = [torch.zeros(s, requires_grad=True) for s in [(4, 3), (3,), (5,), (2, 2)]]
        try:
            opt = DistributedOptimizer(torch.optim.SGD(weights, lr=0.1),
                                       **(options if rank == 0 else {}))
            for _ in range(opt.backward_passes_per_step):
                sum((w * (rank + 1)).sum() for w in weights).backward()
            opt.step()
            seen[name] = None
        except RuntimeError as exc:
            seen[name] = (str(exc), all(bool((w == 0).all()) for w in weights))
    return seen


def test_optimizer_options_that_differ_by_rank_raise_on_every_rank_instead_of_diverging():
    results = run_ranks(_differing_options, 2, timeout=TIMEOUT)
    for rank, seen in enumerate(results):
        for name in DIFFERING_OPTIONS:
            assert seen[name] is not None, (rank, name)
            message, untouched = seen[name]
            # the sharded mode makes a checkpoint group at construction (a
            # collective): a rank alone with shard=True is refused there
            expected = "disagree on shard" if name == "shard" else "not on the bucket layout"
            assert expected in message, (rank, name, message)
            assert untouched, (rank, name)


def _differing_bcast_period(rank, world_size):
    """Per case, rank 0 alone with another ``bcast_period``: what each rank's
    construction raised, whether the parameters kept their own values (no
    broadcast ran), and whether a plain backward afterwards leaves each
    rank's own gradient (no hook of the failed optimizer is left behind)."""
    seen = {}
    for name, period in (("never", -1), ("every_3_steps", 3)):
        weights = [torch.full(s, float(rank)).requires_grad_() for s in [(4, 3), (3,)]]
        try:
            DistributedOptimizer(torch.optim.SGD(weights, lr=0.1),
                                 bcast_period=period if rank == 0 else 0)
            seen[name] = None
            continue
        except RuntimeError as exc:
            message = str(exc)
        kept = all(bool((w == rank).all()) for w in weights)
        sum((w * (rank + 1)).sum() for w in weights).backward()
        local = all(bool((w.grad == rank + 1).all()) for w in weights)
        seen[name] = (message, kept, local)
    return seen


@pytest.mark.timeout(TIMEOUT)
def test_a_bcast_period_that_differs_by_rank_raises_at_construction_instead_of_hanging():
    # before the check, rank 0 (bcast_period=-1) skipped the construction's
    # broadcast and rank 1 waited in it until the collective timeout
    for rank, seen in enumerate(run_ranks(_differing_bcast_period, 2, timeout=TIMEOUT)):
        for name, period in (("never", -1), ("every_3_steps", 3)):
            assert seen[name] is not None, (rank, name)
            message, kept, local = seen[name]
            assert f"disagree on bcast_period: rank 0: {period}; rank 1: 0" in message, message
            assert "same bcast_period" in message
            assert kept and local, (rank, name)


# ------------------------------------- parameter groups added, parameters (un)frozen
def _changing_parameters(rank, world_size, bucket_view):
    """Six steps of SGD with momentum on a model whose trained set changes:
    the last layer joins through ``add_param_group`` before step 2 (perturbed
    on rank 1 first: the broadcast must undo it), the first layer is frozen
    for steps 3 and 4 and unfrozen for step 5. The reference: the same model
    and schedule with plain SGD and an all-reduce of its gradients."""
    model, reference = _mlp(torch.float32), _mlp(torch.float32)
    first, middle, last = ([*model[i].parameters()] for i in (0, 2, 4))
    ref_first, ref_middle, ref_last = ([*reference[i].parameters()] for i in (0, 2, 4))
    opt = DistributedOptimizer(torch.optim.SGD(first + middle, lr=0.05, momentum=0.9),
                               gradient_as_bucket_view=bucket_view)
    ref_opt = torch.optim.SGD(ref_first + ref_middle, lr=0.05, momentum=0.9)
    seen = []
    for step in range(6):
        if step == 2:
            if rank == 1:
                _perturb(model[4])
            opt.add_param_group({"params": last, "lr": 0.02})
            ref_opt.add_param_group({"params": ref_last, "lr": 0.02})
        frozen = step in (3, 4)
        for p in first + ref_first:
            p.requires_grad_(not frozen)
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = _shard(rank, world_size, step, torch.float32)
        _loss(model, x, y, "mean").backward()
        _loss(reference, x, y, "mean").backward()
        for group in ref_opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size  # a power of two: the reducer's bits
        frozen_grads = [p.grad is None for p in first]
        opt.step()
        ref_opt.step()
        seen.append((frozen_grads, [torch.equal(a, b) for a, b in
                                    zip(_params(model), _params(reference))], _params(model)))
    return seen


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("bucket_view", [False, True])
def test_added_groups_and_frozen_or_unfrozen_parameters_are_reduced_as_torch_would(bucket_view):
    ranks = run_ranks(_changing_parameters, 2, bucket_view)
    for seen in ranks:
        for step, (no_grad, same, _) in enumerate(seen):
            assert all(same), (step, same)  # every step matches the reference bitwise
            # a frozen layer gets no gradient, so SGD skips it (momentum too)
            assert no_grad == [step in (3, 4)] * 2, (step, no_grad)
    for (_, _, p0), (_, _, p1) in zip(*ranks):
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def _changed_between_passes(rank, world_size):
    model = _mlp(torch.float32)
    params = list(model.parameters())
    opt = DistributedOptimizer(torch.optim.SGD(params[:4], lr=0.05),
                               backward_passes_per_step=2)
    x, y = _shard(rank, world_size, 0, torch.float32)
    _loss(model, x, y, "mean").backward()  # the first of two passes: accumulated locally
    seen = {}
    try:
        opt.add_param_group({"params": params[4:]})
    except RuntimeError as exc:
        seen["between passes"] = str(exc)
    with opt.no_sync():
        try:
            opt.add_param_group({"params": params[4:]})
        except RuntimeError as exc:
            seen["inside no_sync"] = str(exc)
    seen["groups"] = len(opt.param_groups)
    return seen


@pytest.mark.timeout(TIMEOUT)
def test_adding_a_group_between_the_passes_of_a_step_is_refused_and_changes_nothing():
    for seen in run_ranks(_changed_between_passes, 2):
        assert "between the backward passes of one step" in seen["between passes"]
        assert "no_sync" in seen["inside no_sync"]
        assert seen["groups"] == 1


# ------------------------------------------------ parameters without gradients
class _Branches(nn.Module):
    """A trunk every rank uses, a branch no rank uses in odd steps, and one
    that rank 0 alone uses (float64, so a reference mean is exact enough)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.sometimes, self.rank0 = (nn.Linear(4, 4).double() for _ in range(3))

    def forward(self, x, step, rank):
        h = self.trunk(x)
        if step % 2 == 0:
            h = self.sometimes(h)
        if rank == 0:
            h = self.rank0(h)
        return h.square().mean()


#: the tensor methods that read a value to the host
HOST_READS = ("item", "tolist", "__bool__")


def _counting_host_reads(counts):
    """Patch ``HOST_READS`` to count into ``counts``; returns the undo."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    for name, original in originals.items():
        def counted(self, *args, _original=original, **kwargs):
            counts.append(1)
            return _original(self, *args, **kwargs)
        setattr(torch.Tensor, name, counted)
    return lambda: [setattr(torch.Tensor, n, f) for n, f in originals.items()]


def _branches_training(rank, world_size, shard, find_unused=None):
    """Four steps of ``_Branches`` under ``DistributedOptimizer``, with
    ``find_unused_parameters=find_unused`` (None: the default): per step each parameter's reduced ``.grad`` (None
    kept), this rank's own gradients (float64, before any reduction), and
    the host reads of the backward and step; the warnings seen."""
    ours, local = _Branches(), _Branches()
    optimizer = DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                     shard=shard, param_pack_thd=100,
                                     **({} if find_unused is None
                                        else {"find_unused_parameters": find_unused}))
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x = torch.randn(3, 4, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(10 * rank + step))
            with torch.no_grad():
                for a, b in zip(local.parameters(), ours.parameters()):
                    a.copy_(b)
            local.zero_grad()
            local(x, step, rank).backward()
            loss = ours(x, step, rank)
            reads = []
            undo = _counting_host_reads(reads)
            try:
                loss.backward()
                grads = [None if p.grad is None else p.grad.clone() for p in ours.parameters()]
                optimizer.step()
            finally:
                undo()
            optimizer.zero_grad()
            steps.append({"grads": grads, "reads": len(reads),
                          "local": [None if p.grad is None else p.grad.clone()
                                    for p in local.parameters()]})
    return {"default": optimizer.find_unused_parameters, "steps": steps,
            "warned": [str(w.message) for w in caught
                       if "had no gradient on this rank" in str(w.message)]}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("shard", [False, True])
def test_by_default_a_missing_gradient_is_zeros_with_one_warning_and_no_host_read(shard):
    world_size = 3
    results = run_ranks(_branches_training, world_size, shard, timeout=TIMEOUT)
    names = ["trunk.weight", "trunk.bias", "sometimes.weight", "sometimes.bias",
             "rank0.weight", "rank0.bias"]
    for rank, r in enumerate(results):
        # DDP's default: no count of who had each gradient (so a parameter
        # no rank used gets zeros, never None: below)
        assert r["default"] is False, rank
        # rank 0 misses "sometimes" in odd steps, ranks 1 and 2 "rank0" in
        # every step: each warns once, from what it knows locally
        assert len(r["warned"]) == 1, (rank, r["warned"])
        assert "find_unused_parameters=True" in r["warned"][0]
        for step, s in enumerate(r["steps"]):
            if not shard:
                # nothing read to the host in backward or step (sharded, the
                # ranks' non-finite count is read anyway)
                assert s["reads"] == 0, (rank, step, s["reads"])
            for i, name in enumerate(names):
                grad = s["grads"][i]
                # never None: a parameter no rank used ("sometimes" in odd
                # steps) gets zeros, one rank 0 alone used the mean with zeros
                assert grad is not None, (rank, step, name)
                if shard:
                    # each rank holds the elements it owns, zeros elsewhere:
                    # the ranks' .grad add up to the whole reduced gradient
                    grad = sum(q["steps"][step]["grads"][i] for q in results)
                else:
                    assert torch.equal(grad, results[0]["steps"][step]["grads"][i]), \
                        f"rank {rank} differs from rank 0: step {step}, {name}"
                # the mean of the ranks' own gradients (missing ones zeros),
                # summed in float64: the fused mean rounds a few times, so a
                # few float64 eps of the largest gradient
                own = [q["steps"][step]["local"][i] for q in results]
                mean = sum(torch.zeros_like(grad) if g is None else g for g in own) / world_size
                scale = max(float(g.abs().max()) for g in own if g is not None) \
                    if any(g is not None for g in own) else 0.0
                assert torch.allclose(grad, mean, rtol=0, atol=8 * torch.finfo(
                    torch.float64).eps * max(scale, 1e-300)), (rank, step, name)
            if step % 2:  # and the zeros are exact
                assert not s["grads"][2].any() and not s["grads"][3].any(), (rank, step)


def test_finding_unused_parameters_reads_the_ranks_answer_on_the_host_at_every_backward():
    """The contrast that makes the test above able to fail: with the rule on,
    each backward's decision (None or a tensor) is read to the host."""
    results = run_ranks(_branches_training, 2, False, True, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert all(s["reads"] > 0 for s in r["steps"]), (rank, [s["reads"] for s in r["steps"]])
        assert r["warned"] == []
        # no rank used "sometimes" in odd steps: None, so SGD skips it
        assert all((s["grads"][2] is None) == (step % 2 == 1)
                   for step, s in enumerate(r["steps"])), rank
