"""Fused gradient clipping: ``DistributedGradReducer(..., max_grad_norm=...)``.

What "correct" means: ``torch.nn.utils.clip_grad_norm_`` applied to the
reduced (mean) gradients, worked out in float64 (``reference.reference_clip``)
from every rank's gradients; the norm (``grad_norm``) and the clipped
gradients are the same bits on every rank. Checked on 1, 2 and 3 gloo ranks
(one spawn per world size runs every scenario; the tests judge) for the hooks
and the call path and ``DistributedOptimizer`` (unsharded, and sharded: the
norm of every rank's part), fp32/bf16/fp16/fp64 gradients, the 2-norm and the
max norm, accumulation, gradients as bucket views, a norm under the limit (then
exactly the unclipped reduction), an inf on one rank, and
``error_if_nonfinite``; the hooks, the sharded optimizer and DDP's hook
again on the Triton norm kernels (interpreted). Single-process tests cover the norm's fixed order
on the CPU (the same bits with 1 and 2 threads) and the argument checks; the
norm kernels of both backends against float64 are ``test_norm_kernels.py``'s.

Tolerances: the mean is an fp32 sum of ``world_size`` terms (``world_size *
eps32`` of the terms' magnitudes), the norm is summed in rows in fp32 then in
fp64 (relative error under ``NORM_RTOL``), and the clipped value is rounded
once to the gradient's dtype (``eps_dtype``): a coefficient off by a factor,
a missing postscale or an unclipped bucket is far outside.
"""
import math

import pytest
import torch

from fusedreduce import DistributedGradReducer
from fusedreduce.clipping import NORM_ROW, check_clipping
from fusedreduce.kernels.norm.torch_backend import norm_powers, partials_powers
from harness import ranks_once_getter
from reference import reference_clip

EPS32 = torch.finfo(torch.float32).eps
#: the norm's relative error: rows of NORM_ROW fp32 terms (torch sums them
#: pairwise: about log2(NORM_ROW) roundings), then fp64
NORM_RTOL = 4 * math.log2(NORM_ROW) * EPS32
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPES = ((7, 13), (13,), (5, 3), (3000,))  # the last spans two norm rows
TIMEOUT = 300.0
#: the norm orders torch's clip_grad_norm_ test takes besides 2 and inf (any
#: order but 1, 2 and inf runs the general |x| ** p path of the kernels), each
#: with a limit that clips the test's gradients to a few percent (a 0.5-norm of
#: thousands of elements is millions: a smaller limit would push the fp16
#: results into fp16's subnormals, where the check says little)
TORCH_ORDERS = {0.5: 1e5, 1.5: 10.0, 4.0: 0.5}


#: GradScaler refuses fp16 gradients (it expects fp32 masters there)
SCALER_DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.float64)


def norm_bits(norm):
    """A norm's bits, whatever its dtype (NaN equal to itself)."""
    return norm.reshape(1).view(torch.int64 if norm.dtype == torch.float64 else torch.int32)


def _params(dtypes=DTYPES):
    return [torch.zeros(shape, dtype=dtype, requires_grad=True)
            for shape, dtype in zip(SHAPES, dtypes)]


def _grads(rank, step, magnitude=1.0, dtypes=DTYPES):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [(torch.randn(shape, generator=gen) * magnitude).to(dtype)
            for shape, dtype in zip(SHAPES, dtypes)]


def _backward(params, grads):
    """A backward pass that gives ``params`` exactly ``grads``."""
    sum((p * g).sum() for p, g in zip(params, grads)).backward()


def _hooked(rank, max_norm, norm_type=2.0, passes=1, views=False, magnitude=1.0, **kwargs):
    params = _params()
    reducer = DistributedGradReducer(params, max_grad_norm=max_norm, norm_type=norm_type,
                                     bucket_cap_mb=0.004, **kwargs)
    reducer.register_hooks(passes, gradient_as_bucket_view=views)
    for step in range(passes):
        _backward(params, _grads(rank, step, magnitude))
    return {"grads": [p.grad.clone() for p in params],
            "norm": None if reducer.grad_norm is None else reducer.grad_norm.clone()}


def _called(rank, max_norm, norm_type=2.0, **kwargs):
    params = _params()
    reducer = DistributedGradReducer(params, max_grad_norm=max_norm, norm_type=norm_type,
                                     bucket_cap_mb=0.004, **kwargs)
    out = reducer(_grads(rank, 0))
    return {"grads": list(out), "norm": reducer.grad_norm.clone()}


def _with_inf(rank, world_size, error_if_nonfinite, max_norm=1.0, **kwargs):
    params = _params()
    reducer = DistributedGradReducer(params, max_grad_norm=max_norm, bucket_cap_mb=0.004,
                                     error_if_nonfinite=error_if_nonfinite, **kwargs)
    reducer.register_hooks()
    grads = _grads(rank, 0)
    if rank == world_size - 1:
        grads[0][0, 0] = math.inf
    try:
        _backward(params, grads)
    except RuntimeError as exc:
        # the local gradients stay as backward left them: nothing written back
        untouched = all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        return {"raised": str(exc), "untouched": untouched}
    return {"grads": [p.grad.clone() for p in params], "norm": reducer.grad_norm.clone()}


