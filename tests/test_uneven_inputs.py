"""Uneven inputs: ranks that run out of data at different steps, under torch's ``Join``.

DDP supports them through ``torch.distributed.algorithms.Join`` (``ddp.join()``):
a rank that has run out shadows the others' collectives, its own bucket
contributing zeros, by calling the registered comm hook on zero buckets. With
fusedreduce's hooks registered, the shadowing calls run our hooks, so every
hook must issue the same collectives for a zero bucket as for a real one,
including its first-use checks (a rank may join before its first backward).

``DistributedOptimizer`` (without ``shard``) and a ``DistributedGradReducer``
with hooks are ``Join`` participants themselves (``fusedreduce.uneven_inputs``):
a rank that ran out runs shadow passes, and at the end every rank takes the
last joiner's parameters (and the optimizer's state, step count and
``buffers=``). ``shard=True`` and ``AdaSumByDeltaWeight`` are refused by name,
with what works, instead of failing on a missing method.
"""
import contextlib
import hashlib
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import fusedreduce
from fusedreduce import hooks
from fusedreduce.local_ranks import RankFailure
from harness import rank_errors, run_ranks

WORLD = 3
#: steps each rank runs: rank 0 has no data at all (it joins before its first
#: backward, so a hook's first use happens while shadowing), rank 2 the most
STEPS = (0, 3, 5)
HOOKS = {
    "allreduce_hook": lambda: (None, hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, hooks.fp16_compress_hook),
    "bf16_compress_hook": lambda: (None, hooks.bf16_compress_hook),
    "adasum_hook": lambda: (None, hooks.adasum_hook),
    "int8 wire, error feedback": lambda: (
        hooks.HookState(wire_dtype=torch.int8, error_feedback=True), hooks.allreduce_hook),
    "clipping": lambda: (hooks.HookState(max_grad_norm=0.5), hooks.allreduce_hook),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(rank, world_size, hook, divide=True, throw=False, steps=STEPS):
    """Train with a comm hook (or none) under ``Join``; this rank's weights
    and the steps it ran, or the step at which ``Join`` raised."""
    model = _model()
    # a small cap: several buckets, whose collectives the joined ranks match in order
    ddp = DistributedDataParallel(model, bucket_cap_mb=200 * 4 / 2 ** 20)
    if hook is not None:
        ddp.register_comm_hook(*HOOKS[hook]())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    ran = 0
    try:
        with Join([ddp], divide_by_initial_world_size=divide,
                  throw_on_early_termination=throw):
            for _ in range(steps[rank]):
                x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
                loss = nn.functional.cross_entropy(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                ran += 1
    except RuntimeError as exc:
        return "raised", ran, str(exc)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, ran


def _digest(weights):
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_ddp_join_with_our_hook_leaves_every_rank_the_same_model(hook):
    results = run_ranks(_train, WORLD, hook)
    assert [ran for _, ran in results] == list(STEPS)
    weights = [w for w, _ in results]
    assert all(torch.isfinite(w).all() for w in weights)
    assert len({_digest(w) for w in weights}) == 1, f"{hook}: the ranks' weights differ"
    untrained = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    assert not torch.equal(weights[0], untrained)  # the steps the ranks ran were taken


@pytest.mark.parametrize("divide", [True, False])
def test_ddp_join_with_allreduce_hook_is_bitwise_ddp_without_a_hook(divide):
    hooked = run_ranks(_train, WORLD, "allreduce_hook", divide)
    plain = run_ranks(_train, WORLD, None, divide)
    if divide:
        assert _digest(hooked[0][0]) == _digest(plain[0][0])
    else:
        # DDP alone divides by the ranks still running; a comm hook divides by
        # the group's size, torch's own hooks too (DDP applies no divisor to
        # what a hook returns), so the models differ as with torch's hooks
        assert _digest(hooked[0][0]) != _digest(plain[0][0])
        assert _digest(hooked[0][0]) == _digest(run_ranks(_train, WORLD, "allreduce_hook")[0][0])


def test_ddp_join_throw_on_early_termination_with_our_hook_stops_every_rank_together():
    steps = (2, 3, 5)
    results = run_ranks(_train, WORLD, "allreduce_hook", True, True, steps)
    assert [r[0] for r in results] == ["raised"] * WORLD
    assert [r[1] for r in results] == [2, 2, 2]  # the first rank out stops everyone


def _join_refused(rank, world_size, which):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {}
    if which == "sharded, overlap_param_gather":
        joinable = fusedreduce.DistributedOptimizer(optimizer, shard=True,
                                                    overlap_param_gather=True)
    elif which == "adasum_delta":
        joinable = fusedreduce.AdaSumByDeltaWeight(optimizer)
    elif which == "reducer without hooks":
        joinable = fusedreduce.DistributedGradReducer(list(model.parameters()))
    else:  # a mean cannot leave the ranks that ran out of data out of its divisor
        joinable = fusedreduce.DistributedOptimizer(optimizer)
        kwargs = {"divide_by_initial_world_size": False}
    before = [p.detach().clone() for p in model.parameters()]
    try:
        Join([joinable], **kwargs)
    except (TypeError, RuntimeError, ValueError) as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return type(exc).__name__, str(exc), unchanged
    return None


@pytest.mark.parametrize("which, error, names", [
    ("sharded, overlap_param_gather", "TypeError", "overlap_param_gather=True"),
    ("adasum_delta", "TypeError", "AdaSumByDeltaWeight"),
    ("reducer without hooks", "RuntimeError", "register_hooks()"),
    ("divide", "ValueError", "divide_by_initial_world_size=False"),
])
def test_join_refuses_what_it_cannot_shadow_by_name(which, error, names):
    for result in run_ranks(_join_refused, 2, which):
        assert result is not None, f"{which}: Join accepted it"
        kind, message, unchanged = result
        assert kind == error and names in message and unchanged, message


class _Model(nn.Module):
    """Two layers with BatchNorm statistics that each rank's data moves
    differently, and with ``unused`` a branch no rank uses."""

    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                  nn.Linear(16, 4))
        self.unused = nn.Linear(8, 4) if unused else None

    def forward(self, x):
        return self.body(x)


#: DistributedOptimizer options under Join: each shapes the collectives a
#: shadow pass must match (buckets, wire, clipping's norm, the unused rule,
#: AdaSum's exchanges) or what the end of the context synchronises
OPTIONS = {
    "default": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "clipping": {"max_grad_norm": 0.05},
    "bucket views": {"gradient_as_bucket_view": True},
    "int8 wire, error feedback": {"wire_dtype": torch.int8, "error_feedback": True},
    "adasum": {"reduce_method": "adasum"},
    "sum": {"reduce_method": "sum"},
    "two passes per step": {"backward_passes_per_step": 2},
    "bcast_period and buffers": {"bcast_period": 2, "buffers": "model"},
    # a sharded rank that ran out steps its part at every pass of the others
    "shard": {"shard": True},
    "shard, ZeRO-2, clipping": {"shard": True, "shard_gradients": True, "max_grad_norm": 0.05},
    "shard, adasum, buffers": {"shard": True, "reduce_method": "adasum", "buffers": "model",
                               "bcast_period": 1},
}
#: the options whose ranks with data train exactly as DDP's under ddp.join()
AS_DDP = ("default", "find_unused_parameters", "clipping", "bucket views", "shard",
          "shard, ZeRO-2, clipping")


def _set_up(way, model, options):
    """``(net, optimizer, joinables)`` for ``way``: DDP ("ddp", its bucket
    options from ``options``), a reducer with hooks ("reducer") or
    ``DistributedOptimizer(**options)`` ("optimizer"), each with the same
    200-element buckets and SGD; ``buffers="model"`` in ``options`` means
    ``model.buffers()``."""
    options = dict(options)
    if options.get("buffers") == "model":
        options["buffers"] = model.buffers()
    if way == "ddp":
        net = DistributedDataParallel(
            model, bucket_cap_mb=200 * 4 / 2 ** 20,
            find_unused_parameters=options.get("find_unused_parameters", False),
            gradient_as_bucket_view=bool(options.get("gradient_as_bucket_view")))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        return net, optimizer, [net]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if way == "reducer":
        reducer = fusedreduce.DistributedGradReducer(
            list(model.parameters()), bucket_cap_mb=200 * 4 / 2 ** 20).register_hooks()
        return model, sgd, [reducer]
    optimizer = fusedreduce.DistributedOptimizer(sgd, param_pack_thd=200 * 4, **options)
    return model, optimizer, [optimizer]


def _train_ours(rank, world_size, way, options, steps, epochs=1, schedule=False):
    """Train under Join with ``way`` ("optimizer", "reducer" or DDP's "ddp"),
    with ``schedule`` an LR scheduler that halves the rate after each step
    (stepped in the loop, as training scripts do); this rank's weights,
    buffers, optimizer state, step count and learning rate."""
    model = _Model(options.get("find_unused_parameters", False))
    net, optimizer, joinables = _set_up(way, model, options)
    passes = options.get("backward_passes_per_step", 1)
    clip = options.get("max_grad_norm")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if schedule else None
    data = torch.Generator().manual_seed(100 + rank)
    for epoch in range(epochs):
        # the first epoch's batches are uneven; later ones even, outside Join
        with Join(joinables) if epoch == 0 else contextlib.nullcontext():
            for _ in range(steps[rank] if epoch == 0 else 2):
                optimizer.zero_grad()
                for _ in range(passes):
                    x = torch.randn(4, 8, generator=data)
                    y = torch.randint(0, 4, (4,), generator=data)
                    nn.functional.cross_entropy(net(x), y).backward()
                if way != "optimizer" and clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
    flat = lambda ts: torch.cat([t.detach().reshape(-1).double() for t in ts])  # noqa: E731
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return (flat(model.parameters()), flat(model.buffers()), flat(state) if state else None,
            getattr(optimizer, "_steps", None), optimizer.param_groups[0]["lr"])


def _same_on_every_rank(results, buffers, sharded=False):
    """Weights and optimizer state (not sharded: each rank holds its part), and
    with ``buffers`` (the ``buffers=`` option) the BatchNorm statistics, which
    each rank's data moves otherwise."""
    for i, what in enumerate(("weights", "buffers", "optimizer state")):
        if (what == "buffers" and not buffers) or (what == "optimizer state" and sharded):
            continue
        values = [r[i] for r in results]
        assert all(v is not None and torch.equal(v, values[0]) for v in values), \
            f"the ranks' {what} differ"


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_join_with_our_optimizer_leaves_every_rank_the_same_model_and_state(option):
    results = run_ranks(_train_ours, WORLD, "optimizer", OPTIONS[option], STEPS)
    _same_on_every_rank(results, "buffers" in OPTIONS[option], OPTIONS[option].get("shard"))
    assert [r[3] for r in results] == [max(STEPS)] * WORLD  # the last joiner's step count
    untrained = torch.cat([p.detach().reshape(-1).double()
                           for p in _Model(option == "find_unused_parameters").parameters()])
    assert not torch.equal(results[0][0], untrained)
    assert torch.isfinite(results[0][0]).all()
    if option in AS_DDP:
        ddp = run_ranks(_train_ours, WORLD, "ddp", OPTIONS[option], STEPS)
        # the last joiner trained on the mean over the 3 ranks, as DDP's did;
        # at 3 ranks gloo adds the buckets in another order (fusedreduce aligns
        # each tensor to 16 bytes), so each reduced gradient may differ by an
        # fp32 rounding, which 5 SGD steps (lr 0.1, momentum 0.9) keep far below 1e-6
        torch.testing.assert_close(results[-1][0], ddp[-1][0], rtol=0, atol=1e-6)
        if option == "find_unused_parameters":
            unused = slice(-(8 * 4 + 4), None)  # the unused branch: no rank stepped it
            assert torch.equal(results[0][0][unused], untrained[unused])


def test_join_with_our_optimizer_on_two_ranks_is_bitwise_ddp():
    steps = (1, 4)
    ours = run_ranks(_train_ours, 2, "optimizer", {}, steps)
    ddp = run_ranks(_train_ours, 2, "ddp", {}, steps)
    assert torch.equal(ours[1][0], ddp[1][0])
    assert torch.equal(ours[0][0], ddp[0][0])  # DDP also gives the last joiner's weights


@pytest.mark.parametrize("option", ["shard", "shard, ZeRO-2, clipping"])
def test_a_sharded_rank_that_ran_out_steps_its_part_at_the_others_learning_rate(option):
    # an LR schedule goes on in the loop of the ranks with data only; a rank
    # that ran out steps its part of the parameters at every pass of theirs,
    # so it must take the rate they set (DDP's rank with data steps them all).
    # Found on nanoGPT's train.py (cosine schedule set each iteration) on
    # per-rank shards: 1e-4 off DDP's weights after two steps past the join
    ours = run_ranks(_train_ours, WORLD, "optimizer", OPTIONS[option], STEPS, 1, True)
    ddp = run_ranks(_train_ours, WORLD, "ddp", OPTIONS[option], STEPS, 1, True)
    _same_on_every_rank(ours, False, sharded=True)
    torch.testing.assert_close(ours[-1][0], ddp[-1][0], rtol=0, atol=1e-6)
    # and every rank ends with the last joiner's rate, as its state
    assert [r[4] for r in ours] == [0.1 * 0.5 ** max(STEPS)] * WORLD


def _two_contexts(rank, world_size, options):
    """Two passes over uneven data, each under its own Join, the gradients
    zeroed after each step (nanoGPT's loop); with ``options`` None, DDP's.
    The weights, and whether this rank held a gradient between the contexts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if options is None:
        net = DistributedDataParallel(model, bucket_cap_mb=200 * 4 / 2 ** 20)
        optimizer, joinable = torch.optim.SGD(model.parameters(), lr=0.1), net
    else:
        net = model
        optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                     param_pack_thd=200 * 4, **options)
        joinable = optimizer
    data = torch.Generator().manual_seed(100 + rank)
    held = None
    for epoch in range(2):
        with Join([joinable]):
            for _ in range(STEPS[rank]):
                x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
                nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        if epoch == 0:
            held = any(p.grad is not None for p in model.parameters())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), held


@pytest.mark.parametrize("option", ["default", "shard", "shard, ZeRO-2, clipping"])
def test_a_rank_that_ran_out_leaves_the_context_without_gradients(option):
    # its shadow passes wrote the others' reduced gradients into its .grad; a
    # loop that zeroes after step() (nanoGPT's) added them to its first step
    # after the context (2e-3 off DDP's weights on nanoGPT with per-rank shards,
    # two epochs). DDP's rank keeps the None its loop left
    options = dict(OPTIONS[option])
    options.pop("max_grad_norm", None)  # DDP's loop here has no clip
    ours = run_ranks(_two_contexts, WORLD, options)
    ddp = run_ranks(_two_contexts, WORLD, None)
    _same_on_every_rank([(w, None, None) for w, _ in ours], False, sharded=True)
    torch.testing.assert_close(ours[-1][0], ddp[-1][0], rtol=0, atol=1e-6)
    assert [held for _, held in ours] == [held for _, held in ddp] == [False] * WORLD


def _passes_not_declared(rank, world_size, way, steps):
    """Two reducing backward passes per step under Join (the optimizer told
    one; DDP without no_sync()); the weights and the warnings about them."""
    model = _Model()
    if way == "ddp":
        net = DistributedDataParallel(model, bucket_cap_mb=200 * 4 / 2 ** 20)
        optimizer, joinable = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), net
    else:
        net = model
        optimizer = fusedreduce.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), param_pack_thd=200 * 4)
        joinable = optimizer
    data = torch.Generator().manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([joinable]):
            for _ in range(steps[rank]):
                optimizer.zero_grad()
                for _ in range(2):
                    x = torch.randn(4, 8, generator=data)
                    y = torch.randint(0, 4, (4,), generator=data)
                    nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
    said = [str(w.message) for w in caught if "reduced the gradients" in str(w.message)]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), said


def test_extra_reductions_inside_join_warn_that_they_do_not_sum_right():
    # outside Join an extra reduction before a step gives the passes' reduced
    # sum; inside it a rank that ran out adds zeros, not the reduced gradients
    # of the earlier passes, which are divided by the world size again: DDP's
    # result without no_sync(), which the warning must not call right
    # (nanoGPT with per-rank shards, backward_passes_per_step forgotten: 3e-4
    # off its accumulating run after a rank ran out)
    steps = (1, 3)
    ours = run_ranks(_passes_not_declared, 2, "optimizer", steps)
    ddp = run_ranks(_passes_not_declared, 2, "ddp", steps)
    torch.testing.assert_close(ours[1][0], ddp[1][0], rtol=0, atol=1e-6)
    for _, said in ours:
        assert len(said) == 1 and "inside a Join context the result is not" in said[0], said


def test_join_with_our_reducer_leaves_every_rank_the_last_joiners_weights():
    reducer = run_ranks(_train_ours, WORLD, "reducer", {}, STEPS)
    ddp = run_ranks(_train_ours, WORLD, "ddp", {}, STEPS)
    weights = [r[0] for r in reducer]
    assert all(torch.equal(w, weights[0]) for w in weights)
    # the same fp32 rounding bound as for the optimizer
    torch.testing.assert_close(weights[0], ddp[-1][0], rtol=0, atol=1e-6)


def test_training_goes_on_after_a_join_with_its_broadcasts():
    # a second, even epoch after the first one's Join, outside it: the context
    # was left on every rank, so the buffers= broadcasts after each step run
    # again (the BatchNorm statistics would differ by rank otherwise)
    options = {"bcast_period": 1, "buffers": "model"}
    results = run_ranks(_train_ours, WORLD, "optimizer", options, STEPS, 2)
    _same_on_every_rank(results, True)
    assert [r[3] for r in results] == [max(STEPS) + 2] * WORLD


def _train_ours_throwing(rank, world_size, steps):
    model = nn.Linear(8, 4)
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ran = 0
    try:
        with Join([optimizer], throw_on_early_termination=True):
            for _ in range(steps[rank]):
                optimizer.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                ran += 1
    except RuntimeError as exc:
        return ran, str(exc)
    return ran, None


def test_join_throw_on_early_termination_with_our_optimizer_stops_every_rank_together():
    results = run_ranks(_train_ours_throwing, WORLD, (2, 3, 5))
    assert [ran for ran, _ in results] == [2, 2, 2]
    assert all(message is not None for _, message in results)


def _epoch_after_a_throwing_join(rank, world_size, shard, join):
    """A first epoch: with ``join``, under ``Join(throw_on_early_termination=True)``
    (ranks with 2, 3 and 5 batches: every rank raises at the third step), else
    two even steps; then two even steps outside any ``Join``. What the second
    epoch does: the all-reduces it issued, the weights and the BatchNorm
    statistics."""
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), buffers=model.buffers(),
        bcast_period=1, shard=shard)
    data = torch.Generator().manual_seed(100 + rank)

    def step():
        optimizer.zero_grad()
        x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    if join:
        try:
            with Join([optimizer], throw_on_early_termination=True):
                for _ in range((2, 3, 5)[rank]):
                    step()
        except RuntimeError:
            pass
    else:
        for _ in range(2):
            step()
    all_reduce, issued = torch.distributed.all_reduce, []

    def counted(*args, **kwargs):
        issued.append(1)
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counted
    try:
        for _ in range(2):
            step()
    finally:
        torch.distributed.all_reduce = all_reduce
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    return len(issued), flat(model.parameters()), flat(model.buffers())


@pytest.mark.parametrize("shard", [False, True])
def test_training_after_a_join_that_threw_is_back_to_the_plain_step(shard):
    # torch's Join runs no post hook when its block raises, which is how
    # throw_on_early_termination ends it: the optimizer leaves the context
    # when the context is released, so its passes stop notifying and the
    # buffers= broadcast after each step runs again (the BatchNorm
    # statistics, moved by each rank's own data, would differ otherwise)
    after = run_ranks(_epoch_after_a_throwing_join, WORLD, shard, True)
    plain = run_ranks(_epoch_after_a_throwing_join, WORLD, shard, False)
    for i, what in ((1, "weights"), (2, "buffers")):
        assert all(torch.equal(r[i], after[0][i]) for r in after), f"the ranks' {what} differ"
    assert [r[0] for r in after] == [r[0] for r in plain]  # no notification left


def _train_with_skipped_steps(rank, world_size, steps):
    """A GradScaler that skips the step of every rank with data at their
    second batch (its gradients are not finite there), with the per-step
    broadcasts on: a rank that ran out cannot know of the skip, and must not
    need to."""
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), bcast_period=1,
        buffers=model.buffers())
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    data = torch.Generator().manual_seed(100 + rank)
    with Join([optimizer]):
        for i in range(steps[rank]):
            optimizer.zero_grad()
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if i == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return (torch.cat([t.detach().reshape(-1) for t in (*model.parameters(), *model.buffers())]),
            optimizer._steps, scaler.get_scale())


def test_join_with_our_optimizer_under_a_gradscaler_that_skips_steps():
    results = run_ranks(_train_with_skipped_steps, WORLD, STEPS)
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    assert torch.isfinite(results[0][0]).all()
    assert [r[1] for r in results] == [max(STEPS) - 1] * WORLD  # one step skipped
    assert results[-1][2] < 1.0  # the scaler saw the skip


def test_join_with_our_optimizer_across_two_nodes_with_an_int8_wire():
    # 4 ranks as 2 nodes of 2: the shadow pass runs the two-level collectives
    options = {"local_size": 2, "wire_dtype": torch.int8, "error_feedback": True}
    results = run_ranks(_train_ours, 4, "optimizer", options, (0, 2, 3, 5))
    _same_on_every_rank(results, False)
    assert [r[3] for r in results] == [5] * 4


def _change_trained_set_in_join(rank, world_size, how):
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with Join([optimizer]):
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()
        optimizer.step()
        before = [p.detach().clone() for p in model.parameters()]
        if how == "freeze":
            model.body[0].requires_grad_(False)
        else:
            optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
            return None  # unreachable when refused
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()
        try:
            optimizer.step()
        except RuntimeError:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            raise


@pytest.mark.parametrize("how", ["freeze", "add_param_group"])
def test_changing_the_trained_set_inside_join_is_refused_before_any_collective(how):
    # every rank alike (no rank has run out): the refusal, on every rank, with
    # nothing stepped, instead of passes the ranks that ran out could not match
    for kind, message in rank_errors(_change_trained_set_in_join, 2, how):
        assert kind == "RuntimeError" and "inside a Join context" in message, message


def _sharded_collective_in_join(rank, world_size, what):
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 shard=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    before = [p.detach().clone() for p in model.parameters()]
    with Join([optimizer]):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3]))
        scaler.scale(loss).backward()
        try:
            if what == "torch's clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif what == "the optimizer's clip":
                optimizer.clip_grad_norm_(1.0)
            scaler.step(optimizer)
        except RuntimeError:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            raise


@pytest.mark.parametrize("what, names", [
    ("torch's clip", "torch.nn.utils.clip_grad_norm_"),
    ("the optimizer's clip", "clip_grad_norm_()"),
])
def test_a_sharded_steps_collective_a_joined_rank_cannot_know_of_is_refused(what, names):
    # every rank alike (none has run out): the refusal on every rank, nothing
    # stepped, where a rank that ran out would otherwise miss a collective
    for kind, message in rank_errors(_sharded_collective_in_join, 2, what):
        assert kind == "RuntimeError" and names in message and "Join" in message, message


def _even_steps(rank, world_size, enable):
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), bcast_period=1)
    data = torch.Generator().manual_seed(100 + rank)
    with Join([optimizer], enable=enable) if enable is not None else contextlib.nullcontext():
        for _ in range(3):
            optimizer.zero_grad()
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("enable", [True, False])
def test_join_over_even_inputs_trains_as_without_it(enable):
    # torch's Join(enable=False) does nothing; enabled over even inputs no rank
    # ever shadows, and the final sync changes no bit
    plain = run_ranks(_even_steps, 2, None)
    joined = run_ranks(_even_steps, 2, enable)
    assert all(torch.equal(w, plain[0]) for w in plain + joined)


def _lbfgs_in_join(rank, world_size, steps):
    # LBFGS calls the closure several times per step, each backward a
    # communicating pass the ranks that ran out shadow one by one
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5,
                                                                   max_iter=3))
    data = torch.Generator().manual_seed(100 + rank)
    passes = []
    with Join([optimizer]):
        for _ in range(steps[rank]):
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)

            def closure():
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                passes.append(1)
                return loss
            optimizer.step(closure)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), len(passes)


def test_join_with_a_closure_that_runs_several_passes_per_step():
    results = run_ranks(_lbfgs_in_join, WORLD, STEPS)
    assert all(torch.equal(w, results[0][0]) for w, _ in results)
    assert results[-1][1] > max(STEPS)  # more passes than steps: each was shadowed


class _Raising(nn.Module):
    def forward(self, x):
        raise ValueError("intentional error")


def _exception_in_join(rank, world_size):
    model = nn.Sequential(nn.Linear(8, 4), _Raising())
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with Join([optimizer]):
        model(torch.randn(4, 8)).sum().backward()


def test_an_exception_inside_join_reaches_the_caller_on_every_rank():
    # as DDP's test_ddp_uneven_input_exception: Join runs no hook after an
    # exception, so it propagates (no rank is left shadowing)
    for kind, message in rank_errors(_exception_in_join, 2):
        assert (kind, message) == ("ValueError", "intentional error")


def _train_scaled(rank, world_size, way, options, steps, inf_at, explicit=False):
    """Train under Join with a GradScaler whose scale grows every two good
    steps and backs off where the last rank's loss is infinite (step
    ``inf_at``, after other ranks ran out); ``way`` "ddp" clips after
    ``unscale_`` with torch's clip where ``options`` has ``max_grad_norm``,
    ours sets ``loss_scale`` before each backward (the clipping guide's
    way). This rank's weights, scale, growth tracker and step count."""
    model = _Model()
    net, optimizer, joinables = _set_up(way, model, options)
    clip = options.get("max_grad_norm")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)
    kwargs = {"grad_scaler": scaler} if explicit and way != "ddp" else {}
    data = torch.Generator().manual_seed(100 + rank)
    with Join(joinables, **kwargs):
        for i in range(steps[rank]):
            optimizer.zero_grad()
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            loss = nn.functional.cross_entropy(net(x), y)
            if i == inf_at and rank == world_size - 1:
                loss = loss * float("inf")
            if way != "ddp" and clip is not None:
                optimizer.loss_scale = scaler.scale(torch.ones(()))
            scaler.scale(loss).backward()
            if way == "ddp" and clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
    return (torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]),
            scaler.get_scale(),
            0 if scaler._growth_tracker is None else int(scaler._growth_tracker),
            getattr(optimizer, "_steps", None))


