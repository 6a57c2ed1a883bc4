"""flatten_cast_scale / unflatten_cast_scale against the float64 reference, both backends.

Tensors are described by small specs (shape, dtype, layout, seed, magnitude)
and built inside the test, so Hypothesis prints a readable falsifying example
and shrinks shapes and counts rather than thousands of values.

How results are compared, and why:

- flatten and plain unflatten are compared bit for bit. The reference performs
  exactly the documented roundings (product in the compute dtype, then the
  destination dtype, 16-bit ones via fp32), every one of them an IEEE
  round-to-nearest-even, so there is no legitimate freedom left: a one-ulp
  difference is a rounding bug (a scale rounded to 16 bits, a truncating bf16
  cast, a missed fp32 step). NaN matches any NaN, since payloads are not part
  of the semantics.
- accumulate is compared within a bound (see ``_accumulate_bound``) because
  ``t + x * scale`` may legitimately be contracted into one FMA (Triton's
  default fp fusion on GPUs, vectorized ``add_(alpha=)`` on CPUs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Tuple

import pytest
import torch
from hypothesis import given, strategies as st

from fusedreduce.kernels import flatten_cast_scale, triton_available, unflatten_cast_scale
from reference import (packed_starts, reference_flatten, reference_nonfinite,
                       reference_unflatten)

# numpy under Triton's interpreter warns about the overflows and inf * 0 that
# the tests feed it on purpose
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
LAYOUTS = ("contiguous", "offset", "transposed", "strided")
# 0x7f..f: a NaN with every payload bit set, the one a GPU makes, whose fp32 bits
# overflow into the sign when rounded to bf16 by adding 0x7fff unguarded
NAN_PAYLOAD = "NaN, all payload bits set"
# elements per example: the interpreter costs ~10 ms per 2048-element program
BUDGET = 12_000
MAX_TENSORS = 40


# ---------------------------------------------------------------- comparisons

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def _first_mismatch(bad, actual, expected) -> str:
    index = int(bad.reshape(-1).nonzero()[0])
    got, want = actual.reshape(-1)[index].item(), expected.reshape(-1)[index].item()
    return f"{int(bad.sum())} of {bad.numel()} elements differ; first at flat index {index}: " \
           f"got {got!r}, want {want!r}"


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (so -0.0 != +0.0), except that NaN matches any NaN."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    bad = (nan_a != nan_e) | (~nan_a & (_bits(actual) != _bits(expected)))
    assert not bad.any(), f"{what}: {_first_mismatch(bad, actual, expected)}"


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor,
                  what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise; inf and NaN must match exactly."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    finite = torch.isfinite(e)
    same_special = (torch.isnan(a) & torch.isnan(e)) | (a == e)
    bad = torch.where(finite, ~((a - e).abs() <= bound), ~same_special)
    assert not bad.any(), f"{what}: {_first_mismatch(bad, actual, expected)}"


def _accumulate_bound(product, expected, flat_dtype, dst_dtype) -> torch.Tensor:
    """How far a correct ``t + x * scale`` may sit from the unfused reference.

    Fused, the product is not rounded before the sum: that moves the sum by at
    most half an ulp of the product in the compute dtype (``eps_c * |p|``
    covers it). Rounding that slightly different sum to the compute dtype and
    then to the destination can each land one ulp away (``2 * eps_dst *
    |expected|``, as eps_dst >= eps_c); near zero an ulp is the destination's
    smallest subnormal (``tiny * eps``)."""
    compute = torch.float64 if torch.float64 in (flat_dtype, dst_dtype) else torch.float32
    eps_c, dst = torch.finfo(compute).eps, torch.finfo(dst_dtype)
    return (eps_c * product.abs() + 2 * dst.eps * expected.to(torch.float64).abs()
            + 2 * dst.tiny * dst.eps)


# ------------------------------------------------------------ building tensors

@dataclass(frozen=True)
class Spec:
    """One test tensor: its values come from ``seed`` and ``magnitude`` (a power of two)."""
    shape: Tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"
    seed: int = 0
    magnitude: int = 0
    ties: bool = False
    nonfinite: Tuple[Tuple[float, object], ...] = ()  # (position in [0, 1), value)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Built:
    """A tensor, the storage it lives in (padding included), and how to re-take the view."""
    tensor: torch.Tensor
    owner: torch.Tensor
    view_of: Callable[[torch.Tensor], torch.Tensor]


# (narrow dtype, relative nudge): midpoints between neighbours of the narrow
# dtype, and fp64-only ones nudged off the midpoint by less than half an fp32
# ulp, which rounding via fp32 (as documented) turns back into ties
TIES = ((torch.float16, 0.0), (torch.bfloat16, 0.0), (torch.float32, 0.0),
        (torch.float16, 2.0 ** -30), (torch.bfloat16, 2.0 ** -30))


def _ties(values: torch.Tensor, src: torch.dtype) -> torch.Tensor:
    """Replace values by (nearly) midpoints between neighbours of a narrower dtype,
    where ``src`` holds them exactly: round-to-nearest-even then decides, and a
    truncating cast, or one that skips the documented fp32 step, shows up."""
    out = values.clone()
    for k, (narrow, nudge) in enumerate(TIES):
        a = values[k::len(TIES)].to(narrow)
        neighbour = (_bits(a) + 1).view(narrow)
        mid = (a.to(torch.float64) + neighbour.to(torch.float64)) / 2 * (1 + nudge)
        exact = torch.isfinite(mid) & (mid.to(src).to(torch.float64) == mid)
        out[k::len(TIES)] = torch.where(exact, mid, out[k::len(TIES)])
    return out


def make_values(spec: Spec, bound: float, backend: str) -> torch.Tensor:
    """The spec's row-major values as a contiguous 1-D tensor of its dtype."""
    generator = torch.Generator().manual_seed(spec.seed)
    values = torch.randn(spec.numel, generator=generator, dtype=torch.float64)
    values = values * 2.0 ** spec.magnitude
    if spec.ties:
        values = _ties(values, spec.dtype)
    values = values.clamp(-bound, bound)
    # exact zeros of both signs in every tensor: x * scale must keep the sign
    values[spec.seed % 5::7] = 0.0
    values[spec.seed % 3::11] = -0.0
    values = values.to(spec.dtype)
    for position, value in spec.nonfinite if spec.numel else ():
        index = int(position * spec.numel)
        if value == NAN_PAYLOAD:
            _bits(values)[index] = torch.iinfo(BITS[values.element_size()]).max
        else:
            values[index] = value
    return values


