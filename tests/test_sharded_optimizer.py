"""DistributedOptimizer(shard=True): ZeRO on the fused buckets.

What "correct" means, and what is checked against it, on 2, 3 and 4 gloo
ranks (one spawn per world size runs every scenario; the tests judge):

- the sharded step is the unsharded one: parameters after several AdamW steps
  equal a reference that all-reduces the same gradients and steps fp32
  masters of 16-bit parameters with plain AdamW (bitwise at 2 ranks, where a
  sum of two is the same in any order; within the rounding of a different
  summation order at 3 and 4 ranks), and the first step's owned gradients are
  within the float64 mean's bound; parameters bitwise identical on every rank;
- each rank's optimizer state is its share (the ranks' shares add up to the
  unsharded state, none above 1/world_size of it plus a bucket's padding);
- options: param_pack=False, "sum", gradient accumulation, fp64 beside fp32,
  master_dtype=bfloat16 (no masters), fused/foreach AdamW, SGD, AdaSum (equal
  to unsharded AdaSum, with local_size and bf16 parameters; the tree stops at
  its halving: the shares add up to the state, no all-gather, the unsharded
  tree's bytes), add_param_group, freezing, a closure, an LR scheduler;
- torch's rules: a parameter no rank gave a gradient is skipped (AdamW's decay
  and step count do not move), exactly as DDP(find_unused_parameters=True)
  leaves it; zero_grad() after a backward makes step() a no-op; GradScaler
  with an inf on one rank skips the step on every rank;
- checkpoints: state_dict() is the unsharded form (equal to the unsharded
  optimizer's), it loads at another world size (a subgroup), into an
  unsharded optimizer and into plain torch, and resuming is the uninterrupted
  run; ``to=`` materialises it on one rank; sharded_state_dict() saves each
  element once, by the rank that holds it, and its files (or dicts, in any
  order) resume the run bitwise and load at smaller world sizes, another
  bucket cap, AdaSum's layout and into and from an unsharded optimizer, equal
  to the whole state dict; a bad save is refused and changes nothing;
- bad input is refused before any collective, and a state dict of another
  model changes nothing.

Rank functions never assert: they return what they saw.
"""
import contextlib
import copy
import math
import os
import tempfile
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedreduce
from fusedreduce import (DistributedGradReducer, DistributedOptimizer,
                         consolidate_sharded_state_dict)
from fusedreduce.buckets import storage_bytes
from fusedreduce.checkpoint_group import DEFAULT_TIMEOUT_S, checkpoint_group
from fusedreduce.sharded_checkpoint import pieces_of
from harness import (COLLECTIVES, FailingBackward, InfOnOneRank,
                     assert_raised_before_any_collective, outcomes_and_collectives,
                     ranks_once_getter, run_ranks)

STEPS = 4
LR = 0.01
TIMEOUT = 400.0
EPS32 = torch.finfo(torch.float32).eps


# ------------------------------------------------------------------ models

def _model(seed=0, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    """Three layers with sizes no world size of 2, 3 or 4 divides, one dtype each."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(),
                          nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    for layer, dtype in zip((model[0], model[2], model[4]), dtypes):
        layer.to(dtype)
    return model


def _loss(model, rank, step, extra=0):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + extra)
    x = torch.randn(4, 7, generator=gen)
    h = model[0](x.to(model[0].weight.dtype))
    h = model[2](model[1](h).to(model[2].weight.dtype))
    return model[4](model[3](h).to(model[4].weight.dtype)).float().square().mean()


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _state_elements(optimizer):
    return sum(v.numel() for entry in optimizer.state.values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _masters_reference(model, make_optimizer, master_dtype):
    """Copies of ``model``'s parameters (16-bit ones in ``master_dtype``)
    stepped by a plain optimizer: what the sharded mode steps, unsharded."""
    masters = [p.detach().to(master_dtype if p.dtype in (torch.float16, torch.bfloat16)
                             else p.dtype).clone() for p in model.parameters()]
    return masters, make_optimizer(masters)


def _step_reference(model, masters, plain, grads):
    for m, g in zip(masters, grads):
        m.grad = g.to(m.dtype)
    plain.step()
    plain.zero_grad()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)


@contextlib.contextmanager
def _issued(events):
    """Append ``(name, first argument)`` of every torch.distributed collective
    issued inside (the functions are restored on exit)."""
    with contextlib.ExitStack() as stack:
        for name in (n for n in COLLECTIVES if hasattr(dist, n)):
            def recording(*args, _real=getattr(dist, name), _name=name, **kwargs):
                events.append((_name, args[0] if args else None))
                return _real(*args, **kwargs)
            stack.enter_context(mock.patch.object(dist, name, recording))
        yield events


def _into_parameters(events, model):
    """How many of ``events`` (``_issued``) are broadcasts straight into the
    memory of one of ``model``'s parameters."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(name == "broadcast" and tensor.untyped_storage().data_ptr() in storages
               for name, tensor in events)


#: the collectives NCCL's process groups get, forced on gloo: a reduce-scatter
#: and an all-gather per bucket
NCCL_COLLECTIVES = {"gradient_collective": "reduce_scatter", "parameter_gather": "all_gather"}


def _masters(optimizer):
    """Elements of this rank's master copies (``"master_weight"`` in its
    ``sharded_state_dict()``)."""
    return sum(piece["slices"]["master_weight"].numel()
               for piece in pieces_of(optimizer.sharded_state_dict()).values()
               if "master_weight" in piece["slices"])


# ---------------------------------------------------------------- scenarios

def _equivalence(rank, world_size, make, *, cap_bytes=300, dtypes=None, passes=1,
                 reduce_method="mean", param_pack=True, reduce_scatter=False,
                 gather_direct=False, nan_buffers=False, **options):
    """Sharded vs the all-reduce reference, ``STEPS`` steps. ``reduce_scatter``:
    NCCL's path (a reduce-scatter and an all-gather per bucket) even on gloo,
    where the reducer all-reduces, as gloo's reduce-scatter does inside, and
    the parameters come back by one broadcast per rank. ``gather_direct``:
    on gloo every bucket of one dtype comes back by one broadcast per tensor
    range straight into the parameters, and on 2 ranks every bucket that is
    neither prescaled nor cast is reduce-scattered by one exchange, as for a
    model of large tensors.
    ``nan_buffers``: the buffers start as NaN (no element the reduction does
    not write may be read)."""
    kwargs = {} if dtypes is None else {"dtypes": dtypes}
    model, reference = _model(**kwargs), _model(**kwargs)
    if reduce_scatter:
        # NCCL's path: a reduce-scatter and an all-gather per bucket, both in place
        options.update(NCCL_COLLECTIVES)
    if gather_direct:
        options["parameter_gather"] = "broadcast_direct"
        options.setdefault("gradient_collective", "exchange")
    optimizer = DistributedOptimizer(make(model.parameters()), reduce_method=reduce_method,
                                     param_pack=param_pack, param_pack_thd=cap_bytes,
                                     backward_passes_per_step=passes, shard=True, **options)
    if nan_buffers:
        for buffer in optimizer.flat_buffers.gradients:
            buffer.fill_(math.nan)
    events = []
    reducer = DistributedGradReducer(list(reference.parameters()),
                                     mean=reduce_method == "mean")
    masters, plain = _masters_reference(reference, make,
                                        options.get("master_dtype", torch.float32))
    seen = {"params": [], "reference": [], "buckets": len(optimizer.layout.plan.buckets),
            "nonfinite": []}
    with _issued(events):
        _train_against_reference(rank, model, reference, optimizer, reducer, masters, plain,
                                 passes, seen)
    names = [name for name, _ in events]
    seen["reduce_scatters"] = sum(e.startswith("reduce_scatter") for e in names)
    seen["all_gathers"] = sum(e.startswith("all_gather") for e in names)
    seen["direct_broadcasts"] = _into_parameters(events, model)
    seen["exchanges"] = names.count("all_to_all_single")
    seen["state"] = _state_elements(optimizer)
    seen["param_numel"] = sum(p.numel() for p in model.parameters())
    seen["padding"] = sum(b.size - sum(b.numels) for b in optimizer.layout.plan.buckets)
    seen["masters"] = _masters(optimizer)
    layout = optimizer.layout
    seen["layout"] = {"ranges": [(r.param, r.start, r.end, r.bucket, r.offset)
                                 for r in layout.ranges],
                      "parts": list(layout.parts), "rank": layout.rank,
                      "world_size": layout.world_size,
                      "shapes": [tuple(p.shape) for p in model.parameters()]}
    return seen


def _train_against_reference(rank, model, reference, optimizer, reducer, masters, plain, passes,
                             seen):
    """``STEPS`` steps of ``optimizer`` and of the all-reduce reference; into
    ``seen`` the parameters of both after each, the first step's local and
    owned gradients, and the largest gradient outside the owned elements."""
    for step in range(STEPS):
        for k in range(passes):
            _loss(model, rank, step, k).backward()
            _loss(reference, rank, step, k).backward()
        if step == 0:
            seen["local"] = [p.grad.double() for p in reference.parameters()]
            seen["owned"] = _owned_grads(optimizer, model)
            seen["outside"] = _largest_not_owned(optimizer, model)
        grads = reducer([p.grad for p in reference.parameters()])
        reference.zero_grad()
        seen["nonfinite"].append(bool(optimizer.reducer.found_nonfinite))
        optimizer.step()
        optimizer.zero_grad()
        _step_reference(reference, masters, plain, grads)
        seen["params"].append(_snapshot(model))
        seen["reference"].append(_snapshot(reference))


def _owned_grads(optimizer, model):
    """(parameter index, start, end, values) of each gradient slice this rank owns."""
    params = list(model.parameters())
    return [(r.param, r.start, r.end,
             params[r.param].grad.detach().reshape(-1)[r.start:r.end].double())
            for r in optimizer.layout.ranges if params[r.param].grad is not None]


def _largest_not_owned(optimizer, model):
    """The largest magnitude in the ``.grad`` elements this rank does not own
    (0.0 where it owns them all)."""
    largest = 0.0
    for i, p in enumerate(model.parameters()):
        if p.grad is None:
            continue
        rest = p.grad.detach().reshape(-1).double().clone()
        owned = optimizer.layout.range_of(i)
        if owned is not None:
            rest[owned.start:owned.end] = 0
        largest = max(largest, float(rest.abs().max()))
    return largest


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True)


class _BytesSent:
    """Counts the bytes this rank hands to torch.distributed's sends and
    collectives (point-to-point sends, all-reduce and all-gather inputs), and
    its all-gathers over the whole world, while active; the functions are
    restored on exit."""

    def __init__(self):
        self.bytes = 0
        self.all_gathers = 0

    def __enter__(self):
        self._real = {name: getattr(dist, name) for name in
                      ("batch_isend_irecv", "send", "all_reduce", "all_gather_into_tensor",
                       "all_gather_single") if hasattr(dist, name)}

        def batch(ops, _real=self._real["batch_isend_irecv"]):
            self.bytes += sum(op.tensor.nbytes for op in ops if op.op.__name__ == "isend")
            return _real(ops)

        def first_tensor(name):
            def counted(*args, _real=self._real[name], **kwargs):
                tensor = args[1] if name.startswith("all_gather") else args[0]
                self.bytes += tensor.nbytes
                whole = dist.get_world_size(kwargs.get("group")) == dist.get_world_size()
                self.all_gathers += name.startswith("all_gather") and whole
                return _real(*args, **kwargs)
            return counted

        dist.batch_isend_irecv = batch
        for name in self._real:
            if name != "batch_isend_irecv":
                setattr(dist, name, first_tensor(name))
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)


