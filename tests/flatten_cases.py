"""What the flatten-kernel tests share: tensor specs, builders, strategies, comparisons.

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
- accumulate is compared within a bound (see ``accumulate_bound``) because
  ``t + x * scale`` may legitimately be contracted into one FMA (Triton's
  default fp fusion on GPUs, vectorized ``add_(alpha=)`` on CPUs).

Tensors are built on the CPU and moved, layout and all, to the test device
(``device_mode.DEVICE()``); comparisons move both sides back to the CPU, where
the references are computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Tuple

import torch
from hypothesis import strategies as st

import device_mode
from device_mode import on_cpu

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
    actual, expected = on_cpu(actual), on_cpu(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    bad = (nan_a != nan_e) | (~nan_a & (_bits(actual) != _bits(expected)))
    assert not bad.any(), f"{what}: {_first_mismatch(bad, actual, expected)}"


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor,
                  what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise; inf and NaN must match exactly."""
    actual, expected, bound = on_cpu(actual), on_cpu(expected), on_cpu(bound)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    finite = torch.isfinite(e)
    same_special = (torch.isnan(a) & torch.isnan(e)) | (a == e)
    bad = torch.where(finite, ~((a - e).abs() <= bound), ~same_special)
    assert not bad.any(), f"{what}: {_first_mismatch(bad, actual, expected)}"


def accumulate_bound(product, expected, flat_dtype, dst_dtype) -> torch.Tensor:
    """How far a correct ``t + x * scale`` may sit from the unfused reference.

    Fused, the product is not rounded before the sum: that moves the sum by at
    most half an ulp of the product in the compute dtype (``eps_c * |p|``
    covers it). Rounding that slightly different sum to the compute dtype and
    then to the destination can each land one ulp away (``2 * eps_dst *
    |expected|``, as eps_dst >= eps_c); near zero an ulp is the destination's
    smallest subnormal (``tiny * eps``)."""
    product, expected = on_cpu(product), on_cpu(expected)
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
    """A tensor, the storage it lives in (padding included), and how to re-take the view;
    on the test device."""
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
    """The spec's row-major values as a contiguous 1-D tensor of its dtype, on the CPU."""
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
    element of a padded last dim. Padding is NaN, so reading it shows. The storage
    is built on the CPU, then moved whole to the test device and the view re-taken
    there, so the layout is the same on every device."""
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
    owner = device_mode.to_device(owner)
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


def device_known(specs) -> bool:
    """False for no tensors under ``--device cuda``: with neither a tensor nor an ``out``
    to take it from, a call makes its buffer on the CPU, where Triton runs only through
    the CPU mode's interpreter (test_empty_list_gives_an_empty_buffer_and_a_false_flag
    covers the empty list)."""
    return bool(specs) or not device_mode.cuda_mode()


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


def cpu_list(tensors):
    """The tensors on the CPU, for the references."""
    return [on_cpu(t) for t in tensors]


def assert_owners_unchanged(built, snapshot, what):
    for i, (b, before) in enumerate(zip(built, snapshot)):
        assert_same_bits(b.owner, before, f"{what}[{i}] (storage, padding included)")