def lay_out(values: torch.Tensor, shape, layout: str) -> Built:
    """A tensor of ``shape`` holding ``values`` in row-major order, stored as ``layout``:
    contiguous; ``offset``: contiguous one element into its storage (misaligned);
    ``transposed``: last two dims swapped in memory; ``strided``: every other
    element of a padded last dim. Padding is NaN, so reading it shows."""
    ndim = len(shape)
    if layout == "offset":
        owner = torch.full((values.numel() + 1,), math.nan, dtype=values.dtype)
        owner[1:] = values

        def view_of(o):
            return o[1:].view(shape)
    elif layout == "transposed" and ndim >= 2:
        owner = values.reshape(shape).transpose(-1, -2).contiguous()

        def view_of(o):
            return o.transpose(-1, -2)
    elif layout == "strided" and ndim >= 1:
        owner = torch.full(tuple(shape[:-1]) + (2 * shape[-1] + 1,), math.nan, dtype=values.dtype)
        owner[..., 1::2] = values.reshape(shape)

        def view_of(o):
            return o[..., 1::2]
    else:
        owner = values.reshape(shape).clone()

        def view_of(o):
            return o
    return Built(view_of(owner), owner, view_of)


def safe_bound(src: torch.dtype, dst: torch.dtype, scale: float) -> float:
    """Largest |x| for which x * scale, and the sum of two such values, stay finite."""
    return min(torch.finfo(src).max, torch.finfo(dst).max) / (4 * max(1.0, abs(scale)))


