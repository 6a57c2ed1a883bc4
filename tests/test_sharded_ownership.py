"""DistributedOptimizer(shard=True): which elements each rank owns, loads,
saves and agrees on, checked directly (each test fails on its own bug, with an
assertion, in seconds):

- in a subgroup, a rank owns its *group* rank's part: global rank 1 of
  {1, 2} owns what rank 0 of {0, 1} owns, and each group's ranks own every
  element of every parameter once (seen in ``sharded_state_dict()``);
- ``load_state_dict`` of a whole dict hands the wrapped optimizer only this
  rank's part, so a host dict puts 1/N of the state on the device (what the
  wrapped optimizer's own ``load_state_dict`` receives is recorded);
- a checkpoint of AdaSum's layout, where the tree's halving gives the ranks
  slices out of rank order (rank 1 holds the third quarter at 4 ranks once a
  parameter spans more than two AdaSum chunks), is put together in element
  order: ``state_dict()`` is the unsharded optimizer's bit for bit, and the
  per-rank save put together, and loaded back, is the same;
- an inf in one rank's gradient reaches every rank: each rank's GradScaler
  sees a non-finite gradient and skips the same step, as unsharded; the
  ranks compare what they saw before stepping, and gloo's timeout is short,
  so a rank left out fails an assertion instead of hanging.

Rank functions never assert: they return what they saw and the tests judge.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import DistributedOptimizer, consolidate_sharded_state_dict
from fusedreduce.sharded_checkpoint import pieces_of
from harness import InfOnOneRank, run_ranks

# gloo's timeout for the runs where a bug leaves ranks in different
# collectives: long beside the milliseconds each collective takes here, short
# beside the default minute
SHORT_COLLECTIVE_TIMEOUT = 20.0


def _model(seed=0, widths=(7, 13, 5)):
    gen = torch.Generator().manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _loss(model, rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return model(torch.randn(4, model[0].in_features, generator=gen)).square().mean()


def _elements(state: dict) -> int:
    """How many per-element state values a torch-form state dict holds."""
    return sum(v.numel() for entry in state.values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _ranges(own: dict) -> dict:
    """``{parameter index: (start, end)}`` of a ``sharded_state_dict()``."""
    return {index: (piece["start"], piece["end"]) for index, piece in pieces_of(own).items()}


def _equal_states(a: dict, b: dict) -> bool:
    """Two torch-form state dicts with the same keys and bitwise equal tensors."""
    return a["param_groups"] == b["param_groups"] and list(a["state"]) == list(b["state"]) \
        and all(list(a["state"][i]) == list(b["state"][i]) and all(
            torch.equal(v, b["state"][i][k]) if isinstance(v, torch.Tensor)
            else v == b["state"][i][k] for k, v in a["state"][i].items())
            for i in a["state"])


def _whole_state(seed=0) -> dict:
    """A whole AdamW state (one plain step), the same on every rank."""
    model = _model(seed)
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)
    _loss(model, 99, 0).backward()
    plain.step()
    return plain.state_dict()


# ------------------------------------------------------ owned by group rank

def _owned_in_two_groups(rank, world_size):
    """Groups {0, 1} and {1, 2} of 3 ranks: each member loads the same whole
    state and reports the ranges its ``sharded_state_dict()`` holds (not
    collective after the construction, so a wrong part cannot hang)."""
    groups = {name: dist.new_group(ranks) for name, ranks in (("low", [0, 1]),
                                                              ("high", [1, 2]))}
    whole = _whole_state()
    seen = {}
    for name, ranks in (("low", [0, 1]), ("high", [1, 2])):
        if rank not in ranks:
            continue
        optimizer = DistributedOptimizer(torch.optim.AdamW(_model().parameters(), lr=0.01),
                                         group=groups[name], shard=True, param_pack_thd=120,
                                         bcast_period=-1)
        optimizer.load_state_dict(copy.deepcopy(whole))
        own = optimizer.sharded_state_dict()
        # each piece's values are the whole state's elements over its range
        values_match = all(
            torch.equal(piece["slices"][key],
                        whole["state"][index][key].reshape(-1)[piece["start"]:piece["end"]])
            for index, piece in pieces_of(own).items() for key in ("exp_avg", "exp_avg_sq"))
        seen[name] = {"group_rank": dist.get_rank(groups[name]), "ranges": _ranges(own),
                      "values_match": values_match}
    return seen


def test_a_rank_owns_its_group_rank_s_part_not_its_global_rank_s():
    results = run_ranks(_owned_in_two_groups, 3, timeout=120.0)
    numels = [p.numel() for p in _model().parameters()]
    by_group_rank = {}
    for name, members in (("low", [0, 1]), ("high", [1, 2])):
        seen = [results[r][name] for r in members]
        assert [s["group_rank"] for s in seen] == [0, 1], name
        assert all(s["values_match"] for s in seen), name
        # every element of every parameter owned once in the group
        for index, numel in enumerate(numels):
            ranges = sorted(s["ranges"][index] for s in seen if index in s["ranges"])
            covered = [0] + [end for _, end in ranges]
            assert [start for start, _ in ranges] == covered[:-1] and covered[-1] == numel, \
                f"group {name}, parameter {index}: ranges {ranges} of {numel} elements"
        by_group_rank[name] = [s["ranges"] for s in seen]
    # the same layout in both groups: the group rank decides what a rank owns
    # (global rank 1 owns part 1 of {0, 1} and part 0 of {1, 2})
    assert by_group_rank["high"] == by_group_rank["low"]
    assert by_group_rank["low"][0] != by_group_rank["low"][1]


# ------------------------------------------- what the wrapped optimizer loads

class _RecordingAdamW(torch.optim.AdamW):
    """AdamW that records how many per-element state values each of its
    ``load_state_dict`` calls receives."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.received = []

    def load_state_dict(self, state_dict):
        self.received.append(_elements(state_dict["state"]))
        super().load_state_dict(state_dict)