def _adasum_pair(rank, world_size, local_size=1, dtypes=(torch.float32,) * 3):
    """AdaSum sharded vs AdaSum unsharded, same model and data (16-bit
    parameters stepped as themselves, master_dtype=bfloat16, as unsharded
    steps them); the bytes each sent in its last step, and the sharded
    state's size."""
    out = {}
    for shard in (True, False):
        model = _model(dtypes=dtypes)
        optimizer = DistributedOptimizer(_sgd(model.parameters()), reduce_method="adasum",
                                         param_pack_thd=300, shard=shard, local_size=local_size,
                                         master_dtype=torch.bfloat16)
        for step in range(STEPS):
            with _BytesSent() as sent:
                _loss(model, rank, step).backward()
                optimizer.step()
            optimizer.zero_grad()
        out["sharded" if shard else "unsharded"] = _snapshot(model)
        out["momenta_" + ("sharded" if shard else "unsharded")] = [
            entry["momentum_buffer"] for _, entry in sorted(optimizer.state_dict()["state"].items())]
        out["sent_" + ("sharded" if shard else "unsharded")] = sent.bytes
        out["all_gathers_" + ("sharded" if shard else "unsharded")] = sent.all_gathers
        if shard:
            out["state"] = _state_elements(optimizer)
            out["param_numel"] = sum(p.numel() for p in model.parameters())
            out["padding_bytes"] = 4 * sum(b.size - sum(b.numels)
                                           for b in optimizer.layout.plan.buckets)
    return out


class _Branchy(nn.Module):
    """A branch no rank uses in odd steps, one only rank 0 uses, a frozen layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.sometimes = nn.Linear(5, 5), nn.Linear(5, 5)
        self.rank0, self.frozen = nn.Linear(5, 5), nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x, step, rank):
        h = self.frozen(self.trunk(x))
        if step % 2 == 0:
            h = self.sometimes(h)
        if rank == 0:
            h = self.rank0(h)
        return h.square().mean()


def _unused_against_ddp(rank, world_size, shard, views=False, find_unused=True,
                        shard_gradients=False):
    """fusedreduce against DDP(find_unused_parameters=True) + AdamW with weight
    decay: bitwise equal at 2 ranks (a mean of two is exact either way). With
    ``find_unused=False``, every gradient DDP leaves None is made zeros before
    torch's step (what the option promises)."""
    ours, theirs = _Branchy(), _Branchy()
    optimizer = DistributedOptimizer(_adamw(ours.parameters()), shard=shard, param_pack_thd=200,
                                     gradient_as_bucket_view=views,
                                     find_unused_parameters=find_unused,
                                     shard_gradients=shard_gradients)
    ddp = nn.parallel.DistributedDataParallel(theirs, find_unused_parameters=True)
    plain = _adamw(theirs.parameters())
    seen = []
    for step in range(STEPS):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(10 * rank + step))
        ours(x, step, rank).backward()
        sometimes_grad = ours.sometimes.weight.grad
        sometimes_grad = None if sometimes_grad is None else sometimes_grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        ddp(x, step, rank).backward()
        if not find_unused:
            for p in theirs.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        plain.step()
        plain.zero_grad()
        state = optimizer.state_dict()["state"]
        seen.append({"equal": [torch.equal(a, b) for a, b in zip(ours.parameters(),
                                                                 theirs.parameters())],
                     "sometimes_grad": sometimes_grad,
                     "sometimes_grad_none": sometimes_grad is None,
                     "params": _snapshot(ours),
                     "step_counts": [float(state[i]["step"]) if i in state else 0.0
                                     for i in range(len(list(ours.parameters())))]})
    return seen


def _unused_not_found(rank, world_size, shard):
    """find_unused_parameters=False against DDP (``_unused_against_ddp``); the
    warnings, and the all-reduces per backward of a model that uses every
    parameter, with the option and without it."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = _unused_against_ddp(rank, world_size, shard, find_unused=False)
    warned = [str(w.message) for w in caught if "had no gradient on this rank" in str(w.message)]

    def all_reduces_per_backward(find_unused):
        model = _model()
        opt = DistributedOptimizer(_adamw(model.parameters()), shard=shard, param_pack_thd=300,
                                   find_unused_parameters=find_unused)
        calls = []
        original = dist.all_reduce
        dist.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            _loss(model, rank, 0).backward()
        finally:
            dist.all_reduce = original
        opt.step()
        return len(calls)

    return {"seen": seen, "warned": warned,
            "all_reduces": {flag: all_reduces_per_backward(flag) for flag in (True, False)}}


def _zero_grad_then_step(rank, world_size):
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300)
    before = _snapshot(model)
    _loss(model, rank, 0).backward()
    optimizer.zero_grad()
    optimizer.step()
    return {"unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
            "state": len(optimizer.state)}


def _deferred_gathers(rank, world_size):
    """overlap_param_gather=True against False: the same losses (the forward
    waits for each layer's bucket) and parameters, step by step; and deferred
    with ``parameter_gather="broadcast_direct"``, which must then gather
    through the buffers: a broadcast straight into a parameter would write it
    while code before the next forward may read it (how many did, in
    ``"direct"``)."""
    runs = []
    for overlap, gather in ((True, None), (False, None), (True, "broadcast_direct")):
        model = _model()
        optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                         param_pack_thd=300, overlap_param_gather=overlap,
                                         parameter_gather=gather)
        seen = {"losses": [], "params": [], "in_flight": [], "direct": 0}
        for step in range(STEPS):
            loss = _loss(model, rank, step)
            loss.backward()
            with _issued([]) as events:
                optimizer.step()
            seen["direct"] += _into_parameters(events, model)
            seen["in_flight"].append(optimizer.param_gather_in_flight)
            optimizer.zero_grad()
            seen["losses"].append(float(loss))
        seen["final_loss"] = float(_loss(model, rank, STEPS))  # the forward finishes them
        seen["in_flight_after_forward"] = optimizer.param_gather_in_flight
        optimizer.finish_param_gather()
        seen["params"] = _snapshot(model)
        runs.append(seen)
    return runs


def _clipping(rank, world_size):
    """clip_grad_norm_ sharded against the whole reduced gradient (the
    unsharded optimizer's, every rank alike) in float64; norm orders 2 and
    inf, and torch's spelling ``'inf'`` with its ``foreach`` argument."""
    seen = {}
    for norm_type in (2.0, math.inf, "inf"):
        sharded_model, whole_model = _model(), _model()
        sharded = DistributedOptimizer(_adamw(sharded_model.parameters()), shard=True,
                                       param_pack_thd=300)
        whole = DistributedOptimizer(_adamw(whole_model.parameters()), param_pack_thd=300)
        _loss(sharded_model, rank, 0).backward()
        _loss(whole_model, rank, 0).backward()
        exact = torch.linalg.vector_norm(
            torch.cat([p.grad.double().reshape(-1) for p in whole_model.parameters()]),
            float(norm_type))
        options = {"foreach": True} if norm_type == "inf" else {}
        total = sharded.clip_grad_norm_(0.05, norm_type, **options)
        after = sharded.clip_grad_norm_(1e9, norm_type, **options)  # the clipped norm
        seen[norm_type] = {"total": total, "exact": float(exact), "after": float(after),
                           "elements": sum(p.numel() for p in whole_model.parameters())}
    refused = {}
    grads = [p.grad.clone() for p in sharded_model.parameters()]
    for name, args, kwargs in (("max_norm_str", ("1",), {}), ("order_zero", (1.0, 0), {}),
                               ("order_negative", (1.0, -1.0), {}),
                               ("foreach_int", (1.0,), {"foreach": 1}),
                               ("error_if_nonfinite_none", (1.0,), {"error_if_nonfinite": None})):
        try:
            sharded.clip_grad_norm_(*args, **kwargs)
            refused[name] = None
        except (TypeError, ValueError) as exc:
            refused[name] = type(exc).__name__
    seen["refused"] = refused
    # math.inf measures and scales by exactly 1: the norm a limit far above
    # it returns, and the gradients unchanged
    seen["measured"] = sharded.clip_grad_norm_(math.inf)
    seen["measured_untouched"] = all(torch.equal(g, p.grad)
                                     for g, p in zip(grads, sharded_model.parameters()))
    seen["far_limit"] = sharded.clip_grad_norm_(1e30)
    seen["untouched"] = all(torch.equal(g, p.grad)
                            for g, p in zip(grads, sharded_model.parameters()))
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300)
    loss = _loss(model, rank, 0) * (math.inf if rank == world_size - 1 else 1.0)
    loss.backward()
    try:
        optimizer.clip_grad_norm_(1.0, error_if_nonfinite=True)
        seen["error"] = None
    except RuntimeError as exc:
        seen["error"] = str(exc)
    return seen


def _masters_follow_parameters(rank, world_size):
    """Parameters edited between steps: in place (a version counter moves),
    through ``.data`` (none does: ``reload_master_weights``)."""
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300)
    _loss(model, rank, 0).backward()
    optimizer.step()
    optimizer.zero_grad()
    weight = model[2].weight  # bfloat16: stepped through fp32 masters
    seen = {}
    with torch.no_grad():
        weight.copy_(torch.full_like(weight, 0.5))
    optimizer.step()  # no gradients: nothing stepped, the parts gathered back
    seen["in_place"] = bool((weight == 0.5).all())
    weight.data.fill_(0.25)
    optimizer.reload_master_weights()
    optimizer.step()
    seen["through_data_reloaded"] = bool((weight == 0.25).all())
    _loss(model, rank, 1).backward()
    optimizer.step()
    seen["stepped_from_there"] = float((weight.float() - 0.25).abs().max())
    return seen