SCALED = {
    "not sharded": {},
    "shard": {"shard": True},
    "shard, clipping": {"shard": True, "max_grad_norm": 0.05},
    "shard, ZeRO-2, clipping": {"shard": True, "shard_gradients": True, "max_grad_norm": 0.05},
}


@pytest.mark.parametrize("option, explicit", [
    ("not sharded", False), ("not sharded", True), ("shard", False), ("shard", True),
    ("shard, clipping", True), ("shard, ZeRO-2, clipping", True)])
def test_join_under_a_gradscaler_trains_as_ddps_join_and_leaves_every_scaler_alike(option,
                                                                                    explicit):
    # the last rank's loss is infinite at its 4th step, when only it has data:
    # its scaler skips that step and backs off, and grows the scale every two
    # good steps; a sharded rank that ran out steps its part at every pass, so
    # it must skip, unscale and (for the clip) scale as the others do. Rank 0
    # has no batch at all: it knows the scaler only from Join's grad_scaler=
    # (``explicit``), the others also from their steps inside the context
    options = SCALED[option]
    ours = run_ranks(_train_scaled, WORLD, "optimizer", options, STEPS, 3, explicit)
    ddp = run_ranks(_train_scaled, WORLD, "ddp", options, STEPS, 3)
    assert all(torch.equal(r[0], ours[0][0]) for r in ours), "the ranks' weights differ"
    assert torch.isfinite(ours[0][0]).all()
    torch.testing.assert_close(ours[-1][0], ddp[-1][0], rtol=0, atol=1e-6)
    # 5 steps: grown after the 2nd, backed off at the 4th (skipped), one good since
    assert ddp[-1][1:3] == (2.0 ** 4, 1)
    followed = ours if explicit else ours[1:]  # rank 0 stepped none without grad_scaler=
    assert [r[1:3] for r in followed] == [(2.0 ** 4, 1)] * len(followed)
    if not explicit:
        assert ours[0][1:3] == (2.0 ** 4, 0)  # untouched: never scaled a loss
    assert [r[3] for r in ours] == [max(STEPS) - 1] * WORLD  # the skipped step is not counted


