"""A bad-input sweep of the APIs added with the sharded optimizer, clipping and
device scales: each bad value is refused with a TypeError or ValueError that
names the argument, before any collective starts, leaving everything the caller
owns (parameters, ``.grad``, optimizer state, buffers, files) as it was.

Also what a device ``loss_scale`` that is not finite and > 0 does (its value is
not read on the host): the norm becomes NaN, so the gradients become NaN (a
GradScaler skips the step) or ``error_if_nonfinite`` raises, never zeroed or
flipped gradients.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from harness import record_collectives, run_ranks

TENSOR = "tensor"  # a bad value built in the rank: tensors do not travel in the table


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _backward(model):
    model(torch.ones(2, 4)).sum().backward()


def _owned(model, opt=None, extra=()):
    """Copies of everything the caller owns: parameters, ``.grad``, the
    optimizer's state, and ``extra`` tensors (buffers, parts)."""
    tensors = [p.detach() for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    return [t.clone() for t in (*tensors, *extra)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _scale_value(value):
    return {"2 elements": torch.ones(2), "meta": torch.ones((), device="meta"),
            "int tensor": torch.ones((), dtype=torch.int32)}.get(value, value)


# (case, bad value, exception type, name in the message)
LOSS_SCALES = [(0.0, "ValueError"), (-2.0, "ValueError"), (math.nan, "ValueError"),
               (math.inf, "ValueError"), ("2.0", "TypeError"), (True, "TypeError"),
               ("2 elements", "ValueError"), ("meta", "ValueError"),
               ("int tensor", "TypeError")]
LOSS_SCALE_TARGETS = ["reducer", "optimizer", "sharded optimizer", "hook state"]

OPTIMIZER_OPTIONS = [
    ({"shard": True, "assume_elementwise": "False"}, "TypeError", "assume_elementwise"),
    ({"shard": True, "overlap_param_gather": "False"}, "TypeError", "overlap_param_gather"),
    ({"overlap_param_gather": "False"}, "TypeError", "overlap_param_gather"),
    ({"param_pack": "False"}, "TypeError", "param_pack"),
    ({"gradient_as_bucket_view": "False"}, "TypeError", "gradient_as_bucket_view"),
    ({"master_dtype": torch.int32}, "TypeError", "master_dtype"),
    ({"shard": True, "master_dtype": torch.int32}, "TypeError", "master_dtype"),
    ({"error_if_nonfinite": "False", "max_grad_norm": 1.0}, "TypeError", "error_if_nonfinite"),
]
REDUCER_OPTIONS = [({"mean": "False"}, "TypeError", "mean"),
                   ({"check_finite": "False"}, "TypeError", "check_finite")]


def _loss_scale_case(target, value):
    from fusedreduce import DistributedGradReducer, DistributedOptimizer
    from fusedreduce.hooks import HookState
    model = _model()
    _backward(model)
    if target == "hook state":
        owner, opt = HookState(max_grad_norm=1.0), None
    elif target == "reducer":
        owner, opt = DistributedGradReducer(model.parameters(), max_grad_norm=1.0), None
    else:
        opt = owner = DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                           max_grad_norm=1.0,
                                           shard=target == "sharded optimizer")
    before = owner.loss_scale

    def act():
        owner.loss_scale = _scale_value(value)

    return model, opt, act, lambda: owner.loss_scale is before


def _sweep(rank, world_size):
    """Every case: (exception type, message) or None, the collectives it
    started, and whether what the caller owns is untouched."""
    from fusedreduce import DistributedGradReducer, DistributedOptimizer
    from fusedreduce.buckets import BucketPlan
    from fusedreduce.sharded import all_gather_plan, part_ranges, reduce_scatter_plan
    cases = {}
    for target in LOSS_SCALE_TARGETS:
        for value, _ in LOSS_SCALES:
            cases[f"{target} loss_scale={value!r}"] = \
                lambda t=target, v=value: _loss_scale_case(t, v)

    def constructor(make, kwargs):
        model = _model()
        _backward(model)
        return model, None, lambda: make(model, kwargs), lambda: True

    for kwargs, _, _ in OPTIMIZER_OPTIONS:
        cases[f"DistributedOptimizer {kwargs}"] = lambda k=kwargs: constructor(
            lambda m, kw: DistributedOptimizer(torch.optim.AdamW(m.parameters()), **kw), k)
    for kwargs, _, _ in REDUCER_OPTIONS:
        cases[f"DistributedGradReducer {kwargs}"] = lambda k=kwargs: constructor(
            lambda m, kw: DistributedGradReducer(m.parameters(), **kw), k)

    def plan_case(act_on):
        model = _model()
        _backward(model)
        grads = [p.grad for p in model.parameters()]
        plan = BucketPlan(grads, shards=world_size, bucket_cap_mb=16 / 2 ** 20)
        parts = [torch.full((b.part_size,), 7.0) for b in plan.buckets]
        return model, None, lambda: act_on(plan, grads, parts), lambda: True, parts

    def overlapping_scatter(plan, grads, parts):
        # the last bucket's first tensor is a view of that bucket's part
        last = plan.buckets[-1]
        tensors = list(grads)
        i = last.tensor_indices[0]
        tensors[i] = parts[-1][:grads[i].numel()].view_as(grads[i])
        reduce_scatter_plan(plan, tensors, parts=parts)

    def overlapping_gather(plan, grads, parts):
        outputs = [g.clone() for g in grads]
        i = plan.buckets[-1].tensor_indices[0]
        outputs[i] = parts[-1][:grads[i].numel()].view_as(grads[i])
        all_gather_plan(plan, parts, outputs)

    def bad_buffers(fn):
        def act(plan, grads, parts):
            buffers = [torch.zeros(1) for _ in plan.buckets]
            if fn is reduce_scatter_plan:
                fn(plan, grads, parts=parts, buffers=buffers)
            else:
                fn(plan, parts, [g.clone() for g in grads], buffers=buffers)
        return act

    cases["reduce_scatter_plan tensors overlap parts"] = lambda: plan_case(overlapping_scatter)
    cases["all_gather_plan outputs overlap parts"] = lambda: plan_case(overlapping_gather)
    cases["reduce_scatter_plan buffers"] = lambda: plan_case(bad_buffers(reduce_scatter_plan))
    cases["all_gather_plan buffers"] = lambda: plan_case(bad_buffers(all_gather_plan))
    cases["part_ranges(plan)"] = lambda: plan_case(lambda plan, g, p: part_ranges(plan, 0))
    cases["part_ranges(None)"] = lambda: plan_case(lambda plan, g, p: part_ranges(None, 0))

    events = []
    record_collectives(events)
    seen = {}
    for name, make in cases.items():
        model, opt, act, kept, *extra = make()
        before = _owned(model, opt, *extra)
        del events[:]  # construction may communicate; the refused call may not
        try:
            act()
            got = None
        except Exception as exc:  # noqa: BLE001
            got = (type(exc).__name__, str(exc))
        seen[name] = (got, list(events), _same(before, _owned(model, opt, *extra)) and kept())
    return seen


def _expected():
    expected = {}
    for target in LOSS_SCALE_TARGETS:
        for value, kind in LOSS_SCALES:
            expected[f"{target} loss_scale={value!r}"] = (kind, "loss_scale")
    for kwargs, kind, name in OPTIMIZER_OPTIONS:
        expected[f"DistributedOptimizer {kwargs}"] = (kind, name)
    for kwargs, kind, name in REDUCER_OPTIONS:
        expected[f"DistributedGradReducer {kwargs}"] = (kind, name)
    expected.update({
        "reduce_scatter_plan tensors overlap parts": ("ValueError", "overlaps parts["),
        "all_gather_plan outputs overlap parts": ("ValueError", "overlaps parts["),
        "reduce_scatter_plan buffers": ("ValueError", "buffers["),
        "all_gather_plan buffers": ("ValueError", "buffers["),
        "part_ranges(plan)": ("TypeError", "plan.buckets"),
        "part_ranges(None)": ("TypeError", "bucket"),
    })
    return expected


@pytest.fixture(scope="module", params=[1, 2])
def sweep(request):
    return request.param, run_ranks(_sweep, request.param, timeout=300)


@pytest.mark.parametrize("case", sorted(_expected()))
def test_bad_input_is_refused_naming_the_argument_before_any_collective(sweep, case):
    world_size, results = sweep
    kind, fragment = _expected()[case]
    for rank, seen in enumerate(results):
        got, collectives, untouched = seen[case]
        assert got is not None, f"rank {rank} of {world_size}: {case} was accepted"
        assert got[0] == kind and fragment in got[1], f"rank {rank}: {case}: {got}"
        assert not collectives, f"rank {rank}: {case} communicated first: {collectives}"
        assert untouched, f"rank {rank}: {case} changed what the caller owns"


# ------------------------------------------------ a device scale's bad values
def _reduce_with_scale(scale, backend, error_if_nonfinite=False):
    from fusedreduce import DistributedGradReducer
    model = _model()
    reducer = DistributedGradReducer(model.parameters(), max_grad_norm=0.5, backend=backend,
                                     error_if_nonfinite=error_if_nonfinite)
    reducer.loss_scale = torch.tensor(scale)
    _backward(model)
    grads = reducer([p.grad for p in model.parameters()])
    return reducer.grad_norm, grads


def _device_scales(rank, world_size, backend):
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    out = {}
    for scale in (4.0, 0.0, -2.0, math.inf, math.nan):
        norm, grads = _reduce_with_scale(scale, backend)
        try:
            _reduce_with_scale(scale, backend, error_if_nonfinite=True)
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        out[repr(scale)] = (norm, grads, raised)  # a NaN key would not match after pickling
    model = _model()
    _backward(model)
    out["unscaled norm"] = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten().double() for p in model.parameters()]))
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_device_loss_scale_not_finite_and_positive_gives_a_nan_norm(backend):
    """0 would zero the gradients and -2 flip them; the norm is NaN instead,
    so the gradients are NaN (a GradScaler skips the step) or
    error_if_nonfinite raises before they are written back."""
    if backend == "triton":
        pytest.importorskip("triton")
    for out in run_ranks(_device_scales, 2, backend, timeout=300):
        norm, grads, raised = out[repr(4.0)]
        # fp32 norm of fp32 gradients: a few ulps of the fp64 reference
        assert norm.item() == pytest.approx(out["unscaled norm"].item() / 4.0, rel=1e-6)
        assert raised is None
        for scale in (0.0, -2.0, math.inf, math.nan):
            norm, grads, raised = out[repr(scale)]
            assert math.isnan(norm.item()), (scale, norm)
            assert all(bool(g.isnan().all()) for g in grads), scale
            assert raised is not None and "non-finite" in raised, scale