def _grad_scaler(rank, world_size, **options):
    """An inf in one element of one rank's gradient in step 1."""
    model = _model(dtypes=(torch.float32,) * 3)
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300,
                                     **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    target = list(model.parameters())[2]  # the second layer's weight
    poison = InfOnOneRank(rank, world_size)
    target.register_hook(poison)
    seen = []
    for step in range(3):
        poison.step = step
        before = _snapshot(model)
        scaler.scale(_loss(model, rank, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append({"changed": any(not torch.equal(a, b) for a, b in zip(before,
                                                                          model.parameters())),
                     "scale": float(scaler.get_scale()), "params": _snapshot(model)})
    return seen


def _two_more_steps(model, optimizer, rank):
    """Steps 2 and 3 of the checkpoint scenarios' run; the parameters after them."""
    for step in range(2, 4):
        _loss(model, rank, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _snapshot(model)


def _resumed(model_state, rank, load, shard=True):
    """A fresh model given ``model_state`` and a fresh (sharded) optimizer
    (lr 1.0, which the checkpoint's must replace) loaded by ``load(model,
    opt)``, stepped as the run: the optimizer, its loaded lr, the parameters."""
    resumed = _model(seed=5)
    resumed.load_state_dict(model_state)
    again = DistributedOptimizer(torch.optim.AdamW(resumed.parameters(), lr=1.0),
                                 shard=shard, param_pack_thd=300)
    load(resumed, again)
    lr = again.param_groups[0]["lr"]
    return again, lr, _two_more_steps(resumed, again, rank)


def _checkpoints(rank, world_size):
    """Save from the world; resume; load at other world sizes (subgroups),
    into an unsharded optimizer and into plain torch."""
    out = {}
    make = _adamw
    model = _model()
    optimizer = DistributedOptimizer(make(model.parameters()), shard=True, param_pack_thd=300)
    twin = _model()
    unsharded = DistributedOptimizer(make(twin.parameters()), param_pack_thd=300)
    for step in range(2):
        _loss(model, rank, step).backward()
        _loss(twin, rank, step).backward()
        optimizer.step()
        unsharded.step()
        optimizer.zero_grad()
        unsharded.zero_grad()
        if step == 0:
            # the fp32 layer after one step (later, the 16-bit layers, stepped
            # through masters here and as themselves there, feed it other values)
            first, plain_first = optimizer.state_dict(), unsharded.state_dict()
            out["equal_to_unsharded"] = all(
                torch.equal(first["state"][i][k], v) for i, entry in
                plain_first["state"].items() if i in (0, 1) for k, v in entry.items())
    plain_form = unsharded.state_dict()
    saved = optimizer.state_dict()
    out["keys"] = {k: sorted(v) for k, v in saved["state"].items()}
    out["shapes_match"] = all(
        v.shape == p.shape for p, entry in zip(model.parameters(), saved["state"].values())
        for k, v in entry.items() if k != "step")
    only_on_0 = optimizer.state_dict(to=0)
    out["to_0"] = only_on_0 is None if rank else _dicts_equal(only_on_0, saved)
    # on the host (where the CPU suite's state already is: the values and
    # where they sit are checked on the device in test_cuda.py)
    offloaded, offloaded_to_0 = (optimizer.state_dict(cpu_offload=True),
                                 optimizer.state_dict(to=0, cpu_offload=True))
    out["cpu_offload"] = (_dicts_equal(offloaded, saved) and
                          (offloaded_to_0 is None if rank else
                           _dicts_equal(offloaded_to_0, saved)) and
                          _dicts_equal(unsharded.state_dict(cpu_offload=True), plain_form))
    # load_state_dict keeps the rank's part of a whole dict before anything
    # moves: summed over the ranks, every per-element value's element once
    def elements(state_dict):
        return sum(v.numel() for entry in state_dict["state"].values()
                   for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    own = [None] * world_size
    dist.all_gather_object(own, elements(optimizer.sharded.own_part(saved)))
    out["own_part_once"] = sum(own) == elements(saved) and (world_size == 1 or
                                                             max(own) < elements(saved))
    # without sharding too, to=k gives the dict to rank k only: one save in both modes
    plain_to_0 = unsharded.state_dict(to=0, cpu_offload=True)
    out["unsharded_to_0"] = plain_to_0 is None if rank else _dicts_equal(plain_to_0, plain_form)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    out["uninterrupted"] = _two_more_steps(model, optimizer, rank)
    # a copy: torch's load keeps the dict's step tensors, and steps count on in them
    _, out["lr_loaded"], out["resumed"] = _resumed(
        model_state, rank, lambda _, again: again.load_state_dict(copy.deepcopy(saved)))
    # another world size: the first k ranks load and give the same dict back
    for k in range(1, world_size):
        group = dist.new_group(list(range(k)))
        if rank < k:
            small = _model()
            smaller = DistributedOptimizer(make(small.parameters()), group=group, shard=True,
                                           param_pack_thd=300, bcast_period=-1)
            smaller.load_state_dict(copy.deepcopy(saved))
            out[f"round_trip_{k}"] = _dicts_equal(smaller.state_dict(), saved)
            out[f"state_{k}"] = _state_elements(smaller)
    # into an unsharded DistributedOptimizer and into plain torch
    flat = _model()
    into_unsharded = DistributedOptimizer(make(flat.parameters()), param_pack_thd=300)
    into_unsharded.load_state_dict(copy.deepcopy(saved))
    out["unsharded_has_masters"] = any("master_weight" in e for e in
                                       into_unsharded.state_dict()["state"].values())
    into_plain = make(_model().parameters())
    into_plain.load_state_dict(copy.deepcopy(saved))
    out["plain_loaded"] = len(into_plain.state)
    # an unsharded checkpoint into a sharded optimizer
    from_unsharded = DistributedOptimizer(make(_model().parameters()), shard=True,
                                          param_pack_thd=300)
    from_unsharded.load_state_dict(copy.deepcopy(plain_form))
    out["from_unsharded"] = _dicts_equal(
        from_unsharded.state_dict(), plain_form, skip=("master_weight",))
    return out


def _gathered_in_rounds(rank, world_size):
    """The collective state_dict()'s gather (``gather_parts``) in many
    rounds of a few bytes (cutting elements apart; ranks holding different
    byte counts), on the optimizer's checkpoint group, to every rank and to
    one: per case,
    whether the state put together is bitwise (dtypes too) the one-round
    gather's, and None where the rank gets nothing."""
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300)
    for step in range(2):
        _loss(model, rank, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    sharded = optimizer.sharded
    part = sharded.part_to_send(optimizer.state)
    # the optimizer's own: one group per (process group, timeout)
    checkpoint = checkpoint_group(None, timedelta(seconds=DEFAULT_TIMEOUT_S))
    want = sharded.whole_state(sharded.gather_parts(part, checkpoint))
    sizes = [None] * world_size
    dist.all_gather_object(sizes, sum(t.numel() * t.element_size() for entry in
                                      part["state"]["slices"].values() for t in entry["data"]))
    seen = {"sizes": sizes}
    for chunk in (7, 100, 10 ** 6):
        for to in (None, world_size - 1):
            parts = sharded.gather_parts(part, checkpoint, to, chunk_bytes=chunk)
            if to is not None and rank != to:
                seen[(chunk, to)] = None if parts is None else "got parts"
                continue
            got = sharded.whole_state(parts)
            seen[(chunk, to)] = list(got) == list(want) and all(
                list(got[p]) == list(entry) and all(
                    not isinstance(v, torch.Tensor) or
                    (got[p][k].dtype == v.dtype and torch.equal(got[p][k], v))
                    for k, v in entry.items())
                for p, entry in want.items())
    return seen


def _sharded_checkpoints(rank, world_size):
    """sharded_state_dict(): each rank's own elements, saved per rank (as
    dicts and as files read with mmap), put together, resumed from, loaded
    at other world sizes and bucket caps, into and from an unsharded
    optimizer; bad saves refused before anything changes."""
    out = {}
    model, twin = _model(), _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True, param_pack_thd=300)
    unsharded = DistributedOptimizer(_adamw(twin.parameters()), param_pack_thd=300)
    for step in range(2):
        for m, o in ((model, optimizer), (twin, unsharded)):
            _loss(m, rank, step).backward()
            o.step()
            o.zero_grad()
    whole, plain_form = optimizer.state_dict(), unsharded.state_dict()
    own = optimizer.sharded_state_dict()
    out["own"] = own  # put together by the test process, which has no process group
    out["whole"] = whole
    shards = [None] * world_size
    dist.all_gather_object(shards, own)
    kept = copy.deepcopy(shards)
    out["consolidated"] = _dicts_equal(consolidate_sharded_state_dict(shards), whole)
    directory = [tempfile.mkdtemp(prefix="sharded-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    torch.save(own, os.path.join(directory[0], f"optim.{rank}.pt"))
    dist.barrier()
    # in any order
    files = [os.path.join(directory[0], f"optim.{r}.pt") for r in reversed(range(world_size))]
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    out["uninterrupted"] = _two_more_steps(model, optimizer, rank)
    again, out["lr_loaded"], out["resumed"] = _resumed(
        model_state, rank, lambda _, again: again.load_sharded_state_dict(files))
    # another bucket cap; the loaded state is the optimizer's own: stepping
    # it leaves the save alone
    other_model = _model()
    other = DistributedOptimizer(_adamw(other_model.parameters()), shard=True,
                                 param_pack_thd=100)
    other.load_sharded_state_dict(shards)
    out["other_cap"] = _dicts_equal(other.state_dict(), whole)
    _loss(other_model, rank, 9).backward()
    other.step()
    out["save_untouched"] = all(_pieces_equal(a, b) for a, b in zip(shards, kept))
    # the first k ranks: another world size, another bucket cap
    for k in range(1, world_size):
        group = dist.new_group(list(range(k)))
        if rank < k:
            smaller = DistributedOptimizer(_adamw(_model().parameters()), group=group,
                                           shard=True, param_pack_thd=200, bcast_period=-1)
            smaller.load_sharded_state_dict(files)
            out[f"round_trip_{k}"] = _dicts_equal(smaller.state_dict(), whole)
    # AdaSum's layout: each rank owns the slice its tree's halving leaves it
    adasum = DistributedOptimizer(_adamw(_model().parameters()), shard=True,
                                  reduce_method="adasum", param_pack_thd=300)
    adasum.load_sharded_state_dict(shards)
    out["into_adasum"] = _dicts_equal(adasum.state_dict(), whole)
    adasum_shards = [None] * world_size
    dist.all_gather_object(adasum_shards, adasum.sharded_state_dict())
    out["adasum_consolidated"] = _dicts_equal(consolidate_sharded_state_dict(adasum_shards),
                                              whole)
    # into an unsharded optimizer: what loading the whole dict gives
    into_unsharded = DistributedOptimizer(_adamw(_model().parameters()), param_pack_thd=300)
    into_unsharded.load_sharded_state_dict(shards)
    by_whole = DistributedOptimizer(_adamw(_model().parameters()), param_pack_thd=300)
    by_whole.load_state_dict(copy.deepcopy(whole))
    out["into_unsharded"] = _dicts_equal(into_unsharded.state_dict(), by_whole.state_dict())
    # an unsharded save: each rank writes a share of the parameters
    unsharded_own = unsharded.sharded_state_dict()
    out["unsharded_own"] = unsharded_own
    out["unsharded_own_whole"] = plain_form
    unsharded_shards = [None] * world_size
    dist.all_gather_object(unsharded_shards, unsharded_own)
    out["unsharded_consolidated"] = _dicts_equal(
        consolidate_sharded_state_dict(unsharded_shards), plain_form)
    from_unsharded = DistributedOptimizer(_adamw(_model().parameters()), shard=True,
                                          param_pack_thd=300)
    from_unsharded.load_sharded_state_dict(unsharded_shards)
    out["from_unsharded"] = _dicts_equal(from_unsharded.state_dict(), plain_form,
                                         skip=("master_weight",))
    # bad saves: refused with the error, and nothing changed
    before = again.state_dict()
    moved = copy.deepcopy(shards)
    if moved[0]["state"]["start"]:
        moved[0]["state"]["start"][0] += 1
    bad = {
        "one_dict": own,
        "empty": [],
        "rank_twice": shards + [shards[0]],
        "whole_dict": [whole],
        "not_a_dict": [1],
        "another_model": [{**s, "shapes": [[99]] + s["shapes"][1:]} for s in shards],
        "piece_moved": moved,
    }
    if world_size > 1:
        bad["rank_missing"] = shards[1:]
    out["bad"] = {}
    for name, value in bad.items():
        try:
            again.load_sharded_state_dict(value)
            out["bad"][name] = None
        except (TypeError, ValueError) as e:
            out["bad"][name] = (type(e).__name__, str(e))
    out["unchanged_after_bad"] = _dicts_equal(again.state_dict(), before)
    return out


def _torch_checkpoint(rank, world_size, shard):
    """torch.distributed.checkpoint as FSDP2 users save and resume:
    ``get_state_dict`` of a fresh optimizer (which steps it once on zero
    gradients at lr 0 to make its state) and after two steps, ``dcp.save``,
    then a fresh model and optimizer through ``get_state_dict``,
    ``dcp.load`` and ``set_state_dict``, stepped on; and a sharded rank that
    owns nothing, whose state alone is empty (DCP initialises it alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    out = {}
    directory = [tempfile.mkdtemp(prefix="torch-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=shard,
                                     param_pack_thd=300)
    before = _snapshot(model)
    _, fresh = get_state_dict(model, optimizer)
    out["fresh_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out["fresh_steps"] = sorted({float(entry["step"]) for entry in fresh["state"].values()})
    for step in range(2):
        _loss(model, rank, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory[0])
    out["uninterrupted"] = _two_more_steps(model, optimizer, rank)

    def load(resumed, again):
        state = dict(zip(("model", "optim"), get_state_dict(resumed, again)))
        dcp.load(state, checkpoint_id=directory[0])
        set_state_dict(resumed, again, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    # from other weights than the run's: the model's come from the checkpoint too
    _, out["lr_loaded"], out["resumed"] = _resumed(_model(seed=7).state_dict(), rank, load,
                                                   shard=shard)
    # one parameter of one element: with shard=True one rank owns it, the other nothing
    tiny = nn.Linear(1, 1, bias=False)
    tiny_optimizer = DistributedOptimizer(_adamw(tiny.parameters()), shard=shard)
    tiny(torch.ones(1, 1)).sum().backward()
    tiny_optimizer.step()
    tiny_optimizer.zero_grad()
    out["tiny_owns"] = bool(tiny_optimizer.state)
    _, tiny_state = get_state_dict(tiny, tiny_optimizer)
    out["tiny_state"] = tiny_state["state"]
    return out


def _pieces_equal(a, b):
    """Two sharded state dicts, equal bit for bit."""
    a_pieces, b_pieces = pieces_of(a), pieces_of(b)
    if set(a_pieces) != set(b_pieces) or a["param_groups"] != b["param_groups"]:
        return False
    for index, piece in a_pieces.items():
        other = b_pieces[index]
        if (piece["start"], piece["end"]) != (other["start"], other["end"]):
            return False
        for kind in ("slices", "values"):
            for key, value in piece[kind].items():
                if not torch.equal(value, other[kind][key]):
                    return False
    return True


def _dicts_equal(a, b, skip=()):
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    for i, entry in a["state"].items():
        keys = set(entry) - set(skip)
        if keys != set(b["state"][i]) - set(skip):
            return False
        for k in keys:
            x, y = entry[k], b["state"][i][k]
            if isinstance(x, torch.Tensor):
                if not torch.equal(x, y.to(x.dtype)):
                    return False
            elif x != y:
                return False
    return True


def _structure_changes(rank, world_size, shard):
    """add_param_group, freezing and unfreezing, a closure, an LR scheduler,
    a broadcast every 2 steps and a pass accumulated inside no_sync()."""
    torch.manual_seed(0)
    body, head = nn.Linear(6, 7), nn.Linear(7, 3)
    optimizer = DistributedOptimizer(_adamw(body.parameters()), shard=shard, param_pack_thd=100,
                                     bcast_period=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def loss_of(step):
        gen = torch.Generator().manual_seed(10 * rank + step)
        return head(body(torch.randn(5, 6, generator=gen))).square().mean()

    def closure_for(step):
        def closure():
            loss = loss_of(step)
            loss.backward()
            return loss
        return closure

    losses = []
    for step in range(6):
        if step == 1:
            optimizer.add_param_group({"params": head.parameters(), "lr": 0.02})
        if step == 2:
            body.weight.requires_grad_(False)
        if step == 3:
            body.weight.requires_grad_(True)
        if step == 5:
            with optimizer.no_sync():
                loss_of(100 + step).backward()
        losses.append(float(optimizer.step(closure_for(step))))
        optimizer.zero_grad()
        scheduler.step()
    return {"params": [p.detach().clone() for p in (*body.parameters(), *head.parameters())],
            "losses": losses}


def on_rank(rank, world_size):
    results = {
        "adamw": _equivalence(rank, world_size, _adamw),
        "adamw_fused": _equivalence(rank, world_size, _adamw_fused,
                                    dtypes=(torch.float32,) * 3),
        "adamw_reduce_scatter": _equivalence(rank, world_size, _adamw, reduce_scatter=True),
        "adamw_direct": _equivalence(rank, world_size, _adamw, gather_direct=True),
        "adamw_direct_grads_sharded": _equivalence(rank, world_size, _adamw, gather_direct=True,
                                                   shard_gradients=True),
        # fp32 buckets, not prescaled: on 2 gloo ranks each is reduce-scattered
        # by one exchange of the ranks' elements (two passes: the sent
        # gradients are the accumulated ones; the padding read as zeros)
        "fp32_direct_accumulation": _equivalence(rank, world_size, _adamw, gather_direct=True,
                                                 dtypes=(torch.float32,) * 3, passes=2,
                                                 nan_buffers=True),
        "sgd_unpacked_sum": _equivalence(rank, world_size, _sgd, param_pack=False,
                                         reduce_method="sum"),
        "accumulation_fp64": _equivalence(rank, world_size, _adamw, passes=2,
                                          dtypes=(torch.float64, torch.float32, torch.float32)),
        "bf16_without_masters": _equivalence(rank, world_size, _adamw, cap_bytes=10 ** 6,
                                             master_dtype=torch.bfloat16),
        "adasum": _adasum_pair(rank, world_size),
        # bf16 parameters: the tree's swaps gather them as bf16
        "adasum_bf16": _adasum_pair(rank, world_size,
                                    dtypes=(torch.float32, torch.bfloat16, torch.bfloat16)),
        # blocks of 2 in a world of 2 (one block) and of 4 (two); one block of 3
        "adasum_local": _adasum_pair(rank, world_size, local_size=3 if world_size == 3 else 2)
        if world_size > 1 else None,
        "zero_grad": _zero_grad_then_step(rank, world_size),
        "masters_follow": _masters_follow_parameters(rank, world_size),
        "deferred": _deferred_gathers(rank, world_size),
        "clipping": _clipping(rank, world_size),
        "scaler": _grad_scaler(rank, world_size),
        "scaler_grads_sharded": _grad_scaler(rank, world_size, shard_gradients=True),
        "adamw_grads_sharded": _equivalence(rank, world_size, _adamw, shard_gradients=True),
        "accumulation_grads_sharded": _equivalence(
            rank, world_size, _adamw, passes=2, shard_gradients=True,
            dtypes=(torch.float64, torch.float32, torch.float32)),
        "grads_sharded": _grads_sharded(rank, world_size),
        "grads_sharded_tiny": _grads_sharded_tiny(rank, world_size),
        "grads_sharded_failure": _grads_sharded_after_a_failed_backward(rank, world_size),
    }
    if world_size == 2:
        results["unused_sharded"] = _unused_against_ddp(rank, world_size, True)
        results["unused_unsharded"] = _unused_against_ddp(rank, world_size, False)
        results["unused_bucket_views"] = _unused_against_ddp(rank, world_size, False, views=True)
        results["unused_grads_sharded"] = _unused_against_ddp(rank, world_size, True,
                                                              shard_gradients=True)
        results["unfound_sharded"] = _unused_not_found(rank, world_size, True)
        results["unfound_unsharded"] = _unused_not_found(rank, world_size, False)
        results["structure"] = [_structure_changes(rank, world_size, shard)
                                for shard in (True, False)]
        results["torch_checkpoint"] = [_torch_checkpoint(rank, world_size, shard)
                                       for shard in (True, False)]
    results["checkpoints"] = _checkpoints(rank, world_size)
    results["gather_rounds"] = _gathered_in_rounds(rank, world_size)
    results["sharded_checkpoints"] = _sharded_checkpoints(rank, world_size)
    results["buffer_bytes"] = _buffer_bytes(rank, world_size)
    return results


#: the options ``_grads_sharded`` runs with and without shard_gradients
GRADS_SHARDED_OPTIONS = {
    "mean": {},
    "sum_unpacked": {"reduce_method": "sum", "param_pack": False},
    "clipped": {"max_grad_norm": 0.5},
    "clipped_inf": {"max_grad_norm": 0.5, "norm_type": math.inf},
    "adasum": {"reduce_method": "adasum"},
    "accumulation": {"backward_passes_per_step": 2},
    "bf16_masters": {"master_dtype": torch.bfloat16},
    "reduce_scatter": NCCL_COLLECTIVES,  # forced on gloo
}


def _grads_sharded(rank, world_size):
    """shard_gradients=True against shard=True alone, from the same start with
    the same batches, for each of ``GRADS_SHARDED_OPTIONS``: the parameters
    after each step and the owned elements of each ``.grad``; which
    parameters keep a ``.grad`` and its bytes; whether the gradients of the
    last layer were released before backward reached the first layer."""
    seen = {}
    for name, options in GRADS_SHARDED_OPTIONS.items():
        options = dict(options)
        passes = options.get("backward_passes_per_step", 1)
        models = [_model(), _model()]
        optimizers = [DistributedOptimizer(_adamw(m.parameters()), shard=True,
                                           param_pack_thd=300, shard_gradients=sharded,
                                           **options)
                      for m, sharded in zip(models, (False, True))]
        released_early = []

        def note_release(grad, model=models[1]):
            released_early.append(all(p.grad is None for p in model[4].parameters()))
            return grad
        record = {"params_equal": [], "owned_equal": [], "held": [], "owns": [],
                  "grad_bytes": [], "full_grad_bytes": []}
        for step in range(STEPS):
            for k in range(passes):
                for i, model in enumerate(models):
                    if i == 1 and k == passes - 1:
                        # the first layer's output: its gradient comes after
                        # the last layers' parameters' gradients
                        handle = model[0].register_forward_hook(
                            lambda mod, args, out: out.register_hook(note_release) and None)
                        _loss(model, rank, step, k).backward()
                        handle.remove()
                    else:
                        _loss(model, rank, step, k).backward()
            zero1, zero2 = models
            owned_equal = True
            layout = optimizers[1].layout
            for i, (a, b) in enumerate(zip(zero1.parameters(), zero2.parameters())):
                r = layout.range_of(i)
                if r is not None and b.grad is not None:
                    owned_equal &= torch.equal(a.grad.reshape(-1)[r.start:r.end],
                                               b.grad.reshape(-1)[r.start:r.end])
                    # zeros outside the owned elements of a parameter a boundary cuts
                    rest = torch.cat([b.grad.reshape(-1)[:r.start],
                                      b.grad.reshape(-1)[r.end:]])
                    owned_equal &= bool((rest == 0).all())
            record["owned_equal"].append(owned_equal)
            record["held"].append([p.grad is not None for p in zero2.parameters()])
            record["owns"].append([layout.range_of(i) is not None
                                   for i in range(len(list(zero2.parameters())))])
            record["grad_bytes"].append(storage_bytes(
                [p.grad for p in zero2.parameters() if p.grad is not None]))
            record["full_grad_bytes"].append(storage_bytes(
                [p.grad for p in zero1.parameters() if p.grad is not None]))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            record["params_equal"].append(all(torch.equal(a, b) for a, b in
                                              zip(zero1.parameters(), zero2.parameters())))
        record["released_early"] = released_early
        record["params"] = _snapshot(models[1])
        seen[name] = record
    return seen


def _grads_sharded_tiny(rank, world_size):
    """A model smaller than the ranks' parts (some rank owns nothing) with a
    GradScaler and an inf on the last rank in step 1: every rank steps, or
    skips, alike, as shard=True alone."""
    out = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                         shard_gradients=sharded)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        held, params = [], []
        for step in range(3):
            x = torch.randn(3, 2, generator=torch.Generator().manual_seed(rank + 10 * step))
            if rank == world_size - 1 and step == 1:
                x[0, 0] = float("inf")
            scaler.scale(model(x).square().mean()).backward()
            held.append(sum(p.grad is not None for p in model.parameters()))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            params.append(_snapshot(model))
        out.append({"held": held, "params": params, "scale": float(scaler.get_scale()),
                    "owned": sum(r.numel for r in optimizer.layout.ranges)})
    return out


def _failing_loss(model, rank, step):
    """``_loss`` with a backward that raises once the last layers' gradients
    are made (their buckets have started), before the first layer's."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * rank + 10 * step))
    h = FailingBackward.apply(model[0](x.to(model[0].weight.dtype)))
    h = model[2](model[1](h).to(model[2].weight.dtype))
    return model[4](model[3](h).to(model[4].weight.dtype)).float().square().mean()


def _grads_sharded_after_a_failed_backward(rank, world_size):
    """shard_gradients=True against shard=True alone when the second step's
    first backward raises after some buckets started (then the step is done
    again, after zero_grad): per collective path, the parameters after each
    step, the buckets in flight the failure left, what each error said and
    ``buffer_bytes`` after each step's good backward."""
    seen = {}
    for path in ("gloo", "reduce_scatter"):
        models = [_model(), _model()]
        options = NCCL_COLLECTIVES if path == "reduce_scatter" else {}
        optimizers = [DistributedOptimizer(_adamw(m.parameters()), shard=True,
                                           param_pack_thd=300, shard_gradients=sharded,
                                           **options)
                      for m, sharded in zip(models, (False, True))]
        record = {"params_equal": [], "held": [], "errors": [], "started_then_failed": None}
        for step in range(3):
            for model, optimizer in zip(models, optimizers):
                if step == 1:
                    with _issued([]) as started:
                        try:
                            _failing_loss(model, rank, step).backward()
                        except RuntimeError as exc:
                            record["errors"].append(str(exc))
                    if optimizer.shard_gradients:
                        # one collective per bucket started: the last one or
                        # two are left in flight (a bucket's is waited for
                        # when the bucket after next starts, the last ones
                        # when backward ends)
                        record["started_then_failed"] = len(started)
                    optimizer.zero_grad()
                _loss(model, rank, step).backward()
                if optimizer.shard_gradients:
                    record["held"].append(optimizer.buffer_bytes)
                optimizer.step()
                optimizer.zero_grad()
            record["params_equal"].append(all(torch.equal(a, b) for a, b in
                                              zip(models[0].parameters(),
                                                  models[1].parameters())))
        seen[path] = record
    return seen


def _buffer_bytes(rank, world_size):
    """``buffer_bytes`` of an unsharded, a bucket-view and a sharded optimizer
    before and after a step, with what the plans say they hold."""
    seen = {}
    for mode in ("unsharded", "bucket_views", "sharded"):
        model = _model()
        optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=mode == "sharded",
                                         gradient_as_bucket_view=mode == "bucket_views",
                                         param_pack_thd=300)
        before = optimizer.buffer_bytes
        _loss(model, rank, 0).backward()
        optimizer.step()
        buckets = optimizer.reducer.plan.buckets
        grads = [p.grad for p in model.parameters()]
        seen[mode] = {
            "before": before, "after": optimizer.buffer_bytes,
            "n_buckets": len(buckets),
            "bucket_bytes": sum(b.size * b.dtype.itemsize for b in buckets),
            "part_bytes": sum(getattr(b, "part_size", 0) * b.dtype.itemsize for b in buckets),
            "elements": sum(p.numel() for p in model.parameters()),
            "grads_in_buffers": storage_bytes(_flat_buffers(optimizer) + grads)
            == optimizer.buffer_bytes}
    seen["grads_sharded"] = _buffers_of_sharded_gradients(rank)
    return seen


def _flat_buffers(optimizer):
    """Every flat buffer ``optimizer`` holds."""
    held = optimizer.flat_buffers
    return [b for b in (*held.gradients, *held.calls, *held.views, *held.parts, *held.gathers)
            if b is not None]


def _gather_dtype(dtypes):
    """The dtype a bucket of parameters of ``dtypes`` is all-gathered in: the
    widest, fp32 for fp16 beside bf16 (it carries each exactly)."""
    if len(dtypes) == 1:
        return next(iter(dtypes))
    widest = max(dtypes, key=lambda d: d.itemsize)
    return torch.float32 if widest.itemsize == 2 else widest


def _buffers_of_sharded_gradients(rank):
    """``buffer_bytes`` of a ``shard_gradients`` optimizer whose all-gather
    overlaps the next forward, at each point of two steps: what it holds,
    and what a bucket's buffer and its all-gather buffer would take; the
    whole buffers with memory as each bucket is flattened, and the bytes
    held at each write-back launch against those of the parts not written
    yet."""
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                     shard_gradients=True, overlap_param_gather=True,
                                     param_pack_thd=300)
    layout = optimizer.layout
    during, starts, writes, objects = [], [], [], []
    # the first layer's gradient is the last one made: later buckets have
    # started by then
    model[0].bias.register_hook(lambda grad: during.append(optimizer.buffer_bytes))
    held = {"built": optimizer.buffer_bytes}
    buckets = layout.plan.buckets
    unflatten = fusedreduce.kernels.unflatten_cast_scale
    flatten = fusedreduce.kernels.flatten_cast_scale

    def part_bytes(index):
        # the last two buckets' parts are slots of their buffers, still
        # in flight when backward ends
        bucket = buckets[index]
        if dist.get_world_size() > 1 and index >= len(buckets) - 2:  # _ALIVE
            return bucket.size * bucket.dtype.itemsize
        lo, hi = layout.parts[index]
        return (hi - lo) * bucket.dtype.itemsize

    def written(part, *args, **kwargs):
        index = next(i for i, p in enumerate(optimizer.flat_buffers.parts) if p is part)
        unwritten = sum(part_bytes(i) for i in range(index, len(buckets)))
        writes[-1].append((optimizer.buffer_bytes, unwritten))
        return unflatten(part, *args, **kwargs)

    def flattening(*args, **kwargs):
        # each bucket's flatten into its buffer (or its part, on one rank)
        starts[-1].append(sum(b.untyped_storage().nbytes() > 0
                              for b in optimizer.flat_buffers.gradients if b is not None))
        return flatten(*args, **kwargs)

    for step in range(2):
        optimizer.zero_grad()
        writes.append([])
        starts.append([])
        with mock.patch.object(fusedreduce.kernels, "unflatten_cast_scale", written), \
                mock.patch.object(fusedreduce.kernels, "flatten_cast_scale", flattening):
            _loss(model, rank, step).backward()
        held[f"backward_{step}"] = optimizer.buffer_bytes
        optimizer.step()
        held[f"gathering_{step}"] = optimizer.buffer_bytes
        optimizer.finish_param_gather()
        held[f"gathered_{step}"] = optimizer.buffer_bytes
        kept = optimizer.flat_buffers
        objects.append([*map(id, kept.gradients), *map(id, kept.parts), *map(id, kept.gathers)])
    specs = layout.plan.specs
    gathers = [_gather_dtype({specs[slot].dtype for slot in b.tensor_indices}) for b in buckets]
    return {**held, "during": during, "writes": writes, "starts": starts,
            "gathered_in_turn": _gather_buffers_in_turn(rank),
            "same_objects": objects[0] == objects[1],
            "written_buckets": len({r.bucket for r in layout.ranges}),
            "bucket_bytes": sum(b.size * b.dtype.itemsize for b in buckets),
            "gather_bytes": sum(b.size * d.itemsize for b, d in zip(buckets, gathers))}


def _gather_buffers_in_turn(rank):
    """A ``shard_gradients`` optimizer gathering in ``step()`` (not
    deferred): per step, the all-gather buffers with memory as each bucket
    is written into the parameters, and ``buffer_bytes`` after the step."""
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                     shard_gradients=True, param_pack_thd=300)
    seen = {"alive": [], "after": []}
    unflatten = fusedreduce.kernels.unflatten_cast_scale

    def writing(*args, **kwargs):
        seen["alive"][-1].append(sum(f.untyped_storage().nbytes() > 0
                                     for f in optimizer.flat_buffers.gathers if f is not None))
        return unflatten(*args, **kwargs)

    for step in range(2):
        seen["alive"].append([])
        _loss(model, rank, step).backward()
        with mock.patch.object(fusedreduce.kernels, "unflatten_cast_scale", writing):
            optimizer.step()
        optimizer.zero_grad()
        seen["after"].append(optimizer.buffer_bytes)
    return seen


def _compiled(rank, world_size):
    """A torch.compile'd model: sharded and unsharded steps, bitwise alike."""
    out = []
    for shard in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
        optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=shard,
                                         param_pack_thd=200)
        compiled = torch.compile(model)
        for step in range(3):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * rank + step))
            compiled(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append(_snapshot(model))
    return out


def test_a_compiled_model_steps_as_unsharded():
    for rank, (sharded, unsharded) in enumerate(run_ranks(_compiled, 2, timeout=TIMEOUT)):
        _assert_bitwise(sharded, unsharded, f"rank {rank}")


def _bad_arguments(rank, world_size):
    class Custom(torch.optim.AdamW):
        pass

    def wrap(optimizer_class=torch.optim.AdamW, **kwargs):
        return lambda: DistributedOptimizer(
            optimizer_class(nn.Linear(3, 2).parameters(), lr=0.1), shard=True, **kwargs)
    return outcomes_and_collectives({
        "lbfgs": wrap(torch.optim.LBFGS),
        "unknown subclass": wrap(Custom),
        "integer master_dtype": wrap(master_dtype=torch.int32),
        "master_dtype not a dtype": wrap(master_dtype="float32"),
        "bucket views": wrap(gradient_as_bucket_view=True),
        "overlap without shard": lambda: DistributedOptimizer(
            torch.optim.AdamW(nn.Linear(3, 2).parameters()), overlap_param_gather=True),
        "shard not a bool": lambda: DistributedOptimizer(
            torch.optim.AdamW(nn.Linear(3, 2).parameters()), shard="yes"),
        "shard_gradients without shard": lambda: DistributedOptimizer(
            torch.optim.AdamW(nn.Linear(3, 2).parameters()), shard_gradients=True),
        "shard_gradients not a bool": wrap(shard_gradients=1),
        "misspelt gradient_collective": wrap(gradient_collective="allreduce"),
        "gradient_collective not a string": wrap(gradient_collective=True),
        "misspelt parameter_gather": wrap(parameter_gather="all-gather"),
        "parameter_gather not a string": wrap(parameter_gather=0),
        "gradient_collective without shard": lambda: DistributedOptimizer(
            torch.optim.AdamW(nn.Linear(3, 2).parameters()),
            gradient_collective="reduce_scatter"),
        "parameter_gather with adasum": wrap(reduce_method="adasum",
                                             parameter_gather="all_gather"),
        "misspelt backend": lambda: DistributedOptimizer(
            torch.optim.AdamW(nn.Linear(3, 2).parameters()), backend="cuda"),
    })


def _another_models_state(rank, world_size):
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                     param_pack_thd=300)
    _loss(model, rank, 0).backward()
    optimizer.step()
    before = optimizer.state_dict()
    other = nn.Sequential(nn.Linear(7, 12), nn.Tanh(), nn.Linear(12, 5), nn.Tanh(),
                          nn.Linear(5, 3))
    plain = _adamw(other.parameters())
    other(torch.randn(2, 7)).sum().backward()
    plain.step()
    try:
        optimizer.load_state_dict(plain.state_dict())
        error = None
    except ValueError as exc:
        error = str(exc)
    custom = DistributedOptimizer(type("Mine", (torch.optim.AdamW,), {})(
        _model().parameters(), lr=LR), shard=True, assume_elementwise=True)
    return {"error": error, "unchanged": _dicts_equal(optimizer.state_dict(), before),
            "custom": type(custom).__name__}


