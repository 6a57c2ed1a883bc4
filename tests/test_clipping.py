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
from fusedreduce.kernels.norm.torch_backend import flat_norm_power
from harness import ranks_once_getter
from reference import reference_clip

EPS32 = torch.finfo(torch.float32).eps
#: the norm's relative error: rows of NORM_ROW fp32 terms (torch sums them
#: pairwise: about log2(NORM_ROW) roundings), then fp64
NORM_RTOL = 4 * math.log2(NORM_ROW) * EPS32
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHAPES = ((7, 13), (13,), (5, 3), (3000,))  # the last spans two norm rows
TIMEOUT = 300.0


#: GradScaler refuses fp16 gradients (it expects fp32 masters there)
SCALER_DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.float64)


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


def _called(rank, max_norm, norm_type=2.0):
    params = _params()
    reducer = DistributedGradReducer(params, max_grad_norm=max_norm, norm_type=norm_type,
                                     bucket_cap_mb=0.004)
    out = reducer(_grads(rank, 0))
    return {"grads": list(out), "norm": reducer.grad_norm.clone()}


def _with_inf(rank, world_size, error_if_nonfinite):
    params = _params()
    reducer = DistributedGradReducer(params, max_grad_norm=1.0, bucket_cap_mb=0.004,
                                     error_if_nonfinite=error_if_nonfinite)
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


def _optimizer(rank, shard, max_norm=1.0, norm_type=2.0, backend="auto"):
    """DistributedOptimizer(SGD(lr=1), max_grad_norm=...) from zero parameters:
    after one step each parameter is minus its clipped gradient (sharded:
    stepped in fp32 masters from the 16-bit gradient, so the same values)."""
    from fusedreduce import DistributedOptimizer
    params = _params()
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), param_pack_thd=4000,
                               shard=shard, max_grad_norm=max_norm, norm_type=norm_type)
    opt.reducer.backend = backend
    _backward(params, _grads(rank, 0))
    opt.step()
    return {"grads": [-p.detach().clone() for p in params], "norm": opt.grad_norm.clone()}


def _grad_scaler(rank, shard):
    """The documented recipe: DistributedOptimizer(SGD(lr=1), max_grad_norm=1)
    under torch.amp.GradScaler, the scaler's scale handed over as a device
    tensor before backward: the limit applies to the unscaled norm and
    scaler.step unscales the clipped gradients as usual."""
    from fusedreduce import DistributedOptimizer
    params = _params(SCALER_DTYPES)
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), param_pack_thd=4000,
                               shard=shard, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt.loss_scale = scaler.scale(torch.ones(()))
    local = _grads(rank, 0, dtypes=SCALER_DTYPES)
    scaler.scale(sum((p.float() * g.float()).sum() for p, g in zip(params, local))).backward()
    scaler.step(opt)
    scaler.update()
    return {"grads": [-p.detach().clone() for p in params], "norm": opt.grad_norm.clone(),
            "local": local, "scale_after": scaler.get_scale()}


def _adasum(rank, shard):
    """AdaSum's combined gradients clipped, beside the same unclipped: the
    clipped ones are the unclipped times the coefficient of their norm."""
    from fusedreduce import DistributedOptimizer
    out = {}
    for max_norm in (None, 1.0):
        params = _params(SCALER_DTYPES)
        opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), reduce_method="adasum",
                                   param_pack_thd=4000, shard=shard, max_grad_norm=max_norm)
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


