"""``param_swap.swapped``: what it swaps is put back exactly, on success and
when the block raises, nested swaps included (``init_state`` swaps ``lr``
around the sharded step, which swaps ``params``)."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from fusedreduce.param_swap import swapped


def _optimizer():
    a, b, c = (torch.zeros(n) for n in (1, 2, 3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": torch.tensor(0.5)}],
                          lr=0.1, momentum=0.9)
    del opt.param_groups[0]["momentum"]  # a group without the key is left alone
    opt.state[a] = {"momentum_buffer": torch.ones(1)}
    return opt


def _snapshot(opt):
    """What the optimizer holds, by identity: the group dicts, each entry's
    object, and the state dict."""
    return ([id(g) for g in opt.param_groups],
            [{k: id(v) for k, v in g.items()} for g in opt.param_groups],
            id(opt.state), {id(p): id(v) for p, v in opt.state.items()})


class _Planted(Exception):
    pass


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_swapped_puts_everything_back(raises):
    opt = _optimizer()
    before = _snapshot(opt)
    params = [g["params"] for g in opt.param_groups]
    new_params = [[torch.ones(1)], [torch.ones(2)]]
    new_state = {}

    def block():
        with swapped(opt, state=new_state, params=new_params, momentum=[1.0, 0.0]):
            assert opt.state is new_state
            assert [g["params"] for g in opt.param_groups] == new_params
            assert "momentum" not in opt.param_groups[0]
            assert opt.param_groups[1]["momentum"] == 0.0
            if raises:
                raise _Planted

    if raises:
        with pytest.raises(_Planted):
            block()
    else:
        block()
    assert _snapshot(opt) == before
    assert all(g["params"] is p for g, p in zip(opt.param_groups, params))
    assert "momentum" not in opt.param_groups[0]


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_nested_swaps_unwind(raises):
    opt = _optimizer()
    before = _snapshot(opt)
    lrs = [g["lr"] for g in opt.param_groups]
    zero_lrs = [0.0, torch.zeros(())]
    with pytest.raises(_Planted) if raises else nullcontext():
        with swapped(opt, lr=zero_lrs):
            with swapped(opt, params=[[], []]):
                assert [g["lr"] for g in opt.param_groups] == zero_lrs
                assert all(g["params"] == [] for g in opt.param_groups)
                if raises:
                    raise _Planted
            assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
            assert [g["lr"] for g in opt.param_groups] == zero_lrs
    assert _snapshot(opt) == before
    assert all(g["lr"] is lr for g, lr in zip(opt.param_groups, lrs))


def test_entries_go_back_into_replaced_groups():
    """torch's ``load_state_dict`` replaces the group dicts: the swapped
    entries leave the groups the optimizer holds when the block ends."""
    opt = _optimizer()
    saved = opt.state_dict()
    params = [g["params"] for g in opt.param_groups]
    with swapped(opt, params=[[torch.empty(0), torch.empty(0)], [torch.empty(0)]]):
        opt.load_state_dict(saved)
    assert all(g["params"] is p for g, p in zip(opt.param_groups, params))


def test_a_failed_swap_is_undone():
    """A value list too short raises inside the swap: what was already
    swapped goes back."""
    opt = _optimizer()
    before = _snapshot(opt)
    with pytest.raises(IndexError):
        with swapped(opt, params=[[]]):
            pass
    assert _snapshot(opt) == before

