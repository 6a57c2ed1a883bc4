"""flatten_cast_scale / unflatten_cast_scale against the float64 reference, both backends.

The tensor specs, strategies and comparisons these tests use, and why results
are compared bit for bit (or within a bound for ``accumulate``), are in
flatten_cases.py. A little over 300 lines: flatten and unflatten are tested
together because round trips and in-place use need both.

Device-aware: the tensors live on ``device_mode.DEVICE()`` (CUDA under
``pytest --device cuda``); the references are computed on CPU copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
from hypothesis import assume, given, strategies as st

import device_mode
from device_mode import on_cpu
from fusedreduce.kernels import flatten_cast_scale, triton_available, unflatten_cast_scale
from flatten_cases import (DTYPES, Spec, accumulate_bound, assert_owners_unchanged,
                           assert_same_bits, assert_within, build, cpu_list, device_known, gaps,
                           lay_out, layouts, make_values, offsets_after, owners_snapshot,
                           safe_bound, scales, shifts, spec_lists)
from reference import (packed_starts, reference_flatten, reference_nonfinite,
                       reference_unflatten)

# numpy under Triton's interpreter warns about the overflows and inf * 0 that
# the tests feed it on purpose
pytestmark = [pytest.mark.device_aware,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning")]

# ---------------------------------------------------------------------- flatten

@given(specs=spec_lists(), dtype=st.sampled_from(DTYPES), scale=scales)
def test_flatten_matches_float64_reference(backend, specs, dtype, scale):
    assume(device_known(specs))
    built = [build(s, dtype, scale, backend) for s in specs]
    tensors = [b.tensor for b in built]
    flat = flatten_cast_scale(tensors, dtype=dtype, scale=scale, backend=backend)
    assert flat.dim() == 1 and flat.is_contiguous() \
        and flat.device.type == device_mode.DEVICE().type
    assert_same_bits(flat, reference_flatten(cpu_list(tensors), dtype, scale), "flat")


@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales)
def test_nonfinite_flag_is_true_exactly_when_an_input_is_inf_or_nan(backend, specs, dtype, scale):
    assume(device_known(specs))
    tensors = [build(s, dtype, scale, backend).tensor for s in specs]
    flat, found = flatten_cast_scale(tensors, dtype=dtype, scale=scale, check_finite=True,
                                     backend=backend)
    assert found.dtype == torch.bool and found.shape == () and found.device == flat.device
    assert bool(found) == reference_nonfinite(cpu_list(tensors))
    assert_same_bits(flat, reference_flatten(cpu_list(tensors), dtype, scale), "flat")


# pairs whose largest finite source value, doubled, overflows the destination
OVERFLOWING = [(s, d) for s in DTYPES for d in DTYPES
               if 2 * torch.finfo(s).max > torch.finfo(d).max]


@given(pair=st.sampled_from(OVERFLOWING), scale=st.floats(2, 1e3) | st.floats(-1e3, -2),
       others=spec_lists(max_size=5), position=st.integers(0, 5))
def test_nonfinite_flag_ignores_overflow_of_finite_inputs(backend, pair, scale, others, position):
    src, dtype = pair
    huge = torch.full((3,), torch.finfo(src).max, dtype=src)
    huge[1] = -huge[1]
    tensors = [build(s, dtype, scale, backend).tensor for s in others]
    tensors.insert(min(position, len(tensors)), device_mode.to_device(huge))
    expected = reference_flatten(cpu_list(tensors), dtype, scale)
    assert torch.isinf(expected).any(), "the case must overflow to mean anything"
    flat, found = flatten_cast_scale(tensors, dtype=dtype, scale=scale, check_finite=True,
                                     backend=backend)
    assert not bool(found), "only inputs count: an overflowing product is not a non-finite input"
    assert_same_bits(flat, expected, "flat")


def covered(starts, tensors, size) -> torch.Tensor:
    """Which flat elements belong to a segment (the rest are gaps or tail); on the CPU."""
    mask = torch.zeros(size, dtype=torch.bool)
    for start, t in zip(starts, tensors):
        mask[start:start + t.numel()] = True
    return mask


@given(data=st.data(), dtype=st.sampled_from(DTYPES), scale=scales, use_out=st.booleans(),
       shift=shifts, tail=gaps, check_finite=st.booleans())
def test_flatten_places_segments_at_offsets_and_zeroes_gaps_and_tail(backend, data, dtype, scale,
                                                                     use_out, shift, tail,
                                                                     check_finite):
    specs = data.draw(spec_lists(with_nonfinite=check_finite), "specs")
    assume(use_out or device_known(specs))
    starts, end = offsets_after(specs, data.draw(
        st.lists(gaps, min_size=len(specs), max_size=len(specs)), "gaps"))
    size = end + tail if use_out else end
    tensors = [build(s, dtype, scale, backend).tensor for s in specs]
    # out sits ``shift`` elements into a NaN-filled storage with NaN after it too
    storage = device_mode.to_device(torch.full((shift + size + 8,), math.nan, dtype=dtype))
    out = storage[shift:shift + size] if use_out else None
    result = flatten_cast_scale(tensors, out, dtype=dtype, scale=scale, offsets=starts,
                                check_finite=check_finite, backend=backend)
    flat = result[0] if check_finite else result
    assert flat.shape == (size,) and flat.dtype == dtype
    if use_out:
        assert flat is out
        outside = torch.cat([storage[:shift], storage[shift + size:]])
        assert torch.isnan(outside).all(), "flatten wrote outside out"
    expected = reference_flatten(cpu_list(tensors), dtype, scale, offsets=starts, size=size)
    data_mask = covered(starts, tensors, size)
    assert_same_bits(on_cpu(flat)[data_mask], expected[data_mask], "segments")
    # gaps are checked as values here; their sign is
    # test_flatten_writes_gaps_as_positive_zero's business
    gap_values = on_cpu(flat)[~data_mask]
    assert torch.all(gap_values == 0), f"gaps hold {gap_values[gap_values != 0][:5]}"
    if check_finite:
        assert bool(result[1]) == reference_nonfinite(cpu_list(tensors))


@given(first=spec_lists(), second_scale=scales, dtype=st.sampled_from(DTYPES), scale=scales,
       garbage=st.sampled_from([math.nan, math.inf, -7.0]))
def test_reused_out_buffer_is_fully_overwritten(backend, first, second_scale, dtype, scale,
                                                garbage):
    tensors = [build(s, dtype, scale, backend).tensor for s in first]
    out = torch.full((sum(s.numel for s in first),), garbage, dtype=dtype,
                     device=device_mode.DEVICE())
    flat, found = flatten_cast_scale(tensors, out, scale=scale, check_finite=True,
                                     backend=backend)
    assert flat is out and not bool(found), "the garbage was in out, not in the inputs"
    assert_same_bits(out, reference_flatten(cpu_list(tensors), dtype, scale), "first fill")
    tensors = [build(s, dtype, second_scale, backend).tensor for s in first]
    flat, found = flatten_cast_scale(tensors, out, scale=second_scale, check_finite=True,
                                     backend=backend)
    assert flat is out and not bool(found)
    assert_same_bits(out, reference_flatten(cpu_list(tensors), dtype, second_scale),
                     "second fill")


@pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")
@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales,
       data=st.data())
def test_backends_agree_bitwise_on_flatten(specs, dtype, scale, data):
    assume(device_known(specs))
    starts = data.draw(layouts(specs), "offsets")
    tensors = [build(s, dtype, scale, "triton").tensor for s in specs]
    by_torch, found_torch = flatten_cast_scale(tensors, dtype=dtype, scale=scale, offsets=starts,
                                               check_finite=True, backend="torch")
    by_triton, found_triton = flatten_cast_scale(tensors, dtype=dtype, scale=scale,
                                                 offsets=starts, check_finite=True,
                                                 backend="triton")
    assert bool(found_torch) == bool(found_triton)
    data_mask = covered(starts or packed_starts(tensors), tensors, by_torch.numel())
    by_torch, by_triton = on_cpu(by_torch), on_cpu(by_triton)
    assert_same_bits(by_triton[data_mask], by_torch[data_mask], "triton vs torch")
    # gaps compare as values: their sign is test_flatten_writes_gaps_as_positive_zero's
    assert torch.all(by_triton[~data_mask] == 0) and torch.all(by_torch[~data_mask] == 0)


@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales,
       accumulate=st.booleans(), data=st.data())
def test_flatten_and_unflatten_never_write_to_their_sources(backend, specs, dtype, scale,
                                                            accumulate, data):
    assume(device_known(specs))
    built = [build(s, dtype, scale, backend) for s in specs]
    before = owners_snapshot(built)
    starts = data.draw(layouts(specs), "offsets")
    tensors = [b.tensor for b in built]
    flat = flatten_cast_scale(tensors, dtype=dtype, scale=scale, offsets=starts,
                              check_finite=True, backend=backend)[0]
    assert_owners_unchanged(built, before, "flatten source")
    flat_before = flat.clone()
    destinations = [torch.zeros(s.shape, dtype=s.dtype, device=device_mode.DEVICE())
                    for s in specs]
    unflatten_cast_scale(flat, destinations, scale=scale, accumulate=accumulate, offsets=starts,
                         backend=backend)
    assert_same_bits(flat, flat_before, "flat after unflatten")


# ---------------------------------------------------------------------- unflatten

@dataclass(frozen=True)
class UnflattenCase:
    destinations: Tuple[Spec, ...]
    flat_dtype: torch.dtype
    scale: float
    offsets: Optional[Tuple[int, ...]]
    shift: int  # elements from the start of flat's storage to flat[0]


@st.composite
def unflatten_cases(draw):
    destinations = draw(spec_lists())
    flat_dtype = draw(st.sampled_from(DTYPES))
    starts = draw(layouts(destinations))
    return UnflattenCase(tuple(destinations), flat_dtype, draw(scales),
                         None if starts is None else tuple(starts), draw(shifts))


def make_flat(case: UnflattenCase, backend: str) -> torch.Tensor:
    """A flat buffer whose segment for each destination stays in range for it, ``shift``
    elements into its storage; the gaps between segments are NaN, which must never
    reach a destination. Filled on the CPU, then moved, storage and all, to the device."""
    starts = case.offsets or offsets_after(case.destinations, [0] * len(case.destinations))[0]
    end = max([s + d.numel for s, d in zip(starts, case.destinations)], default=0)
    storage = torch.full((case.shift + end,), math.nan, dtype=case.flat_dtype)
    flat = storage[case.shift:]
    for start, d in zip(starts, case.destinations):
        segment = Spec((d.numel,), case.flat_dtype, seed=d.seed + 1, magnitude=d.magnitude,
                       ties=d.ties)
        flat[start:start + d.numel] = make_values(
            segment, safe_bound(case.flat_dtype, d.dtype, case.scale), backend)
    return device_mode.to_device(storage)[case.shift:]


@given(case=unflatten_cases())
def test_unflatten_matches_float64_reference(backend, case):
    flat = make_flat(case, backend)
    built = [lay_out(torch.full((d.numel,), math.nan, dtype=d.dtype), d.shape, d.layout)
             for d in case.destinations]
    expected = reference_unflatten(on_cpu(flat), cpu_list(b.tensor for b in built), case.scale,
                                   False, case.offsets)
    padding = owners_snapshot(built)
    unflatten_cast_scale(flat, [b.tensor for b in built], scale=case.scale,
                         offsets=case.offsets, backend=backend)
    for i, (b, want, owner_before) in enumerate(zip(built, expected, padding)):
        assert_same_bits(b.tensor, want, f"destination {i}")
        # only the view's own elements may change: the rest of its storage is intact
        b.view_of(owner_before).copy_(want)
        assert_same_bits(b.owner, owner_before, f"storage of destination {i}")


@given(case=unflatten_cases())
def test_unflatten_accumulate_matches_float64_reference_up_to_fma(backend, case):
    flat = make_flat(case, backend)
    built = [build(d, d.dtype, case.scale, backend) for d in case.destinations]
    tensors = [b.tensor for b in built]
    padding = owners_snapshot(built)
    expected, products = accumulate_expectation(case, flat, tensors)
    unflatten_cast_scale(flat, tensors, scale=case.scale, accumulate=True, offsets=case.offsets,
                         backend=backend)
    assert_accumulated(case, built, expected, products, padding)


def accumulate_expectation(case: UnflattenCase, flat, tensors):
    """What an accumulating unflatten of ``case`` must write into ``tensors``
    (the float64 reference), and ``|x * scale|`` per element for its bound
    (float64 destinations: no rounding to speak of); read before the call."""
    expected = reference_unflatten(on_cpu(flat), cpu_list(tensors), case.scale, True,
                                   case.offsets)
    products = reference_unflatten(on_cpu(flat), [torch.zeros(t.shape, dtype=torch.float64)
                                                  for t in tensors], case.scale, False,
                                   case.offsets)
    return expected, products


def assert_accumulated(case: UnflattenCase, built, expected, products, padding) -> None:
    """Each destination within one fused or unfused multiply-add of the
    reference, and nothing else of its storage changed."""
    for i, (b, want, p, owner_before) in enumerate(zip(built, expected, products, padding)):
        bound = accumulate_bound(p, want, case.flat_dtype, b.tensor.dtype)
        assert_within(b.tensor, want, bound, f"destination {i}")
        b.view_of(owner_before).copy_(b.tensor)
        assert_same_bits(b.owner, owner_before, f"storage of destination {i}")


@st.composite
def lossless_round_trips(draw):
    """(sources, buffer dtype, power-of-two scale) where the buffer holds every
    scaled source value exactly: a wider buffer, or the same dtype at scale 1."""
    buffer = draw(st.sampled_from(DTYPES))
    exponent = 0 if buffer in (torch.float16, torch.bfloat16) else draw(st.integers(-8, 8))
    if buffer in (torch.float16, torch.bfloat16):
        sources = (buffer,)
    elif buffer == torch.float32:
        sources = (torch.float16, torch.bfloat16) + ((torch.float32,) if exponent == 0 else ())
    else:
        sources = DTYPES
    specs = draw(spec_lists(dtypes=sources, with_nonfinite=True,
                            magnitude=st.integers(-30, 8)))
    return specs, buffer, exponent


@given(trip=lossless_round_trips(), data=st.data())
def test_round_trip_through_a_lossless_buffer_is_bitwise_exact(backend, trip, data):
    specs, buffer, exponent = trip
    assume(device_known(specs))
    starts = data.draw(layouts(specs), "offsets")
    originals = [build(s, buffer, 1.0, backend).tensor for s in specs]
    flat = flatten_cast_scale(originals, dtype=buffer, scale=2.0 ** exponent, offsets=starts,
                              backend=backend)
    copies = [lay_out(torch.full((s.numel,), 7.0, dtype=s.dtype), s.shape, s.layout).tensor
              for s in specs]
    unflatten_cast_scale(flat, copies, scale=2.0 ** -exponent, offsets=starts, backend=backend)
    for i, (copy, original) in enumerate(zip(copies, originals)):
        assert_same_bits(copy, original, f"tensor {i}")


# -------------------------------------------------------- edge cases, by example

def test_empty_list_gives_an_empty_buffer_and_a_false_flag(backend):
    if backend == "triton" and device_mode.cuda_mode():
        pytest.skip("an empty list has no device, so its buffer is made on the CPU, where "
                    "Triton runs only through the interpreter of the CPU test mode")
    flat, found = flatten_cast_scale([], dtype=torch.bfloat16, check_finite=True, backend=backend)
    assert flat.shape == (0,) and flat.dtype == torch.bfloat16 and not bool(found)
    unflatten_cast_scale(flat, [], backend=backend)


def test_only_empty_tensors_with_offsets_zero_the_whole_out(backend):
    device = device_mode.DEVICE()
    out = torch.full((4100,), math.nan, device=device)
    flatten_cast_scale([torch.empty(0, device=device),
                        torch.empty(0, 3, dtype=torch.float16, device=device)], out,
                       offsets=[5, 4099], backend=backend)
    assert torch.all(out == 0)


def test_flatten_reads_broadcast_views(backend):
    device = device_mode.DEVICE()
    row = torch.arange(5, dtype=torch.float16, device=device)
    tensors = [row.expand(3, 5), torch.tensor(2.5, device=device).expand(4),
               torch.ones(2, 1, device=device).expand(2, 3)]
    flat = flatten_cast_scale(tensors, dtype=torch.float32, scale=0.5, backend=backend)
    assert_same_bits(flat, reference_flatten(cpu_list(tensors), torch.float32, 0.5))


@pytest.mark.parametrize("numel", [2047, 2048, 2049, 4097])
@pytest.mark.parametrize("storage_offset", [0, 1, 4])
@pytest.mark.parametrize("flat_start", [0, 1, 8])
def test_block_and_alignment_boundaries_round_trip(backend, numel, storage_offset, flat_start):
    """Full blocks take the vectorized path only when source and flat are both
    aligned; the rest take the masked path. Both must be exact."""
    storage = torch.randn(numel + storage_offset, generator=torch.Generator().manual_seed(numel))
    source = device_mode.to_device(storage.to(torch.bfloat16))[storage_offset:]
    flat = flatten_cast_scale([source], dtype=torch.float32, scale=4.0, offsets=[flat_start],
                              backend=backend)
    assert_same_bits(flat, reference_flatten([on_cpu(source)], torch.float32, 4.0,
                                             offsets=[flat_start]))
    back = torch.zeros(numel + storage_offset, dtype=torch.bfloat16,
                       device=device_mode.DEVICE())[storage_offset:]
    unflatten_cast_scale(flat, [back], scale=0.25, offsets=[flat_start], backend=backend)
    assert_same_bits(back, source)


@pytest.mark.parametrize("scale", [-1.0, -0.0])
def test_flatten_writes_gaps_as_positive_zero(backend, scale):
    """The docs say gaps are "written as zero"; the torch fallback writes +0.0,
    so the Triton kernel must too for the two backends to agree bit for bit."""
    out = torch.full((4,), math.nan, device=device_mode.DEVICE())
    flatten_cast_scale([torch.ones(1, device=out.device)], out, scale=scale, offsets=[1],
                       backend=backend)
    assert_same_bits(out, torch.tensor([0.0, scale, 0.0, 0.0]))


def test_bf16_subnormals_are_read_exactly(backend):
    """bf16 shares fp32's exponent range, so every bf16 value, subnormals included,
    is exactly an fp32 value: widening must not change it."""
    subnormals = torch.tensor([2.0 ** -130, -3 * 2.0 ** -133, 1.5 * 2.0 ** -127],
                              dtype=torch.bfloat16, device=device_mode.DEVICE())
    flat = flatten_cast_scale([subnormals], dtype=torch.float32, backend=backend)
    assert_same_bits(flat, on_cpu(subnormals).to(torch.float32), "flatten")
    widened = torch.zeros(3, device=device_mode.DEVICE())
    unflatten_cast_scale(subnormals, [widened], backend=backend)
    assert_same_bits(widened, on_cpu(subnormals).to(torch.float32), "unflatten")
