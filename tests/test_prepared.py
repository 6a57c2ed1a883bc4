"""Prepared launches (``kernels/_prepared.py``): kept per layout, reused, never stale.

A call of ``flatten_cast_scale``/``unflatten_cast_scale`` with a persistent
buffer prepares a launch for its layout once and reuses it while the call's
*signature* (addresses, sizes, dtypes, contiguity, strides of strided tensors,
the buffer object and the offsets) stays the same, and re-points it when
only contiguous tensors' addresses changed (gradients set to None come back
elsewhere). These tests prove every side of that: a steady-state call really skips the preparation (a spy counts
the backends' ``prepare_*`` calls and the kept launch object stays the same),
and every change of layout between calls — a tensor replaced, resized,
re-typed, transposed at the same address, new offsets, another buffer — still
gives results bitwise equal to the float64 reference (``reference.py``).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import weakref

import pytest
import torch
from hypothesis import given, strategies as st

import device_mode
import fusedreduce.kernels._backends as backends
from device_mode import on_cpu
from fusedreduce.kernels import _checks, _prepared, flatten_cast_scale, unflatten_cast_scale
from fusedreduce.kernels.flatten import torch_backend
from flatten_cases import (DTYPES, accumulate_bound, assert_same_bits, assert_within, lay_out,
                           scales)
from reference import reference_flatten, reference_unflatten

# numpy under Triton's interpreter warns about the overflows the tests cause on purpose
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
ENTRIES = _prepared.LAUNCHES._entries


# ------------------------------------------------------------------- helpers

@pytest.fixture
def fresh():
    """An empty launch cache before and after the test."""
    _prepared.LAUNCHES.clear()
    yield
    _prepared.LAUNCHES.clear()


@pytest.fixture
def prepares(monkeypatch, backend, fresh):
    """How many launches the backend under test has prepared, per op (a spy)."""
    counts = {"flatten": 0, "unflatten": 0}
    if backend == "torch":
        name, chosen = "TORCH", backends.TORCH
    else:
        name, chosen = "_triton", backends.triton_backend()

    def counting(op, prepare):
        def spy(*args, **kwargs):
            counts[op] += 1
            return prepare(*args, **kwargs)
        return spy

    monkeypatch.setattr(backends, name, dataclasses.replace(
        chosen, prepare_flatten=counting("flatten", chosen.prepare_flatten),
        prepare_unflatten=counting("unflatten", chosen.prepare_unflatten)))
    return counts


def kept_launch(op, backend, buffer):
    entry = ENTRIES.get((op, backend, id(buffer)))
    return None if entry is None else entry.launch


def randn(shape, dtype, seed, magnitude=4.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=F64) * magnitude).to(dtype)


def refill(tensors, seed):
    """New values in place (same objects, same addresses)."""
    for i, t in enumerate(tensors):
        t.copy_(randn(t.shape, t.dtype, seed * 101 + i))


def alias(t):
    """A new tensor object over exactly ``t``'s memory: what a gradient set to None
    comes back as when the caching allocator hands out the same block."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(),
                                              t.shape, t.stride())


def assert_unflattened(flat, tensors, scale, offsets, what):
    for i, (t, want) in enumerate(zip(tensors, reference_unflatten(flat, tensors, scale, False,
                                                                   offsets))):
        assert_same_bits(t.contiguous(), want, f"{what}: tensors[{i}]")


def run(op, backend, buffer, tensors, scale, offsets):
    """One call of ``op`` and the bitwise check of its result."""
    if op == "flatten":
        flatten_cast_scale(tensors, buffer, scale=scale, offsets=offsets, backend=backend)
        want = reference_flatten(tensors, buffer.dtype, scale, offsets, size=buffer.numel())
        assert_same_bits(buffer, want, "out")
    else:
        unflatten_cast_scale(buffer, tensors, scale=scale, offsets=offsets, backend=backend)
        assert_unflattened(buffer, tensors, scale, offsets, "unflatten")


# ------------------------------------------------- 1. steady state reuses the launch

def mixed_tensors(seed):
    """Mixed dtypes, a 0-element and a 1-element tensor, and two strided ones."""
    strided_owner = torch.full((4, 11), math.nan, dtype=F16)
    return [randn((5, 3), F16, seed), randn((0,), F32, seed), randn((1,), BF16, seed),
            randn((7,), F64, seed), randn((4, 6), F32, seed).t(), strided_owner[:, 1::2]]


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
def test_steady_state_calls_reuse_the_prepared_launch(backend, prepares, op):
    tensors = mixed_tensors(1)
    refill(tensors, 1)
    offsets = [2, 20, 20, 23, 31, 60]
    buffer = torch.full((80,), math.nan) if op == "flatten" else randn((80,), F32, 5)
    run(op, backend, buffer, tensors, 0.375, offsets)
    assert prepares[op] == 1
    entry = ENTRIES[(op, backend, id(buffer))]
    kept, calls = entry.launch, []

    def counted(*args):
        calls.append(args)
        return kept(*args)

    entry.launch = counted
    for step, scale in enumerate([1.0, -2.5, 1 / 3, 1e-3], start=2):
        refill(tensors, step)
        if op == "unflatten":
            buffer.copy_(randn((80,), F32, 10 + step))
        run(op, backend, buffer, tensors, scale, list(offsets))
    assert prepares[op] == 1, "a steady-state call prepared its launch again"
    assert len(calls) == 4, "a steady-state call did not run the kept launch"
    assert ENTRIES[(op, backend, id(buffer))] is entry