def _hook_scale(rank, world_size, scale):
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce import hooks
    model = DistributedDataParallel(_model())
    state = hooks.HookState(max_grad_norm=0.5)
    model.register_comm_hook(state, hooks.allreduce_hook)
    state.loss_scale = torch.tensor(scale)
    _backward(model)
    return state.grad_norm, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("scale", [0.0, -2.0])
def test_a_device_loss_scale_of_zero_or_negative_gives_nan_through_the_ddp_hook(scale):
    for norm, grads in run_ranks(_hook_scale, 2, scale, timeout=300):
        assert math.isnan(norm.item())
        assert all(bool(g.isnan().all()) for g in grads)


# ----------------------------------------------------------- checkpoint files
def _interrupted_save(rank, world_size, directory, shard):
    """A loop that saves every step; the save after step 2 reached rank 1's
    file only (rank 0 crashed first): the files mix two saves."""
    from fusedreduce import DistributedOptimizer, consolidate_sharded_state_dict
    model = _model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()), shard=shard)
    files = [os.path.join(directory, f"optim.{r}.pt") for r in range(world_size)]
    for step in range(2):
        opt.zero_grad()
        _backward(model)
        opt.step()
        if step == 0 or rank == 1:
            torch.save(opt.sharded_state_dict(), files[rank])
    torch.distributed.barrier()
    events = []
    record_collectives(events)
    before = _owned(model, opt)
    errors = []
    for load in (opt.load_sharded_state_dict, consolidate_sharded_state_dict):
        try:
            load(files)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors, events, _same(before, _owned(model, opt))


