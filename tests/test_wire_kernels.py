"""The wire kernels (``quantize_flatten``, ``dequantize_sum``), both backends,
against the float64 reference of ``wire_reference.py``.

Codes, block scales and residuals must be the reference's bit for bit (the
semantics fix every rounding); the error bounds below are checked against
the exact float64 input on top, so that a semantics that is exact but loose
would fail too.

Error bounds per element, for ``v`` and its dequantized ``d`` (``s`` the
block scale, ``u = 2^-24`` fp32's unit roundoff):

- int8: the code is ``v / s`` (one fp32 rounding, relative ``u``) rounded to
  an integer (at most 1/2 away), so ``|v / s - code| <= 1/2 + 127 u``; ``d``
  is ``code * s`` rounded (relative ``u``), so ``|v - d| <= s/2 + 128 u s +
  u |v|``, under ``s/2 * (1 + 2^-15)`` since ``|v| <= 127 s``;
- e4m3: e4m3 keeps 3 mantissa bits, so rounding ``y = v / s`` to it moves it
  by at most half a spacing, ``2^-4 |y|`` for normal ``|y| >= 2^-6``, and
  half the subnormal spacing ``2^-10`` below; with the two fp32 roundings:
  ``|v - d| <= 2^-4 |v| + 2^-10 s + 2u (|v| + s)`` (clamping to 448 only
  removes the last fp32 rounding of ``absmax / s`` back to 448);
- bf16: rounding to nearest with 8 significant bits: ``|v - d| <= 2^-8 |v|``
  (and the subnormal spacing of bf16, which is fp32's, ``2^-133``).

A scale ``s`` that is itself an fp32 subnormal (a block whose absmax is
below ``127 * 2^-126``) loses relative precision; its error is covered by
``SUBNORMAL_FLOOR``, far below any gradient that matters.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import wire_reference as ref
from fusedreduce import kernels

pytestmark = pytest.mark.device_aware

U = 2.0 ** -24
SUBNORMAL_FLOOR = 2.0 ** -140
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SCALED = (torch.int8, torch.float8_e4m3fn)
SIZES = (0, 1, 2, 7, 8, 9, 17, 31, 33, 64, 100)
SCALES = (1.0, 0.5, -0.37, 1.0 / 3.0, 1e-3, 100.0)


def _tensors(specs, seed, magnitude, device):
    """Tensors of ``(size, dtype, strided)``: a strided one is every other column."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for size, dtype, strided in specs:
        values = torch.randn(size, 2, generator=gen) * magnitude * \
            torch.exp(torch.randn(size, 2, generator=gen))
        values = values.to(dtype).to(device)
        out.append(values[:, 1] if strided else values[:, 1].contiguous())
    return out


