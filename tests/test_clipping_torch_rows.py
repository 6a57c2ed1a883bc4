"""PyTorch's own ``clip_grad_norm_`` tests (test_nn.py), re-expressed for the
fused clip on every entry point, at 1, 2 and 3 gloo ranks.

The rows, from ``test_clip_grad_norm`` and
``test_clip_grad_norm_error_if_nonfinite``:

- ``nn.Linear(10, 10)``'s gradients (``arange(1, 101)`` and ``ones / 1000``)
  clipped to 2 in orders 0.5, 1.5, 2, 4 and inf, and small ones
  (``rand / 10000``, ``ones / 500``) left as they are; fp32 as torch's, and
  fp64;
- fp64 gradients of ``±2e22`` (every element, or one; with or without a
  prefix parameter whose gradient is 1): finite in every positive order, so
  ``error_if_nonfinite=True`` must not raise. Their p-th powers overflow fp32
  (``2e22 ** 2 = 4e44``): a norm or a sum of powers taken in fp32 gives inf;
- fp64 gradients of ``±2e200``: finite in orders inf, 1 and 0.1 (the norm is
  past fp32's range: an fp32 norm is inf, its coefficient 0 and every
  gradient zeroed), infinite in orders 2 and 3.5 (their powers overflow fp64,
  as in torch): there ``error_if_nonfinite=True`` raises, and without it the
  gradients are zeroed, as torch's coefficient ``1 / (inf + 1e-6)`` does;
- fp32 beside fp64 gradients: torch's stacked per-dtype norms promote, so the
  norm is fp64;
- an exhausted parameter generator: torch's warning, and a norm of 0.

torch's rows with orders of 0 and below are left out: the library refuses
them (``clipping.check_norm_type``).

The entry points: ``DistributedGradReducer(max_grad_norm=...)`` (hooks, both
kernel backends, Triton's interpreted here), DDP with a clipping
``HookState``, ``DistributedOptimizer(max_grad_norm=...)`` unsharded and
``shard=True``, and ``DistributedOptimizer.clip_grad_norm_()`` unsharded and
``shard=True``. Every rank gives the same gradients, so the reduced mean is
the row (up to the mean's rounding), and the optimizers are plain SGD with
``lr=1`` from zero parameters: after a step each parameter is minus its
clipped gradient, on every rank (sharded ones too, after the gather).

The reference is ``reference.reference_clip`` (float64, exactly rounded sums).
Tolerances, relative, from the dtypes' eps (``eps`` the gradients' dtype's):

- the reduced mean: ``world_size`` identical addends summed and divided,
  ``(world_size + 1) * eps`` per element, so in the norm too (a relative
  error of every element is the norm's, whatever the order);
- the norm's sums: rows of ``NORM_ROW`` summed in the buffer's dtype (fp32
  for 16-bit), ``log2(NORM_ROW)`` roundings (4x for margin), or the sharded
  ``clip_grad_norm_``'s per-slice norms (fewer); ``|x| ** p`` and the root
  ``1 / p`` multiply a sum's relative error by ``max(p, 1 / p)``;
- the norm's rounding to its dtype (``eps`` of fp32 or fp64) and the clipped
  value's to the gradient's dtype.
"""
import math
import warnings

import pytest
import torch

from fusedreduce.kernels import NORM_ROW
from harness import ranks_once_getter
from reference import reference_clip
from test_clipping import norm_bits
from test_clipping_properties import _Given

TIMEOUT = 600.0
WORLD_SIZES = [1, 2, 3]
F32, F64 = torch.float32, torch.float64
#: torch's orders in test_clip_grad_norm, and in the nonfinite test (positive)
LINEAR_ORDERS = (0.5, 1.5, 2.0, 4.0, math.inf)
NONFINITE_ORDERS = (0.1, 1.0, 2.0, 3.5, math.inf)
#: the 2e200 row's orders whose norm overflows fp64 (torch's "norms_nonfinite")
OVERFLOWING = (2.0, 3.5)
#: the entry points; the ``_triton`` ones take the Triton norm kernels
ENTRIES = ("reducer", "reducer_triton", "ddp_hook", "optimizer", "optimizer_sharded",
           "optimizer_sharded_triton", "clip_method", "clip_method_sharded")
#: the scalar rows' variants past the first skip the Triton entries: the
#: interpreter is slow, and the variants differ in the gradients, not the kernels
UNTRITONED = tuple(e for e in ENTRIES if not e.endswith("_triton"))


