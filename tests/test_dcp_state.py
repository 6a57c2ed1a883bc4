"""DistributedOptimizer's state through torch.distributed.checkpoint (DCP).

DCP makes the state of an optimizer whose ``state`` is empty by one
``step()`` on zero gradients at learning rate 0 (``_init_optim_state``);
``step()`` runs that call locally, and ``init_state()`` makes the same state
explicitly. What "correct" means, checked on 1 to 3 gloo ranks, unsharded,
ZeRO-1, ZeRO-2 and AdaSum (unsharded and sharded):

- a fresh optimizer loaded through ``get_optimizer_state_dict``,
  ``dcp.load`` and ``set_optimizer_state_dict`` before any step resumes the
  run bitwise, with or without ``init_state()`` first, and after
  ``init_state()`` DCP takes no step of its own on a rank that holds state
  (with ``shard=True`` it still does, locally, on a rank that owns nothing);
- ``init_state()`` makes bitwise the state DCP makes for a plain torch
  optimizer (AdamW, SGD with momentum, ASGD, whose state depends on the
  learning rate), communicates nothing, leaves the parameters, the
  gradients and the learning rates as they were, and leaves a parameter
  that has state as it is;
- a step at learning rate 0 on zero gradients that a backward reduced (a
  warm-up schedule's first step) is an ordinary step: AdamW counts it as
  torch does, and the buffers are synchronised after it.

Rank functions never assert: they return what they saw.
"""
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from fusedreduce import DistributedOptimizer
from harness import record_collectives, run_ranks

LR = 0.01
#: what each mode passes to DistributedOptimizer
MODES = {
    "unsharded": {},
    "zero1": {"shard": True},
    "zero2": {"shard": True, "shard_gradients": True},
    "adasum": {"reduce_method": "adasum"},
    "adasum_sharded": {"reduce_method": "adasum", "shard": True},
}


def _model(seed=0):
    """fp32 and bf16 layers (fp16 AdamW unsharded makes NaN: its eps rounds
    to 0); a small bucket cap (below) gives several buckets, so at 3 ranks
    parameters are cut between owners."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))
    model[2].bfloat16()
    return model


def _loss(model, rank, step):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))
    return model[2](model[1](model[0](x)).bfloat16()).float().square().mean()


def _train(model, opt, rank, steps):
    for step in steps:
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()


def _optimizer(model, lr, mode):
    return DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1),
                                param_pack_thd=200, **MODES[mode])


def _counting_steps(opt):
    """``opt.step`` counting its calls (DCP calls ``optim.step``)."""
    calls = []
    step = opt.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)
    opt.step = counted
    return calls


def _resume_through_dcp(rank, world_size, mode, explicit):
    """Two steps, DCP's save of the optimizer, two more; then a fresh model
    (other weights) and optimizer (lr 1.0, which the save's must replace)
    loaded through DCP before any step (after ``init_state()`` if
    ``explicit``), and stepped the same two steps."""
    directory = [tempfile.mkdtemp(prefix="dcp-state-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    model = _model()
    opt = _optimizer(model, LR, mode)
    _train(model, opt, rank, range(2))
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=directory[0])
    _train(model, opt, rank, range(2, 4))
    resumed = _model(seed=1)
    again = _optimizer(resumed, 1.0, mode)
    if explicit:
        again.init_state()
    calls = _counting_steps(again)
    state = {"model": resumed.state_dict(), "optim": get_optimizer_state_dict(resumed, again)}
    dcp_steps = len(calls)
    dcp.load(state, checkpoint_id=directory[0])
    resumed.load_state_dict(state["model"])
    set_optimizer_state_dict(resumed, again, state["optim"])
    lr_loaded = again.param_groups[0]["lr"]
    _train(resumed, again, rank, range(2, 4))
    dist.barrier()  # every rank has read the save
    if rank == 0:
        shutil.rmtree(directory[0])
    return {"same_parameters": all(torch.equal(a, b) for a, b in
                                   zip(model.parameters(), resumed.parameters())),
            "same_state": _states_equal(opt.state_dict(), again.state_dict()),
            "lr_loaded": lr_loaded, "dcp_steps": dcp_steps, "holds_state": bool(again.state)}


def _states_equal(a, b):
    """Two optimizer state dicts, bit for bit."""
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    for key, entry in a["state"].items():
        other = b["state"][key]
        if set(entry) != set(other):
            return False
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not (value.dtype == other[name].dtype and torch.equal(value, other[name])):
                    return False
            elif value != other[name]:
                return False
    return True


def _all_resumes(rank, world_size):
    return {(mode, explicit): _resume_through_dcp(rank, world_size, mode, explicit)
            for mode in MODES for explicit in (False, True)}


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_fresh_optimizer_loaded_through_dcp_resumes_the_run(world_size):
    for rank, seen in enumerate(run_ranks(_all_resumes, world_size, timeout=240)):
        for (mode, explicit), got in seen.items():
            where = f"rank {rank}, {mode}, init_state() first: {explicit}"
            assert got["lr_loaded"] == LR, where  # the save's hyperparameters win
            assert got["same_parameters"] and got["same_state"], where
            if explicit and got["holds_state"]:
                # init_state() left nothing for DCP to make: no step inside
                assert got["dcp_steps"] == 0, where
            if not explicit:
                assert got["dcp_steps"] == 1, where


def _owning_nothing(rank, world_size):
    """One parameter of one element, sharded: one rank owns it, the others
    nothing. ``init_state()`` on every rank, then DCP's state dict."""
    tiny = nn.Linear(1, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.AdamW(tiny.parameters(), lr=LR), shard=True)
    before = tiny.weight.detach().clone()
    opt.init_state()
    calls = _counting_steps(opt)
    state = get_optimizer_state_dict(tiny, opt)
    return {"owns": bool(opt.state), "dcp_steps": len(calls),
            "steps": {k: float(v["step"]) for k, v in state["state"].items()},
            "unchanged": torch.equal(tiny.weight, before)}


def test_dcp_steps_only_on_the_ranks_that_own_nothing_after_init_state():
    seen = run_ranks(_owning_nothing, 3)
    assert sorted(r["owns"] for r in seen) == [False, False, True]
    for rank, got in enumerate(seen):
        # the owner's state is made; DCP still makes it (as nothing) where
        # the state stays empty, locally; every rank gets the whole state
        assert got["dcp_steps"] == (0 if got["owns"] else 1), rank
        assert got["steps"] == {"weight": 1.0} and got["unchanged"], rank


_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.1),
    # its state (eta, mu) is a function of the learning rate
    "asgd": lambda params: torch.optim.ASGD(params, lr=LR, t0=0.0),
}


