"""The clipping norm's kernels (``kernels/norm``), both backends, against float64.

``clipping.norm_powers`` (each buffer's sum of ``|x| ** p``), ``clip_scales``
and ``clip_buffers`` (the norm of the written gradients and each buffer's
postscale times torch's clip coefficient) on several buffers of mixed dtypes
and sizes at once: empty, one element, odd lengths, not a whole number of
rows, a view into a larger tensor. The float64 reference is ``math.fsum`` of
the exact powers of the stored values.

Tolerances: each row is summed in fp32 (fp64 for fp64 buffers) by a tree, so
its relative error is under ``log2(NORM_ROW)`` roundings of eps32 (4x for
margin: ``NORM_RTOL``); a p-th power carries ``p`` times that, and on a GPU
the fp32 ``|x| ** p`` of a general p goes through ``exp2(p · log2|x|)``, whose
approximate instructions add a few eps32 more per term (inside the margin).
The max norm rounds nothing: exact. The coefficient ``max_norm / (norm +
1e-6)`` is an fp32 division of the fp32 norm: one more eps32 in the scales.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fusedreduce import clipping, kernels
from fusedreduce.kernels._common import NORM_ROW

pytestmark = pytest.mark.device_aware

EPS32 = torch.finfo(torch.float32).eps
NORM_RTOL = 4 * math.log2(NORM_ROW) * EPS32
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: the Triton kernel's programs take 8 rows each: sizes across and inside them
SIZES = (0, 1, 2, 7, NORM_ROW - 1, NORM_ROW, NORM_ROW + 1, 3 * NORM_ROW + 5, 8 * NORM_ROW + 7,
         17 * NORM_ROW)
NORMS = (1.0, 2.0, 3.5, math.inf)


def _buffers(device, specs, seed, magnitude):
    """Buffers of ``(size, dtype, as_view)``: a view starts 3 elements into a larger tensor."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for size, dtype, as_view in specs:
        values = (torch.randn(size + 3, generator=gen) * magnitude).to(dtype).to(device)
        out.append(values[3:] if as_view else values[:size].clone())
    return out


def _exact_power(buffer, norm_type):
    values = [abs(v) for v in buffer.double().cpu().tolist()]
    if norm_type == math.inf:
        return max(values, default=0.0)
    return math.fsum(v ** norm_type for v in values)


def _reference_clip(powers, postscales, max_norm, norm_type, loss_scale):
    """float64 ``(norm, scales)``; the coefficient as torch's (fp32 norm, fp32 division)."""
    if norm_type == math.inf:
        total = max((p * abs(s) for p, s in zip(powers, postscales)), default=0.0)
    else:
        total = math.fsum(p * abs(s) ** norm_type for p, s in zip(powers, postscales))
        total = total ** (1.0 / norm_type)
    total /= 1.0 if loss_scale is None else float(loss_scale)
    coefficient = min(1.0, max_norm / (total + 1e-6))
    return total, [s * coefficient for s in postscales]