def test_calls_without_out_are_never_kept(backend, prepares):
    tensors = [randn((3,), F16, 0), randn((2, 2), F32, 1)]
    for scale in (1.0, 0.5):
        flat = flatten_cast_scale(tensors, scale=scale, backend=backend)
        assert_same_bits(flat, reference_flatten(tensors, F32, scale))
    assert prepares["flatten"] == 2
    assert len(_prepared.LAUNCHES) == 0


class Rebuilt(Exception):
    pass


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
def test_triton_steady_state_builds_no_table(backend, monkeypatch, fresh, op):
    """The launch table is built and moved to the device once, by the first call."""
    if backend != "triton":
        pytest.skip("the launch table is the Triton backend's")
    from fusedreduce.kernels.flatten import triton_backend
    tensors = mixed_tensors(2)
    refill(tensors, 2)
    buffer = torch.zeros(100) if op == "flatten" else randn((100,), F32, 3)
    offsets = (1, 30, 31, 40, 50, 80)
    run(op, backend, buffer, tensors, 2.0, offsets)

    def rebuilt(*args, **kwargs):
        raise Rebuilt
    monkeypatch.setattr(torch, "from_numpy", rebuilt)
    monkeypatch.setattr(triton_backend, "build_table", rebuilt)
    for step, scale in enumerate([0.1, -7.0, 1.0]):
        refill(tensors, 10 + step)
        run(op, backend, buffer, tensors, scale, offsets)
    # the spies are live: a new layout does build a table
    with pytest.raises(Rebuilt):
        run(op, backend, buffer, tensors, 1.0, (0, 30, 31, 40, 50, 80))


# ------------------------------------------- 2. layout changes between calls stay right

SQUARE = 6


def layout_tensors(seed):
    """Four tensors in slots of 40: one is square (for a transpose at the same
    address) and one strided over a larger owner (for a change of strides)."""
    owner = torch.full((20,), math.nan, dtype=F64)
    return [randn((5, 6), F16, seed), randn((7,), F32, seed),
            randn((SQUARE, SQUARE), BF16, seed), owner.as_strided((5,), (2,))]


def new_buffer(op, size, seed=9):
    return torch.full((size,), math.nan) if op == "flatten" else randn((size,), F32, seed)


def _scale_only(op, ts, offsets, buffer):
    return ts, offsets, buffer


def _new_objects_same_addresses(op, ts, offsets, buffer):
    return [alias(t) for t in ts], offsets, buffer


def _moved(op, ts, offsets, buffer):
    # the same shapes, dtypes and strides at other addresses (a gradient set to
    # None and allocated elsewhere)
    ts[1] = torch.empty_like(ts[1])
    ts[3] = torch.empty(20, dtype=F64).as_strided((5,), (2,))
    return ts, offsets, buffer


def _numel(op, ts, offsets, buffer):
    ts[1] = randn((9,), F32, 3)
    return ts, offsets, buffer


def _shape(op, ts, offsets, buffer):
    ts[0] = ts[0].view(6, 5)
    return ts, offsets, buffer


def _dtype(op, ts, offsets, buffer):
    ts[1] = randn((7,), F64, 3)
    return ts, offsets, buffer


def _reinterpreted(op, ts, offsets, buffer):
    ts[0] = ts[0].view(BF16)  # same address, numel and shape; another dtype
    return ts, offsets, buffer


def _transposed(op, ts, offsets, buffer):
    ts[2] = ts[2].t()  # same address, shape and numel; not contiguous
    return ts, offsets, buffer


def _restrided(op, ts, offsets, buffer):
    ts[3] = ts[3].as_strided((5,), (3,))  # same address, shape, numel and contiguity
    return ts, offsets, buffer


def _resized(op, ts, offsets, buffer):
    ts[1].resize_(4)  # the same objects, shrunk in place
    ts[2].resize_(2, 3)
    return ts, offsets, buffer


def _offsets(op, ts, offsets, buffer):
    return ts, [3, 41, 85, 121], buffer


def _offsets_mutated(op, ts, offsets, buffer):
    offsets[2] = 84  # the very list the first call got, changed in place
    return ts, offsets, buffer


def _packed(op, ts, offsets, buffer):
    return ts, None, new_buffer(op, sum(t.numel() for t in ts))


def _other_buffer(op, ts, offsets, buffer):
    other = new_buffer(op, buffer.numel())
    assert other.data_ptr() != buffer.data_ptr()
    return ts, offsets, other


def _same_buffer_other_object(op, ts, offsets, buffer):
    return ts, offsets, alias(buffer)


# (change, whether the kept launch must serve it: True, False, or None for either)
CHANGES = [
    (_scale_only, True),
    (_new_objects_same_addresses, True),
    (_moved, False),
    (_numel, False),
    (_shape, None),  # Triton reads a contiguous tensor by count, torch views it by shape
    (_dtype, False),
    (_reinterpreted, False),
    (_transposed, False),
    (_restrided, False),
    (_resized, False),
    (_offsets, False),
    (_offsets_mutated, False),
    (_packed, False),
    (_other_buffer, False),
    (_same_buffer_other_object, False),
]


