"""A collective checkpoint call made on some ranks only, as training scripts make it.

``if rank == 0: torch.save(opt.state_dict(), path)`` with ``shard=True``:
the ranks that made the call get, within ``checkpoint_timeout``, a
RuntimeError that names the call and the fix, and the others train on
untouched (the call communicates on a gloo group of its own, never between
their training collectives). Mid-training and at the end of training, on the
all-reduce and the reduce-scatter paths, on 2 and 3 gloo ranks. Before this
(the call on the training group), rank 0 died of a gloo abort (SIGABRT,
``Received data size doesn't match expected size``) mid-training and got
``Connection reset by peer`` at the end: these tests then fail with a
RankFailure or a timeout.
"""
from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import DistributedOptimizer, consolidate_sharded_state_dict

from harness import CRASH_TIMEOUT, rank_errors, run_ranks

#: the tests' checkpoint_timeout: short, so a lone call fails fast
TIMEOUT_S = 3.0
#: how much later than TIMEOUT_S a lone call may raise: the waits are gloo's
#: own timers, the rest is a loaded 2-core machine's scheduling
SLACK_S = 10.0
STEPS = 5
#: the step before whose backward the lone call is made mid-training
CALL_AT = 2
PATHS = {"all_reduce": {}, "reduce_scatter": {"shard_gradients": True}}
CALL = "DistributedOptimizer.state_dict() with shard=True is collective"


def _model():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _optimizer(model, path, **options):
    return DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                shard=True, param_pack_thd=200,
                                checkpoint_timeout=TIMEOUT_S, **PATHS[path], **options)


def _train_step(model, opt, rank, step):
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * rank + step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _timed_state_dict(opt):
    """What ``opt.state_dict()`` raised (type, message, whether chained) and
    how long it took; None if it returned."""
    start = time.monotonic()
    try:
        opt.state_dict()
    except Exception as exc:  # noqa: BLE001 - the type is part of the result
        return (type(exc).__name__, str(exc), exc.__cause__ is not None,
                time.monotonic() - start)
    return None


def _lone_call(rank, world_size, path, when, caller):
    """A user's loop whose rank ``caller`` alone calls ``state_dict()``
    (``when``: "mid", before step ``CALL_AT``'s backward, the other ranks
    going on into backward and step; "end", after the last step, the
    others finishing: their groups are destroyed and they exit; None: no
    call). What the call raised there, and the parameters after training."""
    model = _model()
    opt = _optimizer(model, path)
    seen = None
    for step in range(STEPS):
        if when == "mid" and step == CALL_AT and rank == caller:
            seen = _timed_state_dict(opt)
        _train_step(model, opt, rank, step)
    if when == "end" and rank == caller:
        seen = _timed_state_dict(opt)
    return {"seen": seen, "params": [p.detach().clone() for p in model.parameters()]}


def _check_lone_call(seen):
    kind, message, chained, seconds = seen
    assert kind == "RuntimeError", seen
    assert CALL in message, message
    assert "state_dict(to=0)" in message and "sharded_state_dict()" in message, message
    assert chained, "the error is chained from torch's"
    assert seconds < TIMEOUT_S + SLACK_S, seen


@pytest.mark.parametrize("path", list(PATHS))
def test_a_lone_call_mid_training_raises_and_training_goes_on(path):
    # no gloo abort: every rank returns, within the crash bound
    results = run_ranks(_lone_call, 2, path, "mid", 0, timeout=CRASH_TIMEOUT + 60)
    _check_lone_call(results[0]["seen"])
    assert results[1]["seen"] is None
    # the other rank's training was untouched: the run is the run without the call
    plain = run_ranks(_lone_call, 2, path, None, 0)
    for got, want in zip(results, plain):
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("path", list(PATHS))
def test_a_lone_call_at_the_end_of_training_raises(path):
    results = run_ranks(_lone_call, 2, path, "end", 0, timeout=CRASH_TIMEOUT + 60)
    _check_lone_call(results[0]["seen"])


@pytest.mark.parametrize("caller", [0, 2])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_lone_call_on_three_ranks_names_the_missing_ranks(path, caller):
    """Rank 0 alone (monitored_barrier's timeout) or the last rank alone
    (the checkpoint group's own timeout bounds its wait)."""
    results = run_ranks(_lone_call, 3, path, "mid", caller, timeout=CRASH_TIMEOUT + 60)
    _check_lone_call(results[caller]["seen"])
    if caller == 0:
        assert "Ranks 1, 2 failed to pass monitoredBarrier" in results[0]["seen"][1]
    assert all(r["seen"] is None for i, r in enumerate(results) if i != caller)
    assert all(torch.equal(a, b) for r in results[1:]
               for a, b in zip(r["params"], results[0]["params"]))


