"""The torch fallback's strategies (``kernels/flatten/torch_backend.py``): each one
writes the reference's bits, the fastest is chosen once per layout and kind of
call and kept, and ``FUSEDREDUCE_TORCH_STRATEGY`` forces one.

Every strategy is forced in turn on the same layout and compared bit for bit
with the float64 reference (``reference.py``; why bits, in
``flatten_cases.py``): a strategy that scaled before casting, rounded the
scale to 16 bits or rounded a 16-bit result twice would differ by an ulp
somewhere in these examples (scales with a full mantissa, ties, subnormals,
both zeros, 16-bit destinations). CPU only: the trial is the CPU's.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fusedreduce.kernels import _checks, _prepared, flatten_cast_scale, unflatten_cast_scale
from fusedreduce.kernels.flatten import strategy_choice, torch_backend
from fusedreduce.kernels.flatten.scratch_runs import WholeScratch
from fusedreduce.kernels.flatten.torch_backend import (ACCUMULATE, STRATEGIES,
                                                       STRATEGY_VARIABLE, Choice)
from flatten_cases import (DTYPES, Spec, assert_same_bits, build, layouts, lay_out,
                           make_values, safe_bound, scales, spec_lists)
from reference import reference_flatten, reference_unflatten

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# the kinds of call whose strategies these tests force (accumulate has routes alone)
KINDS = (True, False)


@contextmanager
def forcing(strategy):
    """``FUSEDREDUCE_TORCH_STRATEGY`` set to ``strategy`` (None: unset)."""
    with mock.patch.dict(os.environ):
        os.environ.pop(STRATEGY_VARIABLE, None)
        if strategy is not None:
            os.environ[STRATEGY_VARIABLE] = strategy
        yield


def flatten_launch(tensors, out, offsets=None):
    starts, _ = _checks.segment_starts(tensors, offsets, "tensors")
    return torch_backend.prepare_flatten(tensors, starts, _checks.extents(starts, out.numel()),
                                         out)


def unflatten_launch(flat, tensors, offsets=None):
    starts, _ = _checks.segment_starts(tensors, offsets, "tensors")
    return torch_backend.prepare_unflatten(flat, tensors, starts)


def assert_forced(launch, strategy, kind):
    """The forced strategy is the kept one where the launch offers it, else routes."""
    offered = strategy in launch.choice.candidates[kind]
    assert launch.choice.chosen[kind] == (strategy if offered else "routes")
    return offered


def make_flat(destinations, flat_dtype, scale, offsets):
    """A flat buffer whose segments hold values in range for their destinations; NaN
    between segments, which must never reach a destination."""
    starts = offsets or _checks.segment_starts(destinations, None, "")[0]
    end = max([s + d.numel() for s, d in zip(starts, destinations)], default=0)
    flat = torch.full((end,), math.nan, dtype=flat_dtype)
    for i, (start, d) in enumerate(zip(starts, destinations)):
        segment = Spec((d.numel(),), flat_dtype, seed=i + 7, magnitude=(-3 * i) % 11)
        flat[start:start + d.numel()] = make_values(segment, safe_bound(flat_dtype, d.dtype,
                                                                        scale), "torch")
    return flat


# -------------------------------------------------------- every strategy, same bits

# torch's ops are offered where every tensor has the same kind of pair, so
# one dtype for all tensors is drawn more often than a mix, and the buffer is
# fp32 (the library's) half the time
one_dtype_or_a_mix = st.one_of(st.sampled_from(DTYPES).map(lambda d: (d,)), st.just(DTYPES))
buffer_dtypes = st.one_of(st.just(F32), st.sampled_from(DTYPES))


@settings(max_examples=80, deadline=None)
@given(specs=one_dtype_or_a_mix.flatmap(lambda d: spec_lists(dtypes=d)), dtype=buffer_dtypes,
       scale=scales, data=st.data())
def test_every_forced_strategy_flattens_to_the_reference_bits(specs, dtype, scale, data):
    built = [build(s, dtype, scale, "torch") for s in specs]
    tensors = [b.tensor for b in built]
    offsets = data.draw(layouts(specs))
    starts, size = _checks.segment_starts(tensors, offsets, "tensors")
    out = torch.empty(size + data.draw(st.integers(0, 3)), dtype=dtype)
    expected = reference_flatten(tensors, dtype, scale, offsets, out.numel())
    for strategy in STRATEGIES:
        with forcing(strategy):
            launch = flatten_launch(tensors, out, offsets)
        assert_forced(launch, strategy, scale == 1.0)
        out.fill_(math.nan)  # every element must be written, whichever strategy runs
        launch(tensors, out, scale, False)
        assert_same_bits(out, expected, f"flatten by {strategy}")


@settings(max_examples=80, deadline=None)
@given(specs=one_dtype_or_a_mix.flatmap(lambda d: spec_lists(dtypes=d)),
       flat_dtype=buffer_dtypes, scale=scales, data=st.data())
def test_every_forced_strategy_unflattens_to_the_reference_bits(specs, flat_dtype, scale, data):
    offsets = data.draw(layouts(specs))
    built = [lay_out(torch.full((s.numel,), math.nan, dtype=s.dtype), s.shape, s.layout)
             for s in specs]
    tensors = [b.tensor for b in built]
    flat = make_flat(tensors, flat_dtype, scale, offsets)
    expected = reference_unflatten(flat, tensors, scale, False, offsets)
    for strategy in STRATEGIES:
        with forcing(strategy):
            launch = unflatten_launch(flat, tensors, offsets)
        assert_forced(launch, strategy, scale == 1.0)
        for t in tensors:
            t.fill_(math.nan)
        launch(flat, tensors, scale, False)
        for i, (t, want) in enumerate(zip(tensors, expected)):
            assert_same_bits(t, want, f"destination {i} by {strategy}")


# The layouts a training loop has, where torch's ops are offered: each forced
# strategy must really be the one that runs (not a silent fall-back to routes).
CASES = [  # (source dtype, buffer dtype, scale, the strategies offered besides routes)
    (F16, F32, 0.125, {"foreach", "concat", "per_tensor"}),
    (BF16, F32, 1.0, {"foreach", "concat", "per_tensor"}),
    (F32, F32, 1 / 3, {"foreach", "concat", "per_tensor"}),
    (F32, F64, -0.7, {"foreach", "concat", "per_tensor"}),
    (F32, F16, 1.0, {"foreach", "concat", "per_tensor"}),
    # 16-bit results of a scale: the products in an fp32 scratch, run by run
    (F32, F16, 0.125, {"scratch"}),
    (BF16, BF16, 3.0, {"scratch"}),
]
SHAPES = [(3, 5), (0,), (1,), (7,), (2, 3, 4), (33,)]


@pytest.mark.parametrize("src, dst, scale, offered", CASES)
def test_torch_ops_are_offered_and_forced_on_a_training_layout(src, dst, scale, offered):
    tensors = [build(Spec(shape, src, seed=i, magnitude=i % 5, ties=True), dst, scale,
                      "torch").tensor for i, shape in enumerate(SHAPES)]
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dst)
    expected = reference_flatten(tensors, dst, scale)
    launch = flatten_launch(tensors, out)
    assert set(launch.choice.candidates[scale == 1.0]) == {"routes"} | offered
    for strategy in ("routes", *sorted(offered)):
        with forcing(strategy):
            launch = flatten_launch(tensors, out)
        assert launch.choice.chosen[scale == 1.0] == strategy
        out.fill_(math.nan)
        launch(tensors, out, scale, False)
        assert_same_bits(out, expected, f"flatten by {strategy}")


@pytest.mark.parametrize("flat_dtype, dst, scale, offered", [
    # a copy then a scale would round twice: foreach is one mul of the whole
    # buffer into an fp32 scratch, then one copy out of it
    (F32, F16, 0.125, {"foreach"}),
    (F32, BF16, 1.0, {"foreach", "per_tensor"}),
    # destinations in the buffer's dtype: the products in a scratch, then copies
    (F32, F32, 1 / 3, {"foreach", "concat", "per_tensor", "scratch"}),
    (F64, F64, 0.3, {"foreach", "concat", "per_tensor", "scratch"}),
    (F32, F64, -0.7, {"foreach", "per_tensor"}),
])
def test_torch_ops_are_offered_and_forced_on_an_unflatten(flat_dtype, dst, scale, offered):
    tensors = [torch.full(shape, math.nan, dtype=dst) for shape in SHAPES]
    flat = make_flat(tensors, flat_dtype, scale, None)
    expected = reference_unflatten(flat, tensors, scale, False)
    launch = unflatten_launch(flat, tensors)
    assert set(launch.choice.candidates[scale == 1.0]) == {"routes"} | offered
    assert set(launch.choice.candidates[ACCUMULATE]) == {"routes"}
    for strategy in ("routes", *sorted(offered)):
        with forcing(strategy):
            launch = unflatten_launch(flat, tensors)
        assert launch.choice.chosen[scale == 1.0] == strategy
        for t in tensors:
            t.fill_(math.nan)
        launch(flat, tensors, scale, False)
        for i, (t, want) in enumerate(zip(tensors, expected)):
            assert_same_bits(t, want, f"destination {i} by {strategy}")


def test_16_bit_destinations_with_a_scale_are_not_offered_a_copy_then_a_scale():
    # copy then scale would round twice (to fp16, then the fp16 product): the
    # scaled foreach multiplies first, in fp32, and copies the products
    tensors = [torch.zeros(5, dtype=F16)]
    launch = unflatten_launch(torch.zeros(5), tensors)
    assert list(launch.choice.candidates[False]) == ["routes", "foreach"]
    assert isinstance(launch.choice.candidates[False]["foreach"], WholeScratch)
    assert "foreach" in launch.choice.candidates[True]


def test_the_whole_buffer_scratch_gives_its_memory_back_and_takes_it_again():
    tensors = [torch.full(shape, math.nan, dtype=BF16) for shape in SHAPES]
    flat = make_flat(tensors, F32, 0.3, None)
    expected = reference_unflatten(flat, tensors, 0.3, False)
    whole = unflatten_launch(flat, tensors).choice.candidates[False]["foreach"]
    held = whole._storage.nbytes()
    assert held == flat.numel() * 4
    whole.release()
    assert whole._storage.nbytes() == 0
    whole(tensors, 0.3)
    assert whole._storage.nbytes() == held
    for i, (t, want) in enumerate(zip(tensors, expected)):
        assert_same_bits(t, want, f"destination {i}")


@pytest.mark.parametrize("routes_s, other_s, kept", [(1.0, 0.9, "foreach"),
                                                     (1.0, 0.97, "routes"),
                                                     (1.0, 1.2, "routes")])
def test_another_strategy_replaces_routes_only_when_clearly_faster(monkeypatch, routes_s,
                                                                   other_s, kept):
    # a fake clock: each run "takes" its candidate's time
    now = [0.0]
    monkeypatch.setattr(strategy_choice.time, "perf_counter", lambda: now[0])

    def taking(seconds):
        def fn(tensors, scale):
            now[0] += seconds
        return fn
    choice = Choice({False: {"routes": taking(routes_s), "foreach": taking(other_s)}},
                    forced=None, trial=True)
    choice.run(False, [], 0.5)
    choice.run(False, [], 0.5)
    assert choice.chosen[False] == kept


@pytest.mark.parametrize("scratch_s, kept", [(1.2, "routes"), (0.5, "scratch")])
def test_a_candidate_not_kept_gives_its_memory_back(monkeypatch, scratch_s, kept):
    now = [0.0]
    monkeypatch.setattr(strategy_choice.time, "perf_counter", lambda: now[0])
    released = []

    def taking(seconds):
        def fn(tensors, scale):
            now[0] += seconds
        return fn
    scratch = taking(scratch_s)
    scratch.release = lambda: released.append("scratch")
    choice = Choice({False: {"routes": taking(1.0), "scratch": scratch}}, forced=None,
                    trial=True)
    choice.run(False, [], 0.5)
    choice.run(False, [], 0.5)
    assert choice.chosen[False] == kept
    assert released == ([] if kept == "scratch" else ["scratch"])


@pytest.mark.parametrize("direction", ["flatten", "unflatten"])
def test_a_released_scratch_takes_memory_again_and_writes_the_same_bits(direction):
    # the layouts where the scratch strategy is offered: a scaled flatten into
    # 16 bits, a scaled unflatten into the buffer's own dtype
    scale = 1 / 3
    if direction == "flatten":
        tensors = [torch.randn(shape) for shape in SHAPES]
        out = torch.empty(sum(t.numel() for t in tensors), dtype=F16)
        expected = [reference_flatten(tensors, F16, scale)]
        launch = flatten_launch(tensors, out)
        results = [out]
    else:
        tensors = [torch.empty(shape) for shape in SHAPES]
        out = make_flat(tensors, F32, scale, None)
        expected = reference_unflatten(out, tensors, scale, False)
        launch = unflatten_launch(out, tensors)
        results = tensors
    scratch = launch.choice.candidates[False]["scratch"]
    runs = scratch.release.__self__
    held = runs._storage.nbytes()
    assert held > 0
    scratch.release()
    assert runs._storage.nbytes() == 0
    for r in results:
        r.fill_(math.nan)
    scratch(tensors, scale)
    assert runs._storage.nbytes() == held
    for r, want in zip(results, expected):
        assert_same_bits(r, want, f"{direction} by a released scratch")


# A scaled flatten into fp32/fp64 by ``routes`` copies and scales the buffer in
# runs of about SCALE_GROUP elements (each run's piece scaled while in cache):
# only a layout over two runs or more shows a piece that starts a segment early
# (that segment scaled twice) or late (left unscaled). The scales are exact in
# fp32 or have a full mantissa; the product is rounded once in fp32 either way,
# so the bits are the reference's.
GROUP = torch_backend.SCALE_GROUP
RUN_LAYOUTS = {  # name: (shapes, source dtypes, offsets or None for packed)
    "fp32, packed": ([(7 * GROUP // 10,), (GROUP // 4, 2), (3 * GROUP // 10,)],
                     (F32, F32, F32), None),
    "16-bit into fp32, packed": ([(7 * GROUP // 10,), (GROUP // 2,), (3 * GROUP // 10,)],
                                 (F16, BF16, F16), None),
    "fp32, gaps": ([(7 * GROUP // 10,), (GROUP // 2,), (5,), (3 * GROUP // 10,)],
                   (F32, F32, F32, F32), "gaps"),
}


@pytest.mark.parametrize("scale", [0.5, 1 / 3])
@pytest.mark.parametrize("name", sorted(RUN_LAYOUTS))
def test_routes_scales_every_segment_once_over_several_runs(name, scale):
    shapes, dtypes, offsets = RUN_LAYOUTS[name]
    # no zeros (x * scale == x there): every element shows whether it was scaled once
    generator = torch.Generator().manual_seed(len(shapes))
    tensors = [(torch.rand(shape, generator=generator) + 0.5).to(dtype) for shape, dtype
               in zip(shapes, dtypes)]
    assert sum(t.numel() for t in tensors) >= GROUP + GROUP // 4  # two runs at least
    if offsets == "gaps":  # one element before every segment
        offsets = _checks.segment_starts(tensors, None, "")[0]
        offsets = [start + i + 1 for i, start in enumerate(offsets)]
    _, size = _checks.segment_starts(tensors, offsets, "tensors")
    out = torch.empty(size + 3, dtype=F32)
    expected = reference_flatten(tensors, F32, scale, offsets, out.numel())
    with forcing("routes"):
        launch = flatten_launch(tensors, out, offsets)
    assert launch.choice.chosen[False] == "routes"
    for call in range(2):  # the first call, and a kept launch's later one
        out.fill_(math.nan)
        launch(tensors, out, scale, False)
        assert_same_bits(out, expected, f"{name}, call {call}")


# ------------------------------------------------------------- chosen once, kept

def counting(launch):
    """Count each candidate's runs, per kind: ``{(kind, name): runs}``."""
    runs = {}
    for kind, fns in launch.choice.candidates.items():
        for name, fn in fns.items():
            def counted(tensors, scale, fn=fn, key=(kind, name)):
                runs[key] = runs.get(key, 0) + 1
                return fn(tensors, scale)
            fns[name] = counted
    return runs


