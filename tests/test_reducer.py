"""DistributedGradReducer's call API on local gloo ranks.

The reduced shard gradients are checked against a float64 whole-batch
reference (called directly and through backward hooks, for every dtype, bucket
cap and fusion grouping), then the structures a call returns, the 16-bit
overflow guard, a world of one, a subgroup, non-finite detection, and the
errors raised on every rank instead of a hang (bad arguments, including those
of register_hooks, and ranks that disagree on their parameters). What the
overlap engine behind register_hooks does during backward is test_overlap.py's.
It stays above 300 lines because the whole-batch check, with the heads,
reference, rounding bound and configurations only it uses, takes about 160 of
them, and the rest is one rank function and test per aspect of the same API.

Each ``run_ranks`` call spawns fresh processes (seconds each), so one call
checks many configurations and returns everything for the parent to judge.
Rank functions never assert: a rank that raised would leave the others
waiting in a collective, so they return what they saw instead.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import (CRASH_TIMEOUT, ONE_BYTE_MB, TIMEOUT, assert_raised_before_any_collective,
                     outcomes, outcomes_and_collectives, rank_errors, record_collectives,
                     run_ranks)
from fusedreduce import DistributedGradReducer, DistributedOptimizer
from reference import SIXTEEN_BIT, communication_dtype, subnormal_spacing

HUGE = 1e3  # MiB: everything that may share a bucket does
BATCH = 12  # rows; divisible by every world size used here

# (in_features, out_features, bias, dtype): one reducer over mixed precisions,
# as in the seed's note on grads "mixed with float16 and float32"
HEADS = [(5, 3, True, torch.float32), (7, 1, True, torch.float16),
         (4, 6, False, torch.bfloat16), (3, 2, True, torch.float64),
         (33, 9, True, torch.float16), (9, 4, True, torch.bfloat16)]
PARAM_DTYPES = [d for _, _, bias, d in HEADS for _ in range(2 if bias else 1)]


def _heads() -> nn.ModuleList:
    """Independent linear heads; with the loss below their gradients do not
    depend on the weights, so every rank and the reference agree without a
    broadcast."""
    return nn.ModuleList(nn.Linear(i, o, bias=b, dtype=d) for i, o, b, d in HEADS)


def _batch():
    """Per head, inputs ``x`` and output weights ``t``: float64 draws rounded to
    the head's dtype, so the float64 reference sees exactly the values the
    ranks compute with."""
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, i, generator=gen, dtype=torch.float64).to(d),
             torch.randn(BATCH, o, generator=gen, dtype=torch.float64).to(d))
            for i, o, _, d in HEADS]


def _shard(rank, world_size):
    return slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)


def _loss(model, data, rows):
    """A sum-reduced loss linear in the outputs: d/dW = t[rows]^T x[rows] and
    d/db = sum(t[rows]), one matmul (or sum) per gradient."""
    return sum((head(x[rows]) * t[rows]).sum().double() for head, (x, t) in zip(model, data))


def _whole_batch_reference():
    """(gradient, magnitude) per parameter in float64: the single-process
    gradient on the whole batch and the sum of |terms| that bounds rounding."""
    reference = []
    for (x, t), (_, _, bias, _) in zip(_batch(), HEADS):
        x, t = x.double(), t.double()
        reference.append((t.T @ x, t.abs().T @ x.abs()))
        if bias:
            reference.append((t.sum(0), t.abs().sum(0)))
    return reference


def _bound(expected, magnitude, dtype, comm, world_size, scale, postscale):
    """Worst-case error of the reduced gradient against the float64 reference.

    With u = finfo(.).eps (twice the unit roundoff), each term at most doubled
    to absorb second-order effects:
    - each rank's gradient: autograd accumulates its rows in fp32 (fp64 for
      fp64) and rounds once to ``dtype``: (rows + 1) * u_acc + u_dtype/2, times
      the magnitude;
    - the cast (and prescale) into the communication dtype and the
      world_size - 1 additions there: (world_size + 1) * u_comm / 2 of the
      magnitude (an element never exceeds the sum of |terms|);
    - the postscale and the cast back: u_dtype / 2 of the result;
    - roundings in the subnormal range are absolute, and the postscale
      magnifies those made before it.
    """
    eps = lambda d: torch.finfo(d).eps  # noqa: E731
    rows = BATCH // world_size
    accumulate = eps(torch.float64) if dtype == torch.float64 else eps(torch.float32)
    relative = eps(dtype) + 2 * (rows + 1) * accumulate + (world_size + 1) * eps(comm)
    absolute = (world_size + 2) * (subnormal_spacing(dtype)
                                   + subnormal_spacing(comm) * max(1.0, postscale))
    return scale * magnitude * relative + eps(dtype) * expected.abs() + absolute


# --------------------------------------------------------------- correctness
def _configs():
    n = len(PARAM_DTYPES)
    configs = []
    for hooks in (False, True):
        for cap in (ONE_BYTE_MB, 1e-3, HUGE):
            for fusion in (1, [k % 2 for k in range(n)]):
                for mean in (True, False):
                    for reduce_dtype in (torch.float32, torch.float16, torch.bfloat16):
                        configs.append(dict(hooks=hooks, kwargs=dict(
                            mean=mean, fusion_type=fusion, bucket_cap_mb=cap,
                            reduce_dtype=reduce_dtype)))
        # an explicit degree, and an explicit prescale (the rest of the mean after the sum)
        configs.append(dict(hooks=hooks, kwargs=dict(mean=True, degree=5)))
        configs.append(dict(hooks=hooks, kwargs=dict(mean=True, degree=5,
                                                     reduce_dtype=torch.float16)))
        configs.append(dict(hooks=hooks, kwargs=dict(mean=True, prescale=0.25,
                                                     reduce_dtype=torch.float16)))
        configs.append(dict(hooks=hooks, kwargs=dict(mean=False, prescale=0.5,
                                                     bucket_cap_mb=ONE_BYTE_MB)))
    return configs


def _reduce_shards(rank, world_size, configs):
    data, rows = _batch(), _shard(rank, world_size)
    results = []
    for config in configs:
        model = _heads()
        reducer = DistributedGradReducer(model.parameters(), **config["kwargs"])
        seen = {"buckets": len(reducer.plan.buckets)}
        if config["hooks"]:
            reducer.register_hooks()
            _loss(model, data, rows).backward()
            seen["reduced_flag"] = reducer.reduced
            grads = [p.grad.clone() for p in model.parameters()]
        else:
            _loss(model, data, rows).backward()
            local = tuple(p.grad for p in model.parameters())
            before = [g.clone() for g in local]
            out = reducer(local)
            seen["tuple_in_tuple_out"] = isinstance(out, tuple)
            seen["new_tensors"] = all(o.data_ptr() != g.data_ptr() for o, g in zip(out, local))
            seen["inputs_untouched"] = all(torch.equal(a, b) for a, b in zip(local, before))
            grads = list(out)
        results.append((grads, seen))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduced_shard_gradients_equal_the_whole_batch_gradient_on_every_rank(world_size):
    configs = _configs()
    results = run_ranks(_reduce_shards, world_size, configs, timeout=TIMEOUT)
    reference = _whole_batch_reference()
    n = len(PARAM_DTYPES)
    for c, config in enumerate(configs):
        kwargs = config["kwargs"]
        where = f"config {c}: hooks={config['hooks']} {kwargs}"
        grads, seen = results[0][c]
        for r in range(1, world_size):
            other = results[r][c][0]
            assert all(torch.equal(a, b) for a, b in zip(grads, other)), \
                f"{where}: rank {r} differs from rank 0"
        assert all(flag for key, flag in seen.items() if key != "buckets"), f"{where}: {seen}"
        reduce_dtype = kwargs.get("reduce_dtype", torch.float32)
        comms = [communication_dtype(d, reduce_dtype) for d in PARAM_DTYPES]
        fusion = kwargs.get("fusion_type", 1)
        fusion_ids = [fusion] * n if isinstance(fusion, int) else fusion
        cap = kwargs.get("bucket_cap_mb", 25.0)
        if cap == ONE_BYTE_MB:
            assert seen["buckets"] == n, where
        elif cap == HUGE:
            # different communication dtypes or fusion ids never share a bucket
            assert seen["buckets"] == len(set(zip(comms, fusion_ids))), where
        degree = kwargs.get("degree", world_size)
        scale = 1 / degree if kwargs["mean"] else 1.0
        for i, (grad, (full, magnitude)) in enumerate(zip(grads, reference)):
            dtype, comm = PARAM_DTYPES[i], comms[i]
            assert grad.dtype == dtype, f"{where}: parameters[{i}] came back as {grad.dtype}"
            prescale = kwargs.get("prescale", scale if comm in SIXTEEN_BIT else 1.0)
            expected = full * scale
            bound = _bound(expected, magnitude, dtype, comm, world_size, scale,
                           scale / prescale)
            error = (grad.double() - expected).abs()
            assert torch.all(error <= bound), \
                f"{where}: parameters[{i}] ({dtype}, comm {comm}) off by " \
                f"{(error - bound).max().item():.3g} beyond the bound"


def _structures(rank, world_size):
    weights = [torch.zeros(3, requires_grad=True), torch.zeros(2, 3, requires_grad=True),
               torch.zeros(0, requires_grad=True)]
    # a transposed (non-contiguous) view and an empty gradient among them
    grads = [torch.full((3,), float(rank + 1)),
             torch.arange(6.0).reshape(3, 2).t() * (rank + 1), torch.zeros(0)]
    before = [g.clone() for g in grads]
    single = DistributedGradReducer(weights[:1])(grads[0])
    several = DistributedGradReducer(weights)
    as_list, as_tuple = several(list(grads)), several(tuple(grads))
    fresh = all(o.data_ptr() != g.data_ptr() for out in ([single], as_list, as_tuple)
                for o, g in zip(out, grads) if g.numel())
    untouched = all(torch.equal(a, b) for a, b in zip(grads, before))
    return single, as_list, as_tuple, fresh, untouched


def test_a_tensor_list_or_tuple_comes_back_in_kind_as_new_tensors():
    results = run_ranks(_structures, 2, timeout=TIMEOUT)
    for single, as_list, as_tuple, fresh, untouched in results:
        assert isinstance(single, torch.Tensor)
        assert torch.equal(single, torch.full((3,), 1.5))
        assert type(as_list) is list and type(as_tuple) is tuple
        for out in (as_list, as_tuple):
            assert torch.equal(out[0], torch.full((3,), 1.5))
            assert torch.equal(out[1], torch.arange(6.0).reshape(3, 2).t() * 1.5)
            assert out[2].shape == (0,)
        assert fresh, "the results must be new tensors"
        assert untouched, "an input was modified"


def _near_the_top_of_the_range(rank, world_size):
    fp16_max, bf16_big = 60000.0, 3e38  # twice either overflows its dtype
    cases = {
        "fp16 comm, mean": (torch.float16, fp16_max, dict(reduce_dtype=torch.float16)),
        "fp16 comm, mean, no prescale": (torch.float16, fp16_max,
                                         dict(reduce_dtype=torch.float16, prescale=1.0)),
        "bf16 comm, mean": (torch.bfloat16, bf16_big, dict(reduce_dtype=torch.bfloat16)),
        "fp32 comm, fp16 mean": (torch.float16, fp16_max, dict()),
        "fp32 comm, fp16 sum": (torch.float16, fp16_max, dict(mean=False)),
    }
    seen = {}
    for name, (dtype, value, kwargs) in cases.items():
        weight = torch.zeros(8, dtype=dtype, requires_grad=True)
        reducer = DistributedGradReducer([weight], **kwargs)
        (out,) = reducer([torch.full((8,), value, dtype=dtype)])
        seen[name] = (out, reducer.plan.buckets[0].dtype)
    return seen


def test_sixteen_bit_communication_prescales_so_a_mean_near_the_max_does_not_overflow():
    results = run_ranks(_near_the_top_of_the_range, 2, timeout=TIMEOUT)
    seen = results[0]
    assert all(torch.equal(seen[k][0], results[1][k][0]) for k in seen)
    big = lambda v, d: torch.full((8,), v, dtype=d)  # noqa: E731
    assert seen["fp16 comm, mean"][1] == torch.float16, "fp16 reduce_dtype must compress"
    assert torch.equal(seen["fp16 comm, mean"][0], big(60000.0, torch.float16))
    # without the guard the fp16 sum overflows: the sum really travels in fp16
    assert torch.isinf(seen["fp16 comm, mean, no prescale"][0]).all()
    assert seen["bf16 comm, mean"][1] == torch.bfloat16
    assert torch.equal(seen["bf16 comm, mean"][0], big(3e38, torch.bfloat16))
    # the default reduces fp16 gradients in fp32: the 120000 sum is fine until cast back
    assert seen["fp32 comm, fp16 mean"][1] == torch.float32
    assert torch.equal(seen["fp32 comm, fp16 mean"][0], big(60000.0, torch.float16))
    assert torch.isinf(seen["fp32 comm, fp16 sum"][0]).all()


def _world_of_one(rank, world_size):
    weights = [torch.zeros(3, requires_grad=True),
               torch.zeros(5, dtype=torch.float16, requires_grad=True)]
    grads = [torch.tensor([1.0, -3.0, 0.5]), torch.arange(5, dtype=torch.float16)]
    mean = DistributedGradReducer(weights)(grads)
    quarter = DistributedGradReducer(weights, degree=4, reduce_dtype=torch.float16)(grads)
    DistributedGradReducer(weights).register_hooks()
    (weights[0].sum() * 2 + weights[1].sum()).backward()
    return mean, quarter, [w.grad for w in weights]


def test_a_world_of_one_reduces_to_the_gradients_divided_by_degree():
    ((mean, quarter, hooked),) = run_ranks(_world_of_one, 1, timeout=TIMEOUT)
    assert torch.equal(mean[0], torch.tensor([1.0, -3.0, 0.5]))
    assert torch.equal(mean[1], torch.arange(5, dtype=torch.float16))
    assert torch.equal(quarter[0], torch.tensor([0.25, -0.75, 0.125]))
    assert torch.equal(quarter[1], torch.arange(5, dtype=torch.float16) / 4)
    assert torch.equal(hooked[0], torch.full((3,), 2.0))
    assert torch.equal(hooked[1], torch.ones(5, dtype=torch.float16))


def _world_of_one_sends_nothing(rank, world_size):
    events = []
    record_collectives(events)
    weights = [torch.zeros(3, requires_grad=True),
               torch.zeros(5, dtype=torch.float16, requires_grad=True)]
    grads = [torch.tensor([1.0, -3.0, 0.5]), torch.arange(5, dtype=torch.float16)]
    reducer = DistributedGradReducer(weights, check_finite=True, initial_parameters="broadcast")
    seen = {"call": [reducer(grads), reducer.found_nonfinite]}
    # the hooks' paths, with the unused-parameter settlement: flattened (AdaSum's
    # tree of one rank) or bucket views (bcast_period=-1: the optimizer's own
    # parameter broadcast is not the reduction's)
    for method, views in (("adasum", False), ("mean", True)):
        model = nn.ModuleList([nn.Linear(3, 2), nn.Linear(3, 1)])
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   reduce_method=method, find_unused_parameters=True,
                                   gradient_as_bucket_view=views, bcast_period=-1)
        model[0](torch.ones(4, 3)).sum().backward()
        seen[method] = [p.grad for p in model.parameters()]
        opt.step()
    return seen, events


def test_a_world_of_one_issues_no_collective_and_settles_unused_parameters_locally():
    ((seen, events),) = run_ranks(_world_of_one_sends_nothing, 1, timeout=TIMEOUT)
    assert events == []
    (mean, half), found = seen["call"]
    assert torch.equal(mean, torch.tensor([1.0, -3.0, 0.5]))
    assert torch.equal(half, torch.arange(5, dtype=torch.float16))
    assert not found
    for method in ("adasum", "mean"):
        weight, bias, unused_weight, unused_bias = seen[method]
        # d(sum of Linear(3, 2) over 4 rows of ones) / d(weight, bias): this rank's own
        assert torch.equal(weight, torch.full((2, 3), 4.0)), method
        assert torch.equal(bias, torch.full((2,), 4.0)), method
        assert unused_weight is None and unused_bias is None, method


def _subgroup(rank, world_size):
    group = dist.new_group([0, 2])
    weights = [torch.zeros(3, requires_grad=True)]
    try:
        reducer = DistributedGradReducer(weights, group=group)
    except RuntimeError as exc:
        return str(exc)
    return reducer([torch.full((3,), float(rank))])[0]


def test_a_subgroup_reduces_among_its_members_with_its_size_as_the_degree():
    first, outsider, last = run_ranks(_subgroup, 3, timeout=TIMEOUT)
    assert torch.equal(first, torch.full((3,), 1.0)) and torch.equal(last, first)
    assert isinstance(outsider, str) and "member" in outsider


# ------------------------------------------------------------ non-finite flag
def _nonfinite(rank, world_size):
    weights = [torch.zeros(4, dtype=d, requires_grad=True)
               for d in (torch.float32, torch.float16, torch.bfloat16)]
    seen = {}
    for name, (who, index, value) in {"inf on rank 1": (1, 2, float("inf")),
                                      "nan on rank 0": (0, 0, float("nan")),
                                      "finite": (None, 0, 0.0)}.items():
        reducer = DistributedGradReducer(weights, check_finite=True, bucket_cap_mb=ONE_BYTE_MB)
        grads = [torch.ones(4, dtype=w.dtype) for w in weights]
        if rank == who:
            grads[index][1] = value
        reducer(grads)
        seen[name] = reducer.found_nonfinite
    # through the hooks: one rank's overflowing loss, then a finite iteration
    model = nn.Linear(3, 2)
    reducer = DistributedGradReducer(model.parameters(), check_finite=True).register_hooks()
    for step, name in enumerate(("hooks, inf loss on rank 1", "hooks, finite")):
        model.zero_grad()
        loss = model(torch.ones(4, 3)).sum()
        (loss * float("inf") if rank == 1 and step == 0 else loss).backward()
        seen[name] = reducer.found_nonfinite
    return seen


def test_check_finite_flags_an_inf_or_nan_on_any_rank_on_every_rank():
    results = run_ranks(_nonfinite, 2, timeout=TIMEOUT)
    expected = {"inf on rank 1": True, "nan on rank 0": True, "finite": False,
                "hooks, inf loss on rank 1": True, "hooks, finite": False}
    for rank, seen in enumerate(results):
        for name, want in expected.items():
            flag = seen[name]
            assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool \
                and flag.dim() == 0, f"rank {rank}, {name}: {flag!r}"
            assert bool(flag) is want, f"rank {rank}, {name}"


# ------------------------------------------------------------------ errors
def test_without_a_process_group_the_error_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedGradReducer([torch.zeros(3, requires_grad=True)])


def _bad_arguments(rank, world_size):
    weights = [torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True),
               torch.zeros(5, requires_grad=True)]
    good = [torch.ones_like(w) for w in weights]
    sparse = good[:1] + [good[1].to_sparse()] + good[2:]
    make = lambda **kw: DistributedGradReducer(weights, **kw)  # noqa: E731
    # a reducer that accepted gradients once checks later ones with a metadata
    # guard first (kernels.metadata_guard): the second good call takes its
    # fast path, and a bad list after it must still fail
    warm = make()
    warm(good)
    warm(good)
    cases = {
        "degree=0": lambda: make(degree=0),
        "degree=-2": lambda: make(degree=-2),
        "degree=2.0": lambda: make(degree=2.0),
        "degree=True": lambda: make(degree=True),
        "degree='2'": lambda: make(degree="2"),
        "fusion_type of the wrong length": lambda: make(fusion_type=[1, 2]),
        "fusion_type=True": lambda: make(fusion_type=True),
        "prescale=0": lambda: make(prescale=0.0),
        "prescale=inf": lambda: make(prescale=float("inf")),
        "bucket_cap_mb=0": lambda: make(bucket_cap_mb=0),
        "reduce_dtype=int32": lambda: make(reduce_dtype=torch.int32),
        "a parameter that is not a tensor": lambda: DistributedGradReducer([weights[0], 3.0]),
        "a parameter passed twice": lambda: DistributedGradReducer(weights + weights[1:2]),
        "a single tensor for parameters": lambda: DistributedGradReducer(weights[0]),
        "two gradients for three parameters": lambda: make()(good[:2]),
        "four gradients for three parameters": lambda: make()(good + good[:1]),
        "grads[2] of the wrong shape": lambda: make()(good[:2] + [torch.ones(6)]),
        "grads[0] of the wrong dtype": lambda: make()([good[0].double()] + good[1:]),
        "sparse grads[1]": lambda: make()(sparse),
        "grads[1] a numpy array": lambda: make()(
            [good[0], good[1].numpy(), good[2]]),
        "grads[2] on another device": lambda: make()(
            good[:2] + [torch.ones_like(good[2], device="meta")]),
        "after a good call, grads[2] of the wrong shape": lambda: warm(
            good[:2] + [torch.ones(6)]),
        "after a good call, grads[0] of the wrong dtype": lambda: warm(
            [good[0].double()] + good[1:]),
        "after a good call, sparse grads[1]": lambda: warm(sparse),
        "after a good call, grads[1] a numpy array": lambda: warm(
            [good[0], good[1].numpy(), good[2]]),
        "after a good call, grads[2] on another device": lambda: warm(
            good[:2] + [torch.ones_like(good[2], device="meta")]),
        "passes_per_sync=0": lambda: make().register_hooks(passes_per_sync=0),
        "hooks registered twice": lambda: make().register_hooks().register_hooks(),
        "a parameter without requires_grad": lambda: DistributedGradReducer(
            [torch.zeros(2)]).register_hooks(),
    }
    return outcomes_and_collectives(cases)


def test_bad_arguments_raise_on_every_rank_before_any_collective():
    results = run_ranks(_bad_arguments, 2, timeout=TIMEOUT)
    expected = {
        "degree=0": ("ValueError", "degree"), "degree=-2": ("ValueError", "degree"),
        "degree=2.0": ("ValueError", "degree"), "degree=True": ("ValueError", "degree"),
        "degree='2'": ("ValueError", "degree"),
        "fusion_type of the wrong length": ("ValueError", "fusion_type"),
        "fusion_type=True": ("TypeError", "fusion_type"),
        "prescale=0": ("ValueError", "prescale"),
        "prescale=inf": ("ValueError", "prescale"),
        "bucket_cap_mb=0": ("ValueError", "bucket_cap_mb"),
        "reduce_dtype=int32": ("TypeError", "reduce_dtype"),
        "a parameter that is not a tensor": ("TypeError", "parameters[1]"),
        "a parameter passed twice": ("ValueError", "parameters[3] is parameters[1]"),
        "a single tensor for parameters": ("TypeError", "single tensor"),
        "two gradients for three parameters": ("ValueError", "2"),
        "four gradients for three parameters": ("ValueError", "4"),
        "grads[2] of the wrong shape": ("ValueError", "grads[2]"),
        "grads[0] of the wrong dtype": ("ValueError", "grads[0]"),
        "sparse grads[1]": ("TypeError", "grads[1]"),
        "grads[1] a numpy array": ("TypeError", "grads[1]"),
        "grads[2] on another device": ("ValueError", "grads[2]"),
        "after a good call, grads[2] of the wrong shape": ("ValueError", "grads[2]"),
        "after a good call, grads[0] of the wrong dtype": ("ValueError", "grads[0]"),
        "after a good call, sparse grads[1]": ("TypeError", "grads[1]"),
        "after a good call, grads[1] a numpy array": ("TypeError", "grads[1]"),
        "after a good call, grads[2] on another device": ("ValueError", "grads[2]"),
        "passes_per_sync=0": ("ValueError", "passes_per_sync"),
        "hooks registered twice": ("ValueError", "already"),
        "a parameter without requires_grad": ("ValueError", "parameters[0]"),
    }
    assert_raised_before_any_collective(results, expected)


def _mismatched_parameters(rank, world_size):
    def weights(change=None):
        shapes = [(4, 3), (3,), (5,), (2, 2)]
        if rank == 1 and change is not None:
            change(shapes)
        return [torch.zeros(s, requires_grad=True) for s in shapes]

    def reduce_once(ws, **kwargs):
        DistributedGradReducer(ws, **kwargs)([torch.ones_like(w) for w in ws])

    def backward_once(ws):
        DistributedGradReducer(ws).register_hooks()
        sum(w.sum() for w in ws).backward()

    def reshape(shapes):
        shapes[1] = (4,)

    cases = {
        "differently-shaped parameters[1]": lambda: reduce_once(weights(reshape)),
        "differently-shaped parameters[1], hooks": lambda: backward_once(weights(reshape)),
        "an extra parameter on rank 1": lambda: reduce_once(weights(lambda s: s.append((7,)))),
        "another fusion_type on rank 1": lambda: reduce_once(weights(),
                                                             fusion_type=1 + (rank == 1)),
        "another reduce_dtype on rank 1": lambda: reduce_once(
            weights(), reduce_dtype=torch.float16 if rank == 1 else torch.float32),
    }
    return outcomes(cases)


def test_ranks_with_different_parameters_all_raise_a_runtime_error_instead_of_hanging():
    results = run_ranks(_mismatched_parameters, 3, timeout=TIMEOUT)
    for rank, seen in enumerate(results):
        for name, got in seen.items():
            assert got is not None and got[0] == "RuntimeError", f"rank {rank}: {name}: {got}"
            assert "parameter" in got[1], f"rank {rank}: {name}: {got}"
        for name in ("differently-shaped parameters[1]",
                     "differently-shaped parameters[1], hooks"):
            assert "parameters[1]" in seen[name][1], f"rank {rank}: {name}: {seen[name]}"


def _first_mismatch_named(rank, world_size):
    seen = {}
    for name, shapes in {"extra parameters[4] on rank 1": [(4, 3), (3,), (5,), (2, 2), (7,)],
                         "parameters[1] and [3] differ on rank 1": [(4, 3), (4,), (5,), (9,)]
                         }.items():
        if rank == 0:
            shapes = [(4, 3), (3,), (5,), (2, 2)]
        weights = [torch.zeros(s, requires_grad=True) for s in shapes]
        try:
            DistributedGradReducer(weights)([torch.ones_like(w) for w in weights])
            seen[name] = None
        except RuntimeError as exc:
            seen[name] = str(exc)
    return seen


def test_the_mismatch_error_names_the_first_mismatching_parameter_in_parameter_order():
    results = run_ranks(_first_mismatch_named, 2, timeout=TIMEOUT)
    for seen in results:
        assert "parameters[4]" in seen["extra parameters[4] on rank 1"]
        assert "parameters[1]" in seen["parameters[1] and [3] differ on rank 1"]


def _different_caps(rank, world_size):
    weights = [torch.zeros(s, requires_grad=True) for s in [(4, 3), (3,), (5,), (2, 2)]]
    reducer = DistributedGradReducer(weights, bucket_cap_mb=25.0 if rank == 0 else ONE_BYTE_MB)
    reducer([torch.ones_like(w) for w in weights])


def test_different_bucket_caps_on_two_ranks_raise_a_runtime_error_on_every_rank():
    errors = rank_errors(_different_caps, 2, timeout=CRASH_TIMEOUT)
    assert all(e is not None and e[0] == "RuntimeError" for e in errors), errors