# ------------------------------------------------------------------ the rows
def _linear_grads(dtype, small):
    """torch's test_clip_grad_norm gradients for ``nn.Linear(10, 10)``'s weight
    and bias (``small``: the ones it leaves unclipped; seeded here)."""
    if small:
        gen = torch.Generator().manual_seed(0)
        return [(torch.rand(10, 10, generator=gen) / 10000).to(dtype),
                (torch.ones(10) / 500).to(dtype)]
    return [torch.arange(1.0, 101.0).view(10, 10).to(dtype), (torch.ones(10) / 1000).to(dtype)]


def _scalar_grads(scalar, one_element, prefix):
    """torch's test_clip_grad_norm_error_if_nonfinite gradients (fp64): a
    10-element parameter's gradient ``scalar`` everywhere or in element 1
    only, after a 1-element parameter with gradient 1 when ``prefix``."""
    grad = torch.zeros(10, dtype=F64)
    if one_element:
        grad[1] = scalar
    else:
        grad.fill_(scalar)
    return ([torch.ones(1, dtype=F64)] if prefix else []) + [grad]


def rows():
    """``{name: (grads, max_norm, norm_type, error_if_nonfinite, entries)}``."""
    out = {}
    for dtype in (F32, F64):
        for order in LINEAR_ORDERS:
            for small in (False, True):
                out[f"linear_{'small_' if small else ''}{dtype}_{order}"] = (
                    _linear_grads(dtype, small), 2.0, order, False, ENTRIES)
    variants = [(one, prefix) for one in (False, True) for prefix in (False, True)]
    for scalar, name in ((2e22, "e22"), (2e200, "e200")):
        for i, (one, prefix) in enumerate(variants):
            sign = -1.0 if i % 2 else 1.0  # torch takes both signs
            for order in NONFINITE_ORDERS:
                out[f"{name}_{one}_{prefix}_{order}"] = (
                    _scalar_grads(sign * scalar, one, prefix), 1.0, order, True,
                    ENTRIES if i == 0 else UNTRITONED)
    # what error_if_nonfinite=False does with torch's infinite norms: zeros
    for order in OVERFLOWING:
        out[f"e200_kept_{order}"] = (_scalar_grads(2e200, False, True), 1.0, order, False,
                                     ENTRIES)
    for order in (2.0, math.inf):
        out[f"mixed_{order}"] = ([torch.ones(3, dtype=F32), torch.full((4,), 2e22, dtype=F64)],
                                 1.0, order, True, ENTRIES)
    return out


# ----------------------------------------------------------- the entry points
def _run(entry, grads, max_norm, norm_type, error_if_nonfinite):
    """One step of ``entry`` on ``grads``: ``{"norm", "grads"}`` or ``{"raised"}``."""
    from fusedreduce import DistributedGradReducer, DistributedOptimizer, hooks
    # Parameters: a ParameterList would wrap plain tensors in new ones
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    backend = "triton" if entry.endswith("_triton") else "torch"
    clip = {"max_grad_norm": max_norm, "norm_type": norm_type,
            "error_if_nonfinite": error_if_nonfinite}
    try:
        if entry.startswith("reducer"):
            reducer = DistributedGradReducer(params, backend=backend, **clip).register_hooks()
            _Given(params)(grads).backward()
            return {"norm": reducer.grad_norm.clone(), "grads": [p.grad.clone() for p in params]}
        if entry == "ddp_hook":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(_Given(params))
            state = hooks.HookState(backend=backend, **clip)
            model.register_comm_hook(state, hooks.allreduce_hook)
            model(grads).backward()
            return {"norm": state.grad_norm.clone(),
                    "grads": [p.grad.clone() for p in model.module.weights]}
        shard = "sharded" in entry
        sgd = torch.optim.SGD(params, lr=1.0)
        if entry.startswith("clip_method"):
            opt = DistributedOptimizer(sgd, shard=shard)
            _Given(params)(grads).backward()
            before = [p.grad.clone() for p in params]
            try:
                norm = opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
            except RuntimeError:
                # torch: nothing is scaled when it raises
                if not all(torch.equal(p.grad, b) for p, b in zip(params, before)):
                    return {"raised": "and scaled the gradients"}
                raise
        else:
            opt = DistributedOptimizer(sgd, shard=shard, backend=backend, **clip)
            _Given(params)(grads).backward()
            norm = opt.grad_norm
        opt.step()
        return {"norm": norm.clone(), "grads": [-p.detach().clone() for p in params]}
    except RuntimeError as exc:
        return {"raised": str(exc)}


