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
from hypothesis import assume, given, settings, strategies as st

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


def _packed(chunks, n, wire_dtype, block, spare, device):
    """``(packed, codes, scales)``: one ``(chunks, bytes)`` buffer, each row a
    chunk's ``n`` codes, then its block scales, then ``spare`` bytes that
    nothing may write (0xAB), and the codes and scales as views of it."""
    count = kernels.wire_scale_count(n, wire_dtype, block)
    code_bytes = n * wire_dtype.itemsize
    packed = torch.full((chunks, code_bytes + 4 * count + spare), 0xAB, dtype=torch.uint8,
                        device=device)
    codes = packed[:, :code_bytes].view(wire_dtype)
    scales = packed[:, code_bytes:code_bytes + 4 * count].view(torch.float32) \
        if count else None
    return packed, codes, scales


@settings(max_examples=30, deadline=None)
@given(specs=specs, gaps=st.lists(st.sampled_from([0, 0, 1, 5]), min_size=4, max_size=4),
       wire_dtype=st.sampled_from(kernels.WIRE_DTYPES), block=st.sampled_from([8, 16]),
       chunks=st.integers(1, 4), spare=st.sampled_from([0, 4, 12]),
       with_residual=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_chunked_codes_and_scales_in_one_buffer_are_the_reference_bit_for_bit(
        backend, device, specs, gaps, wire_dtype, block, chunks, spare, with_residual, seed):
    """Codes and scales written chunk by chunk into one buffer (what one
    all_to_all_single sends): the flat layout's bits, tensors crossing chunk
    bounds; summed as ranks' rows and dequantized side by side, the
    reference's bits; no byte past a chunk's scales written."""
    tensors = _tensors(specs, seed, 1.0, device)
    offsets, numel = _layout(tensors, gaps, block * chunks)
    assume(numel > 0)  # empty layouts: test_empty_and_all_gap_layouts
    n = numel // chunks
    packed, codes, scales = _packed(chunks, n, wire_dtype, block, spare, device)
    _, _, residual = _buffers(wire_dtype, numel, block, device, with_residual, seed)
    v = ref.flat_values([t.cpu() for t in tensors], offsets, numel, 0.5,
                        None if residual is None else residual.cpu())
    want_codes, want_scales, _, want_residual = ref.quantize(v, wire_dtype, block)
    flag = kernels.quantize_flatten(tensors, codes, scales, scale=0.5, offsets=offsets,
                                    residual=residual, block=block, check_finite=True,
                                    backend=backend)
    assert not bool(flag)
    _assert_bitwise(codes.reshape(-1), want_codes, "codes")
    if scales is not None:
        _assert_bitwise(scales.reshape(-1), want_scales, "block scales")
    if residual is not None:
        _assert_bitwise(residual, want_residual, "residual")
    assert bool((packed[:, packed.shape[1] - spare:] == 0xAB).all()), "a spare byte written"
    rows = [ref.dequantize(want_codes[c * n:(c + 1) * n],
                           None if want_scales is None
                           else want_scales[c * n // block:(c + 1) * n // block],
                           block, torch.float32) for c in range(chunks)]
    out = torch.empty(n, device=device)
    kernels.dequantize_sum(codes, scales, out, block=block, backend=backend)
    _assert_bitwise(out, ref.pairwise_sum(rows, torch.float32), "the chunks summed")
    side = torch.empty(numel, device=device)
    kernels.dequantize_sum(codes.unsqueeze(0), None if scales is None else scales.unsqueeze(0),
                           side, block=block, backend=backend)
    _assert_bitwise(side, torch.cat(rows), "the chunks side by side")


def _format_bound(magnitude, s, wire_dtype):
    """The largest ``|v - d|`` of the module docstring for ``|v| = magnitude``
    and block scales ``s`` (per element), float64."""
    if wire_dtype == torch.float32:
        return torch.zeros_like(magnitude)
    if wire_dtype == torch.bfloat16:
        return 2.0 ** -8 * magnitude + 2.0 ** -133
    if wire_dtype == torch.int8:
        return s / 2 * (1 + 2.0 ** -15) + SUBNORMAL_FLOOR
    return 2.0 ** -4 * magnitude + 2.0 ** -10 * s + 2 * U * (magnitude + s) + SUBNORMAL_FLOOR


def _check_error_bound(v, deq, scales, wire_dtype, block):
    """The per-element bounds of the module docstring, on the exact ``v``."""
    s = None if scales is None else scales.repeat_interleave(block)
    bound = _format_bound(v.abs(), s, wire_dtype)
    err = (v - deq).abs()
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


def _quantized(values, wire_dtype, block, backend, device, residual=None, check_finite=False):
    """``(codes, scales, flag)`` of one fp32 tensor quantized whole."""
    codes = torch.empty(values.numel(), dtype=wire_dtype, device=device)
    scales = torch.empty(kernels.wire_scale_count(values.numel(), wire_dtype, block),
                         device=device) if wire_dtype in SCALED else None
    flag = kernels.quantize_flatten([values.to(device)], codes, scales, residual=residual,
                                    block=block, check_finite=check_finite, backend=backend)
    return codes, scales, flag


def _dequantized(codes, scales, block, backend):
    out = torch.empty(codes.numel(), device=codes.device)
    kernels.dequantize_sum(codes.view(1, -1), None if scales is None else scales.view(1, -1),
                           out, block=block, backend=backend)
    return out


# the interpreter computes inf - inf in numpy, which warns
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_value_is_flagged_and_its_block_sums_to_nan(backend, device, wire_dtype,
                                                                 bad):
    block = 8
    values = torch.linspace(-1.0, 1.0, 4 * block)
    values[block + 3] = bad  # in the second block
    residual = torch.full((values.numel(),), 1e-3, device=device)
    codes, scales, flag = _quantized(values, wire_dtype, block, backend, device, residual,
                                     check_finite=True)
    assert bool(flag)
    deq = _dequantized(codes, scales, block, backend).cpu()
    others = torch.cat([deq[:block], deq[2 * block:]])
    assert bool(torch.isfinite(others).all()) and bool(torch.isfinite(residual).all())
    if wire_dtype in SCALED:
        # the whole block: scale NaN, codes 0, dequantized NaN, no error kept
        assert math.isnan(scales[1].item()) and bool(torch.isfinite(scales[[0, 2, 3]]).all())
        assert not bool(codes[block:2 * block].float().any())
        assert bool(torch.isnan(deq[block:2 * block]).all())
        assert not bool(residual[block:2 * block].any())
    else:
        # the element itself travels: inf stays inf, NaN stays NaN; its residual is 0
        got = deq[block + 3].item()
        assert (math.isnan(got) and math.isnan(bad)) or got == bad
        assert torch.isfinite(deq).sum() == values.numel() - 1
        assert residual[block + 3].item() == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_an_overflowing_product_is_flagged_even_though_the_inputs_are_finite(backend, device):
    values = torch.full((16,), 3e38)
    codes = torch.empty(16, dtype=torch.int8, device=device)
    scales = torch.empty(2, device=device)
    flag = kernels.quantize_flatten([values.to(device)], codes, scales, scale=10.0, block=8,
                                    check_finite=True, backend=backend)
    assert bool(flag) and bool(torch.isnan(scales).all())


@pytest.mark.parametrize("wire_dtype", SCALED)
def test_huge_and_tiny_values_in_one_block_never_overflow_and_zero_blocks_stay_zero(
        backend, device, wire_dtype):
    block = 8
    values = torch.tensor([3e38, -3e38, 1e-30, -1e-30, 1.0, 0.0, 2e38, -1e38]
                          + [0.0] * block + [1e-40, -3e-41] + [0.0] * (block - 2))
    residual = torch.zeros(values.numel(), device=device)
    codes, scales, flag = _quantized(values, wire_dtype, block, backend, device, residual,
                                     check_finite=True)
    assert not bool(flag)
    level = ref.LEVELS[wire_dtype]
    assert codes[:2].float().tolist() == [level, -level]
    assert scales[1].item() == 0.0 and not bool(codes[block:2 * block].float().any())
    deq = _dequantized(codes, scales, block, backend).cpu()
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(residual).all())
    assert not bool(deq[block:2 * block].any())
    # v == dequantized + residual exactly: every difference here fits fp32
    assert torch.equal(deq.double() + residual.cpu().double(), values.double())


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
def test_error_feedback_keeps_the_accumulated_error_within_one_step(backend, device,
                                                                    wire_dtype):
    """Sum of k dequantized steps = sum of the k inputs - the last residual
    (+ the fp32 roundings of ``g + residual``, about ``2^-24 |v|`` per step);
    without feedback the systematic error of a repeated gradient grows k-fold."""
    block, steps = 16, 40
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(4 * block, generator=gen) * torch.exp(torch.randn(4 * block,
                                                                         generator=gen))
    residual = torch.zeros(grad.numel(), device=device)
    total = torch.zeros(grad.numel(), dtype=torch.float64)
    for _ in range(steps):
        codes, scales, _ = _quantized(grad, wire_dtype, block, backend, device, residual)
        total += _dequantized(codes, scales, block, backend).cpu().double()
    # the last step quantized v = grad + residual, |residual| <= 2^-4 |v| at most
    # (e4m3), so |v| and its block's scale are within 1.125 of grad's
    codes, scales, _ = _quantized(grad, wire_dtype, block, backend, device)
    s = None if scales is None else scales.cpu().double().repeat_interleave(block)
    one_step = _format_bound(1.125 * grad.double().abs(), None if s is None else 1.125 * s,
                             wire_dtype)
    drift = (total - steps * grad.double()).abs()
    rounding = steps * 2.0 ** -23 * grad.double().abs().max()
    assert bool((drift <= one_step + rounding).all()), float((drift - one_step).max())
    # without feedback the same gradient's error adds up k times
    plain = (grad.double() - _dequantized(codes, scales, block, backend).cpu().double()).abs()
    if wire_dtype != torch.float32:
        assert float((steps * plain - one_step - rounding).max()) > 0


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
def test_ranks_chunks_exchanged_and_summed_are_the_reference_sums(backend, device, wire_dtype):
    """R ranks quantize buffers of R parts (blocks crossing tensor bounds, part
    bounds on block bounds); part r of every rank goes to rank r (what
    all_to_all_single does), which dequantizes and sums it."""
    ranks, block = 3, 8
    sizes = (5, 1, 19, 0, 23)  # 48 elements: 3 parts of 16, 2 blocks each
    gen = torch.Generator().manual_seed(5)
    sent, want_rows = [], []
    for _ in range(ranks):
        grads = [torch.randn(n, generator=gen).to(device) for n in sizes]
        codes, scales, _ = _quantized(torch.cat([g.cpu() for g in grads]), wire_dtype, block,
                                      backend, device)
        sent.append((codes.view(ranks, -1), None if scales is None else scales.view(ranks, -1)))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        v = ref.flat_values([g.cpu() for g in grads], starts, 48, 1.0, None)
        want_rows.append(ref.quantize(v, wire_dtype, block)[2])
    for r in range(ranks):
        codes = torch.stack([sent[src][0][r] for src in range(ranks)])
        scales = None if wire_dtype not in SCALED else \
            torch.stack([sent[src][1][r] for src in range(ranks)])
        out = torch.empty(16, device=device)
        kernels.dequantize_sum(codes, scales, out, block=block, backend=backend)
        want = ref.pairwise_sum([row[16 * r:16 * (r + 1)] for row in want_rows], torch.float32)
        _assert_bitwise(out, want, f"part {r}")


def test_empty_and_all_gap_layouts(backend, device):
    codes = torch.full((16,), 5, dtype=torch.int8, device=device)
    scales = torch.full((2,), 7.0, device=device)
    kernels.quantize_flatten([], codes, scales, offsets=[], block=8, backend=backend)
    assert not bool(codes.any()) and not bool(scales.any())
    empty = torch.empty(0, dtype=torch.int8, device=device)
    flag = kernels.quantize_flatten([torch.zeros(0, device=device)], empty,
                                    torch.empty(0, device=device),
                                    block=8, check_finite=True, backend=backend)
    assert not bool(flag)


def test_the_kept_launch_follows_new_values_and_moved_tensors(backend, device):
    block = 8
    grads = [torch.randn(13).to(device), torch.randn(3, 5).to(device)]
    codes = torch.empty(32, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(4, device=device)
    offsets = [0, 14]
    for step in range(3):
        for g in grads:
            g.mul_(1.5)
        kernels.quantize_flatten(grads, codes, scales, offsets=offsets, block=block,
                                 backend=backend)
        v = ref.flat_values([g.cpu() for g in grads], offsets, 32, 1.0, None)
        want_codes, want_scales, _, _ = ref.quantize(v, torch.float8_e4m3fn, block)
        _assert_bitwise(codes, want_codes, f"step {step}")
        _assert_bitwise(scales, want_scales, f"step {step}")
        grads = [g.clone() for g in reversed(grads)][::-1]  # same layout, new addresses


def _call_quantize(grads, codes, scales, residual, **options):
    return lambda: kernels.quantize_flatten(grads, codes, scales, residual=residual, block=8,
                                            **options)


BAD_QUANTIZE = [
    ("codes of a non-wire dtype", dict(codes=torch.zeros(16, dtype=torch.float16)), TypeError,
     "codes.dtype must be one of"),
    ("3-D codes", dict(codes=torch.zeros(2, 1, 8, dtype=torch.int8)), ValueError,
     "codes must be a 1-D or 2-D contiguous"),
    ("chunks whose rows overlap", dict(codes=torch.zeros(12, dtype=torch.int8).as_strided(
        (2, 8), (4, 1)), scales=torch.zeros(2, 1)), ValueError,
     "codes must be a 1-D or 2-D contiguous"),
    ("chunks with flat scales", dict(codes=torch.zeros(2, 8, dtype=torch.int8)), ValueError,
     "block_scales must be a contiguous float32 tensor of shape (2, 1)"),
    ("chunks of part blocks", dict(codes=torch.zeros(4, 4, dtype=torch.int8),
                                   scales=torch.zeros(4, 1)), ValueError,
     "numel=4 is not a multiple of block=8"),
    ("chunk scales over the codes", dict(codes="packed", scales="packed_overlapping"),
     ValueError, "codes and block_scales share memory"),
    ("codes of the wrong size", dict(codes=torch.zeros(24, dtype=torch.int8),
                                     scales=torch.zeros(3)), ValueError,
     "codes has 24 elements but the tensors need 16"),
    ("missing scales", dict(scales=None), ValueError, "block_scales is required"),
    ("too few scales", dict(scales=torch.zeros(1)), ValueError,
     "block_scales must be a contiguous float32 tensor of shape (2,)"),
    ("fp64 scales", dict(scales=torch.zeros(2, dtype=torch.float64)), ValueError,
     "block_scales must be a contiguous float32"),
    ("scales for bf16 codes", dict(codes=torch.zeros(16, dtype=torch.bfloat16)), ValueError,
     "block_scales must be None for torch.bfloat16 codes"),
    ("a short residual", dict(residual=torch.zeros(15)), ValueError,
     "residual must be a 1-D contiguous torch.float32 tensor of 16 elements"),
    ("an fp16 residual", dict(residual=torch.zeros(16, dtype=torch.float16)), ValueError,
     "residual must be a 1-D contiguous torch.float32"),
    ("a residual that is an input", dict(residual="grad0"), ValueError,
     "tensors[0] overlaps residual"),
    ("scales inside the residual", dict(residual=torch.zeros(18), scales="residual_tail"),
     ValueError, "share memory"),
    ("not a power of two", dict(block=12), ValueError, "block must be a power of two"),
    ("a block too small", dict(block=4), ValueError, "block must be a power of two from 8"),
    ("a non-int block", dict(block=8.0), TypeError, "block must be an int"),
    ("a non-finite scale", dict(scale=math.inf), ValueError, "scale must be finite"),
    ("not a list", dict(grads="tensor"), TypeError, "tensors must be a list or tuple"),
    ("an int tensor", dict(grads="int"), TypeError, "tensors[1].dtype must be one of"),
    ("codes not a multiple of the block", dict(codes=torch.zeros(20, dtype=torch.int8),
                                               offsets=[0, 8], scales=torch.zeros(2)),
     ValueError, "numel=20 is not a multiple of block=8"),
    ("an unknown backend", dict(backend="cuda"), ValueError, "backend must be one of"),
    # a string such as "False" would be true
    ("a string flag", dict(check_finite="False"), TypeError, "check_finite must be True or False"),
    ("a None flag", dict(check_finite=None), TypeError, "check_finite must be True or False"),
]


@pytest.mark.parametrize("case, change, error, fragment", BAD_QUANTIZE,
                         ids=[case[0] for case in BAD_QUANTIZE])
def test_bad_quantize_arguments_are_refused_by_name_before_anything_is_written(
        case, change, error, fragment):
    grads = [torch.randn(8), torch.randn(8)]
    codes = change.get("codes", torch.full((16,), 3, dtype=torch.int8))
    scales = change.get("scales", torch.full((2,), 7.0))
    residual = change.get("residual", torch.full((16,), 0.5))
    if isinstance(residual, str):  # the gradients are views of the residual
        residual = torch.randn(16)
        grads = [residual[:8], residual[8:]]
    if isinstance(residual, torch.Tensor) and isinstance(scales, str) \
            and scales == "residual_tail":
        scales, residual = residual[14:16], residual[:16]
    if isinstance(codes, str):  # each chunk's scale laid over its last 4 codes
        packed = torch.zeros(2, 12, dtype=torch.uint8)
        codes, scales = packed[:, :8].view(torch.int8), packed[:, 4:8].view(torch.float32)
    if change.get("grads") == "tensor":
        grads = torch.randn(16)
    elif change.get("grads") == "int":
        grads = [grads[0], torch.ones(8, dtype=torch.int32)]
    options = {k: change[k] for k in ("block", "scale", "offsets", "backend", "check_finite")
               if k in change}
    if "block" in options:
        call = lambda: kernels.quantize_flatten(grads, codes, scales, residual=residual,  # noqa
                                                **options)
    else:
        call = _call_quantize(grads, codes, scales, residual, **options)
    before = [t.clone() for t in (codes, scales, residual) if isinstance(t, torch.Tensor)]
    with pytest.raises(error) as raised:
        call()
    assert fragment in str(raised.value)
    after = [t for t in (codes, scales, residual) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(after, before)), "written before the error"


BAD_SUM = [
    ("1-D codes", dict(codes=torch.zeros(16, dtype=torch.int8)), ValueError,
     "codes must be a 2-D or 3-D contiguous"),
    ("3-D codes and 2-D scales", dict(codes=torch.zeros(3, 1, 16, dtype=torch.int8)),
     ValueError, "block_scales must be a contiguous float32 tensor of shape (3, 1, 2)"),
    ("an out of one chunk for two", dict(codes=torch.zeros(3, 2, 16, dtype=torch.int8),
                                         scales=torch.zeros(3, 2, 2)), ValueError,
     "out must be a 1-D contiguous torch.float32 tensor of 32 elements"),
    ("no rows", dict(codes=torch.zeros(0, 16, dtype=torch.int8), scales=torch.zeros(0, 2)),
     ValueError, "at least one row"),
    ("scales of the wrong shape", dict(scales=torch.zeros(2, 2)), ValueError,
     "block_scales must be a contiguous float32 tensor of shape (3, 2)"),
    ("an fp16 out", dict(out=torch.zeros(16, dtype=torch.float16)), ValueError,
     "out must be float32 or float64"),
    ("a short out", dict(out=torch.zeros(15)), ValueError,
     "out must be a 1-D contiguous torch.float32 tensor of 16 elements"),
    ("an out inside the codes", dict(codes=torch.zeros(3, 16), scales=None, out="codes_row"),
     ValueError, "out and codes share memory"),
    ("chunks of part blocks", dict(codes=torch.zeros(3, 12, dtype=torch.int8),
                                   out=torch.zeros(12)), ValueError,
     "n=12 is not a multiple of block=8"),
    ("float16 codes", dict(codes=torch.zeros(3, 16, dtype=torch.float16), scales=None),
     TypeError, "codes.dtype must be one of"),
]


@pytest.mark.parametrize("case, change, error, fragment", BAD_SUM,
                         ids=[case[0] for case in BAD_SUM])
def test_bad_dequantize_sum_arguments_are_refused_by_name_before_anything_is_written(
        case, change, error, fragment):
    codes = change.get("codes", torch.ones(3, 16, dtype=torch.int8))
    scales = change.get("scales", torch.ones(3, 2))
    out = change.get("out", torch.full((16,), 9.0))
    if isinstance(out, str):
        out = codes[1]
    before = out.clone()
    with pytest.raises(error) as raised:
        kernels.dequantize_sum(codes, scales, out, block=8)
    assert fragment in str(raised.value)
    assert torch.equal(out, before), "written before the error"


def test_wire_scale_count_counts_whole_blocks_of_the_scaled_formats():
    assert kernels.wire_scale_count(0, torch.int8) == 0
    assert kernels.wire_scale_count(4 * kernels.WIRE_BLOCK, torch.float8_e4m3fn) == 4
    assert kernels.wire_scale_count(1001, torch.float32) == 0
    assert kernels.wire_scale_count(1001, torch.bfloat16, block=64) == 0
    with pytest.raises(ValueError, match="not a multiple of block"):
        kernels.wire_scale_count(1001, torch.int8)
    with pytest.raises(TypeError, match="wire_dtype must be one of"):
        kernels.wire_scale_count(1024, torch.float16)
    with pytest.raises(ValueError, match="numel must not be negative"):
        kernels.wire_scale_count(-256, torch.int8)


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
def test_the_torch_backend_pieces_change_no_bit(monkeypatch, wire_dtype):
    # the fallback encodes and sums PIECE elements at a time: pieces of 64
    # cut these tensors, blocks and chunks everywhere
    from fusedreduce.kernels.wire import torch_backend
    monkeypatch.setattr(torch_backend, "PIECE", 64)
    block, gen = 16, torch.Generator().manual_seed(11)
    tensors = [torch.randn(n, generator=gen).to(dtype)
               for n, dtype in ((70, torch.float16), (3, torch.float32), (130, torch.float64))]
    offsets, numel = _layout(tensors, [0, 1, 5], block)
    codes, scales, residual = _buffers(wire_dtype, numel, block, "cpu", True, 11)
    for step in range(3):  # prepared, then kept (the second call times strategies)
        for t in tensors:
            t.mul_(-1.5)
        v = ref.flat_values(tensors, offsets, numel, 0.37, residual.clone())
        want_codes, want_scales, _, want_residual = ref.quantize(v, wire_dtype, block)
        kernels.quantize_flatten(tensors, codes, scales, scale=0.37, offsets=offsets,
                                 residual=residual, block=block, backend="torch")
        _assert_bitwise(codes, want_codes, f"codes, step {step}")
        _assert_bitwise(residual, want_residual, f"residual, step {step}")
    # a second rank's row: the same codes shifted by one block
    rows = torch.stack([codes, codes.roll(block)])
    row_scales = None if scales is None else torch.stack([scales, scales.roll(1)])
    out = torch.empty(numel)
    kernels.dequantize_sum(rows, row_scales, out, block=block, backend="torch")
    want = ref.pairwise_sum([ref.dequantize(_as_float64(rows[r]), None if scales is None
                                            else _as_float64(row_scales[r]), block,
                                            torch.float32) for r in range(2)], torch.float32)
    _assert_bitwise(out, want, "sum")


@pytest.mark.parametrize("wire_dtype, values, codes_want", [
    # absmax 127 makes the scale 1: the codes are the values rounded, ties to even
    (torch.int8, [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],
     [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 126.0]),
    # absmax 448 makes the scale 1: ties between e4m3 neighbours go to the even
    # mantissa (1 | 1.125 | 1.25; 240 | 256 | 288), in the subnormals too
    # (0 | 2^-9 | 2^-8)
    (torch.float8_e4m3fn, [448.0, 1.0625, 1.1875, 248.0, 272.0, 2.0 ** -10, 3 * 2.0 ** -10,
                           -1.0625],
     [448.0, 1.0, 1.25, 256.0, 256.0, 0.0, 2.0 ** -8, -1.0]),
])
def test_exact_ties_round_to_even(backend, device, wire_dtype, values, codes_want):
    codes, scales, _ = _quantized(torch.tensor(values), wire_dtype, 8, backend, device)
    assert scales.tolist() == [1.0]
    assert codes.float().tolist() == codes_want


def test_a_kept_launch_still_refuses_a_residual_that_overlaps_the_gradients(backend, device):
    storage = torch.randn(48).to(device)
    grads, residual = [storage[:8], storage[8:16]], torch.zeros(16, device=device)
    codes = torch.empty(16, dtype=torch.int8, device=device)
    scales = torch.empty(2, device=device)
    for _ in range(2):  # prepared and kept, then served by the kept launch
        kernels.quantize_flatten(grads, codes, scales, residual=residual, block=8,
                                 backend=backend)
    before = [codes.clone(), scales.clone(), storage.clone()]
    with pytest.raises(ValueError, match="tensors\\[1\\] overlaps residual"):
        kernels.quantize_flatten(grads, codes, scales, residual=storage[8:24], block=8,
                                 backend=backend)
    with pytest.raises(ValueError, match="block_scales and residual share memory"):
        kernels.quantize_flatten(grads, codes, storage[30:32], residual=storage[16:32],
                                 block=8, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip((codes, scales, storage), before))


@pytest.mark.parametrize("wire_dtype", kernels.WIRE_DTYPES)
def test_blocks_of_fp32_subnormals_are_the_reference_bit_for_bit(backend, device, wire_dtype):
    # the scale absmax / 127 (or / 448) of such a block is itself subnormal,
    # or 0: the clamp and the all-zero rule are what keep the codes in range
    block = 8
    values = torch.tensor([1e-40, -3e-41, 7e-42, 2e-44, 0.0, -1e-45, 5e-39, -5e-39]
                          + [1.4e-45, -1.4e-45, 2.8e-45] + [0.0] * 5 + [1.1e-38] * 8
                          # absmax / 127 and absmax / 448 round down to 2^-149 here, so
                          # v / s is 190 or 600: only the clamp keeps the codes in range
                          + [190 * 2.0 ** -149, -2.0 ** -149] + [0.0] * 6
                          + [600 * 2.0 ** -149, 3 * 2.0 ** -149] + [0.0] * 6)
    residual = torch.zeros(values.numel(), device=device)
    codes, scales, _ = _quantized(values, wire_dtype, block, backend, device, residual)
    v = ref.flat_values([values], [0], values.numel(), 1.0, None)
    want_codes, want_scales, _, want_residual = ref.quantize(v, wire_dtype, block)
    _assert_bitwise(codes, want_codes, "codes")
    _assert_bitwise(residual, want_residual, "residual")
    if scales is not None:
        _assert_bitwise(scales, want_scales, "scales")
