"""The clipping norm split across ranks (``split_norm``), one process: the
backends' ``norm_partials`` of every share add up to the whole vector, bit for
bit, so the all-reduce that adds them (``clipping.clip_buffers(split=...)``)
gives the norm and scales every rank would get reading all of the buffers.

The property the split stands on: share ``(r, count)`` computes exactly the
entries ``share_bounds`` gives it and leaves every other entry +0.0; adding
+0.0 changes no value (an inf stays inf, a NaN stays NaN), whatever order a
collective adds the shares in. The multi-rank check (split and unsplit
reducers, the same bits) is ``test_clipping.py``'s.
"""
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from fusedreduce import clipping
from fusedreduce.kernels._backends import backend_for
from fusedreduce.kernels._common import share_bounds
from fusedreduce.kernels.norm import torch_backend as torch_norm
from test_norm_kernels import NORMS, _buffers, buffer_specs

pytestmark = pytest.mark.device_aware


def _bits(tensor: torch.Tensor) -> list:
    """fp64 values as comparable bits, every NaN alike (adding +0.0 may quiet
    a NaN's payload; any NaN is the same non-finite norm)."""
    flat = tensor.reshape(-1)
    return [None if math.isnan(v) else b
            for v, b in zip(flat.tolist(), flat.view(torch.int64).tolist())]


@settings(max_examples=30, deadline=None)
@given(specs=buffer_specs, norm_type=st.sampled_from(NORMS), count=st.integers(1, 9),
       seed=st.integers(0, 2 ** 16), magnitude=st.sampled_from([1e-3, 1.0, 100.0]),
       poison=st.sampled_from([None, math.inf, math.nan]), poison_at=st.integers(0, 2 ** 20))
@example(specs=[(8 * 2048 + 7, torch.float32, False), (0, torch.float16, False),
                (17 * 2048, torch.bfloat16, True)],
         norm_type=2.0, count=3, seed=1, magnitude=1.0, poison=math.nan,
         poison_at=20_000).via("three ranks over two dtype groups and an empty buffer")
def test_the_shares_partials_add_up_to_the_whole_bit_for_bit(backend, device, specs,
                                                             norm_type, count, seed,
                                                             magnitude, poison, poison_at):
    ops = backend_for(backend, device)
    buffers = _buffers(device, specs, seed, magnitude)
    total_size = sum(b.numel() for b in buffers)
    if poison is not None and total_size:
        at = poison_at % total_size
        for buffer in buffers:
            if at < buffer.numel():
                buffer[at] = poison
                break
            at -= buffer.numel()
    whole = ops.norm_partials(buffers, norm_type)
    shares = [ops.norm_partials(buffers, norm_type, (r, count)) for r in range(count)]
    for r, share in enumerate(shares):
        assert share.dtype == torch.float64 and share.shape == whole.shape
        lo, hi = share_bounds(whole.numel(), (r, count))
        # its own entries are the whole call's; every other one is +0.0
        assert _bits(share[lo:hi]) == _bits(whole[lo:hi])
        outside = torch.cat([share[:lo], share[hi:]])
        assert outside.view(torch.int64).eq(0).all(), r
    # added as a collective would, in any order
    for order in (range(count), reversed(range(count))):
        total = torch.zeros_like(whole)
        for r in order:
            total += shares[r]
        assert _bits(total) == _bits(whole)
    # the finish from the whole partials is clip_buffers, bit for bit
    postscales = [0.5] * len(buffers)
    a_total, a_scales = ops.clip_partials(whole, buffers, postscales, 1.0, norm_type)
    b_total, b_scales = ops.clip_buffers(buffers, postscales, 1.0, norm_type)
    assert _bits(a_total.double().reshape(1)) == _bits(b_total.double().reshape(1))
    assert [_bits(s) for s in a_scales] == [_bits(s) for s in b_scales]