def _explicit_init(rank, world_size):
    """Per optimizer and ``shard``: ``init_state()`` between a reducing
    backward and its step, called on rank 0 only first, against a plain
    torch optimizer made through DCP (same weights, stepped on the same
    mean gradient: the same batch on every rank, so the mean is the local
    gradient bit for bit at 2 ranks)."""
    events = []
    record_collectives(events)
    out = {}
    torch.manual_seed(0)
    for name, make in _OPTIMIZERS.items():
        for shard in (False, True):
            model, plain = nn.Linear(4, 3), nn.Linear(4, 3)
            model.weight.data.normal_(generator=torch.Generator().manual_seed(3))
            plain.load_state_dict(model.state_dict())
            opt = DistributedOptimizer(make(model.parameters()), shard=shard)
            plain_opt = make(plain.parameters())
            get_optimizer_state_dict(plain, plain_opt)  # torch's _init_optim_state
            for m in (model, plain):
                _loss_of(m).backward()
            before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
            if rank == 0:
                sent = len(events)
                opt.init_state()
                opt.init_state()  # the state is there: nothing more
                out[(name, shard, "communicated")] = events[sent:]
            opt.init_state()
            out[(name, shard, "unchanged")] = all(
                torch.equal(p, value) and torch.equal(p.grad, grad)
                for p, (value, grad) in zip(model.parameters(), before))
            out[(name, shard, "lr")] = opt.param_groups[0]["lr"]
            out[(name, shard, "as_dcp")] = _states_equal(_whole(opt), plain_opt.state_dict())
            opt.step()
            plain_opt.step()
            out[(name, shard, "stepped_as_dcp")] = \
                _states_equal(_whole(opt), plain_opt.state_dict()) and \
                all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    # an fp16 parameter: torch's Adam turns it into NaN at lr 0 (eps rounds
    # to 0 in fp16); init_state() leaves it as it was
    half = nn.Linear(4, 3).half()
    before = [p.detach().clone() for p in half.parameters()]
    DistributedOptimizer(torch.optim.Adam(half.parameters(), lr=LR)).init_state()
    out["fp16_unchanged"] = all(torch.equal(a, b) for a, b in zip(half.parameters(), before))
    return out


