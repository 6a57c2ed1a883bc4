"""Replicas that agree from the start and stay so, as under DDP, on local gloo
ranks: a ``DistributedGradReducer`` built on parameters that differ by rank
(a seed per rank) raises on every rank at its first reduction, before any
gradient is written, or makes them rank 0's (``initial_parameters``); a
``DistributedOptimizer`` keeps ``buffers`` (BatchNorm's running statistics)
equal to rank 0's after construction and after every step, in one broadcast,
sharded or not; bad ``buffers`` are refused before anything communicates.

Rank functions never assert (a rank that raised would leave the others
waiting in a collective): they return what they saw and the parent judges it.
"""
import pytest
import torch
from torch import nn

from harness import (assert_raised_before_any_collective, outcomes, outcomes_and_collectives,
                     record_collectives, run_ranks)

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
    from fusedreduce.adasum_reducer import AdaSumReducer

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


# ------------------------------------------------------------------ buffers
class _Net(nn.Module):
    """A BatchNorm between two layers: float statistics and an int64 count."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x)))).square().mean()


def _own_statistics(model, rank):
    """Statistics as per-rank training would leave them."""
    gen = torch.Generator().manual_seed(7 + rank)
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(4, generator=gen))
        model.bn.running_var.copy_(torch.rand(4, generator=gen) + 0.5)
        model.bn.num_batches_tracked.fill_(3 * rank)


def _buffers_on_rank(rank, world_size, shard, sync, bcast_period=0):
    """Buffers as each rank saw them: its own, after construction, after each
    forward (its own update) and after each step; and the broadcasts of each
    step. ``sync``: pass ``buffers=model.buffers()``."""
    from fusedreduce import DistributedOptimizer

    model = _Net()
    _own_statistics(model, rank)
    seen = {"own": _snapshot(model.buffers())}
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=shard,
                               bcast_period=bcast_period,
                               buffers=model.buffers() if sync else None)
    seen["built"] = _snapshot(model.buffers())
    seen["forward"], seen["stepped"], seen["broadcasts"] = [], [], []
    events = []
    record_collectives(events)
    for step in range(3):
        opt.zero_grad()
        model(_data(rank, step).float()).backward()
        seen["forward"].append(_snapshot(model.buffers()))
        del events[:]
        opt.step()
        seen["broadcasts"].append(events.count("broadcast"))
        seen["stepped"].append(_snapshot(model.buffers()))
    del events[:]
    opt.broadcast_buffers()
    seen["on_demand"] = list(events)
    return seen


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shard", [False, True])
def test_buffers_are_rank_0s_after_construction_and_every_step(world_size, shard):
    runs = run_ranks(_buffers_on_rank, world_size, shard, True)
    rank0 = runs[0]
    # not vacuous: the ranks' own statistics differ, before and after each forward
    assert not _equal(runs[1]["own"], rank0["own"])
    for step in range(3):
        assert not _equal(runs[1]["forward"][step], rank0["forward"][step])
    for rank, seen in enumerate(runs):
        assert _equal(seen["built"], rank0["own"]), rank
        for step in range(3):
            # rank 0's statistics of its own forward, bitwise, on every rank
            assert _equal(seen["stepped"][step], rank0["forward"][step]), (rank, step)
        # one broadcast, whatever the dtypes (fp32 statistics, int64 count);
        # on gloo shard=True's all-gathers are broadcasts too
        assert seen["on_demand"] == ["broadcast"], (rank, seen["on_demand"])
        if not shard:
            assert seen["broadcasts"] == [1, 1, 1], (rank, seen["broadcasts"])


@pytest.mark.parametrize("sync, bcast_period", [(False, 0), (True, -1)])
def test_buffers_stay_each_ranks_own_by_default_and_with_bcast_period_minus_1(sync, bcast_period):
    runs = run_ranks(_buffers_on_rank, 2, False, sync, bcast_period)
    for rank, seen in enumerate(runs):
        assert _equal(seen["built"], seen["own"]), rank
        assert _equal(seen["stepped"][-1], seen["forward"][-1]), rank
        assert seen["broadcasts"] == [0, 0, 0], (rank, seen["broadcasts"])
        assert seen["on_demand"] == (["broadcast"] if sync else []), (rank, seen["on_demand"])
    assert not _equal(runs[0]["stepped"][-1], runs[1]["stepped"][-1])


def _bad_buffers(rank, world_size):
    from fusedreduce import DistributedOptimizer

    model = _Net()
    bn = model.bn
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    groups_before = [list(g["params"]) for g in sgd.param_groups]
    cases = {
        "module": model, "tensor": bn.running_mean, "numbers": [1.0, 2.0],
        "modules": nn.Sequential(nn.Linear(2, 2)),
        "parameters": model.parameters(), "twice": [bn.running_mean, bn.running_mean],
        "sparse": [torch.eye(3).to_sparse()], "not_iterable": 3,
    }
    results, collectives = outcomes_and_collectives(
        {name: (lambda b=b: DistributedOptimizer(sgd, buffers=b)) for name, b in cases.items()})
    untouched = [list(g["params"]) for g in sgd.param_groups] == groups_before and \
        all(p.grad is None for p in model.parameters()) and not hasattr(sgd, "reducer")
    return (results, collectives), untouched


def test_bad_buffers_are_refused_before_anything_is_taken_over_or_sent():
    runs = run_ranks(_bad_buffers, 2)
    assert all(untouched for _, untouched in runs)
    assert_raised_before_any_collective([r for r, _ in runs], {
        "module": ("TypeError", "buffers must be an iterable of tensors, got a _Net module"),
        "tensor": ("TypeError", "buffers must be a list or tuple of tensors, got a single"),
        "numbers": ("TypeError", "buffers[0] must be a tensor, got float"),
        "modules": ("TypeError", "buffers must be an iterable of tensors, got a Sequential"),
        "parameters": ("ValueError", "buffers[0] is one of the optimizer's parameters"),
        "twice": ("ValueError", "buffers"),
        "sparse": ("TypeError", "buffers[0] is a torch.sparse_coo tensor"),
        "not_iterable": ("TypeError", "buffers must be an iterable of tensors, got int"),
    })


def _packed_on_rank(rank, world_size):
    """Tensors of every kind a module's buffers can be, through one
    ``PackedBroadcast``: sizes that break any alignment, a 0-d counter, an
    empty tensor, a non-contiguous one, bools; rank ``src`` = 1."""
    from fusedreduce.broadcast import PackedBroadcast

    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(3, generator=gen).half(),
               torch.tensor(10 + rank, dtype=torch.int64),
               torch.rand(5, generator=gen) > 0.5,
               torch.randn(4, 3, generator=gen, dtype=torch.float64).t(),
               torch.empty(0, 2),
               torch.randint(0, 100, (7,), generator=gen, dtype=torch.int8),
               torch.randn(2, generator=gen).bfloat16()]
    own = _snapshot(tensors)
    events = []
    record_collectives(events)
    PackedBroadcast(tensors, 1)()
    return own, tensors, events


def test_a_packed_broadcast_copies_any_dtypes_bitwise_in_one_collective():
    runs = run_ranks(_packed_on_rank, 3)
    source = runs[1][0]
    assert not _equal(runs[0][0], source)
    for rank, (_, tensors, events) in enumerate(runs):
        assert events == ["broadcast"], (rank, events)
        for got, want in zip(tensors, source):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), (rank, got, want)