def _differing_to(rank, world_size):
    """``state_dict(to=...)`` that differs by rank: each case's error (None:
    none) per rank."""
    model = _model()
    optimizer = DistributedOptimizer(_adamw(model.parameters()), shard=True,
                                     param_pack_thd=300)
    _loss(model, rank, 0).backward()
    optimizer.step()
    seen = {}
    for name, to in (("each its own rank", rank), ("None on rank 0", None if rank == 0 else 0)):
        try:
            optimizer.state_dict(to=to)
            seen[name] = None
        except RuntimeError as exc:
            seen[name] = str(exc)
    try:
        optimizer.state_dict(cpu_offload=1)  # refused before the collective
        seen["cpu_offload not a bool"] = None
    except TypeError as exc:
        seen["cpu_offload not a bool"] = str(exc)
    return seen


def _judged(rank, world_size):
    seen, collectives = _bad_arguments(rank, world_size)
    return {"bad": (seen, list(collectives)),
            "another_model": _another_models_state(rank, world_size),
            "differing_to": _differing_to(rank, world_size)}


# ------------------------------------------------------------------- tests

def _assert_bitwise(got, want, where):
    """Two lists of parameters, equal in length and bit for bit."""
    assert len(got) == len(want), where
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{where}, parameter {i}"


@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    """``ranks_once(world_size)``: ``on_rank``'s results on every rank, each
    world size run once per session."""
    return ranks_once_getter(request, tmp_path_factory, "sharded-optimizer-ranks", on_rank,
                             __name__, TIMEOUT)


