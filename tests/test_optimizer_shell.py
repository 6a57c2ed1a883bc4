"""DistributedOptimizer's shell as a user reaches it: the class swap refuses
an optimizer wrapped already, and a sharded ``load_state_dict`` hands the
wrapped optimizer this rank's part of the state, never the whole.

A whole-state load gives the same result (each rank keeps its part anyway),
so only what the wrapped optimizer receives tells the two apart: with a
host dict on a GPU the whole state would move to the device on every rank.
"""
from __future__ import annotations

from unittest import mock

import torch
from torch import nn

from fusedreduce import AdaSumByDeltaWeight, DistributedOptimizer
from harness import run_ranks

TIMEOUT = 300.0


def _model():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 11), nn.Tanh(), nn.Linear(11, 7), nn.Tanh(),
                          nn.Linear(7, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _elements(state: dict) -> int:
    return sum(v.numel() for entry in state.values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _wrapping_twice(rank: int, world_size: int) -> list:
    model = _model()
    refused = []
    for outer, inner in ((DistributedOptimizer, DistributedOptimizer),
                         (DistributedOptimizer, AdaSumByDeltaWeight),
                         (AdaSumByDeltaWeight, DistributedOptimizer)):
        wrapped = inner(torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            outer(wrapped)
        except TypeError as exc:
            refused.append(str(exc))
        if isinstance(wrapped, DistributedOptimizer):
            wrapped.reducer.remove_hooks()
    return refused


def test_an_optimizer_wrapped_already_is_refused():
    for refused in run_ranks(_wrapping_twice, 2, timeout=TIMEOUT):
        assert refused == ["optimizer is already wrapped (DistributedSGD)",
                           "optimizer is already wrapped (AdaSumByDeltaWeightSGD)",
                           "optimizer is already wrapped (DistributedSGD)"]


def _sharded_load(rank: int, world_size: int) -> dict:
    model = _model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), shard=True)
    x = torch.randn(5, 9, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    opt.step()
    before = {i: {k: v.clone() for k, v in opt.state[p].items()}
              for i, p in enumerate(model.parameters()) if p in opt.state}
    saved = opt.state_dict()  # collective: the whole state on every rank
    received = []
    load = torch.optim.Optimizer.load_state_dict

    def spy(self, state_dict):
        received.append(state_dict)
        return load(self, state_dict)
    with mock.patch.object(torch.optim.Optimizer, "load_state_dict", spy):
        opt.load_state_dict(saved)
    params = list(model.parameters())
    owned = [opt.layout.range_of(i) for i in range(len(params))]
    after = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state}
    return {"calls": len(received),
            "received_elements": _elements(received[0]["state"]),
            "owned_elements": 2 * sum(r.end - r.start for r in owned if r is not None),
            "whole_elements": _elements(saved["state"]),
            "unchanged": before.keys() == after.keys() and all(
                torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])}


def test_a_sharded_load_hands_the_wrapped_optimizer_this_rank_s_part_only():
    results = run_ranks(_sharded_load, 2, timeout=TIMEOUT)
    # AdamW keeps two per-element tensors (exp_avg, exp_avg_sq) per element
    assert sum(r["received_elements"] for r in results) == results[0]["whole_elements"]
    for rank, r in enumerate(results):
        assert r["calls"] == 1
        assert r["received_elements"] == r["owned_elements"], (rank, r)
        assert r["received_elements"] < r["whole_elements"], (rank, r)
        assert r["unchanged"], rank