def _loads_of_a_whole_state(rank, world_size):
    """A whole state loaded by load_state_dict, and a per-rank save by
    load_sharded_state_dict: what the wrapped optimizer received each time,
    and the state it holds after."""
    whole = _whole_state()
    optimizer = DistributedOptimizer(_RecordingAdamW(_model().parameters(), lr=0.01),
                                     shard=True, param_pack_thd=120, assume_elementwise=True)
    optimizer.load_state_dict(copy.deepcopy(whole))
    held = _elements(optimizer.state)
    shards = [None] * world_size
    dist.all_gather_object(shards, optimizer.sharded_state_dict())
    optimizer.load_sharded_state_dict(shards)
    return {"received": optimizer.received, "held": [held, _elements(optimizer.state)],
            "whole": _elements(whole["state"])}


def test_load_state_dict_hands_the_wrapped_optimizer_only_the_rank_s_part():
    results = run_ranks(_loads_of_a_whole_state, 2, timeout=120.0)
    whole = results[0]["whole"]
    for rank, seen in enumerate(results):
        # the wrapped optimizer got exactly what it keeps: the rank's part
        assert seen["received"] == seen["held"], f"rank {rank}: {seen}"
        assert max(seen["received"]) < whole, f"rank {rank}: {seen} of {whole}"
    # the parts add up to the whole state, every element once
    assert sum(seen["held"][0] for seen in results) == whole


# ------------------------------------- AdaSum's slices out of rank order, saved