@pytest.fixture(params=["guard", "passes"])
def signature_check(request, monkeypatch):
    """Both ways of comparing a call's signature with the kept one: torch's
    C++ metadata guard as the fast path (where this torch has it), and the
    per-tensor passes alone (a torch without it)."""
    if request.param == "passes":
        monkeypatch.setattr(_checks, "_TensorGuards", None)
    elif _checks._TensorGuards is None:
        pytest.skip("this torch has no torch._C._dynamo.guards.TensorGuards")
    return request.param


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
@pytest.mark.parametrize("change, reused", CHANGES, ids=[c[0].__name__.strip("_") for c in CHANGES])
def test_layout_changes_between_calls_stay_right(backend, prepares, signature_check, op, change,
                                                 reused):
    tensors = layout_tensors(1)
    offsets = [0, 40, 80, 120]
    buffer = new_buffer(op, 160, seed=7)
    refill(tensors, 1)
    run(op, backend, buffer, tensors, 0.7, offsets)
    first = kept_launch(op, backend, buffer)
    assert first is not None and prepares[op] == 1
    # the fast path is really taken where it exists
    guarded = ENTRIES[(op, backend, id(buffer))].guard is not None
    assert guarded == (signature_check == "guard")

    tensors, offsets, after = change(op, list(tensors), offsets, buffer)
    for step, scale in enumerate([-1.3, 1.0, 3.0]):
        # new values every call: a kept launch with stale addresses cannot pass
        refill(tensors, 2 + step)
        if op == "unflatten":
            after.copy_(randn(after.shape, F32, 20 + step))
        run(op, backend, after, tensors, scale, offsets)
        if step == 0:
            launch, count = kept_launch(op, backend, after), prepares[op]
            if reused is True:
                assert launch is first and count == 1, "the kept launch was not reused"
            elif reused is False:
                assert launch is not first and count == 2, "a changed layout was not prepared"
    # the changed layout is kept in turn: its later calls prepared nothing
    assert prepares[op] == count and kept_launch(op, backend, after) is launch
    if after is not buffer:  # another buffer object: the first one's entry stays
        assert kept_launch(op, backend, buffer) is first


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
def test_what_only_the_guard_sees_does_not_re_prepare(backend, prepares, op):
    # the guard also compares shapes, requires_grad and the dispatch keys that
    # inference_mode changes, which the launch does not depend on: a call that
    # differs only there is served by the kept launch, alternating or not
    tensors = layout_tensors(1)
    offsets = [0, 40, 80, 120]
    buffer = new_buffer(op, 160, seed=7)
    run(op, backend, buffer, tensors, 0.7, offsets)
    first = kept_launch(op, backend, buffer)
    for step in range(4):
        refill(tensors, 2 + step)
        if op == "unflatten":
            buffer.copy_(randn(buffer.shape, F32, 20 + step))
        if step % 2:
            with torch.inference_mode():
                run(op, backend, buffer, tensors, 1.5, offsets)
        else:
            run(op, backend, buffer, [alias(t).requires_grad_(t.is_floating_point())
                                      for t in tensors[:3]] + tensors[3:], 1.5, offsets)
    assert prepares[op] == 1 and kept_launch(op, backend, buffer) is first


# ----------------------------------------------------- 3. entries die with their buffer

def test_entries_die_with_their_buffer(backend, fresh):
    sources = [randn((3, 4), F16, 0), randn((5,), F32, 1).expand(2, 5)]
    out = torch.empty(22)
    flatten_cast_scale(sources, out, backend=backend)
    flat, destinations = randn((22,), F32, 2), [torch.empty(3, 4, dtype=F16),
                                                torch.empty(5, 2, dtype=BF16).t()]
    unflatten_cast_scale(flat, destinations, scale=0.5, backend=backend)
    keys = {("flatten", backend, id(out)), ("unflatten", backend, id(flat))}
    assert set(ENTRIES) == keys
    out_ref, flat_ref = weakref.ref(out), weakref.ref(flat)
    del out, flat
    gc.collect()
    assert out_ref() is None and flat_ref() is None, "a kept entry keeps its buffer alive"
    assert len(_prepared.LAUNCHES) == 0, "an entry outlived its buffer"


def test_the_cache_keeps_at_most_KEPT_least_recently_used_out(backend, fresh):
    kept = _prepared.LAUNCHES.kept
    assert kept == _prepared.KEPT
    source = [randn((3,), F16, 0)]
    buffers = [torch.empty(3) for _ in range(kept)]
    for buffer in buffers:
        flatten_cast_scale(source, buffer, backend=backend)
    assert len(_prepared.LAUNCHES) == kept
    # a hit makes buffers[0] the most recently used: buffers[1] goes first
    flatten_cast_scale(source, buffers[0], backend=backend)
    extra = [torch.empty(3) for _ in range(3)]
    for buffer in extra:
        flatten_cast_scale(source, buffer, backend=backend)
        assert len(_prepared.LAUNCHES) == kept
    held = {key[2] for key in ENTRIES}
    assert id(buffers[0]) in held and all(id(b) in held for b in extra)
    assert not any(id(b) in held for b in buffers[1:4])
    # a forgotten layout is prepared afresh, and right
    source[0].mul_(-3)
    flatten_cast_scale(source, buffers[1], scale=0.25, backend=backend)
    assert_same_bits(buffers[1], reference_flatten(source, F32, 0.25))
    assert len(_prepared.LAUNCHES) == kept


# ---------------------------------------------------- 4. check_finite on a kept launch