@settings(max_examples=30, deadline=None)
@given(specs=buffer_specs, norm_type=st.sampled_from(NORMS), count=st.integers(1, 9),
       window=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_the_torch_fallback_s_windows_give_every_share_the_whole_call_s_bits(
        device, specs, norm_type, count, window, seed):
    # windows of a few rows, so that shares' edges cut them (on a GPU a window
    # is 2048 rows, more than these buffers have)
    buffers = _buffers(device, specs, seed, 1.0)
    reductions = []  # each call's rows: (address, elements)
    row_norms_into = torch_norm._row_norms_into

    def recorded(out, part, norm_type):
        reductions[-1].add((part.data_ptr(), part.numel()))
        row_norms_into(out, part, norm_type)

    saved = torch_norm.rows_in_windows, torch_norm.WINDOW_ROWS
    torch_norm.rows_in_windows, torch_norm.WINDOW_ROWS = (lambda device: True), window
    torch_norm._row_norms_into = recorded
    try:
        reductions.append(set())
        whole = torch_norm.norm_partials(buffers, norm_type)
        shares = []
        for r in range(count):
            reductions.append(set())
            shares.append(torch_norm.norm_partials(buffers, norm_type, (r, count)))
    finally:
        torch_norm.rows_in_windows, torch_norm.WINDOW_ROWS = saved
        torch_norm._row_norms_into = row_norms_into
    for r, share in enumerate(shares):
        lo, hi = share_bounds(whole.numel(), (r, count))
        assert _bits(share[lo:hi]) == _bits(whole[lo:hi]), r
        assert torch.cat([share[:lo], share[hi:]]).view(torch.int64).eq(0).all(), r
        # the invariant a GPU needs: a share reduces only windows the whole call
        # reduces, at the same addresses (the CPU's bits cannot tell)
        assert reductions[r + 1] <= reductions[0], r
    if device.type == "cpu":
        # a row's reduction there is the same in any window: windows change no bit
        assert _bits(whole) == _bits(torch_norm.norm_partials(buffers, norm_type))


@pytest.mark.parametrize("items, count", [(0, 1), (0, 4), (3, 8), (10, 3), (7, 7), (1000, 6)])
def test_shares_cover_every_item_once_in_order_within_one_of_each_other(items, count):
    bounds = [share_bounds(items, (r, count)) for r in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == items
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_one_rank_or_none_is_the_unsplit_call(backend, device):
    buffers = _buffers(device, [(5000, torch.float32, False), (9, torch.float16, True)], 2, 1.0)
    plain = clipping.clip_buffers(buffers, [0.5, 0.5], 1.0, 2.0, backend=backend)
    # a world of one needs no collective (no process group here)
    alone = clipping.clip_buffers(buffers, [0.5, 0.5], 1.0, 2.0, backend=backend,
                                  split=clipping.NormSplit(None, 0, 1))
    assert plain[0].view(torch.int32) == alone[0].view(torch.int32)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_split_norm_must_be_none_or_a_bool(value):
    with pytest.raises(TypeError, match="split_norm must be None, True or False"):
        clipping.check_split_norm(value)


def test_the_rule_reads_the_whole_buffers_on_one_rank_or_when_told():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert clipping.norm_split_for(True, None, 1, 10 ** 9, cpu) is None
    assert clipping.norm_split_for(False, None, 8, 10 ** 9, gpu) is None
    # two ranks reading half of 2 * spared - 2 elements each spare one too few
    # (the threshold itself splits: test_clipping's, on ranks)
    for device in (cpu, gpu):
        spared = clipping.SPLIT_NORM_MIN_SPARED[device.type]
        assert clipping.norm_split_for(None, None, 2, 2 * spared - 2, device) is None
    # a device type without a measured threshold takes the GPU's
    spared = clipping.SPLIT_NORM_MIN_SPARED["cuda"]
    assert clipping.norm_split_for(None, None, 2, 2 * spared - 2, torch.device("meta")) is None
