"""torch.nn.utils.clip_grad_norm_ left in a sharded training loop.

With ``DistributedOptimizer(shard=True)`` (and ``shard_gradients=True``) each
rank's ``.grad`` holds its share of the reduced gradient; torch's clip must
still take the whole gradient's norm and scale every share alike, so the run
is the unsharded optimizer's with the same clip (which is DDP's: every rank
holds the whole reduced gradient there). Checked on 2 and 3 gloo ranks as a
user's loop calls it: through ``torch.nn.utils.clip_grad_norm_`` looked up at
call time, through the name imported before fusedreduce was, and through
``get_total_norm`` + ``clip_grads_with_norm_``; orders 2 and inf; a limit that
clips and one that does not; with and without ``GradScaler.unscale_``; a
parameter subset that some rank holds no gradient of; a small GPT-like loop
(gradient accumulation, AdamW, a GradScaler, the clip) as the issue ran it.
Mixed calls are refused on every rank before any collective; without a
sharded optimizer torch's function runs untouched, communicating nothing.

Rank functions never assert: they return what they saw.
"""
from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_ as clip_grad_norm_by_name

from fusedreduce import DistributedOptimizer
from harness import (outcomes_and_collectives, ranks_once_getter, record_collectives,
                     run_torchrun)
from test_sharded_optimizer import _loss, _model

LR = 0.01
STEPS = 3
TIMEOUT = 300.0
EPS32 = torch.finfo(torch.float32).eps
#: a limit below every gradient norm of these models (it clips), and one far above
CLIPS, LEAVES = 0.05, 1e6
#: the models' three layers in fp32 (GradScaler refuses fp16 gradients)
FP32 = (torch.float32,) * 3


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _clip(how, model, params, max_norm, norm_type):
    if how == "attribute":
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    if how == "name":
        return clip_grad_norm_by_name(params, max_norm, norm_type)
    params = list(params)  # "get_total_norm": torch's two halves, called by the script
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                          norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _train(rank, *, shard, shard_gradients=False, norm_type=2.0, max_norm=CLIPS,
           scaled=False, how="attribute", subset=False, dtypes=FP32,
           master_dtype=torch.float32):
    """``STEPS`` AdamW steps with torch's clip in the loop: the parameters,
    the norms the clip returned, and whether this rank held a gradient of
    the clipped parameters in each step."""
    model = _model(dtypes=dtypes)
    sharding = dict(shard=True, shard_gradients=shard_gradients,
                    master_dtype=master_dtype) if shard else {}
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                     param_pack_thd=300, **sharding)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    norms, held = [], []
    for step in range(STEPS):
        loss = _loss(model, rank, step)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        clipped = [model[4].bias] if subset else list(model.parameters())
        held.append(any(p.grad is not None for p in clipped))
        norms.append(_clip(how, model, clipped, max_norm, norm_type))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    return {"params": _snapshot(model), "norms": norms, "held": held}


def _cases():
    """name -> options of ``_train`` (besides ``shard``)."""
    cases = {}
    spellings = ("attribute", "name")
    for zero2 in (False, True):
        for norm_type in (2.0, math.inf):
            for max_norm in (CLIPS, LEAVES):
                for scaled in (False, True):
                    how = spellings[len(cases) % 2]
                    name = (f"zero{2 if zero2 else 1}-order{norm_type}-max{max_norm}"
                            f"{'-unscaled' if scaled else ''}-{how}")
                    cases[name] = dict(shard_gradients=zero2, norm_type=norm_type,
                                       max_norm=max_norm, scaled=scaled, how=how)
    cases["get_total_norm"] = dict(how="get_total_norm")
    # the last layer's bias alone: some rank owns none of its 3 elements
    cases["subset-zero2"] = dict(shard_gradients=True, subset=True)
    cases["subset-zero2-inf"] = dict(shard_gradients=True, subset=True, norm_type=math.inf)
    # fp32, bf16 and fp64 layers: torch's norm promotes to fp64; the bf16
    # layer stepped in bf16 as the unsharded optimizer steps it
    cases["mixed-dtypes"] = dict(dtypes=(torch.float32, torch.bfloat16, torch.float64),
                                 master_dtype=torch.bfloat16)
    return cases