def test_check_finite_on_a_kept_launch_sees_new_nonfinite_values(backend, prepares):
    owner = torch.zeros(3, 8, dtype=BF16)
    tensors = [randn((4, 5), F16, 0), randn((6,), F32, 1), owner[:, ::2], randn((3,), F64, 2)]
    out = torch.empty(sum(t.numel() for t in tensors), dtype=F16)
    for step, (where, value) in enumerate([
            (None, None), ((0, (2, 3)), math.nan), (None, None), ((1, (5,)), math.inf),
            ((2, (1, 3)), -math.inf), ((3, (0,)), math.nan), (None, None)]):
        refill(tensors, step)
        if where is not None:
            tensors[where[0]][where[1]] = value
        _, found = flatten_cast_scale(tensors, out, scale=0.5, check_finite=True,
                                      backend=backend)
        assert bool(found) == (where is not None), f"{where}: flag {bool(found)}"
        assert_same_bits(out, reference_flatten(tensors, F16, 0.5), f"{where}")
    assert prepares["flatten"] == 1


# ------------------------------------------- 5. accumulate twice through a kept launch

@pytest.mark.parametrize("exact", [True, False], ids=["dyadic", "random"])
def test_accumulate_twice_through_a_kept_launch(backend, prepares, exact):
    owner = torch.full((5, 9), math.nan, dtype=F32)
    tensors = [torch.empty(4, 3, dtype=F16), torch.empty(7, dtype=BF16), owner[:, 1::2],
               torch.empty(3, 2, dtype=F64).t(), torch.empty(0, dtype=F16)]
    offsets = [0, 13, 21, 45, 60]
    generator = torch.Generator().manual_seed(4)
    for t in tensors:
        t.copy_(torch.randint(-16, 16, t.shape, generator=generator) * 0.25)
    flat_values = [torch.randint(-64, 64, (60,), generator=generator) * 0.125,
                   torch.randint(-64, 64, (60,), generator=generator) * 0.5]
    for step, scale in enumerate([0.5, -2.0] if exact else [0.3, -1.7]):
        flat = flat_values[step].float() if exact else randn((60,), F32, step)
        if step == 0:
            buffer = flat
        else:
            buffer.copy_(flat)
        before = [t.clone() for t in tensors]
        unflatten_cast_scale(buffer, tensors, scale=scale, accumulate=True, offsets=offsets,
                             backend=backend)
        want = reference_unflatten(buffer, before, scale, True, offsets)
        for i, (t, w, b, start) in enumerate(zip(tensors, want, before, offsets)):
            if exact:  # every value, product and sum is exact in every dtype
                assert_same_bits(t.contiguous(), w, f"step {step}: tensors[{i}]")
            else:
                product = buffer[start:start + t.numel()].double().view(t.shape) * scale
                assert_within(t.contiguous(), w, accumulate_bound(product, w, F32, t.dtype),
                              f"step {step}: tensors[{i}]")
    assert torch.isnan(owner[:, ::2]).all(), "a strided destination's padding was written"
    assert prepares["unflatten"] == 1


# ---------------------------------- 6. non-contiguous inputs and outputs, repeated calls

def test_strided_inputs_and_outputs_repeated(backend, prepares):
    src_owner = torch.full((6, 10), math.nan, dtype=F16)
    one = torch.empty(1, dtype=F32)
    sources = [src_owner[:, 1::3], torch.empty(5, 4, dtype=BF16).t(), one.expand(3, 2),
               torch.empty(2, 3, 4, dtype=F64).permute(2, 0, 1), torch.empty(9, dtype=F32)[::4]]
    dst_owner = torch.full((4, 12), math.nan, dtype=F32)
    destinations = [torch.empty(3, 12, dtype=F16)[:, ::2], torch.empty(4, 5, dtype=BF16).t(),
                    dst_owner[:2, ::4], torch.empty(2, 3, 4, dtype=F64).transpose(0, 2),
                    torch.empty(3, 3, dtype=F16)[:, 1]]
    assert [d.numel() for d in destinations] == [s.numel() for s in sources]
    assert not any(t.is_contiguous() for t in sources + destinations)
    out = torch.empty(sum(s.numel() for s in sources), dtype=BF16)
    padding = dst_owner.clone()
    for step, scale in enumerate([1.0, 0.75, -3.0]):
        refill([s for s in sources if s is not sources[2]] + [one], step)
        flatten_cast_scale(sources, out, scale=scale, backend=backend)
        assert_same_bits(out, reference_flatten(sources, BF16, scale), f"step {step}: out")
        unflatten_cast_scale(out, destinations, scale=1 / (step + 1), backend=backend)
        assert_unflattened(out, destinations, 1 / (step + 1), None, f"step {step}")
    untouched = torch.ones_like(dst_owner, dtype=torch.bool)
    untouched[:2, ::4] = False
    assert_same_bits(dst_owner[untouched], padding[untouched], "around a strided destination")
    assert torch.isnan(src_owner[:, 0]).all()
    assert prepares == {"flatten": 1, "unflatten": 1}


# ------------------------- 7. scaled fp32 -> 16-bit unflatten (torch: ScratchRuns)