def test_a_scaled_clip_shadowed_without_the_scaler_is_refused_naming_grad_scaler():
    # rank 0 has no batch: without Join's grad_scaler= it cannot know the scale
    # the others divide the clip's norm by, and says so
    with pytest.raises(RankFailure, match="grad_scaler=scaler"):
        run_ranks(_train_scaled, WORLD, "optimizer", SCALED["shard, clipping"], STEPS, 3)


def _even_scaled(rank, world_size, join):
    model = _Model()
    optimizer = fusedreduce.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shard=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)
    data = torch.Generator().manual_seed(100 + rank)
    with Join([optimizer]) if join else contextlib.nullcontext():
        for i in range(4):
            optimizer.zero_grad()
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if i == 1 else 1.0)
            scaler.scale(loss).backward()
            if i == 2:
                scaler.unscale_(optimizer)  # step() then gets no scale to divide by
            scaler.step(optimizer)
            scaler.update()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scaler.get_scale()


def test_a_sharded_step_under_join_and_a_gradscaler_is_the_step_outside_join():
    # no rank runs out: GradScaler hands step() its scale and check instead of
    # skipping it, and step() skips and unscales as GradScaler would, bit for bit
    inside = run_ranks(_even_scaled, 2, True)
    outside = run_ranks(_even_scaled, 2, False)
    for a, b in zip(inside, outside):
        assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _reducer_scaled(rank, world_size, explicit):
    """Our reducer's hooks under Join with a GradScaler that grows its scale
    every two steps; this rank's scale and growth tracker."""
    model = _Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = fusedreduce.DistributedGradReducer(list(model.parameters())).register_hooks()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)
    data = torch.Generator().manual_seed(100 + rank)
    with Join([reducer], **({"grad_scaler": scaler} if explicit else {})):
        for _ in range(STEPS[rank]):
            optimizer.zero_grad()
            x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(optimizer)
            scaler.update()
    return scaler.get_scale(), 0 if scaler._growth_tracker is None else int(scaler._growth_tracker)


@pytest.mark.parametrize("explicit", [True, False])
def test_join_with_our_reducer_and_grad_scaler_leaves_every_scaler_the_last_joiners(explicit):
    # 5 good steps on the last rank: the scale doubled after the 2nd and the
    # 4th. Without grad_scaler= each rank keeps its own (as DDP's join() does)
    scalers = run_ranks(_reducer_scaled, WORLD, explicit)
    if explicit:
        assert scalers == [(2.0 ** 6, 1)] * WORLD
    else:
        assert scalers == [(2.0 ** 4, 0), (2.0 ** 5, 1), (2.0 ** 6, 1)]


def _join_with_grad_scaler(rank, world_size, way):
    model = _Model()
    if way == "reducer":
        joinable = fusedreduce.DistributedGradReducer(list(model.parameters())).register_hooks()
    else:
        joinable = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with Join([joinable], grad_scaler=2.0 ** 16):
        pass


@pytest.mark.parametrize("way", ["reducer", "optimizer"])
def test_a_grad_scaler_that_is_not_one_is_refused_by_name(way):
    for kind, message in rank_errors(_join_with_grad_scaler, 2, way):
        assert kind == "TypeError" and "grad_scaler" in message and "float" in message, message
