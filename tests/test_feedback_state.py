"""Error feedback's residuals in checkpoints: a compressed run resumed exactly.

A run with ``wire_dtype`` and ``error_feedback=True`` saved after two steps
and resumed from the save (the model's parameters and
``sharded_state_dict()``) must take the continued run's steps bit for bit:
the residual is part of the state. The same resume without the residuals
(what every earlier save held) must not, so the tests can fail. Residuals
load only into the layout they were saved in: a save of another layout
loads the optimizer's state and warns that error feedback starts at zero;
``load_error_feedback_state`` refuses it by name. Rank functions never
assert: they return what they saw.
"""
import io
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks
import fusedreduce
from fusedreduce import DistributedGradReducer, DistributedOptimizer

CONFIGS = {
    "int8, flat": dict(wire_dtype=torch.int8),
    "int8, two levels, shard=True": dict(wire_dtype=torch.int8, local_size=2, shard=True),
    "bf16, two levels": dict(wire_dtype=torch.bfloat16, local_size=2),
    "e4m3, flat, ZeRO-2": dict(wire_dtype=torch.float8_e4m3fn, shard=True,
                               shard_gradients=True),
}


def _model():
    torch.manual_seed(0)
    # odd sizes: part and block boundaries cut tensors
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5))


def _step(model, opt, rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _optimizer(model, options):
    return DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                error_feedback=True, param_pack_thd=600, **options)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _resume(rank, world_size, options, saved, drop_residuals=False, files=None):
    """A fresh model and optimizer with ``options`` from ``saved`` (every
    rank's ``(parameters, sharded_state_dict())``, or the files they were
    saved to), two more steps: (the parameters, the warnings)."""
    params, _ = saved[rank]
    shards = files or [dict(shard) for _, shard in saved]
    if drop_residuals:
        for shard in shards:
            shard.pop("error_feedback", None)
    model = _model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    opt = _optimizer(model, options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_sharded_state_dict(shards)
    for step in (2, 3):
        _step(model, opt, rank, step)
    return _params(model), [str(w.message) for w in caught]


def _resumes(rank, world_size, directory):
    """Per configuration: the continued run's parameters against the resumed
    run's, with and without the saved residuals; then a save resumed in
    another layout."""
    out = {}
    for name, options in CONFIGS.items():
        model = _model()
        opt = _optimizer(model, options)
        for step in (0, 1):
            _step(model, opt, rank, step)
        shard = opt.sharded_state_dict()
        saved = [None] * world_size
        dist.all_gather_object(saved, (_params(model), shard))
        for step in (2, 3):
            _step(model, opt, rank, step)
        continued = _params(model)
        # through files, as a job saves them: read back weights-only, mapped
        files = [f"{directory}/{name}.{r}.pt".replace(" ", "_") for r in range(world_size)]
        torch.save(shard, files[rank])
        dist.barrier()
        resumed, caught = _resume(rank, world_size, options, saved, files=files)
        consolidated = fusedreduce.consolidate_sharded_state_dict(files)
        without, _ = _resume(rank, world_size, options, saved, drop_residuals=True)
        out[name] = {
            "has residuals": "error_feedback" in shard,
            "resumed equal": all(torch.equal(a, b) for a, b in zip(continued, resumed)),
            "without equal": all(torch.equal(a, b) for a, b in zip(continued, without)),
            "warnings": caught,
            "consolidated": sorted(consolidated) == ["param_groups", "state"],
        }
        if name == "int8, flat":
            # another wire format: the moments load, error feedback restarts at zero
            _, other = _resume(rank, world_size, dict(wire_dtype=torch.bfloat16), saved)
            out["another layout"] = other
    return out


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    # 4 ranks as 2 nodes of 2, one launch for every configuration
    return run_ranks(_resumes, 4, str(tmp_path_factory.mktemp("feedback")), timeout=240)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_compressed_run_resumes_bit_for_bit_with_its_residuals(resumes, name):
    for rank, seen in enumerate(resumes):
        got = seen[name]
        assert got["has residuals"], (rank, name)
        assert got["resumed equal"], (rank, name)
        assert got["warnings"] == [], (rank, got["warnings"])
        assert got["consolidated"], rank  # the residuals are no part of the whole dict
        # what a save without the residuals gives: another run
        assert not got["without equal"], (rank, name)


def test_a_save_of_another_layout_loads_and_warns_that_feedback_restarts(resumes):
    for seen in resumes:
        (message,) = seen["another layout"]
        assert "saved with levels" in message and "error feedback starts at zero" in message


# ----------------------------------------------------- the reducer's own API

def _reducer_calls(rank, world_size):
    """Three reductions; the state saved after the second loaded into a fresh
    reducer, whose third reduction must be the first reducer's; the bad
    states refused with the residuals untouched."""
    torch.manual_seed(1)
    params = [torch.randn(13, 7), torch.randn(29)]

    def grads(step):
        gen = torch.Generator().manual_seed(10 * rank + step)
        return [torch.randn(p.shape, generator=gen) for p in params]

    def make(**options):
        return DistributedGradReducer(params, wire_dtype=torch.int8, error_feedback=True,
                                      **options)

    first = make()
    before = first.error_feedback_state()  # zeros, before any reduction
    first(grads(0))
    first(grads(1))
    state = first.error_feedback_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    third = first(grads(2))
    fresh = make()
    fresh.load_error_feedback_state(state)
    again = fresh(grads(2))
    cold = make()(grads(2))

    bad = {}
    residuals = {i: r.clone() for i, r in fresh.error_feedback_state()["residuals"].items()}
    wrong_size = {**state, "residuals": {i: r[:-1] for i, r in state["residuals"].items()}}
    other_rank = {**state, "layout": {**state["layout"], "rank": 1 - rank}}
    for case, value in (("list", [state]), ("format", {**state, "format": "x"}),
                        ("size", wrong_size), ("rank", other_rank),
                        ("tensor", {**state, "residuals": {i: [1.0] for i in state["residuals"]}}),
                        ("keys", {**state, "residuals": {**state["residuals"], "x": 0}}),
                        ("nan", {**state, "residuals": {i: torch.full_like(r, math.nan)
                                                        for i, r in state["residuals"].items()}}),
                        ("meta", {**state, "residuals": {i: r.to("meta")
                                                         for i, r in state["residuals"].items()}})):
        try:
            fresh.load_error_feedback_state(value)
            bad[case] = None
        except (TypeError, ValueError) as error:
            bad[case] = (type(error).__name__, str(error))
    untouched = all(torch.equal(r, residuals[i])
                    for i, r in fresh.error_feedback_state()["residuals"].items())
    plain = DistributedGradReducer(params)
    try:
        plain.load_error_feedback_state(state)
        no_feedback = None
    except ValueError as error:
        no_feedback = str(error)
    return {"zeros before": all(not r.any() for r in before["residuals"].values()),
            "nonzero after": any(r.any() for r in state["residuals"].values()),
            "equal": all(torch.equal(a, b) for a, b in zip(third, again)),
            "cold equal": all(torch.equal(a, b) for a, b in zip(third, cold)),
            "bad": bad, "untouched": untouched, "no feedback": no_feedback,
            "plain state": plain.error_feedback_state(),
            "keeps": (first.keeps_error_feedback, plain.keeps_error_feedback)}


def test_the_reducers_state_round_trips_through_a_weights_only_file_and_continues_exactly():
    for seen in run_ranks(_reducer_calls, 2):
        assert seen["zeros before"] and seen["nonzero after"]
        assert seen["equal"] and not seen["cold equal"]
        assert seen["plain state"] is None and seen["keeps"] == (True, False)


def test_bad_states_are_refused_by_name_and_change_nothing():
    for seen in run_ranks(_reducer_calls, 2):
        bad = seen["bad"]
        assert bad["list"][0] == "TypeError" and "error_feedback_state()" in bad["list"][1]
        assert bad["format"][0] == "ValueError" and "format" in bad["format"][1]
        assert bad["size"][0] == "ValueError" and "elements holding data, got" in bad["size"][1]
        assert bad["rank"][0] == "ValueError" and "saved with rank" in bad["rank"][1]
        assert bad["tensor"][0] == "TypeError" and "must be a tensor" in bad["tensor"][1]
        assert bad["keys"][0] == "ValueError" and "one tensor per bucket" in bad["keys"][1]
        assert bad["meta"][0] == "ValueError" and "on meta" in bad["meta"][1]
        assert bad["nan"][0] == "ValueError" and "inf or NaN" in bad["nan"][1]
        assert seen["untouched"]
        assert "keeps none" in seen["no feedback"]