WORLD_SIZES = [1, 2, 3, 4]
EQUIVALENCE = ["adamw", "adamw_reduce_scatter", "adamw_fused", "sgd_unpacked_sum",
               "accumulation_fp64", "bf16_without_masters", "adamw_grads_sharded",
               "accumulation_grads_sharded", "adamw_direct", "adamw_direct_grads_sharded",
               "fp32_direct_accumulation"]
#: per-element state tensors each parameter has: AdamW's two moments, SGD's momentum
STATE_TENSORS = {"adamw": 2, "adamw_reduce_scatter": 2, "adamw_fused": 2,
                 "sgd_unpacked_sum": 1, "accumulation_fp64": 2, "bf16_without_masters": 2,
                 "adamw_grads_sharded": 2, "accumulation_grads_sharded": 2,
                 "adamw_direct": 2, "adamw_direct_grads_sharded": 2, "fp32_direct_accumulation": 2}


@pytest.mark.parametrize("name", EQUIVALENCE)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_steps_are_the_all_reduce_steps(ranks_once, world_size, name):
    results = [r[name] for r in ranks_once(world_size)]
    first = results[0]
    if name != "bf16_without_masters" and name != "sgd_unpacked_sum":
        assert first["buckets"] > 1
    if name.startswith("adamw_direct"):
        # gloo gathers these straight into the parameters (not a world of
        # one, which gathers nothing)
        assert (first["direct_broadcasts"] > 0) == (world_size > 1)
    if name == "fp32_direct_accumulation":
        # fp32 buckets, not prescaled: exchanged on 2 ranks, all-reduced on more
        assert (first["exchanges"] > 0) == (world_size == 2)
    if name == "adamw_reduce_scatter":
        # one per bucket and step (a world of one rank communicates nothing)
        assert first["reduce_scatters"] == (STEPS * first["buckets"] if world_size > 1 else 0)
        assert first["all_gathers"] == first["reduce_scatters"]
    for rank, seen in enumerate(results):
        # every gradient is finite: no rank may read one that is not
        assert not any(seen["nonfinite"]), f"rank {rank}"
        # a rank's .grad holds its reduced part and zeros elsewhere
        assert seen["outside"] == 0.0, f"rank {rank}"
        for step in range(STEPS):
            for i, (got, want) in enumerate(zip(seen["params"][step], seen["reference"][step])):
                assert got.dtype == want.dtype
                assert torch.equal(got, first["params"][step][i]), \
                    f"rank {rank} differs from rank 0 (step {step}, parameter {i})"
                if world_size == 2:
                    # a sum of two is the same in any order: bitwise
                    assert torch.equal(got, want), f"step {step}, parameter {i}"
                else:
                    # a different summation order moves the reduced gradient by
                    # a few fp32 ulps (bounded below); AdamW's normalised update
                    # moves by lr times that relative error at most, SGD's by lr
                    # times the gradient error; a 16-bit parameter may round
                    # the other way once per step: per step, one ulp of the
                    # parameter's dtype plus lr times 16 ulps of fp32 relative,
                    # plus the relative gradient change carried by momentum
                    ulp = torch.finfo(got.dtype).eps * want.double().abs().max()
                    bound = (step + 1) * (2 * ulp + LR * 64 * world_size * EPS32 * 10)
                    assert float((got.double() - want.double()).abs().max()) <= bound, \
                        f"step {step}, parameter {i}"
    # the first step's owned gradients against the float64 mean of the ranks'
    # local gradients: fp32 sums of world_size terms (world_size - 1 roundings
    # of at most eps32 of the running sum), the mean's division, one rounding
    # to the gradient's dtype
    mean = name != "sgd_unpacked_sum"
    for seen in results:
        for index, start, end, got in seen["owned"]:
            local = [r["local"][index].reshape(-1)[start:end] for r in results]
            exact = sum(local) / (world_size if mean else 1)
            magnitude = sum(t.abs() for t in local) / (world_size if mean else 1)
            dtype_eps = torch.finfo(results[0]["params"][0][index].dtype).eps
            bound = world_size * EPS32 * magnitude + dtype_eps * exact.abs() + 1e-30
            assert torch.all((got - exact).abs() <= bound), f"parameter {index}"