def narrowing_case():
    """Small and large (>= CACHE_PIECE) 16-bit destinations, fp32 ones among them,
    gaps short enough to share a run and long ones; NaN and inf in the gaps."""
    large = torch_backend.CACHE_PIECE
    destinations = [torch.empty(3, 5, dtype=F16), torch.empty(7, dtype=BF16),
                    torch.empty(4, dtype=F32), torch.empty(large, dtype=F16),
                    torch.empty(5, dtype=BF16), torch.empty(large + 1001, dtype=BF16),
                    torch.empty(6, 4, dtype=F16).t(), torch.empty(0, dtype=F16),
                    torch.empty(1, dtype=BF16), torch.empty(2, 3, dtype=F16)]
    gaps = [1, 10, 0, 3, 300, 2, 255, 4, 0, 257]
    offsets, end = [], 0
    for d, gap in zip(destinations, gaps):
        offsets.append(end + gap)
        end = offsets[-1] + d.numel()
    return destinations, offsets, end + 5


def fill_flat(flat, offsets, destinations, seed):
    values = randn(flat.shape, F32, seed, magnitude=1.0)
    values *= torch.exp2(torch.randint(-30, 18, flat.shape,
                                       generator=torch.Generator().manual_seed(seed)).float())
    covered = torch.zeros(flat.shape, dtype=torch.bool)
    for start, d in zip(offsets, destinations):
        covered[start:start + d.numel()] = True
    values[~covered] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(
        int((~covered).sum()) // 3 + 1)[:int((~covered).sum())]
    flat.copy_(values)


def test_scaled_narrowing_rounds_once_from_the_fp32_product(backend, prepares, monkeypatch):
    narrowed = []
    original = torch_backend.ScratchRuns.__call__

    def spy(self, *args):
        narrowed.append(self)
        return original(self, *args)
    monkeypatch.setattr(torch_backend.ScratchRuns, "__call__", spy)
    destinations, offsets, size = narrowing_case()
    flat = torch.empty(size, dtype=F32)
    scales_used = [0.1, -3.0000001, 1.0, 2.0 ** -20, 1e4] if backend == "torch" else [0.1, 1.0]
    for step, scale in enumerate(scales_used):
        fill_flat(flat, offsets, destinations, step)
        if step == 2:  # the same memory, new tensor objects
            destinations = [alias(d) for d in destinations]
        unflatten_cast_scale(flat, destinations, scale=scale, offsets=offsets, backend=backend)
        for i, (d, start) in enumerate(zip(destinations, offsets)):
            segment = flat[start:start + d.numel()].view(d.shape)
            want = (segment * scale).to(d.dtype)  # fp32 product, one rounding
            assert_same_bits(d.contiguous(), want, f"scale {scale}: destinations[{i}]")
        # and the float64 reference agrees
        assert_unflattened(flat, destinations, scale, offsets, f"scale {scale}")
    assert prepares["unflatten"] == 1
    if backend == "torch":
        assert len(narrowed) >= len(scales_used) - 1, "ScratchRuns was not exercised"


# ------------------------------------------------------- 8. repeated round trips

round_shapes = st.sampled_from([(), (0,), (1,), (3,), (7,), (33,), (2049,), (5, 3), (0, 4),
                                (3, 1, 2), (4, 4)])
tensor_specs = st.tuples(round_shapes, st.sampled_from(DTYPES), st.sampled_from(DTYPES),
                         st.sampled_from(["contiguous", "offset", "transposed", "strided"]),
                         st.integers(0, 2 ** 16))


def _fill(built, seed, magnitude):
    values = randn(built.tensor.shape, F64, seed, magnitude=2.0 ** magnitude)
    values.view(-1)[seed % 3::5] = 0.0
    built.tensor.copy_(values)


def _padding_mask(built):
    mask = torch.ones(built.owner.shape, dtype=torch.bool)
    built.view_of(mask)[...] = False
    return mask


@given(data=st.data(), specs=st.lists(tensor_specs, max_size=6),
       flat_dtype=st.sampled_from(DTYPES), rounds=st.integers(2, 3), use_offsets=st.booleans())
def test_repeated_round_trips_into_one_buffer_stay_right(backend, data, specs, flat_dtype,
                                                         rounds, use_offsets):
    def lay(shape, dtype, layout):
        return lay_out(torch.zeros(math.prod(shape), dtype=dtype), shape, layout)

    sources = [lay(shape, src, layout) for shape, src, _, layout, _ in specs]
    targets = [lay(shape, dst, layout) for shape, _, dst, layout, _ in specs]
    offsets, end = None, sum(math.prod(s[0]) for s in specs)
    if use_offsets:
        offsets, end = [], 0
        for shape, *_ in specs:
            offsets.append(end + data.draw(st.sampled_from([0, 1, 5, 2050]), "gap"))
            end = offsets[-1] + math.prod(shape)
        end += data.draw(st.sampled_from([0, 3]), "tail")
    out = torch.full((end,), math.nan, dtype=flat_dtype)
    tensors = [b.tensor for b in sources]
    destinations = [b.tensor for b in targets]
    launches = None
    for step in range(rounds):
        scale, back = data.draw(scales, "scale"), data.draw(scales, "scale back")
        magnitude = data.draw(st.integers(-8, 8), "magnitude")
        for i, (b, spec) in enumerate(zip(sources, specs)):
            _fill(b, spec[4] + 1000 * step + i, magnitude)
        if data.draw(st.booleans(), "new tensor objects at the same addresses"):
            tensors = [alias(t) for t in tensors]
            destinations = [alias(t) for t in destinations]
        flatten_cast_scale(tensors, out, scale=scale, offsets=offsets, backend=backend)
        assert_same_bits(out, reference_flatten(tensors, flat_dtype, scale, offsets, end),
                         f"round {step}: out")
        accumulate = data.draw(st.booleans(), "accumulate")
        before = [t.clone() for t in destinations]
        paddings = [b.owner[_padding_mask(b)].clone() for b in targets]
        unflatten_cast_scale(out, destinations, scale=back, accumulate=accumulate,
                             offsets=offsets, backend=backend)
        want = reference_unflatten(out, before, back, accumulate, offsets)
        starts = offsets if offsets is not None else \
            [sum(math.prod(s[0]) for s in specs[:i]) for i in range(len(specs))]
        for i, (t, w, start) in enumerate(zip(destinations, want, starts)):
            what = f"round {step}: destinations[{i}]"
            if accumulate:
                product = out[start:start + t.numel()].double().view(t.shape) * back
                assert_within(t.contiguous(), w,
                              accumulate_bound(product, w, flat_dtype, t.dtype), what)
            else:
                assert_same_bits(t.contiguous(), w, what)
        for i, (b, padding) in enumerate(zip(targets, paddings)):
            assert_same_bits(b.owner[_padding_mask(b)], padding, f"round {step}: padding {i}")
        now = (kept_launch("flatten", backend, out), kept_launch("unflatten", backend, out))
        assert None not in now
        if launches is None:
            launches = now
        assert now[0] is launches[0] and now[1] is launches[1], "a steady layout was re-prepared"


# ------------------------------------- 4. moved tensors: the kept launch re-pointed

def _placed(shape, dtype, pad):
    """A new contiguous tensor ``pad`` elements into a fresh allocation of its
    own on the test device: another address, and for ``pad`` not a multiple of
    16 bytes another alignment (the Triton table keeps each address's remainder)."""
    n = math.prod(shape)
    return torch.full((n + pad,), math.nan, dtype=dtype,
                      device=device_mode.DEVICE())[pad:].view(shape)


def _round_trip(backend, data, sources, targets, out, what):
    """Flatten ``sources`` into ``out`` and back into ``targets`` at drawn
    scales, each result checked bitwise against the reference."""
    scale, back = data.draw(scales, "scale"), data.draw(scales, "scale back")
    flatten_cast_scale(sources, out, scale=scale, backend=backend)
    assert_same_bits(out, reference_flatten([on_cpu(t) for t in sources], out.dtype, scale,
                                            None, out.numel()), f"{what}: out")
    unflatten_cast_scale(out, targets, scale=back, backend=backend)
    wants = reference_unflatten(on_cpu(out), [on_cpu(t) for t in targets], back, False, None)
    for i, (t, want) in enumerate(zip(targets, wants)):
        assert_same_bits(t, want, f"{what}: targets[{i}]")


@pytest.mark.device_aware
@given(data=st.data(),
       specs=st.lists(st.tuples(st.sampled_from([(0,), (1,), (7,), (3, 5), (2100,)]),
                                st.sampled_from(DTYPES), st.sampled_from(DTYPES)),
                      min_size=1, max_size=5),
       flat_dtype=st.sampled_from(DTYPES), rounds=st.integers(2, 4))
def test_moved_contiguous_tensors_are_re_pointed_and_stay_right(backend, data, specs,
                                                                  flat_dtype, rounds):
    # gradients set to None come back elsewhere (and same-shaped ones swap
    # places): the kept launches are re-pointed, never prepared again, and every
    # result is still bitwise the reference's
    pads = st.sampled_from([0, 1, 3, 8])
    sources = [_placed(shape, src, data.draw(pads, "pad")) for shape, src, _ in specs]
    targets = [_placed(shape, dst, data.draw(pads, "pad")) for shape, _, dst in specs]
    end = sum(math.prod(shape) for shape, _, _ in specs)
    out = torch.full((end,), math.nan, dtype=flat_dtype, device=device_mode.DEVICE())
    launches = None
    for step in range(rounds):
        moves = data.draw(st.lists(st.booleans(), min_size=len(specs), max_size=len(specs)),
                          "which tensors move")
        if step and data.draw(st.booleans(), "swap two tensors"):
            moves = [True] * len(specs)
        for i, (moved, (shape, src, dst)) in enumerate(zip(moves, specs)):
            if moved and step:
                sources[i] = _placed(shape, src, data.draw(pads, "pad"))
                targets[i] = _placed(shape, dst, data.draw(pads, "pad"))
            sources[i].copy_(randn(shape, src, 1000 * step + i))
        _round_trip(backend, data, sources, targets, out, f"round {step}")
        now = (kept_launch("flatten", backend, out), kept_launch("unflatten", backend, out))
        if launches is None:
            launches = now
        if end > 0:  # an empty buffer has no address to pin offsets to
            assert now == launches, "a moved layout was prepared again"


@pytest.mark.device_aware
@given(data=st.data(), n_sets=st.integers(1, _prepared.RECENT + 3),
       calls=st.integers(2, 12))
def test_address_sets_seen_before_switch_back_without_a_span_check(backend, data, n_sets,
                                                                   calls):
    # steady-state gradients swap addresses back and forth: an entry keeps the
    # last RECENT address lists with their bindings, and a call at one of them
    # switches back (no span check, no new table); any other moved call checks
    # and re-points. A model of that LRU says which calls check; every result
    # is bitwise the reference's, with new values at every call
    shapes, dtypes = [(5,), (3, 4), (1,), (2100,)], [F16, F32, BF16, F64]
    sets = [([_placed(shape, dtype, pad) for shape, dtype in zip(shapes, dtypes)],
             [_placed(shape, dtype, pad) for shape, dtype in zip(shapes, dtypes)])
            for pad in range(n_sets)]
    end = sum(math.prod(shape) for shape in shapes)
    out = torch.full((end,), math.nan, dtype=F32, device=device_mode.DEVICE())
    checks = {False: 0, True: 0}  # span checks of flatten (inputs) and unflatten (outputs)
    spans_clear = _prepared.spans_clear

    def counting(ptrs, nbytes, buffer_span, pairwise, live=None):
        checks[pairwise] += 1
        return spans_clear(ptrs, nbytes, buffer_span, pairwise, live)

    order = data.draw(st.lists(st.integers(0, n_sets - 1), min_size=calls, max_size=calls),
                      "the address set of each call")
    _prepared.LAUNCHES.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_prepared, "spans_clear", counting)
        _follow(backend, order, sets, out, end, checks)
    _prepared.LAUNCHES.clear()