def _optimizer(rank, shard, max_norm=1.0, norm_type=2.0, backend="auto", **kwargs):
    """DistributedOptimizer(SGD(lr=1), max_grad_norm=...) from zero parameters:
    after one step each parameter is minus its clipped gradient (sharded:
    stepped in fp32 masters from the 16-bit gradient, so the same values)."""
    from fusedreduce import DistributedOptimizer
    params = _params()
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), param_pack_thd=4000,
                               shard=shard, max_grad_norm=max_norm, norm_type=norm_type,
                               backend=backend, **kwargs)
    _backward(params, _grads(rank, 0))
    opt.step()
    return {"grads": [-p.detach().clone() for p in params], "norm": opt.grad_norm.clone()}


def _sharded_nan_max_norm(rank, world_size):
    """shard=True, the max norm, a NaN in the last rank's gradient at the last
    element of the (3000,) tensor (alone in its bucket: the last rank owns
    that element of the reduced bucket): the norm after backward
    (``max_grad_norm``) and ``clip_grad_norm_``'s must be NaN on every rank,
    though only the last rank's part holds the NaN."""
    from fusedreduce import DistributedOptimizer
    out = {}
    for via in ("max_grad_norm", "clip_grad_norm_"):
        params = _params()
        opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), param_pack_thd=4000,
                                   shard=True, norm_type=math.inf,
                                   max_grad_norm=1.0 if via == "max_grad_norm" else None)
        grads = _grads(rank, 0)
        if rank == world_size - 1:
            grads[3][-1] = math.nan
        _backward(params, grads)
        norm = opt.grad_norm if via == "max_grad_norm" else opt.clip_grad_norm_(1.0, math.inf)
        out[via] = float(norm)
    return out


def _grad_scaler(rank, shard, **kwargs):
    """The documented recipe: DistributedOptimizer(SGD(lr=1), max_grad_norm=1)
    under torch.amp.GradScaler, the scaler's scale handed over as a device
    tensor before backward: the limit applies to the unscaled norm and
    scaler.step unscales the clipped gradients as usual."""
    from fusedreduce import DistributedOptimizer
    params = _params(SCALER_DTYPES)
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), param_pack_thd=4000,
                               shard=shard, max_grad_norm=1.0, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt.loss_scale = scaler.scale(torch.ones(()))
    local = _grads(rank, 0, dtypes=SCALER_DTYPES)
    scaler.scale(sum((p.float() * g.float()).sum() for p, g in zip(params, local))).backward()
    scaler.step(opt)
    scaler.update()
    return {"grads": [-p.detach().clone() for p in params], "norm": opt.grad_norm.clone(),
            "local": local, "scale_after": scaler.get_scale()}


def _adasum(rank, shard, **kwargs):
    """AdaSum's combined gradients clipped, beside the same unclipped: the
    clipped ones are the unclipped times the coefficient of their norm."""
    from fusedreduce import DistributedOptimizer
    out = {}
    for max_norm in (None, 1.0):
        params = _params(SCALER_DTYPES)
        opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), reduce_method="adasum",
                                   param_pack_thd=4000, shard=shard, max_grad_norm=max_norm,
                                   **kwargs)
        _backward(params, _grads(rank, 0, dtypes=SCALER_DTYPES))
        opt.step()
        key = "clipped" if max_norm else "unclipped"
        out[key] = [-p.detach().clone() for p in params]
        if max_norm:
            out["norm"] = opt.grad_norm.clone()
    return out


class _Given(torch.nn.Module):
    """Parameters whose gradients are whatever ``forward(grads)``'s sum is
    differentiated against (``SCALER_DTYPES``: DDP buckets by dtype)."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.ParameterList(_params(SCALER_DTYPES))

    def forward(self, grads):
        return sum((p.float() * g.float()).sum() for p, g in zip(self.weights, grads))


def _ddp(rank, hook_name, max_norm, backend="auto", **kwargs):
    """Two DDP iterations (DDP rebuilds its buckets after the first) with a
    fusedreduce hook whose HookState clips; the gradients and norm of each,
    and how many times the norm's reading was shared so far."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_Given(), bucket_cap_mb=0.004)
    state = hooks.HookState(max_grad_norm=max_norm, backend=backend, **kwargs)
    model.register_comm_hook(state, getattr(hooks, hook_name))
    shared, share_norm = [], hooks.share_norm
    hooks.share_norm = lambda *args, **kw: shared.append(1) or share_norm(*args, **kw)
    out = []
    try:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            model(_grads(rank, step, dtypes=SCALER_DTYPES)).backward()
            out.append({"grads": [p.grad.clone() for p in model.module.weights],
                        "norm": None if state.grad_norm is None else state.grad_norm.clone(),
                        "shared": len(shared)})
    finally:
        hooks.share_norm = share_norm
    return out