@pytest.mark.parametrize("name", EQUIVALENCE)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_holds_its_share_of_the_optimizer_state(ranks_once, world_size, name):
    results = [r[name] for r in ranks_once(world_size)]
    k = STATE_TENSORS[name]
    total = k * results[0]["param_numel"]
    # the ranks' shares add up to the unsharded state: every element once
    assert sum(seen["state"] for seen in results) == total
    for seen in results:
        assert seen["state"] <= total / world_size + k * results[0]["padding"]
    if name == "adamw":
        # fp32 masters of the 16-bit layers' slices only: a share of them
        sixteen_bit = 5 * 13 + 5 + 3 * 5 + 3
        assert sum(seen["masters"] for seen in results) == sixteen_bit
    if name == "bf16_without_masters":
        # the bf16 layer is stepped as itself; the fp16 layer through bf16 masters
        assert sum(seen["masters"] for seen in results) == 3 * 5 + 3


ADASUM_CASES = [(ws, name) for ws in WORLD_SIZES
                for name in ("adasum", "adasum_bf16", "adasum_local")
                if name != "adasum_local" or ws > 1]


@pytest.mark.parametrize("world_size,name", ADASUM_CASES)
def test_sharded_adasum_is_unsharded_adasum(ranks_once, world_size, name):
    for rank, seen in enumerate(r[name] for r in ranks_once(world_size)):
        if name == "adasum_local" and world_size == 3:
            # the block's gloo all-reduce sums three buffers in an order that
            # depends on their length, and the sharded plan's buckets are
            # longer (padding): each step's mean may differ in its last bit,
            # and so each step may round a parameter one ulp apart
            for i, (a, b) in enumerate(zip(seen["sharded"], seen["unsharded"])):
                bound = STEPS * EPS32 * (b.abs() + LR)
                assert torch.all((a - b).abs() <= bound), f"rank {rank}, parameter {i}"
            continue
        _assert_bitwise(seen["sharded"], seen["unsharded"], f"rank {rank}")
        # the checkpoint gathers the tree's unequal slices back into whole tensors
        _assert_bitwise(seen["momenta_sharded"], seen["momenta_unsharded"], f"rank {rank}")