def _after_a_lone_call(rank, world_size):
    """A lone call, then every rank calls: the checkpoint's connections are
    closed, so each raises at once, naming the call (training goes on)."""
    model = _model()
    opt = _optimizer(model, "all_reduce")
    _train_step(model, opt, rank, 0)
    first = _timed_state_dict(opt) if rank == 0 else None
    _train_step(model, opt, rank, 1)
    return first, _timed_state_dict(opt)


def test_after_a_lone_call_later_calls_raise_the_same_error():
    results = run_ranks(_after_a_lone_call, 2, timeout=CRASH_TIMEOUT + 60)
    _check_lone_call(results[0][0])
    for _, later in results:
        _check_lone_call(later)
        assert later[3] < TIMEOUT_S, "raised at once, without waiting"


def _every_rank_calls(rank, world_size, path):
    """Every rank calls state_dict() (and with to=0, cpu_offload=True), as
    the docs say: the dicts on each rank, and every rank's
    sharded_state_dict() (no collective) for the consolidated reference."""
    model = _model()
    opt = _optimizer(model, path)
    for step in range(3):
        _train_step(model, opt, rank, step)
    whole = opt.state_dict()
    to_zero = opt.state_dict(to=0, cpu_offload=True)
    shards = [None] * world_size
    dist.all_gather_object(shards, opt.sharded_state_dict())
    return whole, to_zero, shards


def _same(a, b):
    """Bitwise equal nested dicts/lists of tensors (dtypes too)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_rank_calling_gets_the_whole_state_bitwise(path, world_size):
    results = run_ranks(_every_rank_calls, world_size, path)
    want = consolidate_sharded_state_dict(results[0][2])
    for rank, (whole, to_zero, _) in enumerate(results):
        assert _same(whole, want)
        assert (to_zero is None) == (rank != 0)
    assert _same(results[0][1], want)


def _bad_timeout(rank, world_size, value):
    DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), shard=True,
                         checkpoint_timeout=value)


@pytest.mark.parametrize("value, kind", [
    (True, "TypeError"), ("3", "TypeError"), (0, "ValueError"), (-1.0, "ValueError"),
    (math.nan, "ValueError"), (math.inf, "ValueError"), (timedelta(0), "ValueError")])
def test_a_bad_checkpoint_timeout_is_refused(value, kind):
    [(got, message)] = rank_errors(_bad_timeout, 1, value)
    assert got == kind and "checkpoint_timeout" in message, message


def _timeout_without_shard(rank, world_size):
    DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1),
                         checkpoint_timeout=5)


def test_checkpoint_timeout_without_shard_is_refused():
    [(kind, message)] = rank_errors(_timeout_without_shard, 1)
    assert kind == "ValueError" and "checkpoint_timeout" in message, message


def _timeout_as_timedelta(rank, world_size):
    model = _model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), shard=True,
                               checkpoint_timeout=timedelta(seconds=TIMEOUT_S))
    _train_step(model, opt, rank, 0)
    seen = _timed_state_dict(opt) if rank == 1 else None
    _train_step(model, opt, rank, 1)  # rank 0 waits here for rank 1
    return seen


def test_a_timedelta_timeout_bounds_a_lone_call_of_another_rank():
    results = run_ranks(_timeout_as_timedelta, 2, timeout=CRASH_TIMEOUT + 60)
    _check_lone_call(results[1])
    assert results[1][3] >= TIMEOUT_S * 0.9, "it waited for the others first"


def _lone_add_param_group(rank, world_size):
    model = _model()
    head = nn.Linear(5, 2)
    opt = _optimizer(model, "all_reduce")
    _train_step(model, opt, rank, 0)
    groups = len(opt.param_groups)
    seen = None
    if rank == 0:
        try:
            opt.add_param_group({"params": list(head.parameters())})
        except RuntimeError as exc:
            seen = str(exc), len(opt.param_groups) == groups
    _train_step(model, opt, rank, 1)
    return seen


def test_add_param_group_on_one_rank_raises_and_changes_nothing():
    results = run_ranks(_lone_add_param_group, 2, timeout=CRASH_TIMEOUT + 60)
    message, unchanged = results[0]
    assert "add_param_group() with shard=True is collective" in message, message
    assert unchanged