def test_the_second_call_times_every_candidate_and_later_calls_run_the_kept_one():
    tensors = [torch.randn(40, 30).half(), torch.randn(7).half(), torch.randn(3, 3).half()]
    out = torch.empty(1216)
    expected = reference_flatten(tensors, F32, 0.25)
    with forcing(None):
        launch = flatten_launch(tensors, out)
    runs = counting(launch)
    launch(tensors, out, 0.25, False)
    assert runs == {(False, "routes"): 1} and False not in launch.choice.chosen
    launch(tensors, out, 0.25, False)  # the trial: every candidate, at least twice
    chosen = launch.choice.chosen[False]
    assert set(launch.choice.candidates[False]) == {"routes", "foreach", "concat", "per_tensor"}
    assert all(runs[False, name] >= 2 for name in launch.choice.candidates[False])
    assert 0 < launch.choice.trial_s[False] < 1.0
    assert_same_bits(out, expected, "the trial's result")
    before = dict(runs)
    for _ in range(3):
        out.fill_(math.nan)
        launch(tensors, out, 0.25, False)
        assert_same_bits(out, expected, f"flatten by the kept {chosen}")
    assert runs[False, chosen] == before[False, chosen] + 3
    assert {k: v for k, v in runs.items() if k != (False, chosen)} == \
        {k: v for k, v in before.items() if k != (False, chosen)}
    assert launch.choice.chosen[False] == chosen


