"""Process subgroups that do not contain global rank 0.

A data-parallel group inside tensor parallelism is, say, ranks {1, 3} of 4.
Every rank an API takes (``src``, the source of ``bcast_period``'s broadcasts)
is a rank of the group passed, so the defaults work in such a group: rank 0
of {1, 3} is global rank 1. On 4 gloo ranks with the groups {0, 2} and {1, 3},
each API runs in both groups at once and must (a) leave the two groups'
replicas apart, (b) make each group's replicas bitwise equal to its own
source, and (c) reduce within the group only, as plain torch does it with
``dist.all_reduce(..., group=g)``.

Rank functions never assert: they return what they saw and the test judges.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_ranks
from fusedreduce import (DistributedGradReducer, DistributedOptimizer, broadcast_optimizer_state,
                         broadcast_tensors, parameter_broadcast)

WORLD = 4
GROUPS = ([0, 2], [1, 3])
STEPS = 3


def _model(seed):
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _my_group(rank):
    """Both groups, created by every rank in the same order; this rank's one."""
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    index = next(i for i, ranks in enumerate(GROUPS) if rank in ranks)
    return groups[index], index


def _train(model, optimizer, rank, group, reduce):
    for step in range(STEPS):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        if reduce:  # plain torch: the mean over the group, by hand
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= dist.get_world_size(group)
        optimizer.step()
        optimizer.zero_grad()


def _optimizer_in_subgroups(rank, world_size, shard, **options):
    group, index = _my_group(rank)
    seen = {"group": index}
    # every rank starts from its own weights: bcast_period=0 makes them the
    # group's rank 0's, which is global rank 1 for {1, 3}; sharded, each
    # group rank's part comes back from that rank (a broadcast on gloo)
    model = _model(seed=rank)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     group=group, shard=shard, **options)
    seen["after_wrap"] = _flat(model)
    _train(model, optimizer, rank, group, reduce=False)
    seen["trained"] = _flat(model)
    # the same training in plain torch, from the group's source weights
    reference = _model(seed=GROUPS[index][0])
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), rank,
           group, reduce=True)
    seen["reference"] = _flat(reference)
    # a group added later is broadcast from the group's rank 0 too
    head = nn.Linear(3, 2)
    with torch.no_grad():
        head.weight.fill_(rank)
        head.bias.fill_(-rank)
    optimizer.add_param_group({"params": head.parameters()})
    seen["added"] = _flat(head)
    return seen


def _optimizer_in_subgroups_of_large_tensors(rank, world_size, shard):
    # every bucket taken for one of few large tensors: on a group of 2 gloo
    # ranks it is reduce-scattered by one exchange of the ranks' elements and
    # gathered by a broadcast per tensor range
    return _optimizer_in_subgroups(rank, world_size, shard, gradient_collective="exchange",
                                   parameter_gather="broadcast_direct")


@pytest.mark.parametrize("shard,large", [(False, False), (True, False), (True, True)])
def test_distributed_optimizer_broadcasts_and_reduces_within_a_group_without_global_rank_0(
        shard, large):
    seen = run_ranks(_optimizer_in_subgroups_of_large_tensors if large
                     else _optimizer_in_subgroups, WORLD, shard)
    for index, ranks in enumerate(GROUPS):
        source = ranks[0]
        for rank in ranks:
            assert seen[rank]["group"] == index
            assert torch.equal(seen[rank]["after_wrap"], _flat(_model(seed=source))), rank
            assert torch.equal(seen[rank]["added"], seen[source]["added"]), rank
            assert torch.equal(seen[rank]["trained"], seen[source]["trained"]), rank
            # one summation order (a 2-rank all-reduce of fp32): the same bits
            assert torch.equal(seen[rank]["trained"], seen[rank]["reference"]), rank
        assert seen[source]["added"][0].item() == source
    # the groups kept apart: different sources, different data
    assert not torch.equal(seen[0]["trained"], seen[1]["trained"])


def _broadcasts_in_subgroups(rank, world_size):
    group, index = _my_group(rank)
    seen = {}
    model = _model(seed=rank)
    parameter_broadcast(model, src=1, group=group)           # group rank 1: global 2 or 3
    seen["module"] = _flat(model)
    tensors = [torch.full((3,), float(rank)), torch.tensor([rank], dtype=torch.int64)]
    broadcast_tensors(tensors, 0, group=group)               # group rank 0: global 0 or 1
    seen["tensors"] = [t.clone() for t in tensors]
    model = _model(seed=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if dist.get_rank(group) == 1:                             # only the source has state
        x, y = _batch(rank, 0)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    broadcast_optimizer_state(optimizer, src=1, group=group)
    state = optimizer.state_dict()["state"]
    seen["state"] = torch.cat([v.reshape(-1).float() for k in sorted(state)
                               for _, v in sorted(state[k].items())])
    try:
        broadcast_tensors([torch.zeros(1)], 2, group=group)   # no rank 2 in a 2-rank group
        seen["bad_src"] = None
    except ValueError as error:
        seen["bad_src"] = str(error)
    return seen


def test_broadcast_sources_are_group_ranks():
    seen = run_ranks(_broadcasts_in_subgroups, WORLD)
    for ranks in GROUPS:
        first, second = ranks
        for rank in ranks:
            assert torch.equal(seen[rank]["module"], _flat(_model(seed=second))), rank
            assert seen[rank]["tensors"][0].tolist() == [float(first)] * 3, rank
            assert seen[rank]["tensors"][1].tolist() == [first], rank
            assert torch.equal(seen[rank]["state"], seen[second]["state"]), rank
            assert "src=2 is not a rank of the group (0..1)" in seen[rank]["bad_src"], rank
    assert not torch.equal(seen[0]["state"], seen[1]["state"])


def _reducer_in_subgroups(rank, world_size):
    group, _ = _my_group(rank)
    model = _model(seed=0)
    DistributedGradReducer(list(model.parameters()), group=group).register_hooks()
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    reduced = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    plain = _model(seed=0)
    nn.functional.mse_loss(plain(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    dist.all_reduce(expected, group=group)
    return reduced, expected / dist.get_world_size(group)


def test_the_reducer_reduces_within_its_group():
    seen = run_ranks(_reducer_in_subgroups, WORLD)
    for ranks in GROUPS:
        for rank in ranks:
            reduced, expected = seen[rank]
            # the fused all-reduce sums the same two fp32 values: the same bits
            assert torch.equal(reduced, expected), rank
            assert torch.equal(reduced, seen[ranks[0]][0]), rank
    assert not torch.equal(seen[0][0], seen[1][0])