def _ddp(rank, hook_name, max_norm, backend="auto"):
    """Two DDP iterations (DDP rebuilds its buckets after the first) with a
    fusedreduce hook whose HookState clips; the gradients and norm of each."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_Given(), bucket_cap_mb=0.004)
    state = hooks.HookState(max_grad_norm=max_norm, backend=backend)
    model.register_comm_hook(state, getattr(hooks, hook_name))
    out = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(_grads(rank, step, dtypes=SCALER_DTYPES)).backward()
        out.append({"grads": [p.grad.clone() for p in model.module.weights],
                    "norm": None if state.grad_norm is None else state.grad_norm.clone()})
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


def _ddp_inf_raises(rank, world_size):
    """An inf on the last rank with error_if_nonfinite: what backward raises."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_Given(), bucket_cap_mb=0.004)
    model.register_comm_hook(hooks.HookState(max_grad_norm=1.0, error_if_nonfinite=True),
                             hooks.allreduce_hook)
    grads = _grads(rank, 0, dtypes=SCALER_DTYPES)
    if rank == world_size - 1:
        grads[0][0, 0] = math.inf
    try:
        model(grads).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def on_rank(rank, world_size):
    return {
        "l2": _hooked(rank, 1.0),
        "inf_norm": _hooked(rank, 0.5, norm_type=math.inf),
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
        "local_scaler_dtypes": [_grads(rank, step, dtypes=SCALER_DTYPES) for step in range(2)],
        "local": [_grads(rank, step) for step in range(2)],
    }


@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    return ranks_once_getter(request, tmp_path_factory, "clipping", on_rank, __name__, TIMEOUT)


WORLD_SIZES = [1, 2, 3]


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
])
def test_clipped_gradients_are_torchs_clipping_of_the_reduced_ones(ranks_once, world_size, name,
                                                                  max_norm, norm_type, steps,
                                                                  mean):
    results = ranks_once(world_size)
    reduced, magnitudes = _reduced(results, steps, mean)
    want_norm, want = reference_clip(reduced, max_norm, norm_type)
    coefficient = min(1.0, max_norm / (want_norm + 1e-6))
    assert coefficient < 0.5  # the case clips
    for rank, r in enumerate(results):
        _assert_clipped(r[name], want_norm, want, magnitudes, coefficient, world_size, steps,
                        f"rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["l2", "inf_norm", "called", "accumulated", "views", "inf",
                                  "optimizer", "optimizer_sharded",
                                  "optimizer_sharded_inf_norm", "l2_triton", "inf_norm_triton",
                                  "optimizer_sharded_triton"])
def test_norm_and_gradients_are_the_same_bits_on_every_rank(ranks_once, world_size, name):
    results = [r[name] for r in ranks_once(world_size)]
    for rank, r in enumerate(results[1:], 1):
        assert r["norm"].view(torch.int32) == results[0]["norm"].view(torch.int32), rank
        for a, b in zip(r["grads"], results[0]["grads"]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), rank


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


def test_the_norm_has_the_same_bits_whatever_the_thread_count():
    buffer = torch.randn(5 * NORM_ROW * 64 + 17, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flat_norm_power(buffer, 2.0)
        torch.set_num_threads(2)
        two = flat_norm_power(buffer, 2.0)
    finally:
        torch.set_num_threads(threads)
    assert one.view(torch.int64) == two.view(torch.int64)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"max_grad_norm": "1"}, TypeError, "max_grad_norm must be a number"),
    ({"max_grad_norm": True}, TypeError, "max_grad_norm must be a number"),
    ({"max_grad_norm": 0.0}, ValueError, "positive and finite"),
    ({"max_grad_norm": math.inf}, ValueError, "positive and finite"),
    ({"max_grad_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be positive"),
    ({"max_grad_norm": 1.0, "norm_type": math.nan}, ValueError, "norm_type must be positive"),
    ({"max_grad_norm": 1.0, "error_if_nonfinite": 1}, TypeError, "error_if_nonfinite"),
])
def test_bad_clipping_arguments_are_refused(kwargs, error, fragment):
    args = {"max_grad_norm": None, "norm_type": 2.0, "error_if_nonfinite": False, **kwargs}
    with pytest.raises(error, match=fragment):
        check_clipping(args["max_grad_norm"], args["norm_type"], args["error_if_nonfinite"])