@pytest.mark.parametrize("shard", [False, True])
def test_files_of_two_saves_are_refused_before_anything_is_loaded(tmp_path, shard):
    for errors, events, untouched in run_ranks(_interrupted_save, 2, str(tmp_path), shard):
        for error in errors:
            assert error is not None and "different saves" in error
            assert "shards[0] (rank 0)" in error and "shards[1] (rank 1)" in error
        assert not events and untouched


def _one_rank_save(rank, world_size, directory):
    from fusedreduce import DistributedOptimizer
    model = _model()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    _backward(model)
    opt.step()
    return opt.sharded_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return run_ranks(_one_rank_save, 1, str(tmp_path_factory.mktemp("save")))[0]


@pytest.mark.parametrize("damage, kind, fragment", [
    ("a tensor", TypeError, "holds a Tensor"),
    ("truncated", ValueError, "lacks ['world_size']"),
])
def test_a_damaged_file_is_refused_naming_the_shard(tmp_path, saved, damage, kind, fragment):
    from fusedreduce import consolidate_sharded_state_dict
    path = tmp_path / "optim.0.pt"
    if damage == "a tensor":
        torch.save(torch.zeros(3), path)
    else:
        torch.save({k: v for k, v in saved.items() if k != "world_size"}, path)
    with pytest.raises(kind, match="shards\\[0\\]") as info:
        consolidate_sharded_state_dict([path])
    assert fragment in str(info.value)


def test_a_file_without_a_save_id_loads_with_a_warning(saved):
    from fusedreduce import consolidate_sharded_state_dict
    old = {k: v for k, v in saved.items() if k != "save_id"}
    with pytest.warns(UserWarning, match="no save id"):
        whole = consolidate_sharded_state_dict([old])
    assert torch.equal(whole["state"][0]["exp_avg"],
                       consolidate_sharded_state_dict([saved])["state"][0]["exp_avg"])
