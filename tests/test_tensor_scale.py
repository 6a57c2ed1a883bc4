"""A scale held in a one-element tensor on the device, both backends.

``flatten_cast_scale(..., scale=t)`` and ``unflatten_cast_scale(..., scale=t)``
take the scale from ``t`` at each call: the Triton kernels read it on the
device (no host sync, the same kept launch from call to call), the torch
fallback reads its value. What "correct" means: the float64 reference at the
tensor's value (an fp32 tensor holds the scale rounded to fp32, and that value
is the scale), bit for bit as with a Python scale, and a kept launch follows
the tensor's value when it changes in place.

Device-aware: tensors and the scale live on ``device_mode.DEVICE()``.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, strategies as st

import device_mode
from device_mode import on_cpu
from flatten_cases import (DTYPES, assert_same_bits, build, cpu_list, device_known, scales,
                           spec_lists)
from fusedreduce.kernels import _prepared, flatten_cast_scale, unflatten_cast_scale
from reference import reference_flatten, reference_unflatten

pytestmark = [pytest.mark.device_aware,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning")]

SCALE_DTYPES = [torch.float32, torch.float64]


def _scale_tensor(scale: float, dtype: torch.dtype, shape=()) -> torch.Tensor:
    return torch.full(shape, scale, dtype=dtype, device=device_mode.DEVICE())


@given(specs=spec_lists(), dtype=st.sampled_from(DTYPES), scale=scales,
       scale_dtype=st.sampled_from(SCALE_DTYPES), shape=st.sampled_from([(), (1,)]))
def test_flatten_with_a_tensor_scale_matches_float64_reference(backend, specs, dtype, scale,
                                                               scale_dtype, shape):
    assume(device_known(specs))
    held = _scale_tensor(scale, scale_dtype, shape)
    value = float(held.reshape(()))  # what the tensor holds is the scale
    tensors = [build(s, dtype, value, backend).tensor for s in specs]
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype,
                      device=device_mode.DEVICE())
    flatten_cast_scale(tensors, out=out, scale=held, backend=backend)
    assert_same_bits(out, reference_flatten(cpu_list(tensors), dtype, value), "flat")


@given(specs=spec_lists(), flat_dtype=st.sampled_from(DTYPES), scale=scales,
       scale_dtype=st.sampled_from(SCALE_DTYPES))
def test_unflatten_with_a_tensor_scale_matches_float64_reference(backend, specs, flat_dtype,
                                                                 scale, scale_dtype):
    assume(device_known(specs))
    held = _scale_tensor(scale, scale_dtype)
    value = float(held)
    # a flat buffer whose every scaled element fits each destination: the
    # sources, flattened exactly at scale 1 into a wide buffer, then cast
    sources = [build(s, s.dtype, value, backend).tensor for s in specs]
    flat = flatten_cast_scale(sources, dtype=torch.float64, backend=backend).to(flat_dtype)
    destinations = [torch.empty_like(t) for t in sources]
    expected = reference_unflatten(on_cpu(flat), cpu_list(destinations), value, False, None)
    unflatten_cast_scale(flat, destinations, scale=held, backend=backend)
    for i, (got, want) in enumerate(zip(destinations, expected)):
        assert_same_bits(got, want, f"destination {i}")


def test_a_kept_launch_follows_the_tensor_when_its_value_changes(backend):
    device = device_mode.DEVICE()
    grads = [torch.ones(5, dtype=torch.bfloat16, device=device),
             torch.full((3, 2), 2.0, device=device)]
    flat = torch.empty(11, device=device)
    held = torch.tensor(0.5, device=device)
    flatten_cast_scale(grads, out=flat, scale=held, backend=backend)
    kept = len(_prepared.LAUNCHES)
    held.fill_(4.0)  # a new loss scale's inverse, written on the device
    flatten_cast_scale(grads, out=flat, scale=held, backend=backend)
    assert len(_prepared.LAUNCHES) == kept  # the same launch, not a new one
    assert on_cpu(flat).tolist() == [4.0] * 5 + [8.0] * 6
    outputs = [torch.empty_like(g) for g in grads]
    unflatten_cast_scale(flat, outputs, scale=held, backend=backend)
    held.fill_(0.25)
    unflatten_cast_scale(flat, outputs, scale=held, backend=backend)
    assert on_cpu(outputs[0]).tolist() == [1.0] * 5
    assert on_cpu(outputs[1]).flatten().tolist() == [2.0] * 6


@pytest.mark.parametrize("bad, error, fragment", [
    (torch.tensor(1, dtype=torch.int32), TypeError, "float32 or float64"),
    (torch.tensor(1.0, dtype=torch.bfloat16), TypeError, "float32 or float64"),
    (torch.ones(2), ValueError, "one element"),
])
def test_a_bad_tensor_scale_is_refused_before_anything_is_written(backend, bad, error,
                                                                  fragment):
    device = device_mode.DEVICE()
    grads = [torch.ones(3, device=device)]
    flat = torch.full((3,), 7.0, device=device)
    with pytest.raises(error, match=fragment):
        flatten_cast_scale(grads, out=flat, scale=bad.to(device), backend=backend)
    with pytest.raises(error, match=fragment):
        unflatten_cast_scale(flat, grads, scale=bad.to(device), backend=backend)
    assert on_cpu(flat).tolist() == [7.0] * 3 and on_cpu(grads[0]).tolist() == [1.0] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_a_scale_tensor_on_another_device_is_refused(backend):
    grads = [torch.ones(3, device="cuda")]
    with pytest.raises(ValueError, match="scale tensor is on cpu"):
        flatten_cast_scale(grads, out=torch.empty(3, device="cuda"), scale=torch.tensor(1.0),
                           backend=backend)


def test_a_cpu_scale_tensor_for_a_cpu_buffer_is_accepted_and_a_meta_one_refused():
    grads = [torch.ones(3)]
    flat = torch.empty(3)
    flatten_cast_scale(grads, out=flat, scale=torch.tensor(2.0), backend="torch")
    assert flat.tolist() == [2.0] * 3
    with pytest.raises(ValueError, match="scale tensor is on meta"):
        flatten_cast_scale(grads, out=flat, scale=torch.tensor(2.0, device="meta"),
                           backend="torch")