def _loss_of(model):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(11))
    return model(x).square().mean()


def _whole(opt):
    """``state_dict()`` without the sharded mode's fp32 masters (a plain
    optimizer has none); collective with ``shard=True``."""
    whole = opt.state_dict()
    for entry in whole["state"].values():
        entry.pop("master_weight", None)
    return whole


def test_init_state_makes_dcps_state_locally_and_moves_nothing():
    for rank, seen in enumerate(run_ranks(_explicit_init, 2)):
        assert seen["fp16_unchanged"], rank
        for name in _OPTIMIZERS:
            for shard in (False, True):
                where = f"rank {rank}, {name}, shard={shard}"
                if rank == 0:
                    assert seen[(name, shard, "communicated")] == [], where
                assert seen[(name, shard, "unchanged")], where
                assert seen[(name, shard, "lr")] == LR, where
                assert seen[(name, shard, "as_dcp")], where
                assert seen[(name, shard, "stepped_as_dcp")], where


def _unfrozen(rank, world_size):
    """A layer frozen for the first step, unfrozen after it: ``init_state()``
    makes its state and leaves the trained layer's as it was."""
    out = {}
    for shard in (False, True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), shard=shard)
        model[0].requires_grad_(False)
        _loss_of(model).backward()
        opt.step()
        opt.zero_grad()
        model[0].requires_grad_(True)
        trained = _whole(opt)
        opt.init_state()
        now = _whole(opt)
        out[shard] = {
            "trained_kept": all(_states_equal(
                {"param_groups": [], "state": {k: trained["state"][k]}},
                {"param_groups": [], "state": {k: now["state"][k]}}) for k in (2, 3)),
            "steps": {k: float(entry["step"]) for k, entry in now["state"].items()},
            "unfrozen_zero": all(not entry[m].any() for k, entry in now["state"].items()
                                 if k in (0, 1) for m in ("exp_avg", "exp_avg_sq")),
        }
    return out


def test_init_state_keeps_the_state_a_parameter_has():
    for rank, seen in enumerate(run_ranks(_unfrozen, 2)):
        for shard, got in seen.items():
            where = f"rank {rank}, shard={shard}"
            assert got["trained_kept"], where
            # the unfrozen layer (0, 1) gets DCP's state; the trained one
            # keeps its count of the one step it took
            assert got["steps"] == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, where
            assert got["unfrozen_zero"], where


def _warm_up(rank, world_size, mode):
    """A warm-up schedule whose first step is at lr 0, on zero gradients from
    a backward (the loss times 0), then two real steps on one batch for
    every rank; against plain AdamW. The buffer differs per rank before the
    first step: an ordinary step makes it rank 0's."""
    model, plain = _model(), _model()
    model[2].float()
    plain[2].float()
    buffer = torch.zeros(3)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), buffers=[buffer],
                               **MODES[mode])
    buffer.fill_(rank)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, step / 2))
                 for o in (opt, plain_opt)]
    out = {"steps": [], "plain_steps": []}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
    for step in range(3):
        for m in (model, plain):
            loss = m(x).square().mean()
            (loss * 0 if step == 0 else loss).backward()
        opt.step()
        plain_opt.step()
        for s in schedules:
            s.step()
        if step == 0:
            out["buffer"] = buffer.tolist()
        opt.zero_grad()
        plain_opt.zero_grad()
        out["steps"].append(sorted({float(e["step"]) for e in _whole(opt)["state"].values()}))
        out["plain_steps"].append(
            sorted({float(e["step"]) for e in plain_opt.state_dict()["state"].values()}))
    out["same_parameters"] = all(torch.equal(a, b)
                                 for a, b in zip(model.parameters(), plain.parameters()))
    return out


@pytest.mark.parametrize("mode", ["unsharded", "zero1", "zero2"])
def test_a_warm_up_step_at_lr_0_on_zero_gradients_is_an_ordinary_step(mode):
    for rank, seen in enumerate(run_ranks(_warm_up, 2, mode)):
        assert seen["buffer"] == [0.0] * 3, f"rank {rank}: the first step was not a step"
        assert seen["steps"] == seen["plain_steps"] == [[1.0], [2.0], [3.0]], rank
        assert seen["same_parameters"], rank