def build(spec: Spec, dst: torch.dtype, scale: float, backend: str) -> Built:
    """The spec's tensor, its values in range for a copy to ``dst`` at ``scale``."""
    values = make_values(spec, safe_bound(spec.dtype, dst, scale), backend)
    return lay_out(values, spec.shape, spec.layout)


# ----------------------------------------------------------------- strategies

# Hypothesis' floats favour short values (0.5, 3.0, 1e3) that are exact even in
# bf16; full-mantissa scales are what expose a scale rounded to too few bits.
full_mantissa = st.builds(lambda sign, mantissa, exponent: sign * (1 + mantissa / 2 ** 52)
                          * 2.0 ** exponent,
                          st.sampled_from([1.0, -1.0]), st.integers(1, 2 ** 52 - 1),
                          st.integers(-20, 9))
scales = st.one_of(
    st.just(1.0),
    st.sampled_from([0.0, -0.0, -1.0]),
    st.integers(-12, 12).map(lambda k: 2.0 ** k),
    st.integers(-12, 12).map(lambda k: -(2.0 ** k)),
    st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
    full_mantissa,
)

# typical magnitudes, and tiny ones that underflow into (or below) the
# subnormals of fp16, of bf16/fp32 and of fp64
magnitudes = st.one_of(st.integers(-30, 8), st.sampled_from([-20, -26, -130, -140, -1030]))

block_sizes = st.sampled_from([1, 2, 3, 7, 8, 9, 2047, 2048, 2049, 4095, 4096, 4097])
shapes = st.one_of(
    st.just(()),
    st.tuples(st.one_of(st.integers(0, 5000), block_sizes)),
    st.tuples(st.integers(0, 70), st.integers(0, 70)),
    st.tuples(st.integers(0, 17), st.integers(0, 17), st.integers(0, 17)),
)

dtype_mixes = st.one_of(st.sampled_from(DTYPES).map(lambda d: (d,)), st.just(DTYPES))


def within_budget(specs):
    """The specs with shapes cut down (to 1-D) where they would exceed BUDGET in total."""
    kept, left = [], BUDGET
    for spec in specs:
        if spec.numel > left:
            spec = replace(spec, shape=(left,))
        left -= spec.numel
        kept.append(spec)
    return kept


nonfinite_values = st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                      st.sampled_from([math.inf, -math.inf, math.nan,
                                                       NAN_PAYLOAD])),
                            max_size=3).map(tuple)


@st.composite
def spec_lists(draw, dtypes=None, max_size=MAX_TENSORS, with_nonfinite=False,
               magnitude=magnitudes):
    """0-40 specs of total size at most BUDGET, of one dtype or a mix of all four."""
    dtypes = draw(dtype_mixes) if dtypes is None else dtypes
    spec = st.builds(Spec, shape=shapes, dtype=st.sampled_from(dtypes),
                     layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2 ** 16),
                     magnitude=magnitude, ties=st.booleans(),
                     nonfinite=nonfinite_values if with_nonfinite else st.just(()))
    # mostly a few tensors, sometimes many: a model's worth of small segments
    count = st.one_of(st.lists(spec, max_size=min(8, max_size)),
                      st.lists(spec, min_size=min(25, max_size), max_size=max_size))
    return within_budget(draw(count))


gaps = st.one_of(st.just(0), st.integers(1, 9), st.integers(2040, 2056))
# where ``out``/``flat`` starts inside its storage: 16-byte aligned or not
shifts = st.integers(0, 7)


def offsets_after(specs, gap_list):
    """Segment starts: each one ``gap`` after the previous segment's end."""
    starts, end = [], 0
    for spec, gap in zip(specs, gap_list):
        starts.append(end + gap)
        end = starts[-1] + spec.numel
    return starts, end


