"""``prepare_flatten`` / ``prepare_unflatten``: the handles that run a flatten
or unflatten of fixed tensors with no per-tensor work, both backends.

What "correct" means: every call of a handle writes exactly what
``flatten_cast_scale`` / ``unflatten_cast_scale`` write for the tensors' values
*at that call* (the float64 reference, bit for bit, for any scale, Python or
tensor), nothing outside its buffer or destinations; the preparation refuses
what the functions refuse, naming the argument, before anything is written;
a call refuses a bad scale or flag, and a buffer (or, on Triton, a tensor)
moved since preparation, before anything is written.

Device-aware: tensors live on ``device_mode.DEVICE()``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, strategies as st

import device_mode
from device_mode import on_cpu
from flatten_cases import (DTYPES, assert_owners_unchanged, assert_same_bits,
                           build, cpu_list, device_known, gaps, offsets_after,
                           lay_out, owners_snapshot, scales, shifts, spec_lists)
from fusedreduce.kernels import (PreparedFlatten, PreparedUnflatten, flatten_cast_scale,
                                 prepare_flatten, prepare_unflatten)
from reference import reference_flatten, reference_nonfinite, reference_unflatten
from test_kernels import (accumulate_expectation, assert_accumulated, make_flat,
                          unflatten_cases)

pytestmark = [pytest.mark.device_aware,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning")]


@given(data=st.data(), dtype=st.sampled_from(DTYPES), first=scales, second=scales,
       shift=shifts, check_finite=st.booleans(), tensor_scale=st.booleans())
def test_every_call_of_a_flatten_handle_matches_the_float64_reference(
        backend, data, dtype, first, second, shift, check_finite, tensor_scale):
    specs = data.draw(spec_lists(with_nonfinite=check_finite), "specs")
    starts, end = offsets_after(specs, data.draw(
        st.lists(gaps, min_size=len(specs), max_size=len(specs)), "gaps"))
    tensors = [build(s, dtype, first, backend).tensor for s in specs]
    storage = device_mode.to_device(torch.full((shift + end + 8,), math.nan, dtype=dtype))
    out = storage[shift:shift + end]
    flatten = prepare_flatten(tensors, out, offsets=starts, backend=backend)
    assert isinstance(flatten, PreparedFlatten) and flatten.out is out
    assert torch.isnan(storage).all(), "preparing wrote something"
    for call, scale in enumerate((first, second)):
        if call:  # the next step: new values in the same tensors
            for t in tensors:
                t.copy_(t.flip(0) if t.dim() else t)
        arg = torch.tensor(scale, dtype=torch.float64, device=out.device) if tensor_scale \
            else scale
        result = flatten(arg, check_finite=check_finite)
        flat = result[0] if check_finite else result
        assert flat is out
        expected = reference_flatten(cpu_list(tensors), dtype, scale, offsets=starts, size=end)
        assert_same_bits(on_cpu(flat), expected, f"call {call}")
        if check_finite:
            assert bool(result[1]) == reference_nonfinite(cpu_list(tensors))
        outside = torch.cat([storage[:shift], storage[shift + end:]])
        assert torch.isnan(outside).all(), "the handle wrote outside out"


@given(specs=spec_lists(), dtype=st.sampled_from(DTYPES), scale=scales)
def test_a_flatten_handle_writes_the_bits_of_flatten_cast_scale(backend, specs, dtype, scale):
    assume(device_known(specs))
    built = [build(s, dtype, scale, backend) for s in specs]
    tensors = [b.tensor for b in built]
    snapshot = owners_snapshot(built)
    want = flatten_cast_scale(tensors, dtype=dtype, scale=scale, backend=backend)
    flatten = prepare_flatten(tensors, dtype=dtype, backend=backend)
    assert flatten.out.dtype == dtype and flatten.out.shape == want.shape
    assert_same_bits(on_cpu(flatten(scale)), on_cpu(want), "flat")
    assert_owners_unchanged(built, snapshot, "a handle's sources")


@given(case=unflatten_cases(), second=scales, tensor_scale=st.booleans())
def test_every_call_of_an_unflatten_handle_matches_the_float64_reference(backend, case, second,
                                                                         tensor_scale):
    flat = make_flat(case, backend)
    built = [lay_out(torch.full((d.numel,), math.nan, dtype=d.dtype), d.shape, d.layout)
             for d in case.destinations]
    tensors = [b.tensor for b in built]
    write_back = prepare_unflatten(flat, tensors, offsets=case.offsets, backend=backend)
    assert isinstance(write_back, PreparedUnflatten) and write_back.flat is flat
    padding = owners_snapshot(built)
    for call, scale in enumerate((case.scale, second)):
        if call:
            flat.copy_(flat.flip(0))
        expected = reference_unflatten(on_cpu(flat), cpu_list(tensors), scale, False,
                                       case.offsets)
        arg = torch.tensor(scale, dtype=torch.float64, device=flat.device) if tensor_scale \
            else scale
        assert write_back(arg) is None
        for i, (b, want, owner_before) in enumerate(zip(built, expected, padding)):
            assert_same_bits(b.tensor, want, f"call {call}, destination {i}")
            b.view_of(owner_before).copy_(want)
            assert_same_bits(b.owner, owner_before, f"storage of destination {i}")


@given(case=unflatten_cases())
def test_an_accumulating_unflatten_handle_matches_the_float64_reference_up_to_fma(backend, case):
    flat = make_flat(case, backend)
    built = [build(d, d.dtype, case.scale, backend) for d in case.destinations]
    tensors = [b.tensor for b in built]
    padding = owners_snapshot(built)
    expected, products = accumulate_expectation(case, flat, tensors)
    prepare_unflatten(flat, tensors, offsets=case.offsets, backend=backend)(
        case.scale, accumulate=True)
    assert_accumulated(case, built, expected, products, padding)


def _grads():
    device = device_mode.DEVICE()
    return [torch.randn(3, 4, device=device).half(), torch.randn(5, device=device)]


@pytest.mark.parametrize("make, error, fragment", [
    (lambda g, out: prepare_flatten(g[0], out), TypeError, "tensors must be a list"),
    (lambda g, out: prepare_flatten([g[0], "x"], out), TypeError, r"tensors\[1\]"),
    (lambda g, out: prepare_flatten(g, out[:5]), ValueError, "out has 5 elements"),
    (lambda g, out: prepare_flatten(g, out.view(1, -1)), ValueError, "out must be a 1-D"),
    (lambda g, out: prepare_flatten(g, dtype=torch.int32), TypeError, "dtype"),
    (lambda g, out: prepare_flatten([g[1], out[:5]], out, offsets=[0, 5]), ValueError,
     r"tensors\[1\] overlaps out"),
    (lambda g, out: prepare_flatten(g, out, offsets=[5, 0]), ValueError, "offsets"),
    (lambda g, out: prepare_flatten(g, out, backend="cuda"), ValueError, "backend"),
    (lambda g, out: prepare_unflatten(out[::2], g), ValueError, "flat"),
    (lambda g, out: prepare_unflatten(out[:5], g), ValueError, "flat has 5 elements"),
    (lambda g, out: prepare_unflatten(out, [g[1], g[1]]), ValueError, "share memory"),
    (lambda g, out: prepare_unflatten(out, g[1]), TypeError, "tensors must be a list"),
])
def test_a_bad_preparation_is_refused_naming_the_argument_before_writing(make, error, fragment):
    grads = _grads()
    out = torch.full((17,), math.nan, device=grads[0].device)
    before = [g.clone() for g in grads]
    with pytest.raises(error, match=fragment):
        make(grads, out)
    assert torch.isnan(out).all()
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("call, error, fragment", [
    (lambda h, flag: h("2"), TypeError, "scale"),
    (lambda h, flag: h(math.nan), ValueError, "scale"),
    (lambda h, flag: h(math.inf), ValueError, "scale"),
    (lambda h, flag: h(torch.ones(2)), ValueError, "one element"),
    (lambda h, flag: h(torch.ones((), dtype=torch.int32)), TypeError, "float32 or float64"),
    (lambda h, flag: h(torch.ones((), device="meta")), ValueError, "scale tensor is on meta"),
    (lambda h, flag: h(1.0, **{flag: "False"}), TypeError, "must be a bool"),
    (lambda h, flag: h(1.0, **{flag: 1}), TypeError, "must be a bool"),
])
@pytest.mark.parametrize("direction", ["flatten", "unflatten"])
def test_a_bad_call_is_refused_before_writing(direction, call, error, fragment):
    grads = _grads()
    out = torch.full((17,), math.nan, device=grads[0].device)
    if direction == "flatten":
        handle, flag = prepare_flatten(grads, out), "check_finite"
    else:
        out.fill_(1.0)
        for g in grads:
            g.fill_(math.nan)
        handle, flag = prepare_unflatten(out, grads), "accumulate"
    before = [out.clone()] + [g.clone() for g in grads]
    with pytest.raises(error, match=fragment):
        call(handle, flag)
    for t, b in zip([out] + grads, before):
        assert_same_bits(t, b, "after a refused call")


@pytest.mark.parametrize("direction", ["flatten", "unflatten"])
def test_a_buffer_moved_since_preparation_is_refused_before_writing(direction):
    grads = _grads()
    buffer = torch.zeros(17, device=grads[0].device)
    handle = prepare_flatten(grads, buffer) if direction == "flatten" \
        else prepare_unflatten(buffer, grads)
    before = [g.clone() for g in grads]
    buffer.set_(torch.full((17,), 2.0, device=buffer.device))
    name = "out" if direction == "flatten" else "flat"
    with pytest.raises(RuntimeError, match=f"handle's {name} is no longer where it was"):
        handle()
    assert (buffer == 2.0).all()
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


@pytest.mark.parametrize("direction", ["flatten", "unflatten"])
def test_a_moved_tensor_is_refused_where_the_launch_holds_addresses(backend, direction):
    grads = _grads()
    buffer = torch.zeros(17, device=grads[0].device)
    handle = prepare_flatten(grads, buffer, backend=backend) if direction == "flatten" \
        else prepare_unflatten(buffer, grads, backend=backend)
    replacement = torch.full_like(grads[1], 3.0)
    grads[1].set_(replacement)
    if backend == "triton":
        # its table holds the old address: reading or writing there is refused
        with pytest.raises(RuntimeError, match=r"tensors\[1\] of this .* no longer where"):
            handle()
        assert (buffer == 0).all() and (grads[1] == 3.0).all()
    else:
        # torch's ops are handed the tensor objects: they follow it
        handle(0.5)
        if direction == "flatten":
            assert (buffer[12:] == 1.5).all()
        else:
            assert (grads[1] == 0).all()


def test_a_handle_keeps_its_own_tuple_of_the_tensors():
    grads = _grads()
    flatten = prepare_flatten(grads, torch.empty(17, device=grads[0].device))
    assert isinstance(flatten.tensors, tuple) and list(flatten.tensors) == grads
    grads.append(torch.ones(4, device=grads[0].device))  # the caller's list changes, not ours
    assert flatten().shape == (17,)


def test_a_handle_says_what_it_holds():
    grads = _grads()
    flatten = prepare_flatten(grads, torch.empty(17, device=grads[0].device), backend="torch")
    assert repr(flatten) == (f"PreparedFlatten(2 tensors, out=float32[17] on "
                             f"{grads[0].device}, backend='torch')")
    write_back = prepare_unflatten(flatten.out, grads, backend="torch")
    assert repr(write_back).startswith("PreparedUnflatten(2 tensors, flat=float32[17]")