def _ddp_grad_scaler(rank):
    """``_grad_scaler``'s recipe through DDP: the hook state takes the
    scaler's scale as ``loss_scale``, so the limit applies to the unscaled
    norm, and scaler.step unscales the clipped gradients."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_Given(), bucket_cap_mb=0.004)
    state = hooks.HookState(max_grad_norm=1.0)
    model.register_comm_hook(state, hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state.loss_scale = scaler.scale(torch.ones(()))
    local = _grads(rank, 0, dtypes=SCALER_DTYPES)
    scaler.scale(model(local)).backward()
    scaler.step(opt)
    scaler.update()
    return {"grads": [-p.detach().clone() for p in model.module.weights],
            "norm": state.grad_norm.clone(), "local": local, "scale_after": scaler.get_scale()}


def _ddp_inf_raises(rank, world_size, **kwargs):
    """An inf on the last rank with error_if_nonfinite: what backward raises."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_Given(), bucket_cap_mb=0.004)
    model.register_comm_hook(hooks.HookState(max_grad_norm=1.0, error_if_nonfinite=True,
                                             **kwargs),
                             hooks.allreduce_hook)
    grads = _grads(rank, 0, dtypes=SCALER_DTYPES)
    if rank == world_size - 1:
        grads[0][0, 0] = math.inf
    try:
        model(grads).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def _split_mismatch(rank, **differing):
    """Rank 0 alone splits the norm (or, with ``differing``, every rank splits
    and rank 0 alone takes those reducer arguments): the first call must raise
    on every rank (the others would never join the split's all-reduce, or join
    one of another size), naming the option."""
    params = _params()
    options = {"split_norm": rank == 0} if not differing else \
        dict(differing if rank == 0 else {}, split_norm=True)
    reducer = DistributedGradReducer(params, max_grad_norm=1.0, bucket_cap_mb=0.004, **options)
    try:
        reducer(_grads(rank, 0))
    except RuntimeError as exc:
        return str(exc)
    return None