buffer_specs = st.lists(st.tuples(st.sampled_from(SIZES), st.sampled_from(DTYPES), st.booleans()),
                        min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(specs=buffer_specs, norm_type=st.sampled_from(NORMS), seed=st.integers(0, 2 ** 16),
       magnitude=st.sampled_from([1e-3, 1.0, 100.0]))
def test_norm_powers_are_the_float64_sums_of_powers(backend, device, specs, norm_type, seed,
                                                    magnitude):
    buffers = _buffers(device, specs, seed, magnitude)
    got = clipping.norm_powers(buffers, norm_type, backend=backend)
    assert got.dtype == torch.float64 and got.shape == (len(buffers),)
    assert got.device == buffers[0].device
    for i, buffer in enumerate(buffers):
        want = _exact_power(buffer, norm_type)
        value = float(got[i])
        if norm_type == math.inf:
            assert value == want, (i, value, want)
        else:
            assert abs(value - want) <= norm_type * NORM_RTOL * want + 1e-300, (i, value, want)


@settings(max_examples=25, deadline=None)
@given(specs=buffer_specs, norm_type=st.sampled_from(NORMS), seed=st.integers(0, 2 ** 16),
       data=st.data())
def test_clip_buffers_gives_torchs_coefficient_times_each_postscale(backend, device, specs,
                                                                   norm_type, seed, data):
    buffers = _buffers(device, specs, seed, 1.0)
    postscales = data.draw(st.lists(st.sampled_from([1.0, 0.5, -0.25, 1 / 3, 8.0]),
                                    min_size=len(buffers), max_size=len(buffers)))
    max_norm = data.draw(st.sampled_from([1e-3, 1.0, 1e6]))  # clipped hard, maybe, never
    loss = data.draw(st.sampled_from([None, 1024.0, "tensor", "int tensor", "cpu tensor"]))
    # a GradScaler's scale is a 0-d fp32 tensor on the device; others are converted
    loss_scale = {"tensor": torch.tensor(64.0, device=device),
                  "int tensor": torch.tensor(64, device=device),
                  "cpu tensor": torch.tensor([64.0], dtype=torch.float64)}.get(loss, loss)
    # fp32, or fp64 as for fp64 gradients (the rows are summed alike either way)
    norm_dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    total, scales = clipping.clip_buffers(buffers, postscales, max_norm, norm_type, loss_scale,
                                          backend=backend, norm_dtype=norm_dtype)
    assert total.dtype == norm_dtype and total.shape == ()
    assert len(scales) == len(buffers) and all(s.dtype == torch.float64 and s.numel() == 1
                                               for s in scales)
    powers = [_exact_power(b, norm_type) for b in buffers]
    want_total, want_scales = _reference_clip(powers, postscales, max_norm, norm_type,
                                              None if loss_scale is None else float(loss_scale))
    rtol = (1 if norm_type == math.inf else max(norm_type, 1.0)) * NORM_RTOL + EPS32
    assert abs(float(total) - want_total) <= rtol * want_total + 1e-30
    for got, want in zip(scales, want_scales):
        assert abs(float(got) - want) <= 2 * rtol * abs(want) + 1e-300
    # under the limit the scale is the postscale exactly: a coefficient of exactly 1
    if max_norm == 1e6:
        assert [float(s) for s in scales] == postscales
    # from the powers, the same bits as in one call
    again_total, again = clipping.clip_scales(clipping.norm_powers(buffers, norm_type,
                                                                   backend=backend),
                                              postscales, max_norm, norm_type, loss_scale,
                                              backend=backend, norm_dtype=norm_dtype)
    assert again_total.reshape(1).view(torch.int64 if norm_dtype == torch.float64
                                       else torch.int32) == \
        total.reshape(1).view(torch.int64 if norm_dtype == torch.float64 else torch.int32)
    assert all(a.view(torch.int64) == s.view(torch.int64) for a, s in zip(again, scales))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("poison, want_norm", [(math.nan, "nan"), (math.inf, "inf")])
def test_a_nonfinite_value_gives_a_nonfinite_norm(backend, device, norm_type, poison,
                                                  want_norm):
    buffers = [torch.randn(3 * NORM_ROW + 1, device=device), torch.randn(5, device=device)]
    buffers[0][NORM_ROW + 7] = poison
    total, scales = clipping.clip_buffers(buffers, [0.5, 0.5], 1.0, norm_type, None,
                                          backend=backend)
    assert (math.isnan(float(total)) if want_norm == "nan" else float(total) == math.inf)
    # torch's coefficient: NaN for a NaN norm (every gradient NaN), 0 for an inf one
    for scale in scales:
        assert math.isnan(float(scale)) if want_norm == "nan" else float(scale) == 0.0


#: fp64 rows are summed in fp64: log2(NORM_ROW) roundings of eps64 each (4x
#: for margin), and the root 1/p (p < 1) or power p multiplies the relative error
FP64_RTOL = 4 * math.log2(NORM_ROW) * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("norm_type", [0.1, 1.0, 2.0, 3.5, math.inf])
def test_fp64_buffers_past_fp32s_range_give_torchs_fp64_norm_and_coefficient(backend, device,
                                                                            norm_type):
    # torch's 2e200 row (test_clip_grad_norm_error_if_nonfinite), beside
    # ordinary values: |x| ** p stays finite in fp64 for p = 0.1, 1 and the
    # max norm, and overflows (an inf norm, as torch's) for p = 2 and 3.5
    gen = torch.Generator().manual_seed(3)
    big = torch.full((10,), 2e200, dtype=torch.float64)
    big[1::2] *= -1
    buffers = [torch.cat([big, torch.randn(NORM_ROW + 5, generator=gen,
                                           dtype=torch.float64)]).to(device),
               torch.randn(7, generator=gen, dtype=torch.float64).to(device)]
    postscales = [0.5, 0.5]
    total, scales = clipping.clip_buffers(buffers, postscales, 1.0, norm_type, backend=backend,
                                          norm_dtype=torch.float64)
    assert total.dtype == torch.float64
    if norm_type in (2.0, 3.5):
        assert float(total) == math.inf and all(float(s) == 0.0 for s in scales)
        return
    want_total, want_scales = _reference_clip(
        [_exact_power(b, norm_type) for b in buffers], postscales, 1.0, norm_type, None)
    rtol = max(norm_type, 1 / norm_type) * FP64_RTOL if norm_type != math.inf else 0.0
    assert abs(float(total) - want_total) <= rtol * want_total, (float(total), want_total)
    for got, want in zip(scales, want_scales):
        # the coefficient is 1 / total, one fp64 division more
        assert abs(float(got) - want) <= (rtol + 4 * FP64_RTOL) * abs(want), (float(got), want)


def test_the_same_buffers_give_the_same_bits_and_moved_ones_are_read_where_they_are(backend,
                                                                                     device):
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(n, generator=gen).to(device) for n in (5000, 1, NORM_ROW)]
    first = clipping.norm_powers(values, 2.0, backend=backend)
    assert first.view(torch.int64).tolist() == \
        clipping.norm_powers(values, 2.0, backend=backend).view(torch.int64).tolist()
    # the same values at other addresses (a kept layout must not be reused for them)
    moved = [v.clone() * 2 for v in values]
    doubled = clipping.norm_powers(moved, 2.0, backend=backend)
    assert doubled.view(torch.int64).tolist() == (first * 4).view(torch.int64).tolist()