def _empty_generator(entry):
    """torch's last row: an exhausted generator warns, and the norm is 0."""
    from fusedreduce import DistributedGradReducer, DistributedOptimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if entry == "reducer":
            params = torch.nn.Linear(2, 2).parameters()
            list(params)  # exhausted, as torch's test leaves it
            reducer = DistributedGradReducer(params, max_grad_norm=1.0)
            reducer([])
            norm = reducer.grad_norm
        else:  # an optimizer holds parameters; with no gradient yet, torch's norm is 0
            opt = DistributedOptimizer(torch.optim.SGD([torch.zeros(3, requires_grad=True)],
                                                       lr=1.0), shard=entry.endswith("sharded"))
            norm = opt.clip_grad_norm_(1.0)
    return {"norm": norm.clone(), "warnings": [str(w.message) for w in caught]}


def on_rank(rank, world_size):
    return {"rows": {(name, entry): _run(entry, [g.clone() for g in grads], max_norm, order,
                                         error)
                     for name, (grads, max_norm, order, error, entries) in rows().items()
                     for entry in entries},
            "empty": {entry: _empty_generator(entry)
                      for entry in ("reducer", "clip_method", "clip_method_sharded")}}


@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    return ranks_once_getter(request, tmp_path_factory, "clipping_torch_rows", on_rank,
                             __name__, TIMEOUT)


# ------------------------------------------------------------------ judging
def _tolerance(grads, norm_type, world_size):
    """The norm's relative tolerance (see the module docstring)."""
    eps = max(torch.finfo(g.dtype).eps for g in grads)
    amplified = 1.0 if norm_type == math.inf else max(norm_type, 1.0 / norm_type)
    return (world_size + 1) * eps + amplified * 4 * math.log2(NORM_ROW) * eps + eps


def _assert_row(result, grads, max_norm, norm_type, error, world_size, what):
    want_dtype = F64 if any(g.dtype == F64 for g in grads) else F32
    overflows = max(abs(float(g.double().abs().max())) for g in grads) > 1e154 \
        and norm_type in OVERFLOWING
    if overflows and error:
        assert "non-finite" in result.get("raised", ""), f"{what}: {result}"
        return
    assert "raised" not in result, f"{what}: {result.get('raised')}"
    norm = result["norm"]
    assert norm.dtype == want_dtype and norm.shape == (), f"{what}: {norm.dtype}"
    if overflows:  # torch: an inf norm, a zero coefficient
        assert float(norm) == math.inf, f"{what}: {float(norm)}"
        assert all(torch.all(g == 0) for g in result["grads"]), what
        return
    want_norm, want = reference_clip(grads, max_norm, norm_type)
    rtol = _tolerance(grads, norm_type, world_size)
    assert abs(float(norm) - want_norm) <= rtol * want_norm, \
        f"{what}: norm {float(norm)!r} vs {want_norm!r}"
    for i, (got, exact) in enumerate(zip(result["grads"], want)):
        assert got.dtype == grads[i].dtype, f"{what}: gradient {i} dtype"
        bound = (rtol + torch.finfo(got.dtype).eps) * exact.abs() \
            + torch.finfo(got.dtype).smallest_normal
        assert torch.all((got.double() - exact).abs() <= bound), \
            f"{what}: gradient {i}: {got.flatten()[:3].tolist()} vs {exact.flatten()[:3].tolist()}"


ROWS = rows()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_torchs_clip_grad_norm_rows_hold_on_every_entry_point(ranks_once, world_size, entry):
    results = ranks_once(world_size)
    failures = []
    for name, row in ROWS.items():
        grads, max_norm, norm_type, error, entries = row
        if entry not in entries:
            continue
        what = f"{entry} {name}"
        try:
            _assert_row(results[0]["rows"][(name, entry)], grads, max_norm, norm_type, error,
                        world_size, what)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_norm_and_the_clipped_gradients_are_the_same_bits_on_every_rank(ranks_once,
                                                                            world_size):
    results = ranks_once(world_size)
    for key, first in results[0]["rows"].items():
        for rank in range(1, world_size):
            other = results[rank]["rows"][key]
            if "raised" in first:
                assert "raised" in other, (key, rank)
                continue
            assert norm_bits(other["norm"]) == norm_bits(first["norm"]), (key, rank)
            assert all(torch.equal(a, b) for a, b in zip(other["grads"], first["grads"])), \
                (key, rank)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_exhausted_parameter_generator_warns_as_torch_and_gives_a_zero_norm(ranks_once,
                                                                              world_size):
    from fusedreduce.clipping import EMPTY_GENERATOR
    results = ranks_once(world_size)
    for rank in range(world_size):
        for entry, seen in results[rank]["empty"].items():
            # torch.nn.utils.clip_grad_norm_ returns torch.tensor(0.)
            assert seen["norm"].dtype == F32 and float(seen["norm"]) == 0.0, entry
            # torch warns for a generator only: the optimizers hold their lists
            want = [EMPTY_GENERATOR] if entry == "reducer" else []
            assert seen["warnings"] == want, (entry, seen["warnings"])