def _adasum_checkpoint(rank, world_size):
    """A model with a 256x256 layer (four AdaSum chunks) stepped by sharded
    and unsharded AdaSum; their state dicts, the per-rank save put together,
    and what loading each back gives."""
    states, params, owns = {}, {}, {}
    for shard in (True, False):
        model = _model(widths=(256, 256, 3))
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9),
                                         reduce_method="adasum", shard=shard)
        for step in range(2):
            _loss(model, rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        params[shard] = [p.detach().clone() for p in model.parameters()]
        try:
            states[shard] = optimizer.state_dict()
        except ValueError as e:  # every rank alike: the gather before it ended
            states[shard] = f"{type(e).__name__}: {e}"
        if shard:
            owns = optimizer.sharded_state_dict()
    seen = {"own": owns, "params_equal": all(torch.equal(a, b)
                                             for a, b in zip(params[True], params[False]))}
    seen["state_dict"] = states[True] if isinstance(states[True], str) else \
        _equal_states(states[True], states[False])
    shards = [None] * world_size
    dist.all_gather_object(shards, owns)
    try:
        seen["consolidated"] = _equal_states(consolidate_sharded_state_dict(shards),
                                             states[False])
    except ValueError as e:
        seen["consolidated"] = f"{type(e).__name__}: {e}"
    # loaded back, from the per-rank save and from the whole dict: each rank
    # holds its part again, bitwise
    for name, load in (("from_shards", lambda o: o.load_sharded_state_dict(shards)),
                       ("from_whole", lambda o: o.load_state_dict(copy.deepcopy(states[False])))):
        again = DistributedOptimizer(torch.optim.SGD(_model(widths=(256, 256, 3)).parameters(),
                                                     lr=0.01, momentum=0.9),
                                     reduce_method="adasum", shard=True)
        try:
            load(again)
            held = again.sharded_state_dict()
            theirs = pieces_of(owns)
            seen[name] = _ranges(held) == _ranges(owns) and all(
                torch.equal(piece["slices"]["momentum_buffer"],
                            theirs[index]["slices"]["momentum_buffer"])
                for index, piece in pieces_of(held).items())
        except ValueError as e:
            seen[name] = f"{type(e).__name__}: {e}"
    return seen


def test_sharded_adasum_checkpoints_put_slices_out_of_rank_order_back_in_element_order():
    results = run_ranks(_adasum_checkpoint, 4, timeout=180.0)
    weight = 0  # the 256x256 layer's weight, four AdaSum chunks
    starts = [_ranges(seen["own"])[weight][0] for seen in results]
    # the premise: the halving's slices are not in rank order
    assert starts != sorted(starts), starts
    for rank, seen in enumerate(results):
        assert seen["params_equal"], f"rank {rank}"
        assert seen["state_dict"] is True, f"rank {rank}: {seen['state_dict']}"
        assert seen["consolidated"] is True, f"rank {rank}: {seen['consolidated']}"
        assert seen["from_shards"] is True, f"rank {rank}: {seen['from_shards']}"
        assert seen["from_whole"] is True, f"rank {rank}: {seen['from_whole']}"


# ----------------------------------------------- one rank's inf, every rank's

def _an_inf_on_one_rank(rank, world_size, options):
    """GradScaler over three steps, an inf in one element of the last rank's
    gradient in step 1. After each backward the ranks compare whether their
    ``.grad`` holds a non-finite value (what GradScaler reads), and stop
    there if they disagree (a rank that skips while the others step would
    leave them waiting in the parameters' gather)."""
    model = _model()
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                     param_pack_thd=120, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    poison = InfOnOneRank(rank, world_size)
    model[1].weight.register_hook(poison)
    seen = []
    for step in range(3):
        poison.step = step
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(_loss(model, rank, step)).backward()
        nonfinite = any(not bool(torch.isfinite(p.grad).all())
                        for p in model.parameters() if p.grad is not None)
        every = [None] * world_size
        dist.all_gather_object(every, nonfinite)
        seen.append({"nonfinite": every})
        if len(set(every)) > 1:
            break
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen[-1].update(changed=any(not torch.equal(a, b)
                                    for a, b in zip(before, model.parameters())),
                        scale=float(scaler.get_scale()),
                        params=[p.detach().clone() for p in model.parameters()])
    return seen


def test_an_inf_on_one_rank_skips_the_sharded_step_on_every_rank_as_unsharded():
    runs = {name: run_ranks(_an_inf_on_one_rank, 2, options, timeout=120.0,
                            collective_timeout=SHORT_COLLECTIVE_TIMEOUT)
            for name, options in (("unsharded", {}), ("sharded", {"shard": True}),
                                  ("gradients sharded", {"shard": True,
                                                         "shard_gradients": True}))}
    for name, results in runs.items():
        for rank, seen in enumerate(results):
            # every rank sees the last rank's inf in step 1, and only there
            assert [s["nonfinite"] for s in seen] == [[False] * 2, [True] * 2, [False] * 2], \
                f"{name}, rank {rank}"
            assert [s["changed"] for s in seen] == [True, False, True], f"{name}, rank {rank}"
            assert [s["scale"] for s in seen] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], \
                f"{name}, rank {rank}"
            for step, s in enumerate(seen):
                assert all(torch.equal(a, b) for a, b in
                           zip(s["params"], runs["unsharded"][0][step]["params"])), \
                    f"{name}, rank {rank}, step {step}: not the unsharded parameters"