def test_the_public_kernel_is_the_clipping_norm(backend, device):
    buffers = _buffers(device, [(3000, torch.float32, False), (7, torch.bfloat16, True)], 5, 1.0)
    public = kernels.norm_powers(buffers, 2.0, backend=backend)
    assert public.view(torch.int64).tolist() == \
        clipping.norm_powers(buffers, 2.0, backend=backend).view(torch.int64).tolist()


@pytest.mark.parametrize("make, norm_type, error, fragment", [
    (lambda d: [], 2.0, ValueError, "at least one"),
    (lambda d: "not a list", 2.0, TypeError, "buffers"),
    (lambda d: [torch.ones(2, 3, device=d)], 2.0, ValueError,
     r"buffers\[0\] must be a 1-D contiguous"),
    (lambda d: [torch.ones(6, device=d)[::2]], 2.0, ValueError,
     r"buffers\[0\] must be a 1-D contiguous"),
    (lambda d: [torch.ones(3, dtype=torch.int32, device=d)], 2.0, TypeError,
     r"buffers\[0\].dtype"),
    (lambda d: [torch.ones(3, device=d)], 0.0, ValueError, "norm_type must be positive"),
    (lambda d: [torch.ones(3, device=d)], math.nan, ValueError, "norm_type must be positive"),
    (lambda d: [torch.ones(3, device=d)], "2", TypeError, "norm_type must be a number"),
], ids=["empty", "not_a_list", "2d", "strided", "int", "zero", "nan", "string"])
def test_bad_arguments_are_refused_naming_them(backend, device, make, norm_type, error,
                                               fragment):
    buffers = make(device)  # built on the device: a copy there would be contiguous
    with pytest.raises(error, match=fragment):
        kernels.norm_powers(buffers, norm_type, backend=backend)