def test_a_kept_launch_runs_one_trial_per_kind_of_call(monkeypatch):
    trials = []
    trial = Choice._trial
    monkeypatch.setattr(Choice, "_trial",
                        lambda self, kind, *args: (trials.append(kind), trial(self, kind, *args)))
    monkeypatch.delenv(STRATEGY_VARIABLE, raising=False)
    _prepared.LAUNCHES.clear()
    tensors = [torch.randn(20, 10).half(), torch.randn(30).half()]
    out, dsts = torch.empty(230), [torch.empty(20, 10), torch.empty(30)]
    for _ in range(4):
        for scale in (1.0, 0.5):
            flatten_cast_scale(tensors, out, scale=scale, backend="torch")
            unflatten_cast_scale(out, dsts, scale=scale, backend="torch")
    assert sorted(trials, key=str) == [False, False, True, True]
    launch = _prepared.LAUNCHES._entries[("flatten", "torch", id(out))].launch
    assert set(launch.choice.chosen) == {True, False}
    _prepared.LAUNCHES.clear()


def test_a_launch_for_one_call_never_runs_a_trial(monkeypatch):
    monkeypatch.setattr(Choice, "_trial", lambda *args: pytest.fail("a trial ran"))
    monkeypatch.delenv(STRATEGY_VARIABLE, raising=False)
    tensors = [torch.randn(20, 10).half(), torch.randn(30).half()]
    for _ in range(3):  # a new buffer each call, so a new launch each call
        flat = flatten_cast_scale(tensors, scale=0.5, backend="torch")
    assert_same_bits(flat, reference_flatten(tensors, F32, 0.5))