@st.composite
def layouts(draw, specs):
    """None (packed), or offsets with random gaps (leading gap included)."""
    if not draw(st.booleans()):
        return None
    return offsets_after(specs, draw(st.lists(gaps, min_size=len(specs), max_size=len(specs))))[0]


def owners_snapshot(built):
    return [b.owner.clone() for b in built]


def assert_owners_unchanged(built, snapshot, what):
    for i, (b, before) in enumerate(zip(built, snapshot)):
        assert_same_bits(b.owner, before, f"{what}[{i}] (storage, padding included)")


# ---------------------------------------------------------------------- flatten

@given(specs=spec_lists(), dtype=st.sampled_from(DTYPES), scale=scales)
def test_flatten_matches_float64_reference(backend, specs, dtype, scale):
    built = [build(s, dtype, scale, backend) for s in specs]
    tensors = [b.tensor for b in built]
    flat = flatten_cast_scale(tensors, dtype=dtype, scale=scale, backend=backend)
    assert flat.dim() == 1 and flat.is_contiguous() and flat.device.type == "cpu"
    assert_same_bits(flat, reference_flatten(tensors, dtype, scale), "flat")


@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales)
def test_nonfinite_flag_is_true_exactly_when_an_input_is_inf_or_nan(backend, specs, dtype, scale):
    tensors = [build(s, dtype, scale, backend).tensor for s in specs]
    flat, found = flatten_cast_scale(tensors, dtype=dtype, scale=scale, check_finite=True,
                                     backend=backend)
    assert found.dtype == torch.bool and found.shape == () and found.device == flat.device
    assert bool(found) == reference_nonfinite(tensors)
    assert_same_bits(flat, reference_flatten(tensors, dtype, scale), "flat")


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
    tensors.insert(min(position, len(tensors)), huge)
    expected = reference_flatten(tensors, dtype, scale)
    assert torch.isinf(expected).any(), "the case must overflow to mean anything"
    flat, found = flatten_cast_scale(tensors, dtype=dtype, scale=scale, check_finite=True,
                                     backend=backend)
    assert not bool(found), "only inputs count: an overflowing product is not a non-finite input"
    assert_same_bits(flat, expected, "flat")


def covered(starts, tensors, size) -> torch.Tensor:
    """Which flat elements belong to a segment (the rest are gaps or tail)."""
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
    starts, end = offsets_after(specs, data.draw(
        st.lists(gaps, min_size=len(specs), max_size=len(specs)), "gaps"))
    size = end + tail if use_out else end
    tensors = [build(s, dtype, scale, backend).tensor for s in specs]
    # out sits ``shift`` elements into a NaN-filled storage with NaN after it too
    storage = torch.full((shift + size + 8,), math.nan, dtype=dtype)
    out = storage[shift:shift + size] if use_out else None
    result = flatten_cast_scale(tensors, out, dtype=dtype, scale=scale, offsets=starts,
                                check_finite=check_finite, backend=backend)
    flat = result[0] if check_finite else result
    assert flat.shape == (size,) and flat.dtype == dtype
    if use_out:
        assert flat is out
        outside = torch.cat([storage[:shift], storage[shift + size:]])
        assert torch.isnan(outside).all(), "flatten wrote outside out"
    expected = reference_flatten(tensors, dtype, scale, offsets=starts, size=size)
    data_mask = covered(starts, tensors, size)
    assert_same_bits(flat[data_mask], expected[data_mask], "segments")
    # gaps are checked as values here; their sign is
    # test_flatten_writes_gaps_as_positive_zero's business
    gap_values = flat[~data_mask]
    assert torch.all(gap_values == 0), f"gaps hold {gap_values[gap_values != 0][:5]}"
    if check_finite:
        assert bool(result[1]) == reference_nonfinite(tensors)


@given(first=spec_lists(), second_scale=scales, dtype=st.sampled_from(DTYPES), scale=scales,
       garbage=st.sampled_from([math.nan, math.inf, -7.0]))