def _follow(backend, order, sets, out, end, checks):
    """The calls of ``order`` (see the test above)."""
    current, recent, expected, launches = None, [], 0, None
    for step, which in enumerate(order):
        sources, targets = sets[which]
        for i, t in enumerate(sources):
            t.copy_(randn(t.shape, t.dtype, 100 * step + i))
        flatten_cast_scale(sources, out, scale=0.5, backend=backend)
        assert_same_bits(out, reference_flatten([on_cpu(t) for t in sources], F32, 0.5, None,
                                                end), f"call {step}: out")
        unflatten_cast_scale(out, targets, scale=3.0, backend=backend)
        wants = reference_unflatten(on_cpu(out), [on_cpu(t) for t in targets], 3.0, False, None)
        for i, (t, want) in enumerate(zip(targets, wants)):
            assert_same_bits(t, want, f"call {step}: targets[{i}]")
        # the model of one entry's kept address lists
        if current is not None and which != current:
            if which not in recent:
                expected += 1
                recent = recent or [current]
            else:
                recent.remove(which)
            recent = [which] + recent[:_prepared.RECENT - 1]
        current = which
        assert checks == {False: expected, True: expected}, (order[:step + 1], checks)
        now = (kept_launch("flatten", backend, out), kept_launch("unflatten", backend, out))
        launches = launches or now
        assert now == launches, "a moved layout was prepared again"