def _an_inf_where_no_grad_is_kept(rank, world_size):
    """shard_gradients=True, two weights a part boundary does not cut, an inf
    in the last rank's: the other rank keeps no ``.grad`` of that weight, so
    the NaN that tells its GradScaler needs a ``.grad`` made for it."""
    model = _model(widths=(4, 4, 4))
    for layer in model:
        layer.bias.requires_grad_(False)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                     shard=True, shard_gradients=True)
    poison = InfOnOneRank(rank, world_size, at_step=0)
    model[0].weight.register_hook(poison)
    _loss(model, rank, 0).backward()
    params = list(model.parameters())
    return {"ranges": [(r.param, r.start, r.end, params[r.param].numel())
                       for r in optimizer.layout.ranges],
            "nonfinite": any(not bool(torch.isfinite(p.grad).all())
                             for p in params if p.grad is not None)}


def test_an_inf_reaches_a_rank_that_keeps_no_grad_of_its_parameter():
    results = run_ranks(_an_inf_where_no_grad_is_kept, 2, timeout=120.0,
                        collective_timeout=SHORT_COLLECTIVE_TIMEOUT)
    poisoned = 0  # model[0].weight
    # the case's premise: rank 0 owns whole parameters only, not the poisoned one
    assert all(start == 0 and end == numel for _, start, end, numel in results[0]["ranges"])
    assert poisoned not in [r[0] for r in results[0]["ranges"]]
    assert [seen["nonfinite"] for seen in results] == [True, True]


_HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__")


def _host_reads_in_a_step(rank, world_size, options):
    """The Python-level host reads of tensors (``bool``, ``item``,
    ``tolist``, ``int``, ``float``) that one steady-state backward and step
    make: on a GPU each waits for the device, so the host stops issuing
    work."""
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               **options)
    for step in range(2):  # the first backward sets up what later ones reuse
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    opt.zero_grad()
    loss = _loss(model, rank, 2)
    reads = []
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return saved[name](self, *args, **kwargs)
        return read

    try:
        for name in _HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        loss.backward()
        opt.step()
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    return reads


@pytest.mark.parametrize("options, most", [({}, 0), ({"shard": True}, 0),
                                           ({"shard": True, "shard_gradients": True}, 1)],
                         ids=["unsharded", "ZeRO-1", "ZeRO-2"])
def test_a_steady_state_backward_and_step_read_nothing_to_the_host(options, most):
    # the non-finite check of the owned parts settles on the device: another
    # rank's inf plants its NaN through torch.where, not a host read. ZeRO-2
    # keeps one where no .grad it holds has an element it does not own: a
    # .grad must then be made for the NaN, or not
    for reads in run_ranks(_host_reads_in_a_step, 2, options):
        assert len(reads) <= most, reads