def _split_rule(rank):
    """Whether ``split_norm=None`` splits, the CPU's threshold set to 1000
    spared elements for the test: buckets sparing each rank exactly that,
    and one element fewer; and what True and False give."""
    from fusedreduce import clipping
    world_size = torch.distributed.get_world_size()
    kept = dict(clipping.SPLIT_NORM_MIN_SPARED)
    clipping.SPLIT_NORM_MIN_SPARED["cpu"] = 1000
    try:
        # the fewest elements that spare 1000 (one rank spares nothing: any size)
        at = next((e for e in range(1000, 4000) if e - e // world_size >= 1000), 1000)
        out = {}
        for name, elements, split_norm in (("at", at, None), ("below", at - 1, None),
                                           ("told", 10, True), ("refused", at, False)):
            reducer = DistributedGradReducer([torch.zeros(elements, requires_grad=True)],
                                             max_grad_norm=1.0, split_norm=split_norm)
            split = reducer.norm_split
            out[name] = None if split is None else (split.rank, split.world_size)
    finally:
        clipping.SPLIT_NORM_MIN_SPARED.update(kept)
    return out


def on_rank(rank, world_size):
    return {
        "l2": _hooked(rank, 1.0),
        "inf_norm": _hooked(rank, 0.5, norm_type=math.inf),
        "inf_norm_string": _hooked(rank, 0.5, norm_type="inf"),  # torch's spelling
        # max_grad_norm=math.inf: the norm measured, nothing clipped (torch's
        # clip_grad_norm_(params, math.inf) idiom for logging the norm)
        "measure_only": _hooked(rank, math.inf),
        "measure_only_triton": _hooked(rank, math.inf, backend="triton"),
        "measure_only_split": _hooked(rank, math.inf, split_norm=True),
        "measure_only_inf": _with_inf(rank, world_size, False, max_norm=math.inf),
        "measure_only_optimizer_sharded": _optimizer(rank, True, math.inf),
        "ddp_measure_only": _ddp(rank, "allreduce_hook", math.inf),
        # the other orders torch's own clip_grad_norm_ test takes
        **{f"p{order}{suffix}": _hooked(rank, limit, norm_type=order, **options)
           for order, limit in TORCH_ORDERS.items() for suffix, options in (("", {}),
                                                             ("_triton", {"backend": "triton"}))},
        "called": _called(rank, 1.0),
        "accumulated": _hooked(rank, 1.0, passes=2),
        "views": _hooked(rank, 1.0, views=True),
        "no_views": _hooked(rank, 1.0, views=False),
        "under_the_limit": _hooked(rank, 1e6),
        "unclipped": _hooked(rank, None),
        "sum": _hooked(rank, 1.0, mean=False),
        "inf": _with_inf(rank, world_size, False),
        "inf_raises": _with_inf(rank, world_size, True),
        "optimizer": _optimizer(rank, False),
        "optimizer_sharded": _optimizer(rank, True),
        "optimizer_sharded_inf_norm": _optimizer(rank, True, 0.5, math.inf),
        "sharded_nan_max_norm": _sharded_nan_max_norm(rank, world_size),
        # the GPU's norm kernels (Triton, interpreted here) on the same paths
        "l2_triton": _hooked(rank, 1.0, backend="triton"),
        "inf_norm_triton": _hooked(rank, 0.5, norm_type=math.inf, backend="triton"),
        "optimizer_sharded_triton": _optimizer(rank, True, backend="triton"),
        "ddp_allreduce_triton": _ddp(rank, "allreduce_hook", 1.0, backend="triton"),
        "grad_scaler": _grad_scaler(rank, False),
        "grad_scaler_sharded": _grad_scaler(rank, True),
        "grad_scaler_ddp_hook": _ddp_grad_scaler(rank),
        "adasum": _adasum(rank, False),
        "adasum_sharded": _adasum(rank, True),
        "ddp_allreduce": _ddp(rank, "allreduce_hook", 1.0),
        "ddp_bf16": _ddp(rank, "bf16_compress_hook", 1.0),
        "ddp_adasum": _ddp(rank, "adasum_hook", 1.0),
        "ddp_adasum_unclipped": _ddp(rank, "adasum_hook", None),
        "ddp_under_the_limit": _ddp(rank, "allreduce_hook", 1e6),
        "ddp_unclipped": _ddp(rank, "allreduce_hook", None),
        "ddp_inf_raises": _ddp_inf_raises(rank, world_size),
        # split_norm=True: each rank reads its share of the buffers for the norm
        **{f"{name}_split": run() for name, run in (
            ("l2", lambda: _hooked(rank, 1.0, split_norm=True)),
            ("inf_norm", lambda: _hooked(rank, 0.5, norm_type=math.inf, split_norm=True)),
            ("called", lambda: _called(rank, 1.0, split_norm=True)),
            ("accumulated", lambda: _hooked(rank, 1.0, passes=2, split_norm=True)),
            ("views", lambda: _hooked(rank, 1.0, views=True, split_norm=True)),
            ("inf", lambda: _with_inf(rank, world_size, False, split_norm=True)),
            ("inf_raises", lambda: _with_inf(rank, world_size, True, split_norm=True)),
            ("optimizer", lambda: _optimizer(rank, False, split_norm=True)),
            ("l2_triton", lambda: _hooked(rank, 1.0, backend="triton", split_norm=True)),
            ("inf_norm_triton", lambda: _hooked(rank, 0.5, norm_type=math.inf,
                                                backend="triton", split_norm=True)),
            ("adasum", lambda: _adasum(rank, False, split_norm=True)),
            ("grad_scaler", lambda: _grad_scaler(rank, False, split_norm=True)),
            # DDP's hooks: the shared norm's all-reduce starts from a callback
            ("ddp_allreduce", lambda: _ddp(rank, "allreduce_hook", 1.0, split_norm=True)),
            ("ddp_bf16", lambda: _ddp(rank, "bf16_compress_hook", 1.0, split_norm=True)),
            ("ddp_adasum", lambda: _ddp(rank, "adasum_hook", 1.0, split_norm=True)),
            ("ddp_allreduce_triton", lambda: _ddp(rank, "allreduce_hook", 1.0,
                                                  backend="triton", split_norm=True)),
            ("ddp_inf_raises", lambda: _ddp_inf_raises(rank, world_size, split_norm=True)))},
        "split_rule": _split_rule(rank),
        "split_mismatch": _split_mismatch(rank),
        # the backends' norms have other rows: other bits, another split size
        "backend_mismatch": _split_mismatch(rank, backend="triton"),
        "local_scaler_dtypes": [_grads(rank, step, dtypes=SCALER_DTYPES) for step in range(2)],
        "local": [_grads(rank, step) for step in range(2)],
    }


@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    return ranks_once_getter(request, tmp_path_factory, "clipping", on_rank, __name__, TIMEOUT)


WORLD_SIZES = [1, 2, 3]
#: the cases run again with split_norm=True
SPLIT = ["l2", "inf_norm", "called", "accumulated", "views", "inf", "optimizer", "l2_triton",
         "inf_norm_triton"]


def _reduced(results, steps=1, mean=True):
    """The float64 mean (or sum) of every rank's gradients over ``steps``
    passes, and the same of their magnitudes (what rounding errors scale with)."""
    divisor = len(results) if mean else 1
    total = [sum(r["local"][s][i].double() for r in results for s in range(steps)) / divisor
             for i in range(len(SHAPES))]
    magnitudes = [sum(r["local"][s][i].double().abs() for r in results for s in range(steps))
                  / divisor for i in range(len(SHAPES))]
    return total, magnitudes


def _assert_clipped(seen, want_norm, want, magnitudes, coefficient, world_size, steps, what):
    # torch's per-dtype norms stack into fp64 beside the fp64 gradient
    assert seen["norm"].dtype == torch.float64, what
    norm = float(seen["norm"])
    assert abs(norm - want_norm) <= NORM_RTOL * want_norm, f"{what}: norm {norm} vs {want_norm}"
    for i, (got, exact, magnitude) in enumerate(zip(seen["grads"], want, magnitudes)):
        eps = torch.finfo(got.dtype).eps
        # before clipping: the fp32 sum over the ranks (world_size roundings)
        # and, accumulating, each rank's local sum rounded to the gradient's
        # dtype; then the norm's error through the coefficient, and one
        # rounding of the result
        reduced = (world_size * EPS32 + (eps if steps > 1 else 0.0)) * magnitude
        bound = coefficient * reduced + (NORM_RTOL + eps) * exact.abs() + 1e-30
        assert got.dtype == DTYPES[i]
        assert torch.all((got.double() - exact).abs() <= bound), f"{what}: gradient {i}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name, max_norm, norm_type, steps, mean", [
    ("l2", 1.0, 2.0, 1, True), ("inf_norm", 0.5, math.inf, 1, True),
    ("called", 1.0, 2.0, 1, True), ("accumulated", 1.0, 2.0, 2, True),
    ("views", 1.0, 2.0, 1, True), ("sum", 1.0, 2.0, 1, False),
    ("optimizer", 1.0, 2.0, 1, True), ("optimizer_sharded", 1.0, 2.0, 1, True),
    ("optimizer_sharded_inf_norm", 0.5, math.inf, 1, True),
    ("l2_triton", 1.0, 2.0, 1, True), ("inf_norm_triton", 0.5, math.inf, 1, True),
    ("optimizer_sharded_triton", 1.0, 2.0, 1, True),
    *[(f"p{order}{suffix}", limit, order, 1, True) for order, limit in TORCH_ORDERS.items()
      for suffix in ("", "_triton")],
    ("measure_only", math.inf, 2.0, 1, True), ("measure_only_triton", math.inf, 2.0, 1, True),
    ("measure_only_optimizer_sharded", math.inf, 2.0, 1, True),
])
def test_clipped_gradients_are_torchs_clipping_of_the_reduced_ones(ranks_once, world_size, name,
                                                                  max_norm, norm_type, steps,
                                                                  mean):
    results = ranks_once(world_size)
    reduced, magnitudes = _reduced(results, steps, mean)
    want_norm, want = reference_clip(reduced, max_norm, norm_type)
    coefficient = min(1.0, max_norm / (want_norm + 1e-6))
    assert coefficient < 0.5 or max_norm == math.inf  # the case clips, or only measures
    for rank, r in enumerate(results):
        _assert_clipped(r[name], want_norm, want, magnitudes, coefficient, world_size, steps,
                        f"rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["l2", "inf_norm", "called", "accumulated", "views", "inf",
                                  "optimizer", "optimizer_sharded",
                                  "optimizer_sharded_inf_norm", "l2_triton", "inf_norm_triton",
                                  "optimizer_sharded_triton"] + [f"{n}_split" for n in SPLIT])