def test_reused_out_buffer_is_fully_overwritten(backend, first, second_scale, dtype, scale,
                                                garbage):
    tensors = [build(s, dtype, scale, backend).tensor for s in first]
    out = torch.full((sum(s.numel for s in first),), garbage, dtype=dtype)
    flat, found = flatten_cast_scale(tensors, out, scale=scale, check_finite=True,
                                     backend=backend)
    assert flat is out and not bool(found), "the garbage was in out, not in the inputs"
    assert_same_bits(out, reference_flatten(tensors, dtype, scale), "first fill")
    tensors = [build(s, dtype, second_scale, backend).tensor for s in first]
    flat, found = flatten_cast_scale(tensors, out, scale=second_scale, check_finite=True,
                                     backend=backend)
    assert flat is out and not bool(found)
    assert_same_bits(out, reference_flatten(tensors, dtype, second_scale), "second fill")


@pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")
@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales,
       data=st.data())
def test_backends_agree_bitwise_on_flatten(specs, dtype, scale, data):
    starts = data.draw(layouts(specs), "offsets")
    tensors = [build(s, dtype, scale, "triton").tensor for s in specs]
    by_torch, found_torch = flatten_cast_scale(tensors, dtype=dtype, scale=scale, offsets=starts,
                                               check_finite=True, backend="torch")
    by_triton, found_triton = flatten_cast_scale(tensors, dtype=dtype, scale=scale,
                                                 offsets=starts, check_finite=True,
                                                 backend="triton")
    assert bool(found_torch) == bool(found_triton)
    data_mask = covered(starts or packed_starts(tensors), tensors, by_torch.numel())
    assert_same_bits(by_triton[data_mask], by_torch[data_mask], "triton vs torch")
    # gaps compare as values: their sign is test_flatten_writes_gaps_as_positive_zero's
    assert torch.all(by_triton[~data_mask] == 0) and torch.all(by_torch[~data_mask] == 0)


@given(specs=spec_lists(with_nonfinite=True), dtype=st.sampled_from(DTYPES), scale=scales,
       accumulate=st.booleans(), data=st.data())