def _move(buffer, pad):
    """``buffer`` (the same object) given fresh memory ``pad`` elements into an
    allocation of its own: what a buffer whose storage was released and
    allocated again looks like to a call, its old bytes gone."""
    placed = _placed(buffer.shape, buffer.dtype, pad)
    buffer.set_(placed.untyped_storage(), placed.storage_offset(), buffer.shape, buffer.stride())


@pytest.mark.device_aware
@given(data=st.data(),
       specs=st.lists(st.tuples(st.sampled_from([(0,), (1,), (7,), (3, 5), (2100,)]),
                                st.sampled_from(DTYPES), st.sampled_from(DTYPES)),
                      min_size=1, max_size=4),
       flat_dtype=st.sampled_from(DTYPES), rounds=st.integers(2, 4))
def test_a_buffer_given_new_memory_is_followed_and_stays_right(backend, data, specs, flat_dtype,
                                                               rounds):
    # ZeRO-2 releases its buffers' memory between steps and allocates it
    # again: the same tensor objects at other addresses. Triton's kept
    # launches follow a buffer that keeps its 16-byte alignment (their table
    # holds offsets from it); every other case is prepared again. Either way
    # every result is bitwise the reference's
    pads = st.sampled_from([0, 0, 1, 3, 8])
    sources = [_placed(shape, src, data.draw(pads, "pad")) for shape, src, _ in specs]
    targets = [_placed(shape, dst, data.draw(pads, "pad")) for shape, _, dst in specs]
    end = sum(math.prod(shape) for shape, _, _ in specs)
    out = _placed((end,), flat_dtype, data.draw(pads, "the buffer's first pad"))
    launches, address = None, None
    _prepared.LAUNCHES.clear()
    for step in range(rounds):
        if step:
            address = out.data_ptr()
            _move(out, data.draw(pads, "the buffer's pad"))
            if data.draw(st.booleans(), "the tensors move too"):
                sources = [_placed(t.shape, t.dtype, data.draw(pads, "pad")) for t in sources]
                targets = [_placed(t.shape, t.dtype, data.draw(pads, "pad")) for t in targets]
        for i, t in enumerate(sources):
            t.copy_(randn(t.shape, t.dtype, 1000 * step + i))
        _round_trip(backend, data, sources, targets, out, f"round {step}")
        now = (kept_launch("flatten", backend, out), kept_launch("unflatten", backend, out))
        # (an empty buffer has no memory to move; a launch prepared for an
        # unaligned buffer counts from one of the tensors, and cannot follow it)
        kept = step > 0 and (out.data_ptr() == address or (
            backend == "triton" and aligned_when_prepared and out.data_ptr() % 16 == 0))
        if step:
            assert (now == launches) == kept, (step, kept)
        if not kept:
            aligned_when_prepared = out.data_ptr() % 16 == 0
        launches = now
    _prepared.LAUNCHES.clear()


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
def test_a_buffer_moved_onto_a_tensor_is_refused_before_anything_is_written(backend, fresh, op):
    owner = torch.full((32,), math.nan)
    tensors = [owner[0:6], owner[8:12]]
    refill(tensors, 1)
    buffer = torch.full((10,), math.nan) if op == "flatten" else randn((10,), F32, 3)
    run(op, backend, buffer, tensors, 0.5, None)
    # the buffer's new memory holds tensors[1]: only addresses differ
    buffer.set_(owner.untyped_storage(), 8, (10,), (1,))
    before = owner.clone()
    with pytest.raises(ValueError, match=r"overlaps (out|flat)"):
        if op == "flatten":
            flatten_cast_scale(tensors, buffer, scale=0.5, backend=backend)
        else:
            unflatten_cast_scale(buffer, tensors, scale=0.5, backend=backend)
    assert_same_bits(owner, before, "the memory of the tensors and the buffer")


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
def test_a_tensor_moved_onto_the_buffer_is_refused_before_anything_is_written(backend, fresh,
                                                                               op):
    tensors = [randn((6,), F32, 1), randn((4,), F32, 2)]
    buffer = torch.full((10,), math.nan) if op == "flatten" else randn((10,), F32, 3)
    run(op, backend, buffer, tensors, 0.5, None)
    moved = [tensors[0], buffer[6:10]]  # same size, dtype and contiguity: only the address
    before = [t.clone() for t in (buffer, tensors[0])]
    with pytest.raises(ValueError, match=r"overlaps (out|flat)"):
        if op == "flatten":
            flatten_cast_scale(moved, buffer, scale=0.5, backend=backend)
        else:
            unflatten_cast_scale(buffer, moved, scale=0.5, backend=backend)
    assert_same_bits(buffer, before[0], "the buffer")
    assert_same_bits(tensors[0], before[1], "tensors[0]")


