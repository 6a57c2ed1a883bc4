"""AdaSum's canonical statistics: chunk partials added in chunk order, both backends.

A segment's statistics are its chunk partials (ADASUM_CHUNK elements from
the segment's start) added in chunk order. These properties are what lets
the halving tree cut a tensor between ranks at chunk boundaries and still
get bitwise the statistics of the whole tensor, whatever the bucket layout:
a segment's statistics do not depend on where it sits in a buffer, pieces cut
at chunk boundaries add up to them, the sums go in chunk order, and the torch
fallback's results depend on neither the thread count nor a chunk's batch slot
or alignment, on the CPU and through the fixed-order sums it takes on CUDA
(which the CPU tests force, so CI checks them too); the Triton launchers'
cached tables stay right. Values and
accuracy budgets are those of ``adasum_cases.py``.

Segments here reach two chunks and a bit; the Triton interpreter runs each
1024 elements of a chunk as one numpy step.

Device-aware: the buffers live on ``device_mode.DEVICE()`` (CUDA under
``pytest --device cuda``); results are compared, and references computed, on
the CPU.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, strategies as st

import device_mode
from adasum_cases import DTYPES, EPS64, values
from device_mode import on_cpu
from fusedreduce.kernels.adasum import torch_backend
from fusedreduce.kernels import (ADASUM_CHUNK, adasum_chunk_counts, adasum_chunk_stats,
                                 adasum_reduce_chunks, adasum_stats)
from reference import adasum_stats as reference_stats

CHUNK = ADASUM_CHUNK

pytestmark = pytest.mark.device_aware


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float64 values as their bit patterns, on the CPU: -0.0 differs from 0.0."""
    return on_cpu(t).contiguous().view(torch.int64)


@contextlib.contextmanager
def fixed_order_sums():
    """The torch fallback's fixed-order sums (its path on CUDA) on any device."""
    saved = torch_backend.sums_in_fixed_order
    torch_backend.sums_in_fixed_order = lambda device: True
    try:
        yield
    finally:
        torch_backend.sums_in_fixed_order = saved


# lengths on either side of one and two chunk boundaries, and short ones
chunked_lengths = st.one_of(st.integers(0, 3000), st.integers(CHUNK - 40, CHUNK + 40),
                            st.integers(2 * CHUNK - 40, 2 * CHUNK + 1500))


def _check_placement(backend, n, before, after, dtype, seed):
    """The same values alone in their own buffers, and shifted behind other
    segments (every alignment) with more after them, give the same bits."""
    a, b = values(n, dtype, seed, 1), values(n, dtype, seed, 2)
    alone = adasum_stats(a, b, [0, n], backend=backend)
    lead = sum(before)
    total = lead + n + after
    big_a, big_b = values(total, dtype, seed, 3), values(total, dtype, seed, 4)
    big_a[lead:lead + n], big_b[lead:lead + n] = a, b
    bounds = [0]
    for length in before:
        bounds.append(bounds[-1] + length)
    bounds += [lead + n, total]
    placed = adasum_stats(big_a, big_b, bounds, backend=backend)
    assert torch.equal(_bits(placed[len(before)]), _bits(alone[0])), (n, before, dtype)


placements = dict(n=chunked_lengths, before=st.lists(st.integers(0, 40), max_size=3),
                  after=st.integers(0, 40), dtype=st.sampled_from(DTYPES),
                  seed=st.integers(0, 2 ** 20))


@given(**placements)
def test_the_stats_of_a_segment_do_not_depend_on_where_it_sits(backend, n, before, after,
                                                                 dtype, seed):
    _check_placement(backend, n, before, after, dtype, seed)


@given(**placements)
def test_fixed_order_stats_do_not_depend_on_where_a_segment_sits(n, before, after, dtype, seed):
    # the fallback's fixed-order sums, its path on CUDA, which the CPU otherwise
    # never takes: CI checks that path's arithmetic here
    with fixed_order_sums():
        _check_placement("torch", n, before, after, dtype, seed)