@pytest.mark.parametrize("world_size,name", ADASUM_CASES)
def test_sharded_adasum_stops_the_tree_at_the_halving(ranks_once, world_size, name):
    results = [r[name] for r in ranks_once(world_size)]
    # each rank steps the slice the halving left it: the shares add up to
    # the whole momentum state, every element once
    assert sum(seen["state"] for seen in results) == results[0]["param_numel"]
    # the parameters come back through the tree's reverse swaps, in their
    # fp32 dtype: the bytes of the unsharded tree's reverse swaps of the fp32
    # gradients, and no all-gather over the world. With local_size k, the k
    # ranks of a block first all-gather their pieces of the slice they share
    # (about a 1/world_size share of the parameters each), which the
    # unsharded tree, where they step the same slice alike, does not. The
    # sharded plan's buckets end in up to world_size * 16 bytes of padding
    # each, which the block's all-reduce, the halving and the swaps may each
    # carry once.
    pieces = 4 * results[0]["param_numel"] / world_size if name == "adasum_local" else 0
    for rank, seen in enumerate(results):
        if name != "adasum_local":  # (there, a block may be the whole world)
            assert seen["all_gathers_sharded"] == 0, f"rank {rank}"
        allowed = seen["sent_unsharded"] + 1.1 * pieces + 3 * seen["padding_bytes"]
        assert seen["sent_sharded"] <= allowed, \
            f"rank {rank}: {seen['sent_sharded']} bytes, unsharded {seen['sent_unsharded']}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_buffer_bytes_counts_the_buckets_and_the_sharded_parts(ranks_once, world_size):
    for rank, seen in enumerate(r["buffer_bytes"] for r in ranks_once(world_size)):
        unsharded, views, sharded = seen["unsharded"], seen["bucket_views"], seen["sharded"]
        # made at the first reduction: one fp32 buffer per bucket (every
        # dtype here is reduced in fp32, its tensors aligned within it), at
        # most two spare elements each (the non-finite and missing-gradient
        # counts)
        assert unsharded["bucket_bytes"] >= 4 * unsharded["elements"]
        assert unsharded["before"] == 0
        assert unsharded["bucket_bytes"] <= unsharded["after"] \
            <= unsharded["bucket_bytes"] + 8 * unsharded["n_buckets"], f"rank {rank}"
        # bucket views: the buffers are made with the views, before any
        # reduction; the fp32 gradients live in the buffers, the 16-bit ones
        # in a buffer per dtype, counted too: each .grad adds no memory of its own
        assert views["grads_in_buffers"], f"rank {rank}"
        assert views["before"] == views["after"] > unsharded["after"]
        # sharded: every bucket whole (padded to a multiple of the world size),
        # from construction on; this rank's part is its slot of it (the
        # reduce-scatter and the all-gather run in place) and adds nothing
        assert sharded["part_bytes"] == sharded["bucket_bytes"] // world_size
        assert sharded["before"] == sharded["after"] == sharded["bucket_bytes"], f"rank {rank}"
        assert sharded["bucket_bytes"] >= 4 * sharded["elements"]
        # shard_gradients: the buckets' buffers live during backward only
        # (their gradients are in .grad after it), the all-gather's while it
        # is in flight; none between steps
        grads = seen["grads_sharded"]
        for step in range(2):
            assert grads[f"backward_{step}"] == grads[f"gathered_{step}"] == 0, f"rank {rank}"
            assert grads[f"gathering_{step}"] == grads["gather_bytes"], f"rank {rank}"
        assert grads["built"] == 0
        # the first backward holds every bucket to its end (to find gradients
        # accumulated twice); in the second, the later buckets have started
        # by the time the first layer's gradient is made
        assert grads["during"][0] == 0
        assert 0 < grads["during"][1] < grads["bucket_bytes"], f"rank {rank}"
        # during backward at most two buckets' whole buffers have memory: the
        # one being flattened and the one before it (a bucket's is released
        # once its collective is waited for, as the bucket after next
        # starts); a world of one rank flattens straight into the parts
        n_buckets = len(grads["starts"][0])
        assert n_buckets >= 3  # so that releasing early shows
        for starts in grads["starts"]:
            assert starts == [min(i + 1, 2) if world_size > 1 else 0
                              for i in range(n_buckets)], f"rank {rank}: {starts}"
        # .grad is written bucket by bucket, from the parts alone (the last
        # two buckets' whole buffers, whose parts are slots of them, and no
        # other's), each part released after its launch
        for writes in grads["writes"]:
            assert len(writes) == grads["written_buckets"], f"rank {rank}"
            assert all(held == unwritten for held, unwritten in writes), f"rank {rank}: {writes}"
            assert all(a[0] > b[0] for a, b in zip(writes, writes[1:])), f"rank {rank}: {writes}"
        # the buffers and parts are the same tensors at every step, only their
        # memory goes and comes back: the fused kernels' kept launches find them
        assert grads["same_objects"]
        # gathering in step(), bucket by bucket: at most two all-gather
        # buffers have memory at a time (a bucket's is released once it is
        # written into the parameters, before the bucket after next starts):
        # two at each write but the last
        in_turn = grads["gathered_in_turn"]
        assert in_turn["after"] == [0, 0], f"rank {rank}"
        for alive in in_turn["alive"]:
            assert alive == [2] * (n_buckets - 1) + [1], f"rank {rank}: {alive}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_step_after_zero_grad_changes_nothing_and_makes_no_state(ranks_once, world_size):
    for seen in (r["zero_grad"] for r in ranks_once(world_size)):
        assert seen == {"unchanged": True, "state": 0}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_deferred_all_gathers_give_the_same_training(ranks_once, world_size):
    for rank, (deferred, direct, not_into_params) in enumerate(
            r["deferred"] for r in ranks_once(world_size)):
        assert deferred["in_flight"] == [True] * STEPS, f"rank {rank}"
        assert direct["in_flight"] == [False] * STEPS
        assert deferred["in_flight_after_forward"] is False
        assert not_into_params["direct"] == deferred["direct"] == 0
        assert not_into_params["losses"] == deferred["losses"] == direct["losses"]
        _assert_bitwise(not_into_params["params"], direct["params"], f"rank {rank}")
        assert deferred["final_loss"] == direct["final_loss"]
        _assert_bitwise(deferred["params"], direct["params"], f"rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clipping_takes_the_whole_gradients_norm_on_every_rank(ranks_once, world_size):
    results = [r["clipping"] for r in ranks_once(world_size)]
    for norm_type in (2.0, math.inf):
        first = results[0][norm_type]
        for seen in (r[norm_type] for r in results):
            assert torch.equal(seen["total"], first["total"])  # bitwise on every rank
            # fp32 norms of slices, combined in fp64: a sum of n squares
            # rounds by at most n eps32 relative, the root halves it; the
            # gradients themselves were rounded once to their dtype
            bound = seen["elements"] * EPS32 * seen["exact"] + \
                torch.finfo(torch.float16).eps * seen["exact"]
            assert abs(float(seen["total"]) - seen["exact"]) <= bound
            # clipped to 0.05: the scaled gradients' norm is 0.05, but for the
            # coefficient's 1e-6, the same summation rounding, and each scaled
            # bf16 gradient element rounded to bf16 (eps_bf16 relative at most)
            assert abs(seen["after"] - 0.05) <= 0.05 * (
                1e-4 + seen["elements"] * EPS32 + torch.finfo(torch.bfloat16).eps)
    for seen in results:
        assert seen["error"] is not None and "non-finite" in seen["error"]
        assert seen["refused"] == {"max_norm_str": "TypeError", "order_zero": "ValueError",
                                   "order_negative": "ValueError", "foreach_int": "TypeError",
                                   "error_if_nonfinite_none": "TypeError"}
        assert seen["untouched"]  # refused before anything was scaled
        assert torch.equal(seen["measured"], seen["far_limit"]) and seen["measured_untouched"]
        assert 0 < float(seen["measured"]) < math.inf
        # torch's 'inf' is math.inf: the same bits
        assert torch.equal(seen["inf"]["total"], seen[math.inf]["total"])
        assert seen["inf"]["after"] == seen[math.inf]["after"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_master_weights_follow_parameters_changed_between_steps(ranks_once, world_size):
    for seen in (r["masters_follow"] for r in ranks_once(world_size)):
        assert seen["in_place"] and seen["through_data_reloaded"]
        # one AdamW step from 0.25 moves each element by about lr (and decay)
        assert 0 < seen["stepped_from_there"] < 2 * LR


@pytest.mark.parametrize("name", ["scaler", "scaler_grads_sharded"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_grad_scaler_skips_the_step_on_every_rank_for_an_inf_on_one(ranks_once, world_size,
                                                                     name):
    results = [r[name] for r in ranks_once(world_size)]
    for rank, seen in enumerate(results):
        assert [s["changed"] for s in seen] == [True, False, True], f"rank {rank}"
        assert [s["scale"] for s in seen] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], f"rank {rank}"
        for step, s in enumerate(seen):
            assert all(torch.equal(a, b) for a, b in zip(s["params"],
                                                         results[0][step]["params"]))


@pytest.mark.parametrize("name", list(GRADS_SHARDED_OPTIONS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_gradients_step_bitwise_as_full_gradients(ranks_once, world_size, name):
    """shard_gradients=True changes what each rank keeps, not what it steps:
    the parameters and the owned elements of .grad are shard=True's bit for
    bit (which the tests above hold to the all-reduce reference)."""
    results = [r["grads_sharded"][name] for r in ranks_once(world_size)]
    for rank, seen in enumerate(results):
        assert all(seen["params_equal"]), f"rank {rank}"
        assert all(seen["owned_equal"]), f"rank {rank}"
        for held, owns, nbytes, full in zip(seen["held"], seen["owns"], seen["grad_bytes"],
                                            seen["full_grad_bytes"]):
            if any(owns):
                # a .grad exactly where this rank owns elements
                assert held == owns, f"rank {rank}"
            else:
                # none owned: one zero .grad for GradScaler to record its check on
                assert sum(held) == 1, f"rank {rank}"
            assert nbytes <= full
            if world_size > 1 and not all(owns):
                assert nbytes < full, f"rank {rank}: {nbytes} of {full} bytes"
        # released during backward from the second step on (the first holds
        # every bucket to its end, to find gradients accumulated twice)
        assert seen["released_early"][0] is False
        assert all(seen["released_early"][1:]), seen["released_early"]
        assert all(torch.equal(a, b) for a, b in zip(seen["params"], results[0]["params"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_gradients_recover_from_a_backward_that_raised(ranks_once, world_size):
    """A backward that raised leaves buckets in flight with their buffers;
    the next backward waits for them and takes the buffers back, and steps
    as shard=True alone does."""
    for rank, seen in enumerate(r["grads_sharded_failure"] for r in ranks_once(world_size)):
        for path, record in seen.items():
            assert record["errors"] == ["a backward error"] * 2, f"rank {rank}, {path}"
            if world_size > 1:  # the case this test is for: buckets left in flight
                assert record["started_then_failed"] >= 1, f"rank {rank}, {path}"
            assert all(record["params_equal"]), f"rank {rank}, {path}"
            assert record["held"] == [0, 0, 0], f"rank {rank}, {path}"


@pytest.mark.parametrize("name", ["adamw", "sgd_unpacked_sum", "bf16_without_masters"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_ranks_layouts_own_every_element_once(ranks_once, world_size, name):
    """``opt.layout``: each rank's part of each bucket is part ``rank`` of
    ``world_size`` equal ones (``lo == rank * part size``), and the
    parameter ranges the ranks own cover
    every element of every parameter exactly once, each at its offset in
    its bucket's part."""
    layouts = [r[name]["layout"] for r in ranks_once(world_size)]
    shapes = layouts[0]["shapes"]
    owners = [torch.zeros(math.prod(shape), dtype=torch.int64) for shape in shapes]
    for rank, layout in enumerate(layouts):
        assert (layout["rank"], layout["world_size"]) == (rank, world_size)
        for lo, hi in layout["parts"]:
            assert lo == rank * (hi - lo), f"rank {rank}: part {lo}:{hi}"
        for param, start, end, bucket, offset in layout["ranges"]:
            lo, hi = layout["parts"][bucket]
            assert 0 <= offset and offset + end - start <= hi - lo, f"rank {rank}"
            owners[param][start:end] += 1
    assert all(bool((count == 1).all()) for count in owners), \
        [count.tolist() for count in owners]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_rank_that_owns_nothing_still_steps_with_a_grad_scaler(ranks_once, world_size):
    results = [r["grads_sharded_tiny"] for r in ranks_once(world_size)]
    if world_size == 4:
        assert min(r[1]["owned"] for r in results) == 0  # the case this test is for
    for rank, (full, sharded) in enumerate(results):
        for step in range(3):
            assert all(torch.equal(a, b) for a, b in zip(full["params"][step],
                                                         sharded["params"][step]))
            assert all(torch.equal(a, b) for a, b in zip(sharded["params"][step],
                                                         results[0][1]["params"][step]))
        assert min(sharded["held"]) >= 1, f"rank {rank}"
        assert full["scale"] == sharded["scale"] == 2.0 ** 9


@pytest.mark.parametrize("mode", ["unused_sharded", "unused_unsharded", "unused_bucket_views",
                                  "unused_grads_sharded"])
def test_parameters_without_gradients_are_skipped_as_ddp_skips_them(ranks_once, mode):
    results = [r[mode] for r in ranks_once(2)]
    names = ["trunk.weight", "trunk.bias", "sometimes.weight", "sometimes.bias",
             "rank0.weight", "rank0.bias", "frozen.weight", "frozen.bias"]
    for rank, seen in enumerate(results):
        for step, s in enumerate(seen):
            for name, equal in zip(names, s["equal"]):
                assert equal, f"rank {rank}, step {step}: {name} differs from DDP's"
            # no rank used "sometimes" in odd steps: no gradient, no step
            if mode == "unused_grads_sharded":
                # and in even steps only the ranks that own some of it hold one
                assert s["sometimes_grad_none"] or step % 2 == 0
            else:
                assert s["sometimes_grad_none"] == (step % 2 == 1)
            counts = dict(zip(names, s["step_counts"]))
            assert counts["sometimes.weight"] == step // 2 + 1
            assert counts["trunk.weight"] == counts["rank0.weight"] == step + 1
            assert counts["frozen.weight"] == 0


@pytest.mark.parametrize("mode", ["unfound_sharded", "unfound_unsharded"])
def test_without_finding_unused_parameters_they_step_on_zeros_after_one_warning(ranks_once,
                                                                                 mode):
    results = [r[mode] for r in ranks_once(2)]
    for rank, r in enumerate(results):
        for step, s in enumerate(r["seen"]):
            assert all(s["equal"]), f"rank {rank}, step {step}: {s['equal']}"
            # no rank used "sometimes" in odd steps: a zero gradient, not None
            grad = s["sometimes_grad"]
            assert grad is not None
            if step % 2 == 1:
                assert not grad.any(), f"rank {rank}, step {step}"
        # every rank misses "sometimes" in odd steps, rank 1 also "rank0": once each
        assert len(r["warned"]) == 1, r["warned"]
        # a model that uses every parameter: finding unused ones costs no
        # collective of its own (unsharded, the buckets' sums say nobody
        # missed one; sharded, the count rides with the non-finite count)
        assert r["all_reduces"][True] == r["all_reduces"][False], r["all_reduces"]


def test_structure_changes_step_as_unsharded(ranks_once):
    for rank, (sharded, unsharded) in enumerate(r["structure"] for r in ranks_once(2)):
        assert sharded["losses"] == unsharded["losses"]
        _assert_bitwise(sharded["params"], unsharded["params"], f"rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_state_gathers_alike_in_any_number_of_rounds(ranks_once, world_size):
    results = [r["gather_rounds"] for r in ranks_once(world_size)]
    if world_size > 2:  # the test's point: ranks send different byte counts
        assert len(set(results[0]["sizes"])) > 1, results[0]["sizes"]
    for rank, seen in enumerate(results):
        cases = {k: v for k, v in seen.items() if k != "sizes"}
        assert len(cases) == 6
        for (chunk, to), outcome in cases.items():
            want = None if to is not None and rank != to else True
            assert outcome is want, (rank, chunk, to, outcome)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checkpoints_are_unsharded_and_move_between_world_sizes(ranks_once, world_size):
    results = [r["checkpoints"] for r in ranks_once(world_size)]
    for rank, seen in enumerate(results):
        assert seen["shapes_match"]
        assert seen["keys"] == results[0]["keys"]
        assert set(seen["keys"][0]) == {"exp_avg", "exp_avg_sq", "step"}
        # 16-bit parameters' fp32 masters travel in the checkpoint
        assert "master_weight" in seen["keys"][2] and "master_weight" in seen["keys"][4]
        if world_size == 2:
            assert seen["equal_to_unsharded"]
        assert seen["to_0"] is True
        assert seen["cpu_offload"] is True
        assert seen["unsharded_to_0"] is True
        assert seen["own_part_once"] is True
        assert seen["lr_loaded"] == LR  # the checkpoint's hyperparameters win
        _assert_bitwise(seen["resumed"], seen["uninterrupted"],
                        f"rank {rank}: resuming is not the run")
        for k in range(1, world_size):
            if rank < k:
                assert seen[f"round_trip_{k}"], f"rank {rank}, {k} ranks"
        assert seen["unsharded_has_masters"] is False
        assert seen["plain_loaded"] == 6
        assert seen["from_unsharded"]


def _saved_elements(own):
    return sum(v.numel() for piece in pieces_of(own).values() for v in piece["slices"].values())


def _whole_elements(whole):
    return sum(v.numel() for entry in whole["state"].values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sharded_checkpoints_save_each_rank_s_own_elements_and_load_anywhere(ranks_once,
                                                                             world_size):
    results = [r["sharded_checkpoints"] for r in ranks_once(world_size)]
    whole = results[0]["whole"]
    # every element of the state saved once, by the rank that holds it
    for key in ("own", "unsharded_own"):
        saved = [_saved_elements(r[key]) for r in results]
        assert sum(saved) == _whole_elements(whole if key == "own" else
                                             results[0]["unsharded_own_whole"]), key
        if world_size > 1:
            assert max(saved) < _whole_elements(whole), key
    # put together in a process without a process group, from the dicts in any order
    mixed = [r["own"] for r in reversed(results)]
    assert _dicts_equal(consolidate_sharded_state_dict(mixed), whole)
    for rank, seen in enumerate(results):
        assert seen["own"]["rank"] == rank and seen["own"]["world_size"] == world_size
        assert seen["consolidated"] and seen["unsharded_consolidated"]
        assert seen["lr_loaded"] == LR  # the checkpoint's hyperparameters win
        _assert_bitwise(seen["resumed"], seen["uninterrupted"],
                        f"rank {rank}: resuming from the files is not the run")
        assert seen["other_cap"] and seen["save_untouched"]
        for k in range(1, world_size):
            if rank < k:
                assert seen[f"round_trip_{k}"], f"rank {rank}, {k} ranks"
        assert seen["into_unsharded"] and seen["from_unsharded"]
        assert seen["into_adasum"] and seen["adasum_consolidated"]
        bad = seen["bad"]
        assert bad["one_dict"][0] == "TypeError" and "list or tuple" in bad["one_dict"][1]
        assert bad["not_a_dict"][0] == "TypeError" and "shards[0]" in bad["not_a_dict"][1]
        assert bad["empty"][0] == "ValueError"
        assert bad["rank_twice"][0] == "ValueError" and "each of the" in bad["rank_twice"][1]
        assert bad["whole_dict"][0] == "ValueError" and "load_state_dict" in bad["whole_dict"][1]
        assert bad["another_model"][0] == "ValueError" and \
            "another model" in bad["another_model"][1]
        assert bad["piece_moved"][0] == "ValueError" and \
            "not each once" in bad["piece_moved"][1]
        if world_size > 1:
            assert bad["rank_missing"][0] == "ValueError"
        assert seen["unchanged_after_bad"]


@pytest.mark.parametrize("shard", [True, False])
def test_torch_distributed_checkpoint_saves_and_resumes_the_run(ranks_once, shard):
    for rank, seen in enumerate(r["torch_checkpoint"][0 if shard else 1]
                                for r in ranks_once(2)):
        # get_state_dict steps a fresh optimizer on zero gradients at lr 0:
        # its state made, nothing moved, nothing communicated
        assert seen["fresh_unchanged"] and seen["fresh_steps"] == [1.0]
        assert seen["lr_loaded"] == LR
        _assert_bitwise(seen["resumed"], seen["uninterrupted"],
                        f"rank {rank}: resuming through torch.distributed.checkpoint")
        # the whole state on every rank, also on the rank that owns nothing of it
        assert set(seen["tiny_state"]) == {"weight"}
        assert float(seen["tiny_state"]["weight"]["step"]) == 1.0
    owners = [r["torch_checkpoint"][0 if shard else 1]["tiny_owns"] for r in ranks_once(2)]
    assert sorted(owners) == ([False, True] if shard else [True, True])


def test_bad_arguments_are_refused_before_any_collective():
    results = run_ranks(_judged, 2)
    assert_raised_before_any_collective([r["bad"] for r in results], {
        "lbfgs": ("ValueError", "LBFGS is not known"),
        "unknown subclass": ("ValueError", "assume_elementwise=True"),
        "integer master_dtype": ("TypeError", "master_dtype"),
        "master_dtype not a dtype": ("TypeError", "master_dtype"),
        "bucket views": ("ValueError", "gradient_as_bucket_view"),
        "overlap without shard": ("ValueError", "overlap_param_gather"),
        "shard not a bool": ("TypeError", "shard"),
        "shard_gradients without shard": ("ValueError", "shard_gradients=True applies"),
        "shard_gradients not a bool": ("TypeError", "shard_gradients must be"),
        "misspelt gradient_collective": (
            "ValueError", "gradient_collective must be None or one of 'reduce_scatter', "
                          "'all_reduce', 'exchange', got 'allreduce'"),
        "gradient_collective not a string": ("TypeError", "gradient_collective must be"),
        "misspelt parameter_gather": ("ValueError", "parameter_gather must be None or one of"),
        "parameter_gather not a string": ("TypeError", "parameter_gather must be"),
        "gradient_collective without shard": (
            "ValueError", "gradient_collective='reduce_scatter' applies to shard=True only"),
        "parameter_gather with adasum": (
            "ValueError", "parameter_gather='all_gather' does not combine with "
                          "reduce_method='adasum'"),
        "misspelt backend": ("ValueError", "backend must be one of"),
    })
    for r in results:
        assert "another model" in r["another_model"]["error"]
        assert r["another_model"]["unchanged"]
        assert r["another_model"]["custom"].endswith("Mine")
        # an all-gather meeting a gather, or gathers to different ranks, would
        # wait until the collective timeout
        assert "disagree on state_dict(to=...): rank 0: 0; rank 1: 1" in \
            r["differing_to"]["each its own rank"]
        assert "disagree on state_dict(to=...): rank 0: None; rank 1: 0" in \
            r["differing_to"]["None on rank 0"]
        assert "cpu_offload must be True or False, got 1" in \
            r["differing_to"]["cpu_offload not a bool"]


def _main_for_debug():
    import sys
    world_size = int(sys.argv[1])
    for r in run_ranks(on_rank, world_size, timeout=TIMEOUT)[:1]:
        for name, value in r.items():
            print(name, value if name in ("zero_grad",) else "")


if __name__ == "__main__":
    _main_for_debug()