# ------------------------------------------------------- a GPT-like loop

class _TinyGPT(nn.Module):
    """nanoGPT's shape in miniature: token and position embeddings, pre-norm
    causal self-attention blocks, a final layer norm, an untied head."""

    def __init__(self, vocab=32, width=16, layers=2, block=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        steps = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(steps))
        mask = nn.Transformer.generate_square_subsequent_mask(steps)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


GPT_CLIP, GPT_ITERATIONS, GPT_LR = 0.1, 6, 1e-2


def _gpt(rank, shard, shard_gradients=False, accumulation=2):
    """The issue's loop: gradient accumulation, a GradScaler, unscale_, torch's
    clip left in place, AdamW; the losses and the parameters."""
    torch.manual_seed(0)
    model = _TinyGPT()
    optimizer = DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=GPT_LR, weight_decay=0.1),
        backward_passes_per_step=accumulation, shard=shard, shard_gradients=shard_gradients,
        param_pack_thd=4096)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(GPT_ITERATIONS):
        for _ in range(accumulation):
            idx = torch.randint(0, 32, (4, 9), generator=gen)
            loss = model(idx[:, :-1], idx[:, 1:]) / accumulation
            scaler.scale(loss).backward()
        losses.append(float(loss.detach()) * accumulation)
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_CLIP)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms,
            "params": [p.detach().clone() for p in model.parameters()]}


# ------------------------------------------------- refusals and passing through

def _refusals(rank, world_size):
    """Mixed calls, an order of 0, a non-finite norm under error_if_nonfinite:
    raised on every rank; the mixed ones before any collective and with every
    gradient untouched."""
    model, other = _model(dtypes=FP32), _model(seed=1, dtypes=FP32)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), shard=True,
                                     param_pack_thd=300)
    second = DistributedOptimizer(torch.optim.AdamW(other.parameters(), lr=LR), shard=True,
                                  param_pack_thd=300)
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.ones(3)
    _loss(model, rank, 0).backward()
    _loss(other, rank, 0).backward()
    before = _snapshot_grads(model) + _snapshot_grads(other)
    params = list(model.parameters())
    seen, recorded = outcomes_and_collectives({
        "with_a_plain_parameter": lambda: torch.nn.utils.clip_grad_norm_(params + [extra], 1.0),
        "two_optimizers": lambda: torch.nn.utils.clip_grad_norm_(
            params + list(other.parameters()), 1.0),
        "order_zero": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, 0.0),
    })
    collectives = list(recorded)  # the recording goes on after this
    untouched = before == _snapshot_grads(model) + _snapshot_grads(other)
    # an inf on one rank: the reduced gradient has it on every rank
    optimizer.zero_grad()
    (_loss(model, rank, 1) * (math.inf if rank == world_size - 1 else 1.0)).backward()
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        nonfinite = None
    except RuntimeError as exc:
        nonfinite = str(exc)
    del second
    return {"seen": seen, "collectives": collectives, "untouched": untouched,
            "nonfinite": nonfinite}


def _snapshot_grads(model):
    return [None if p.grad is None else p.grad.clone().tolist() for p in model.parameters()]