def _layout(tensors, gaps, block):
    """Offsets with ``gaps[i]`` elements before tensor ``i``, and the codes'
    size: the end rounded up to a whole block."""
    offsets, end = [], 0
    for t, gap in zip(tensors, gaps):
        offsets.append(end + gap)
        end = offsets[-1] + t.numel()
    return offsets, -(-end // block) * block


def _buffers(wire_dtype, numel, block, device, with_residual, seed):
    codes = torch.empty(numel, dtype=wire_dtype, device=device)
    scales = torch.empty(kernels.wire_scale_count(numel, wire_dtype, block),
                         device=device) if wire_dtype in SCALED else None
    residual = None
    if with_residual:
        gen = torch.Generator().manual_seed(seed + 1)
        residual = (torch.randn(numel, generator=gen) * 1e-3).to(device)
    return codes, scales, residual


def _as_float64(t):
    return None if t is None else t.detach().cpu().to(torch.float64)


def _assert_bitwise(got, want, what):
    got = got.detach().cpu().to(torch.float64)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    # +0 and -0 compare equal: signs of zero are part of the bits
    same &= torch.signbit(got) == torch.signbit(want)
    assert bool(same.all()), f"{what}: first mismatch at {int((~same).nonzero()[0])}: " \
                             f"{got[~same][:4].tolist()} vs {want[~same][:4].tolist()}"


specs = st.lists(st.tuples(st.sampled_from(SIZES), st.sampled_from(INPUT_DTYPES),
                           st.booleans()), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(specs=specs, gaps=st.lists(st.sampled_from([0, 0, 1, 5]), min_size=4, max_size=4),
       wire_dtype=st.sampled_from(kernels.WIRE_DTYPES), block=st.sampled_from([8, 16, 32]),
       scale=st.sampled_from(SCALES), with_residual=st.booleans(),
       magnitude=st.sampled_from([1e-6, 1.0, 1e3]), seed=st.integers(0, 2 ** 16))
def test_quantize_flatten_is_the_float64_reference_bit_for_bit(
        backend, device, specs, gaps, wire_dtype, block, scale, with_residual, magnitude, seed):
    tensors = _tensors(specs, seed, magnitude, device)
    offsets, numel = _layout(tensors, gaps, block)
    codes, scales, residual = _buffers(wire_dtype, numel, block, device, with_residual, seed)
    v = ref.flat_values([t.cpu() for t in tensors], offsets, numel, scale,
                        None if residual is None else residual.cpu())
    want_codes, want_scales, want_deq, want_residual = ref.quantize(v, wire_dtype, block)
    flag = kernels.quantize_flatten(tensors, codes, scales, scale=scale, offsets=offsets,
                                    residual=residual, block=block, check_finite=True,
                                    backend=backend)
    assert flag.dtype == torch.bool and flag.shape == () and not bool(flag)
    _assert_bitwise(codes, want_codes, "codes")
    if scales is not None:
        _assert_bitwise(scales, want_scales, "block scales")
    if residual is not None:
        _assert_bitwise(residual, want_residual, "residual")
    _check_error_bound(v, want_deq, want_scales, wire_dtype, block)


def _check_error_bound(v, deq, scales, wire_dtype, block):
    """The per-element bounds of the module docstring, on the exact ``v``."""
    err = (v - deq).abs()
    if wire_dtype == torch.float32:
        bound = torch.zeros_like(v)
    elif wire_dtype == torch.bfloat16:
        bound = 2.0 ** -8 * v.abs() + 2.0 ** -133
    else:
        s = scales.repeat_interleave(block)
        if wire_dtype == torch.int8:
            bound = s / 2 * (1 + 2.0 ** -15)
        else:
            bound = 2.0 ** -4 * v.abs() + 2.0 ** -10 * s + 2 * U * (v.abs() + s)
        bound = bound + SUBNORMAL_FLOOR
    assert bool((err <= bound).all()), f"{wire_dtype}: error {float((err - bound).max())} " \
                                       f"over the bound"


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
@pytest.mark.parametrize("ranks", range(1, 10))
def test_dequantize_sum_is_the_pairwise_reference_bit_for_bit(backend, device, wire_dtype,
                                                              ranks):
    block, n = 8, 40
    gen = torch.Generator().manual_seed(ranks)
    rows = torch.randn(ranks, n, generator=gen) * torch.exp(3 * torch.randn(ranks, n,
                                                                            generator=gen))
    codes = torch.empty(ranks, n, dtype=wire_dtype, device=device)
    scales = torch.empty(ranks, n // block, device=device) if wire_dtype in SCALED else None
    for r in range(ranks):
        kernels.quantize_flatten([rows[r].to(device)], codes[r],
                                 None if scales is None else scales[r], block=block,
                                 backend=backend)
    for out_dtype in (torch.float32, torch.float64):
        out = torch.empty(n, dtype=out_dtype, device=device)
        kernels.dequantize_sum(codes, scales, out, block=block, backend=backend)
        want = ref.pairwise_sum([ref.dequantize(_as_float64(codes[r]),
                                                None if scales is None else _as_float64(scales[r]),
                                                block, out_dtype) for r in range(ranks)],
                                out_dtype)
        _assert_bitwise(out, want, f"sum of {ranks} rows into {out_dtype}")


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
@pytest.mark.parametrize("ranks, local_size", [(4, 2), (8, 2), (8, 4), (2, 2)])
def test_node_partials_summed_again_give_the_flat_sums_bits(backend, device, wire_dtype, ranks,
                                                            local_size):
    block, n = 16, 64
    gen = torch.Generator().manual_seed(ranks * 10 + local_size)
    codes = torch.empty(ranks, n, dtype=wire_dtype, device=device)
    scales = torch.empty(ranks, n // block, device=device) if wire_dtype in SCALED else None
    for r in range(ranks):
        kernels.quantize_flatten([torch.randn(n, generator=gen).to(device)], codes[r],
                                 None if scales is None else scales[r], block=block,
                                 backend=backend)
    flat = torch.empty(n, device=device)
    kernels.dequantize_sum(codes, scales, flat, block=block, backend=backend)
    nodes = torch.empty(ranks // local_size, n, device=device)
    for node in range(ranks // local_size):
        part = slice(node * local_size, (node + 1) * local_size)
        kernels.dequantize_sum(codes[part], None if scales is None else scales[part],
                               nodes[node], block=block, backend=backend)
    two_level = torch.empty(n, device=device)
    kernels.dequantize_sum(nodes, None, two_level, block=block, backend=backend)
    assert torch.equal(flat, two_level)