def test_norm_and_gradients_are_the_same_bits_on_every_rank(ranks_once, world_size, name):
    results = [r[name] for r in ranks_once(world_size)]
    for rank, r in enumerate(results[1:], 1):
        assert norm_bits(r["norm"]) == norm_bits(results[0]["norm"]), rank
        for a, b in zip(r["grads"], results[0]["grads"]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", SPLIT)
def test_a_split_norm_gives_the_bits_of_every_rank_reading_all_of_it(ranks_once, world_size,
                                                                     name):
    # the unsplit cases are checked against float64 above; the split ones must
    # be those bits (each rank adds zeros to the others' row sums: exact)
    for rank, r in enumerate(ranks_once(world_size)):
        split, whole = r[f"{name}_split"], r[name]
        assert norm_bits(split["norm"]) == norm_bits(whole["norm"]), rank
        for a, b in zip(split["grads"], whole["grads"]):
            assert a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["ddp_allreduce", "ddp_bf16", "ddp_adasum",
                                  "ddp_allreduce_triton"])
def test_a_ddp_hooks_split_norm_gives_the_bits_of_the_unsplit_one(ranks_once, world_size, name):
    for rank, r in enumerate(ranks_once(world_size)):
        for step, (split, whole) in enumerate(zip(r[f"{name}_split"], r[name])):
            # one shared reading per step where there is anyone to share with
            assert split["shared"] == (0 if world_size == 1 else step + 1)
            assert whole["shared"] == 0
            assert norm_bits(split["norm"]) == norm_bits(whole["norm"]), \
                (rank, step)
            for a, b in zip(split["grads"], whole["grads"]):
                assert a.dtype == b.dtype and torch.equal(a, b), (rank, step)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_split_norm_raises_alike_and_clips_adasum_and_scaled_gradients_alike(ranks_once,
                                                                              world_size):
    for r in ranks_once(world_size):
        assert r["inf_raises_split"] == r["inf_raises"]
        assert r["ddp_inf_raises_split"] == r["ddp_inf_raises"]
        # under a GradScaler: the loss scale divides the shared norm alike
        split, whole = r["grad_scaler_split"], r["grad_scaler"]
        assert norm_bits(split["norm"]) == norm_bits(whole["norm"])
        assert all(torch.equal(a, b) for a, b in zip(split["grads"], whole["grads"]))
        split, whole = r["adasum_split"], r["adasum"]
        assert norm_bits(split["norm"]) == norm_bits(whole["norm"])
        assert all(torch.equal(a, b) for a, b in zip(split["clipped"], whole["clipped"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_nan_in_one_ranks_part_makes_the_sharded_max_norm_nan_everywhere(ranks_once,
                                                                          world_size):
    # torch's max norm of a gradient holding a NaN is NaN; the ranks' maxima
    # must not lose it on the way (gloo's MAX drops a NaN held by a later rank)
    for r in ranks_once(world_size):
        assert all(math.isnan(v) for v in r["sharded_nan_max_norm"].values()), r


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ranks_that_split_the_norm_or_take_backends_differently_are_refused(ranks_once,
                                                                          world_size):
    messages = [r["split_mismatch"] for r in ranks_once(world_size)]
    if world_size == 1:  # nothing to split: nothing differs
        assert messages == [None]
        return
    for message in messages:
        assert message is not None and "not on the bucket layout" in message
        assert "split_norm" in message and "('clipping', 1.0, 2.0, True)" in message
    for message in (r["backend_mismatch"] for r in ranks_once(world_size)):
        assert message is not None and "('backend', 'triton')" in message and \
            "('backend', 'torch')" in message and "('clipping', 1.0, 2.0, False)" not in message


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_split_norm_none_splits_from_the_threshold_per_rank(ranks_once, world_size):
    for rank, r in enumerate(ranks_once(world_size)):
        if world_size == 1:  # nothing to share, nothing spared
            assert r["split_rule"] == {"at": None, "below": None, "told": None, "refused": None}
        else:
            mine = (rank, world_size)
            assert r["split_rule"] == {"at": mine, "below": None, "told": mine, "refused": None}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["grad_scaler", "grad_scaler_sharded", "grad_scaler_ddp_hook"])
def test_under_a_grad_scaler_the_limit_applies_to_the_unscaled_norm(ranks_once, world_size,
                                                                    name):
    results = [r[name] for r in ranks_once(world_size)]
    mean = [sum(r["local"][i].double() for r in results) / world_size
            for i in range(len(SHAPES))]
    magnitudes = [sum(r["local"][i].double().abs() for r in results) / world_size
                  for i in range(len(SHAPES))]
    want_norm, want = reference_clip(mean, 1.0, 2.0)
    coefficient = min(1.0, 1.0 / (want_norm + 1e-6))
    for rank, r in enumerate(results):
        # a power-of-two scale multiplies and divides exactly: the same bound
        # as unscaled clipping; the scaler found nothing and kept its scale
        assert [g.dtype for g in r["grads"]] == list(SCALER_DTYPES)
        norm = float(r["norm"])
        assert abs(norm - want_norm) <= NORM_RTOL * want_norm, f"rank {rank}: norm {norm}"
        for i, (got, exact, magnitude) in enumerate(zip(r["grads"], want, magnitudes)):
            eps = torch.finfo(got.dtype).eps
            bound = coefficient * world_size * EPS32 * magnitude + \
                (NORM_RTOL + eps) * exact.abs() + 1e-30
            assert torch.all((got.double() - exact).abs() <= bound), f"rank {rank}: {i}"
        assert r["scale_after"] == 1024.0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["adasum", "adasum_sharded"])
def test_adasum_clips_its_combined_gradients(ranks_once, world_size, name):
    # the unclipped results were rounded to their dtypes (bf16 among them),
    # the fused norm is of the fp32 values before that rounding: the norm, and
    # through it the coefficient, may differ by bf16's eps
    rounding = torch.finfo(torch.bfloat16).eps
    for rank, r in enumerate(x[name] for x in ranks_once(world_size)):
        want_norm, want = reference_clip(r["unclipped"], 1.0, 2.0)
        assert abs(float(r["norm"]) - want_norm) <= (NORM_RTOL + rounding) * want_norm, rank
        assert want_norm > 2.0  # the case clips
        for i, (got, exact) in enumerate(zip(r["clipped"], want)):
            eps = torch.finfo(got.dtype).eps
            bound = (NORM_RTOL + rounding + 2 * eps) * exact.abs() + 1e-30
            assert torch.all((got.double() - exact).abs() <= bound), f"rank {rank}: {i}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["ddp_allreduce", "ddp_bf16", "ddp_allreduce_triton"])
def test_ddp_hooks_clip_through_their_hook_state(ranks_once, world_size, name):
    results = ranks_once(world_size)
    wire = torch.finfo(torch.bfloat16).eps if name == "ddp_bf16" else 0.0
    for step in range(2):  # DDP's first iteration, then its rebuilt buckets
        mean = [sum(r["local_scaler_dtypes"][step][i].double() for r in results) / world_size
                for i in range(len(SHAPES))]
        magnitudes = [sum(r["local_scaler_dtypes"][step][i].double().abs() for r in results)
                      / world_size for i in range(len(SHAPES))]
        want_norm, want = reference_clip(mean, 1.0, 2.0)
        coefficient = min(1.0, 1.0 / (want_norm + 1e-6))
        assert coefficient < 0.5
        for rank, r in enumerate(x[name][step] for x in results):
            # bf16 on the wire: each rank's share is rounded to bf16 once
            norm = float(r["norm"])
            assert abs(norm - want_norm) <= (NORM_RTOL + wire) * want_norm, (rank, step)
            for i, (got, exact, magnitude) in enumerate(zip(r["grads"], want, magnitudes)):
                eps = torch.finfo(got.dtype).eps
                bound = coefficient * (world_size * EPS32 + wire) * magnitude + \
                    (NORM_RTOL + wire + eps) * exact.abs() + 1e-30
                assert torch.all((got.double() - exact).abs() <= bound), (rank, step, i)
            first = results[0][name][step]
            assert torch.equal(r["norm"], first["norm"])
            assert all(torch.equal(a, b) for a, b in zip(r["grads"], first["grads"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_adasum_hook_clips_and_a_norm_under_the_limit_changes_nothing(ranks_once,
                                                                         world_size):
    rounding = torch.finfo(torch.bfloat16).eps  # as for the optimizer's AdaSum above
    for rank, r in enumerate(ranks_once(world_size)):
        for step in range(2):
            unclipped = r["ddp_adasum_unclipped"][step]["grads"]
            clipped = r["ddp_adasum"][step]
            want_norm, want = reference_clip(unclipped, 1.0, 2.0)
            norm = float(clipped["norm"])
            assert abs(norm - want_norm) <= (NORM_RTOL + rounding) * want_norm, (rank, step)
            for i, (got, exact) in enumerate(zip(clipped["grads"], want)):
                eps = torch.finfo(got.dtype).eps
                bound = (NORM_RTOL + rounding + 2 * eps) * exact.abs() + 1e-30
                assert torch.all((got.double() - exact).abs() <= bound), (rank, step, i)
            assert all(torch.equal(a, b) for a, b in
                       zip(r["ddp_under_the_limit"][step]["grads"],
                           r["ddp_unclipped"][step]["grads"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_ddp_hook_with_error_if_nonfinite_fails_backward_on_every_rank(ranks_once,
                                                                        world_size):
    for r in ranks_once(world_size):
        assert r["ddp_inf_raises"] is not None and "non-finite" in r["ddp_inf_raises"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_under_the_limit_the_gradients_are_the_unclipped_reduction_bitwise(ranks_once,
                                                                          world_size):
    for r in ranks_once(world_size):
        assert all(torch.equal(a, b) for a, b in zip(r["under_the_limit"]["grads"],
                                                     r["unclipped"]["grads"]))
        assert r["unclipped"]["norm"] is None  # no clipping, no norm


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_norm_type_inf_as_torch_spells_it_is_the_max_norm(ranks_once, world_size):
    for r in ranks_once(world_size):
        spelled, number = r["inf_norm_string"], r["inf_norm"]
        assert norm_bits(spelled["norm"]) == norm_bits(number["norm"])
        assert all(torch.equal(a, b) for a, b in zip(spelled["grads"], number["grads"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_infinite_limit_measures_the_norm_and_leaves_the_gradients_bitwise(ranks_once,
                                                                              world_size):
    for rank, r in enumerate(ranks_once(world_size)):
        unclipped = r["unclipped"]["grads"]
        for name, clipped in (("measure_only", "l2"), ("measure_only_triton", "l2_triton"),
                              ("measure_only_split", "l2")):
            seen = r[name]
            # the norm of the same reduced gradients: the clipping case's bits
            assert norm_bits(seen["norm"]) == norm_bits(r[clipped]["norm"]), \
                (rank, name)
            assert all(torch.equal(a, b) for a, b in zip(seen["grads"], unclipped)), (rank, name)
        for step, (seen, plain, clipping) in enumerate(zip(
                r["ddp_measure_only"], r["ddp_unclipped"], r["ddp_allreduce"])):
            assert norm_bits(seen["norm"]) == norm_bits(clipping["norm"])
            assert all(torch.equal(a, b) for a, b in zip(seen["grads"], plain["grads"])), step
        # torch's formula: an infinite limit over an infinite norm is NaN, so
        # every gradient becomes NaN (a GradScaler skips the step)
        assert math.isinf(float(r["measure_only_inf"]["norm"]))
        assert all(g.isnan().all() for g in r["measure_only_inf"]["grads"]), rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucket_views_clip_bitwise_as_the_flat_path(ranks_once, world_size):
    for r in ranks_once(world_size):
        assert all(torch.equal(a, b) for a, b in zip(r["views"]["grads"],
                                                     r["no_views"]["grads"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_inf_on_one_rank_gives_every_rank_an_inf_norm_and_no_finite_step(ranks_once,
                                                                           world_size):
    for r in ranks_once(world_size):
        assert math.isinf(float(r["inf"]["norm"]))
        # torch's rule: the coefficient is 0, so finite gradients become 0 and
        # the inf becomes NaN: a GradScaler finds it and skips the step
        first = r["inf"]["grads"][0]
        assert torch.isnan(first[0, 0])
        assert all(torch.all((g == 0) | torch.isnan(g)) for g in r["inf"]["grads"])
        raised = r["inf_raises"]
        assert "non-finite" in raised["raised"] and raised["untouched"]


def _with_threads(count, fn):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(count)
        return fn()
    finally:
        torch.set_num_threads(threads)


def test_the_norm_has_the_same_bits_whatever_the_thread_count():
    buffer = torch.randn(5 * NORM_ROW * 64 + 17, generator=torch.Generator().manual_seed(3))
    one = _with_threads(1, lambda: norm_powers([buffer], 2.0))
    two = _with_threads(2, lambda: norm_powers([buffer], 2.0))
    assert one.view(torch.int64) == two.view(torch.int64)


def test_a_sum_of_more_rows_than_torchs_grain_has_the_same_bits_whatever_the_thread_count():
    # torch splits one sum over more than 32,768 elements among its threads:
    # a 67M-element buffer's rows; a meta tensor stands in for the buffer
    rows = 40_000
    buffer = torch.empty(rows * NORM_ROW - 5, device="meta")
    partials = torch.rand(rows, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(4)) * 1e3
    one = _with_threads(1, lambda: partials_powers(partials, [buffer], 2.0))
    two = _with_threads(2, lambda: partials_powers(partials, [buffer], 2.0))
    assert one.view(torch.int64) == two.view(torch.int64)
    # the partials are row norms: their squares add up
    assert math.isclose(float(one), math.fsum(v * v for v in partials.tolist()), rel_tol=1e-12)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"max_grad_norm": "1"}, TypeError, "max_grad_norm must be a number"),
    ({"max_grad_norm": True}, TypeError, "max_grad_norm must be a number"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be positive"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be positive"),
    ({"max_grad_norm": math.nan}, ValueError, "max_grad_norm must be positive"),
    ({"max_grad_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be positive"),
    # torch takes these; they cannot limit a gradient's size (check_norm_type)
    ({"max_grad_norm": 1.0, "norm_type": -2.0}, ValueError, "cannot limit"),
    ({"max_grad_norm": 1.0, "norm_type": "-inf"}, ValueError, "norm_type must be positive"),
    ({"max_grad_norm": 1.0, "norm_type": math.nan}, ValueError, "norm_type must be positive"),
    ({"max_grad_norm": 1.0, "norm_type": "nan"}, ValueError, "norm_type must be positive"),
    ({"max_grad_norm": 1.0, "norm_type": "two"}, ValueError, "must be a number"),
    ({"max_grad_norm": 1.0, "norm_type": None}, TypeError, "norm_type must be a number"),
    ({"max_grad_norm": 1.0, "norm_type": True}, TypeError, "norm_type must be a number"),
    ({"max_grad_norm": 1.0, "error_if_nonfinite": 1}, TypeError, "error_if_nonfinite"),
])
def test_bad_clipping_arguments_are_refused(kwargs, error, fragment):
    args = {"max_grad_norm": None, "norm_type": 2.0, "error_if_nonfinite": False, **kwargs}
    with pytest.raises(error, match=fragment):
        check_clipping(args["max_grad_norm"], args["norm_type"], args["error_if_nonfinite"])


@pytest.mark.parametrize("norm_type, order", [("inf", math.inf), ("Infinity", math.inf),
                                              ("2", 2.0), (3, 3.0), (0.5, 0.5)])
def test_norm_type_is_read_as_torch_reads_it(norm_type, order):
    assert check_clipping(1.0, norm_type, False) == (1.0, order)