def _passing_through(rank):
    """torch's function, bitwise and communicating nothing: after step()
    (the gradients were used), and once every sharded optimizer is gone."""
    model = _model(dtypes=FP32)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), shard=True,
                                     param_pack_thd=300)
    _loss(model, rank, 0).backward()
    optimizer.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    events = []
    record_collectives(events)
    after_step = torch.nn.utils.clip_grad_norm_(model.parameters(), LEAVES)
    # torch's _get_total_norm on CPU tensors of one dtype: each tensor's norm,
    # then the norm of those (no foreach kernel on CPU), so bitwise the same
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    alone = torch.nn.utils.clip_grad_norm_(model.parameters(), LEAVES)
    return {"after_step": bool(torch.equal(after_step, expected)),
            "alone": bool(torch.equal(alone, expected)), "kept": gone() is not None,
            "collectives": events}


def on_rank(rank, world_size):
    results = {}
    for name, options in _cases().items():
        results[name] = {"sharded": _train(rank, shard=True, **options),
                         "whole": _train(rank, shard=False, **options)}
    if world_size == 2:
        for name, options in (("gpt-zero1", {}), ("gpt-zero2", {"shard_gradients": True})):
            results[name] = {"sharded": _gpt(rank, True, **options), "whole": _gpt(rank, False)}
    results["refusals"] = _refusals(rank, world_size)
    results["passing_through"] = _passing_through(rank)  # records collectives from here on
    return results


# ------------------------------------------------------------------- tests

@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    return ranks_once_getter(request, tmp_path_factory, "torch-clip-ranks", on_rank,
                             __name__, TIMEOUT)


WORLD_SIZES = [2, 3]
CASES = list(_cases())


def _assert_ranks_bitwise(results, name, key):
    first = results[0][name]["sharded"][key]
    for rank, r in enumerate(results[1:], 1):
        for i, (a, b) in enumerate(zip(r[name]["sharded"][key], first)):
            assert torch.equal(a, b), f"{name}: rank {rank}'s {key}[{i}] differs from rank 0's"


def _norm_tolerance(params):
    """Relative: the two runs differ only in how the norm is summed (torch's
    norm per whole tensor, rounded to the tensor's dtype, then over the
    tensors; or per rank's share, then over the shares in fp64): each
    per-tensor norm is one rounding (``eps / 2``) of a sum whose fp32
    accumulation is within ``n * eps32`` of exact (n terms, non-negative),
    so the totals are within twice both of each other."""
    dtype_eps = max(torch.finfo(p.dtype).eps for p in params)
    return 2 * (dtype_eps + sum(p.numel() for p in params) * EPS32)


def _param_tolerance(param, params):
    """Absolute, per element: a clip coefficient off by the norm's relative
    tolerance changes an AdamW update (at most ``LR`` per element, and
    invariant to a common gradient scale but for ``eps``) by at most ``LR``
    times twice it, and the parameter's rounding may then go the other way
    (``eps`` of its dtype times its magnitude); ``STEPS`` steps add up."""
    step = LR * 2 * _norm_tolerance(params) + \
        torch.finfo(param.dtype).eps * float(param.abs().max())
    return STEPS * step


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_clip_in_a_sharded_loop_steps_as_unsharded(ranks_once, world_size, name):
    results = ranks_once(world_size)
    _assert_ranks_bitwise(results, name, "params")
    _assert_ranks_bitwise(results, name, "norms")
    sharded, whole = results[0][name]["sharded"], results[0][name]["whole"]
    limit = _cases()[name].get("max_norm", CLIPS)
    # CLIPS clips in every step, LEAVES in none
    assert all((float(n) > limit) == (limit == CLIPS) for n in whole["norms"]), name
    for step, (got, want) in enumerate(zip(sharded["norms"], whole["norms"])):
        assert got.dtype == want.dtype and got.device == want.device, (name, step)
        assert got.shape == want.shape == (), (name, step)
        tol = _norm_tolerance(whole["params"]) * float(want)
        assert abs(float(got) - float(want)) <= tol, (name, step, float(got), float(want))
    for i, (got, want) in enumerate(zip(sharded["params"], whole["params"])):
        diff = float((got.double() - want.double()).abs().max())
        assert diff <= _param_tolerance(want, whole["params"]), (name, i, diff)
    if "subset" in name:
        # the point of the case: a rank holding no gradient of the clipped
        # parameters must still join the norm's all-reduce
        assert any(not all(r[name]["sharded"]["held"]) for r in results), name