def test_a_trial_stops_after_its_budget_but_not_before_its_fewest_rounds(monkeypatch):
    import time
    monkeypatch.setattr(strategy_choice, "TRIAL_BUDGET_S", 0.001)
    runs = []
    slow = {name: (lambda tensors, scale, name=name: (runs.append(name), time.sleep(0.002)))
            for name in ("routes", "foreach")}
    choice = Choice({False: slow}, forced=None, trial=True)
    choice.run(False, [], 0.5)
    choice.run(False, [], 0.5)
    fewest = torch_backend.TRIAL_ROUNDS[0]
    assert runs == ["routes"] + ["routes", "foreach"] * fewest
    assert choice.chosen[False] in slow


def test_without_a_trial_routes_is_kept_at_once():
    # on accelerators (trial=False) nothing is timed: no synchronisation, capturable
    fns = {"routes": lambda tensors, scale: None, "foreach": lambda tensors, scale: None}
    choice = Choice({False: dict(fns), True: dict(fns)}, forced=None, trial=False)
    assert choice.chosen == {False: "routes", True: "routes"}


def test_an_unknown_forced_strategy_is_refused_naming_the_variable_before_writing():
    tensors, out = [torch.ones(3)], torch.full((3,), 7.0)
    _prepared.LAUNCHES.clear()
    with forcing("fastest"), pytest.raises(ValueError, match=STRATEGY_VARIABLE):
        flatten_cast_scale(tensors, out, backend="torch")
    assert out.tolist() == [7.0, 7.0, 7.0]
    with forcing(" Foreach "):
        assert torch_backend.forced_strategy() == "foreach"
    with forcing("auto"):
        assert torch_backend.forced_strategy() is None


