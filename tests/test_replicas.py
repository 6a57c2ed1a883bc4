"""Replicas that agree from the start, as under DDP, on local gloo ranks: a
``DistributedGradReducer`` built on parameters that differ by rank (a seed
per rank) raises on every rank at its first reduction, before any gradient is
written, or makes them rank 0's (``initial_parameters``); so does a
``DistributedOptimizer`` that does not broadcast (``bcast_period=-1``).

Rank functions never assert (a rank that raised would leave the others
waiting in a collective): they return what they saw and the parent judges it.
"""
import pytest
import torch
from torch import nn

from harness import (assert_raised_before_any_collective, outcomes, outcomes_and_collectives,
                     run_ranks)

STEPS = 20


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _data(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 5, generator=gen, dtype=torch.float64)


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def _reducer_on_rank(rank, world_size):
    """What each way of building a reducer on replicas that differ does. The
    last rank alone has another seed, so the error must name it."""
    from fusedreduce import DistributedGradReducer
    from fusedreduce.adasum import AdaSumReducer

    seed = 1 if rank == world_size - 1 else 0
    seen = {}

    def hooks():
        local = _model(seed)
        local(_data(rank, 0)).square().mean().backward()
        model = _model(seed)
        before = _snapshot(model.parameters())
        DistributedGradReducer(model.parameters()).register_hooks()
        try:
            model(_data(rank, 0)).square().mean().backward()
        finally:
            # nothing written: the parameters as they were, and a .grad that
            # autograd accumulated before the check is this rank's own
            seen["hooks_untouched"] = all(torch.equal(a, p) for a, p in
                                          zip(before, model.parameters()))
            seen["hooks_grads"] = [p.grad is None or torch.equal(p.grad, q.grad)
                                   for p, q in zip(model.parameters(), local.parameters())]

    def call():
        model = _model(seed)
        reducer = DistributedGradReducer(model.parameters())
        grads = [torch.ones_like(p) for p in model.parameters()]
        reducer(grads)

    def adasum():
        model = _model(seed)
        AdaSumReducer(list(model.parameters()))([torch.ones_like(p)
                                                 for p in model.parameters()])

    def unchecked():
        # not replicas: the gradients are averaged all the same
        model = _model(rank)
        reducer = DistributedGradReducer(model.parameters(), initial_parameters="unchecked")
        seen["unchecked"] = reducer([torch.full_like(p, rank + 1.0)
                                     for p in model.parameters()])

    def broadcast():
        model = _model(rank)  # every rank its own seed
        seen["own"] = _snapshot(model.parameters())
        reducer = DistributedGradReducer(model.parameters(),
                                         initial_parameters="broadcast").register_hooks()
        seen["built"] = _snapshot(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            model(_data(rank, step)).square().mean().backward()
            reducer.consume()
            opt.step()
        seen["trained"] = _snapshot(model.parameters())

    results = outcomes({"hooks": hooks, "call": call, "adasum": adasum,
                        "unchecked": unchecked, "broadcast": broadcast})
    return results, seen


@pytest.fixture(scope="module", params=[2, 3])
def reducer_runs(request):
    return request.param, run_ranks(_reducer_on_rank, request.param)


@pytest.mark.parametrize("case", ["hooks", "call", "adasum"])
def test_reducer_on_replicas_that_differ_raises_on_every_rank_with_the_fix(reducer_runs, case):
    world_size, runs = reducer_runs
    for rank, (results, _) in enumerate(runs):
        kind, message = results[case]
        assert kind == "RuntimeError", (rank, results[case])
        # the last rank differs, and the message gives the fix
        assert f"ranks [{world_size - 1}] hold other values than rank 0 in 4 of 4 " \
               f"parameters" in message, message
        assert "fusedreduce.parameter_broadcast(model)" in message
        assert "initial_parameters='broadcast'" in message


def test_reducer_error_writes_nothing(reducer_runs):
    _, runs = reducer_runs
    for rank, (_, seen) in enumerate(runs):
        assert seen["hooks_untouched"], rank
        assert all(seen["hooks_grads"]), (rank, seen["hooks_grads"])


def test_unchecked_parameters_reduce_as_before(reducer_runs):
    world_size, runs = reducer_runs
    mean = sum(range(1, world_size + 1)) / world_size  # exact in fp64
    for rank, (results, seen) in enumerate(runs):
        assert results["unchecked"] is None, (rank, results["unchecked"])
        assert all(torch.equal(g, torch.full_like(g, mean)) for g in seen["unchecked"])


def test_broadcast_makes_rank_0s_parameters_everywhere_and_they_stay_equal(reducer_runs):
    _, runs = reducer_runs
    rank0 = runs[0][1]
    assert all(not torch.equal(a, b) for a, b in zip(runs[1][1]["own"], rank0["own"]))
    for rank, (results, seen) in enumerate(runs):
        assert results["broadcast"] is None, (rank, results["broadcast"])
        assert all(torch.equal(a, b) for a, b in zip(seen["built"], rank0["own"])), rank
        assert all(torch.equal(a, b) for a, b in zip(seen["trained"], rank0["trained"])), rank
    assert not all(torch.equal(a, b) for a, b in zip(rank0["trained"], rank0["own"]))


def _optimizer_without_broadcast(rank, world_size):
    from fusedreduce import DistributedOptimizer

    def differ():
        DistributedOptimizer(torch.optim.SGD(_model(rank).parameters(), lr=0.1),
                             bcast_period=-1)

    def same():
        DistributedOptimizer(torch.optim.SGD(_model(0).parameters(), lr=0.1), bcast_period=-1)

    return outcomes({"differ": differ, "same": same})


def test_optimizer_without_broadcast_refuses_replicas_that_differ():
    for rank, results in enumerate(run_ranks(_optimizer_without_broadcast, 2)):
        assert results["same"] is None, (rank, results["same"])
        kind, message = results["differ"]
        assert kind == "RuntimeError" and "ranks [1] hold other values" in message, message
        assert "bcast_period=-1" in message and "parameter_broadcast" in message, message


def _bad_initial_parameters(rank, world_size):
    from fusedreduce import DistributedGradReducer

    params = list(_model(0).parameters())
    return outcomes_and_collectives({
        "initial_bool": lambda: DistributedGradReducer(params, initial_parameters=True),
        "initial_name": lambda: DistributedGradReducer(params, initial_parameters="yes")})


def test_bad_initial_parameters_are_refused_before_any_collective():
    assert_raised_before_any_collective(run_ranks(_bad_initial_parameters, 2), {
        "initial_bool": ("TypeError", "initial_parameters must be one of"),
        "initial_name": ("ValueError", "initial_parameters must be one of"),
    })