@pytest.mark.parametrize("name", ["gpt-zero1", "gpt-zero2"])
def test_a_gpt_loop_with_torch_clip_trains_the_unsharded_model(ranks_once, name):
    """The issue's run, at its 2 ranks (a sum of two is the same in either
    order, so the reductions agree bitwise and only the clip's norm is
    summed otherwise; at 3 ranks the reduce-scatter's order alone moves
    AdamW's near-zero second moments)."""
    results = ranks_once(2)
    _assert_ranks_bitwise(results, name, "params")
    for rank, r in enumerate(results):
        sharded, whole = r[name]["sharded"], r[name]["whole"]
        assert all(n > GPT_CLIP for n in whole["norms"]), whole["norms"]  # it clips
        rel = _norm_tolerance(whole["params"])
        for got, want in zip(sharded["norms"], whole["norms"]):
            assert abs(got - want) <= rel * want, (name, rank, got, want)
        for i, (got, want) in enumerate(zip(sharded["params"], whole["params"])):
            diff = float((got - want).abs().max())
            tol = GPT_ITERATIONS * (GPT_LR * 2 * rel + EPS32 * float(want.abs().max()))
            assert diff <= tol, (name, rank, i, diff, tol)
        for got, want in zip(sharded["losses"], whole["losses"]):
            # the first loss is before any step; later ones follow the
            # parameters, within the 2e-7 of DDP's
            assert abs(got - want) <= 2e-7 * max(1.0, abs(want)), (name, rank, got, want)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mixed_clips_are_refused_on_every_rank_before_any_collective(ranks_once, world_size):
    for rank, r in enumerate(ranks_once(world_size)):
        seen = r["refusals"]
        assert not seen["collectives"], (rank, seen["collectives"])
        assert seen["untouched"], rank
        for case, fragment in (("with_a_plain_parameter", "gradients it does not hold"),
                               ("two_optimizers", "of two sharded DistributedOptimizers"),
                               ("order_zero", "an order of 0 or below")):
            kind, message = seen["seen"][case]
            assert kind == "RuntimeError" and fragment in message, (rank, case, message)
            assert "max_grad_norm=" in message and "optimizer.clip_grad_norm_" in message
        assert seen["nonfinite"] is not None and "non-finite" in seen["nonfinite"], rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_without_reduced_sharded_gradients_torch_clip_runs_untouched(ranks_once, world_size):
    for rank, r in enumerate(ranks_once(world_size)):
        seen = r["passing_through"]
        assert seen == {"after_step": True, "alone": True, "kept": False, "collectives": []}, rank


#: torch < 2.6 made on torch >= 2.6: its clip_grad module without
#: _get_total_norm before fusedreduce is imported, in a torchrun launch of its own
OLD_TORCH = """
import json, os, sys, warnings
import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad
torch.nn.utils.clip_grad.__dict__.pop("_get_total_norm", None)
from fusedreduce import DistributedOptimizer
dist.init_process_group("gloo")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1), shard=True)
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as out:
    json.dump([str(w.message) for w in caught], out)
dist.destroy_process_group()
"""


def test_torch_before_2_6_is_warned_at_construction(tmp_path):
    script = tmp_path / "old_torch.py"
    script.write_text(OLD_TORCH)
    process = run_torchrun(["--standalone", "--nproc_per_node=2", str(script), str(tmp_path)],
                           cwd=tmp_path, timeout=TIMEOUT)
    assert process.returncode == 0, process.stdout + process.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        messages = [m for m in seen if "clip_grad_norm_" in m]
        assert len(messages) == 1, (rank, seen)
        assert "max_grad_norm=" in messages[0] and "optimizer.clip_grad_norm_" in messages[0]