def test_destinations_moved_onto_each_other_are_refused(backend, fresh):
    flat = randn((10,), F32, 3)
    owner = torch.zeros(20)
    dsts = [owner[0:6], owner[10:14]]
    run("unflatten", backend, flat, dsts, 2.0, None)
    overlapping = [owner[0:6], owner[3:7]]
    with pytest.raises(ValueError, match="share memory"):
        unflatten_cast_scale(flat, overlapping, scale=2.0, backend=backend)


def test_spans_clear_is_the_validation_rule_for_contiguous_tensors():
    # against the full validation's own pairwise rule, on random spans: few
    # (checked in Python) and more than SMALL_SPANS (checked with numpy)
    import numpy as np
    generator = torch.Generator().manual_seed(0)
    for case in range(600):
        most = 6 if case % 2 else 2 * _prepared.SMALL_SPANS
        count = int(torch.randint(1, most, (1,), generator=generator))
        starts = torch.randint(0, 64 * (1 + count // 6), (count,), generator=generator).tolist()
        sizes = torch.randint(0, 9, (count,), generator=generator).tolist()
        lo = int(torch.randint(0, 64, (1,), generator=generator))
        hi = lo + int(torch.randint(0, 16, (1,), generator=generator))
        spans = [(a, a + n) for a, n in zip(starts, sizes) if n]
        hits_buffer = hi > lo and any(a < hi and e > lo for a, e in spans)
        overlap = any(a1 < e2 and a2 < e1 for i, (a1, e1) in enumerate(spans)
                      for a2, e2 in spans[i + 1:])
        for pairwise in (False, True):
            want = not hits_buffer and not (pairwise and overlap)
            got = _prepared.spans_clear(starts, np.array(sizes, dtype=np.int64), (lo, hi),
                                        pairwise)
            assert got == want, (starts, sizes, lo, hi, pairwise)


# ---------------------------------------------------- calls that must not hit a kept launch

def test_offsets_tensor_changed_in_place_is_not_served_stale(backend, fresh):
    """Offsets may be integer tensors (``as_index`` takes them); their elements are
    views, so the kept copy of them must not change with the caller's tensor."""
    tensors = [torch.ones(2), torch.full((2,), 2.0)]
    out = torch.full((8,), math.nan)
    offsets = torch.tensor([0, 4])
    flatten_cast_scale(tensors, out, offsets=offsets, backend=backend)
    offsets[1] = 5
    flatten_cast_scale(tensors, out, offsets=offsets, backend=backend)
    assert_same_bits(out, reference_flatten(tensors, F32, 1.0, [0, 5], 8))


@pytest.mark.parametrize("op", ["flatten", "unflatten"])
@pytest.mark.parametrize("restride", ["as_strided_", "unsqueeze_"])
def test_buffer_restrided_in_place_is_validated_again(backend, fresh, op, restride):
    """The buffer is compared by object, address, size and dtype; an in-place
    metadata change (same address and size) makes it a buffer that validation
    refuses, so the kept launch must not run on it."""
    x = torch.arange(4.0)
    storage = torch.zeros(8)
    buffer = storage[:4]
    if op == "flatten":
        flatten_cast_scale([x], buffer, backend=backend)
    else:
        unflatten_cast_scale(buffer, [x], backend=backend)
    if restride == "as_strided_":
        buffer.as_strided_((4,), (2,))
    else:
        buffer.unsqueeze_(0)
    with pytest.raises(ValueError, match=r"must be a 1-D contiguous tensor"):
        if op == "flatten":
            flatten_cast_scale([x], buffer, backend=backend)
        else:
            unflatten_cast_scale(buffer, [x], backend=backend)
