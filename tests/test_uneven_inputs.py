"""Uneven inputs: ranks that run out of data at different steps, under torch's ``Join``.

DDP supports them through ``torch.distributed.algorithms.Join`` (``ddp.join()``):
a rank that has run out shadows the others' collectives, its own bucket
contributing zeros, by calling the registered comm hook on zero buckets. With
fusedreduce's hooks registered, the shadowing calls run our hooks, so every
hook must issue the same collectives for a zero bucket as for a real one,
including its first-use checks (a rank may join before its first backward).
``DistributedOptimizer``, ``DistributedGradReducer`` and
``AdaSumByDeltaWeight`` do not shadow collectives: ``Join`` refuses them by
name, with what works, instead of failing on a missing method.
"""
import hashlib

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import fusedreduce
from fusedreduce import hooks
from harness import run_ranks

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


def _join_ours(rank, world_size, which):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if which == "optimizer":
        joinable = fusedreduce.DistributedOptimizer(optimizer)
    elif which == "adasum_delta":
        joinable = fusedreduce.AdaSumByDeltaWeight(optimizer)
    else:
        joinable = fusedreduce.DistributedGradReducer(list(model.parameters()))
    try:
        Join([joinable])
    except TypeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("which", ["optimizer", "reducer", "adasum_delta"])
def test_join_refuses_our_optimizer_and_reducer_by_name(which):
    messages = run_ranks(_join_ours, 2, which)
    for message in messages:
        assert message is not None and "uneven inputs" in message
        assert "register_comm_hook" in message  # the way that works