@given(n=st.integers(CHUNK + 1, 2 * CHUNK + 1500), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2 ** 20), data=st.data())
def test_chunk_partials_of_pieces_cut_at_chunk_boundaries_add_up_to_the_stats(backend, n,
                                                                               dtype, seed,
                                                                               data):
    a, b = values(n, dtype, seed, 1), values(n, dtype, seed, 2)
    whole = adasum_stats(a, b, [0, n], backend=backend)
    rows = adasum_chunk_stats(a, b, [0, n], backend=backend)
    assert rows.shape == (adasum_chunk_counts([0, n])[0], 3) == (-(-n // CHUNK), 3)
    # the pieces on either side of a chunk boundary, each in buffers of its own
    k = data.draw(st.integers(1, rows.shape[0] - 1), label="chunks in the first piece")
    cut = k * CHUNK
    first = adasum_chunk_stats(a[:cut].clone(), b[:cut].clone(), [0, cut], backend=backend)
    second = adasum_chunk_stats(a[cut:].clone(), b[cut:].clone(), [0, n - cut],
                                backend=backend)
    assert torch.equal(_bits(torch.cat([first, second])), _bits(rows))
    # as two ranks of the tree: each fills its own rows of an array of -0.0,
    # the arrays are summed, and the sum reduced in chunk order
    mine, theirs = (torch.full((rows.shape[0], 3), -0.0, dtype=torch.float64, device=rows.device)
                    for _ in "ab")
    mine[:k], theirs[k:] = first, second
    summed = adasum_reduce_chunks(mine + theirs, [0, n], backend=backend)
    assert torch.equal(_bits(summed), _bits(whole))
    assert torch.equal(_bits(adasum_reduce_chunks(rows, [0, n], backend=backend)), _bits(whole))
    # and the statistics are still accurate (the budget of test_adasum_kernels.py's
    # test_stats_match_the_float64_reference)
    expected = reference_stats(on_cpu(a), on_cpu(b), [0, n])[0]
    x, y = on_cpu(a).double(), on_cpu(b).double()
    for j, total in enumerate([(x * y).abs().sum(), (x * x).sum(), (y * y).sum()]):
        assert abs(whole[0, j].item() - expected[j].item()) <= (n + 1) * EPS64 * float(total)


def test_chunk_sums_are_added_one_after_the_other_in_chunk_order(backend):
    # 1 + 2^-53 rounds to 1 (ties to even), so 1 then three 2^-53 one at a time
    # stays 1, while any other association (pairwise, or from the back) sees
    # 2^-53 + 2^-53 = 2^-52 and leaves 1: the first column shows the order
    tiny = 2.0 ** -53
    rows = [[1.0, tiny, 0.0], [tiny, tiny, 5.0], [tiny, tiny, -0.0], [tiny, 1.0, 2.0]]
    partials = torch.tensor(rows + [[-0.0, -0.0, -0.0], [3.0, 4.0, 5.0]], dtype=torch.float64,
                            device=device_mode.DEVICE())
    bounds = [0, 4 * CHUNK, 4 * CHUNK, 5 * CHUNK - 7, 6 * CHUNK - 7]
    got = adasum_reduce_chunks(partials, bounds, backend=backend)
    in_order = [((r0 + r1) + r2) + r3 for r0, r1, r2, r3 in zip(*rows)]
    assert got[0].tolist() == in_order
    assert in_order[0] == 1.0 != (1.0 + tiny) + (tiny + tiny)
    # an empty segment gives +0.0; a single chunk, its partial as it is (-0.0 too)
    assert torch.equal(_bits(got[1:]), _bits(torch.tensor(
        [[0.0] * 3, [-0.0] * 3, [3.0, 4.0, 5.0]], dtype=torch.float64)))


@pytest.mark.skipif(device_mode.cuda_mode(),
                    reason="the thread count is the CPU's: CUDA tensors do not use those threads")
def test_torch_stats_do_not_depend_on_the_thread_count():
    # the fallback's chunk partials are batched Gram products (whole chunks)
    # and row sums (short ones): the thread count must not move a bit
    n = 5 * CHUNK + 333
    a, b = values(n, torch.float32, 7, 1), values(n, torch.float32, 7, 2)
    bounds = [0, 17, 2 * CHUNK + 5, 2 * CHUNK + 5, n]
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            results.append(_bits(adasum_chunk_stats(a, b, bounds, backend="torch")))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("order", ["device's own", "fixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_torch_whole_chunk_partials_do_not_depend_on_batch_slot_or_alignment(dtype, order,
                                                                              monkeypatch):
    # the fallback takes chunks through batches in scratch (Gram products on
    # the CPU, fixed-order sums elsewhere): a chunk must give the same bits in
    # every slot of a batch, behind any number of other chunks, from any
    # source alignment
    if order == "fixed":
        monkeypatch.setattr(torch_backend, "sums_in_fixed_order", lambda device: True)
        monkeypatch.setattr(torch_backend, "TREE_BATCH", 4)  # small batches, many slots
    batch = (torch_backend.TREE_BATCH if torch_backend.sums_in_fixed_order(
        device_mode.DEVICE()) else torch_backend.GRAM_BATCH)
    ours_a, ours_b = values(3 * CHUNK, dtype, 11, 1), values(3 * CHUNK, dtype, 11, 2)
    alone = adasum_chunk_stats(ours_a, ours_b, [0, 3 * CHUNK], backend="torch")
    for lead_chunks in range(batch + 2):
        for odd in (0, 1, 3):
            lead = lead_chunks * CHUNK + odd
            a = torch.cat([values(lead, dtype, lead, 3), ours_a])
            b = torch.cat([values(lead, dtype, lead, 4), ours_b])
            bounds = [0, lead_chunks * CHUNK, lead, lead + 3 * CHUNK]
            rows = adasum_chunk_stats(a, b, bounds, backend="torch")
            first = lead_chunks + (1 if odd else 0)
            assert torch.equal(_bits(rows[first:]), _bits(alone)), (lead_chunks, odd)
    # the three sums are the exact statistics' near neighbours
    expected = reference_stats(on_cpu(ours_a[:CHUNK]), on_cpu(ours_b[:CHUNK]), [0, CHUNK])[0]
    x, y = on_cpu(ours_a[:CHUNK]).double(), on_cpu(ours_b[:CHUNK]).double()
    for j, total in enumerate([(x * y).abs().sum(), (x * x).sum(), (y * y).sum()]):
        assert abs(alone[0, j].item() - expected[j].item()) <= CHUNK * EPS64 * float(total)


@given(lengths=st.lists(st.one_of(st.integers(0, 70), st.integers(CHUNK - 3, CHUNK + 3)),
                        min_size=1, max_size=6),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 20))
def test_fixed_order_sums_are_within_a_pairwise_bound_of_the_exact_statistics(lengths, dtype,
                                                                               seed):
    # every product is exact in fp64 and each partial is a pairwise tree of
    # depth log2(CHUNK) = 14 over at most CHUNK terms (the -0.0 padding adds
    # exactly), so each partial is within 14 roundings of half an fp64 eps of
    # its terms' absolute sum; chunk partials then add in order, one more
    # rounding each. 16 eps per chunk is a safe budget for both.
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    a, b = values(bounds[-1], dtype, seed, 1), values(bounds[-1], dtype, seed, 2)
    with fixed_order_sums():
        got = on_cpu(adasum_stats(a, b, bounds, backend="torch"))
    exact = reference_stats(on_cpu(a), on_cpu(b), bounds)
    x, y = on_cpu(a).double(), on_cpu(b).double()
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        chunks = max(1, -(-(hi - lo) // CHUNK))
        totals = [(x[lo:hi] * y[lo:hi]).abs().sum(), (x[lo:hi] ** 2).sum(),
                  (y[lo:hi] ** 2).sum()]
        for j, total in enumerate(totals):
            budget = 16 * chunks * EPS64 * float(total)
            assert abs(got[i, j].item() - exact[i, j].item()) <= budget, (i, j, lengths)


def test_triton_launch_tables_are_kept_per_layout_and_stay_right():
    # the Triton launchers keep a bucket layout's tables; a caller's list may
    # change afterwards, and a full cache evicts, without a wrong table
    pytest.importorskip("triton")
    from fusedreduce.kernels.adasum import triton_backend as triton_adasum
    a, b = values(2 * CHUNK + 1, torch.float32, 5, 1), values(2 * CHUNK + 1, torch.float32, 5, 2)
    # the device exactly as the kernels see it (cuda:0, not cuda): tables are kept per device
    device = a.device
    segments = [0, 3, 3, 2 * CHUNK + 1]
    first, programs = triton_adasum.segment_table(segments, device, CHUNK)
    segments[-1] = 5  # the kept table belongs to the old values
    again, _ = triton_adasum.segment_table([0, 3, 3, 2 * CHUNK + 1], device, CHUNK)
    assert again is first and programs == 3
    assert first.tolist() == [0, 3, 3, 3, 0, 2 * CHUNK - 2, 0, 2 << 32, (2 << 32) | 1]
    changed, programs = triton_adasum.segment_table(segments, device, CHUNK)
    assert changed.tolist() == [0, 3, 3, 3, 0, 2, 0, 2 << 32] and programs == 2
    bounds = [0, 3, 3, 2 * CHUNK + 1]
    kept = adasum_stats(a, b, bounds, backend="triton")
    for extra in range(triton_adasum.TABLES_KEPT + 1):  # evict it
        triton_adasum.segment_table([0, extra + 1], device, CHUNK)
    assert triton_adasum.segment_table(bounds, device, CHUNK)[0] is not first
    assert torch.equal(adasum_stats(a, b, bounds, backend="triton"), kept)