def test_launches_leave_autograd_what_no_grad_would_leave():
    # the launches run under inference mode: in-place writes must still bump
    # version counters (a saved tensor overwritten is caught by backward) and
    # nothing handed back may be an inference tensor
    param = torch.nn.Parameter(torch.zeros(5))
    weight = torch.ones(5, requires_grad=True)
    loss = (weight * param).sum()  # saves param for backward
    version = param._version
    unflatten_cast_scale(torch.arange(5.0), [param], scale=2.0, backend="torch")
    assert param._version > version and not param.is_inference()
    assert param.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.empty(3)
    flat, found = flatten_cast_scale([torch.ones(3).half()], out, scale=0.5, check_finite=True,
                                     backend="torch")
    assert flat is out and not out.is_inference() and not found.is_inference()
    assert out._version > 0 and not bool(found)
    found |= torch.ones((), dtype=torch.bool)  # an ordinary tensor takes in-place ops


def test_without_torchs_inference_guard_the_public_context_gives_the_same_bits(monkeypatch):
    tensors = [torch.randn(shape).half() for shape in SHAPES]
    want = flatten_cast_scale(tensors, scale=0.375, backend="torch")
    monkeypatch.setattr(torch_backend, "_INFERENCE_GUARD", None)
    assert isinstance(torch_backend._inference_mode(), torch.inference_mode)
    assert_same_bits(flatten_cast_scale(tensors, scale=0.375, backend="torch"), want, "flat")