def test_flatten_and_unflatten_never_write_to_their_sources(backend, specs, dtype, scale,
                                                            accumulate, data):
    built = [build(s, dtype, scale, backend) for s in specs]
    before = owners_snapshot(built)
    starts = data.draw(layouts(specs), "offsets")
    tensors = [b.tensor for b in built]
    flat = flatten_cast_scale(tensors, dtype=dtype, scale=scale, offsets=starts,
                              check_finite=True, backend=backend)[0]
    assert_owners_unchanged(built, before, "flatten source")
    flat_before = flat.clone()
    destinations = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
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
    reach a destination."""
    starts = case.offsets or offsets_after(case.destinations, [0] * len(case.destinations))[0]
    end = max([s + d.numel for s, d in zip(starts, case.destinations)], default=0)
    flat = torch.full((case.shift + end,), math.nan, dtype=case.flat_dtype)[case.shift:]
    for start, d in zip(starts, case.destinations):
        segment = Spec((d.numel,), case.flat_dtype, seed=d.seed + 1, magnitude=d.magnitude,
                       ties=d.ties)
        flat[start:start + d.numel] = make_values(
            segment, safe_bound(case.flat_dtype, d.dtype, case.scale), backend)
    return flat


@given(case=unflatten_cases())
def test_unflatten_matches_float64_reference(backend, case):
    flat = make_flat(case, backend)
    built = [lay_out(torch.full((d.numel,), math.nan, dtype=d.dtype), d.shape, d.layout)
             for d in case.destinations]
    expected = reference_unflatten(flat, [b.tensor for b in built], case.scale, False,
                                   case.offsets)
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
    expected = reference_unflatten(flat, tensors, case.scale, True, case.offsets)
    # |x * scale| for the bound (float64 destinations: no rounding to speak of)
    products = reference_unflatten(flat, [torch.zeros_like(t, dtype=torch.float64)
                                          for t in tensors], case.scale, False, case.offsets)
    unflatten_cast_scale(flat, tensors, scale=case.scale, accumulate=True, offsets=case.offsets,
                         backend=backend)
    for i, (t, want, p, owner_before) in enumerate(zip(tensors, expected, products, padding)):
        bound = _accumulate_bound(p, want, case.flat_dtype, t.dtype)
        assert_within(t, want, bound, f"destination {i}")
        built[i].view_of(owner_before).copy_(t)
        assert_same_bits(built[i].owner, owner_before, f"storage of destination {i}")


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
    flat, found = flatten_cast_scale([], dtype=torch.bfloat16, check_finite=True, backend=backend)
    assert flat.shape == (0,) and flat.dtype == torch.bfloat16 and not bool(found)
    unflatten_cast_scale(flat, [], backend=backend)


def test_only_empty_tensors_with_offsets_zero_the_whole_out(backend):
    out = torch.full((4100,), math.nan)
    flatten_cast_scale([torch.empty(0), torch.empty(0, 3, dtype=torch.float16)], out,
                       offsets=[5, 4099], backend=backend)
    assert torch.all(out == 0)


def test_flatten_reads_broadcast_views(backend):
    row = torch.arange(5, dtype=torch.float16)
    tensors = [row.expand(3, 5), torch.tensor(2.5).expand(4), torch.ones(2, 1).expand(2, 3)]
    flat = flatten_cast_scale(tensors, dtype=torch.float32, scale=0.5, backend=backend)
    assert_same_bits(flat, reference_flatten(tensors, torch.float32, 0.5))


@pytest.mark.parametrize("numel", [2047, 2048, 2049, 4097])
@pytest.mark.parametrize("storage_offset", [0, 1, 4])
@pytest.mark.parametrize("flat_start", [0, 1, 8])
def test_block_and_alignment_boundaries_round_trip(backend, numel, storage_offset, flat_start):
    """Full blocks take the vectorized path only when source and flat are both
    aligned; the rest take the masked path. Both must be exact."""
    storage = torch.randn(numel + storage_offset, generator=torch.Generator().manual_seed(numel))
    source = storage.to(torch.bfloat16)[storage_offset:]
    flat = flatten_cast_scale([source], dtype=torch.float32, scale=4.0, offsets=[flat_start],
                              backend=backend)
    assert_same_bits(flat, reference_flatten([source], torch.float32, 4.0, offsets=[flat_start]))
    back = torch.zeros(numel + storage_offset, dtype=torch.bfloat16)[storage_offset:]
    unflatten_cast_scale(flat, [back], scale=0.25, offsets=[flat_start], backend=backend)
    assert_same_bits(back, source)


@pytest.mark.parametrize("scale", [-1.0, -0.0])
def test_flatten_writes_gaps_as_positive_zero(backend, scale):
    """The docs say gaps are "written as zero"; the torch fallback writes +0.0,
    so the Triton kernel must too for the two backends to agree bit for bit."""
    out = torch.full((4,), math.nan)
    flatten_cast_scale([torch.ones(1)], out, scale=scale, offsets=[1], backend=backend)
    assert_same_bits(out, torch.tensor([0.0, scale, 0.0, 0.0]))


def test_bf16_subnormals_are_read_exactly(backend):
    """bf16 shares fp32's exponent range, so every bf16 value, subnormals included,
    is exactly an fp32 value: widening must not change it."""
    subnormals = torch.tensor([2.0 ** -130, -3 * 2.0 ** -133, 1.5 * 2.0 ** -127],
                              dtype=torch.bfloat16)
    flat = flatten_cast_scale([subnormals], dtype=torch.float32, backend=backend)
    assert_same_bits(flat, subnormals.to(torch.float32), "flatten")
    widened = torch.zeros(3)
    unflatten_cast_scale(subnormals, [widened], backend=backend)
    assert_same_bits(widened, subnormals.to(torch.float32), "unflatten")
