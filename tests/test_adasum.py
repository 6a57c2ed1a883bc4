"""adasum_allreduce and AdaSumByDeltaWeight on local gloo ranks.

The reference is the documented tree worked out in float64 in this process:
with P the largest power of two <= n, rank r >= P is first combined into r - P,
then ranks 0..P-1 combine at distances 1, 2, 4, ...; with ``local_size`` k the
ranks of each block of k are averaged first.

Starting ranks costs seconds each (a fresh interpreter imports torch, and the
first optimizer a process builds imports torch._dynamo), so each world size is
run once per session (``ranks_once``): one start of the ranks computes
everything the tests below judge for that world size (``adasum_runs.on_rank``),
and the result is shared by the tests, across pytest-xdist workers too
(``harness.runs_per_world_size``). Rank functions never assert (a rank that
raised would leave the others waiting in a collective): they return what they
saw and the parent judges it. A little over 300 lines: the tolerances and the
kernel-level tree these tests compare with sit beside them.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from adasum_runs import (DTYPES, LARGE_DTYPES, LARGE_SHAPES, RANK_MARK, STEPS, batch, gradients,
                         horovod_stability, large_gradients, local_sizes, mlp, on_rank,
                         parallel_gradients, parallel_multiple, sgd)
from fusedreduce import AdaSumByDeltaWeight, adasum_allreduce
from fusedreduce.kernels import adasum_combine, adasum_stats
from harness import ONE_BYTE_MB, ranks_once_getter
from reference import adasum_of_blocks, adasum_tree


def _world_sizes(sizes):
    # 8 processes on a small shared machine take tens of seconds just to start
    return [pytest.param(n, marks=pytest.mark.slow) if n >= 8 else n for n in sizes]


WORLD_SIZES = _world_sizes([1, 2, 3, 4, 5, 8])
POWERS_OF_TWO = _world_sizes([1, 2, 4, 8])
TIMEOUT = 400.0


# ---------------------------------------------------------------- one run per world size

@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    """``ranks_once(world_size)``: ``on_rank``'s results on every rank.

    The first test to ask runs every world size the session selected, once for
    the whole session and all its pytest-xdist workers.
    """
    return ranks_once_getter(request, tmp_path_factory, "adasum-ranks", on_rank, __name__,
                             TIMEOUT)


# ---------------------------------------------------------------- tolerances

def _tree_depth(n):
    return (n.bit_length() - 1) + (n & (n - 1) != 0)


def _tolerance(expected, per_rank_tensors, local_size, dtype):
    """Each AdaSum rounds its coefficients, products and sum in fp32 (fp64 for fp64:
    there the fp64 statistics' own summation error, n·eps64 relative, is of the same
    order): <= 4 eps of the largest input per level, doubled for the block mean and
    the error carried through the next level's coefficients; then one rounding to
    the tensor's dtype, and an absolute subnormal step."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    n = expected.numel()
    eps_c = torch.finfo(compute).eps * (n + 4 if dtype == torch.float64 else 1)
    largest = sum(float(t.double().abs().max()) for t in per_rank_tensors if t.numel())
    levels = _tree_depth(len(per_rank_tensors) // local_size) + 1
    eps_d, tiny_d = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return 8 * levels * eps_c * largest + eps_d * expected.abs() + tiny_d * eps_d


# ---------------------------------------------------------------- the collective

def _same_bits(a, b):
    """Same dtype, shape and bit patterns (so -0.0 is not 0.0); any strides."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_adasum_allreduce_matches_the_float64_tree(ranks_once, world_size):
    results = ranks_once(world_size)
    grads = [gradients(r) for r in range(world_size)]
    for local_size in local_sizes(world_size):
        got = results[0]["adasum"][local_size, 25.0]
        for i, dtype in enumerate(DTYPES):
            per_rank = [grads[r][i] for r in range(world_size)]
            expected = adasum_of_blocks(per_rank, local_size)
            assert got[i].dtype == dtype and got[i].shape == per_rank[0].shape
            error = (got[i].double() - expected).abs()
            tolerance = _tolerance(expected, per_rank, local_size, dtype)
            assert bool((error <= tolerance).all()), \
                f"local_size {local_size}, tensor {i} {dtype}: error {float(error.max()):.3g}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_adasum_allreduce_is_bitwise_identical_on_every_rank(ranks_once, world_size):
    results = ranks_once(world_size)
    for key, first in results[0]["adasum"].items():
        for rank in range(1, world_size):
            for i, (a, b) in enumerate(zip(first, results[rank]["adasum"][key])):
                assert _same_bits(a, b), \
                    f"(local_size, cap) {key}: tensor {i} differs on rank {rank}"


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w in (3, 4)])
def test_messages_staged_through_host_memory_give_bitwise_the_same_result(ranks_once,
                                                                          world_size):
    # gloo cannot send or receive CUDA tensors, so the tree stages them through
    # CPU buffers there; the staged path must change nothing, on every rank
    results = ranks_once(world_size)
    for rank in range(world_size):
        staged, messages = results[rank]["through_host"]
        assert messages > 0
        direct = results[rank]["adasum"][1, 25.0]
        assert all(_same_bits(a, b) for a, b in zip(staged, direct)), rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_adasum_allreduce_leaves_its_inputs_alone(ranks_once, world_size):
    assert all(r["inputs_unchanged"] for r in ranks_once(world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_bucket_cap_does_not_change_16_and_32_bit_results(ranks_once, world_size):
    # fp64 tensors: test_the_bucket_cap_does_not_change_float64_results
    results = ranks_once(world_size)
    for local_size in local_sizes(world_size):
        fused = results[0]["adasum"][local_size, 25.0]
        alone = results[0]["adasum"][local_size, ONE_BYTE_MB]
        for i, dtype in enumerate(DTYPES):
            if dtype != torch.float64:
                assert _same_bits(fused[i], alone[i]), \
                    f"local_size {local_size}, tensor {i} {dtype}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_bucket_cap_does_not_change_float64_results(ranks_once, world_size):
    # fp64 coefficients keep every bit of the statistics, so this holds only
    # because a tensor's statistics are canonical: fixed chunks from its start,
    # their partials added in chunk order, however the halving cut the bucket
    results = ranks_once(world_size)
    differing = []
    for local_size in local_sizes(world_size):
        fused = results[0]["adasum"][local_size, 25.0]
        alone = results[0]["adasum"][local_size, ONE_BYTE_MB]
        differing += [(local_size, i) for i, dtype in enumerate(DTYPES)
                      if dtype == torch.float64 and not _same_bits(fused[i], alone[i])]
    assert not differing, f"(local_size, tensor) differing: {differing}"


def _kernel_adasum(a, b):
    n = a.numel()
    return adasum_combine(a, b, [0, n], adasum_stats(a, b, [0, n], backend="torch"),
                          backend="torch")


def kernel_tree(per_rank, local_size):
    """The documented tree worked out with the kernels on one whole tensor per
    rank, in its communication dtype (fp32 for 16-bit, else its own): the block
    means as the buffers hold them (each value times 1/local_size, then summed),
    then AdaSum along the tree; cast back to the tensor's dtype."""
    dtype = per_rank[0].dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    flat = [t.reshape(-1).to(wide) * (1.0 / local_size) for t in per_rank]
    blocks = [sum(flat[i + 1:i + local_size], flat[i]) for i in range(0, len(flat), local_size)]
    return adasum_tree(blocks, pair=_kernel_adasum).to(dtype).view(per_rank[0].shape)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tensors_cut_between_ranks_get_bitwise_the_kernels_adasum_of_the_whole_tensors(
        ranks_once, world_size):
    # the statistics of a tensor cut between ranks (at chunk boundaries) are
    # its chunk partials added in order, exactly as adasum_stats forms them on
    # the whole tensor: so adasum_allreduce is bitwise the kernels applied
    # along the tree to each tensor alone, in every bucket layout
    results = ranks_once(world_size)
    grads = [large_gradients(r) for r in range(world_size)]
    for (local_size, cap), got in results[0]["large"].items():
        for i, dtype in enumerate(LARGE_DTYPES):
            expected = kernel_tree([g[i] for g in grads], local_size)
            assert _same_bits(got[i], expected), \
                f"local_size {local_size}, cap {cap}, tensor {i} {LARGE_SHAPES[i]} {dtype}"
        for rank in range(1, world_size):
            assert all(_same_bits(a, b) for a, b in
                       zip(got, results[rank]["large"][local_size, cap])), rank


@pytest.mark.parametrize("world_size", POWERS_OF_TWO)
def test_a_power_of_two_tree_of_parallel_gradients_gives_their_exact_mean(ranks_once,
                                                                          world_size):
    results = ranks_once(world_size)
    mean = sum(parallel_multiple(r) for r in range(world_size)) / world_size
    for local_size, got in results[0]["parallel"].items():
        for g, start in zip(got, parallel_gradients(0)):
            assert torch.equal(g, (mean * start.double()).to(g.dtype)), \
                f"local_size {local_size}, {g.dtype}"


@pytest.mark.parametrize("world_size,order", [
    (2, "tiny"), (4, "tiny"), (2, "rising"), (4, "rising"),
    # at 4 ranks the ladder's smallest (~2e-24) and largest (~1.8e19) gradients
    # meet first: the coefficient 1 - a·b/(2‖a‖²) ≈ -4e42 is beyond fp32, so that
    # combine takes the kernels' fp64 branch
    (4, "extremes_paired")])
def test_horovod_stability_parallel_float32_gradients_average(ranks_once, world_size, order):
    got = ranks_once(world_size)[0]["horovod"][order]
    per_rank = [horovod_stability(r, world_size, order) for r in range(world_size)]
    expected = sum(t.double() for t in per_rank) / world_size
    assert bool(torch.isfinite(got).all())
    # parallel up to the inputs' fp32 rounding: per level, a few fp32 roundings
    # of the largest input (see _tolerance)
    tolerance = _tolerance(expected, per_rank, 1, torch.float32)
    assert bool(((got.double() - expected).abs() <= tolerance).all())


def test_a_subgroup_combines_its_own_ranks_only(ranks_once):
    # the group of global ranks 1 and 2 of 3: group rank 0 is global rank 1
    results = ranks_once(3)
    grads = [gradients(r) for r in (1, 2)]
    for local_size in (1, 2):
        got = results[1]["subgroup"][local_size]
        for i, dtype in enumerate(DTYPES):
            assert _same_bits(got[i], results[2]["subgroup"][local_size][i])
            per_rank = [g[i] for g in grads]
            expected = adasum_of_blocks(per_rank, local_size)
            tolerance = _tolerance(expected, per_rank, local_size, dtype)
            assert bool(((got[i].double() - expected).abs() <= tolerance).all()), \
                f"local_size {local_size}, tensor {i} {dtype}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchanges_only_moves_the_tree_s_slices_without_combining_them(ranks_once, world_size):
    # each rank keeps one slice of the halving and the all-gather hands every
    # slice to every rank: with the math off, the result is the ranks' own
    # inputs, one contiguous slice from each rank, the same on every rank
    results = ranks_once(world_size)
    got = results[0]["exchanges_only"]
    for rank in range(1, world_size):
        assert _same_bits(results[rank]["exchanges_only"], got), f"rank {rank} differs"
    offset = got.double() - torch.arange(got.numel(), dtype=torch.float64)
    source = (offset / RANK_MARK).round()
    assert torch.equal(offset, source * RANK_MARK), "an element is no rank's input"
    runs = torch.unique_consecutive(source).tolist()
    assert sorted(runs) == list(range(world_size)), f"slices come from ranks {runs}"


# ---------------------------------------------------------------- AdaSumByDeltaWeight

def _reference_training(world_size, local_size):
    """One process in float64: the ranks' models share weights, each keeps its own
    SGD momentum; a step is local steps, then weights = saved + AdaSum(deltas)."""
    models = [mlp().double() for _ in range(world_size)]
    optimizers = [sgd(m) for m in models]
    for step in range(STEPS):
        saved = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x.double()), y.double()).backward()
            optimizer.step()
            deltas.append([p.detach() - s for p, s in zip(model.parameters(), saved)])
        new = [s + adasum_of_blocks([d[i] for d in deltas], local_size)
               for i, s in enumerate(saved)]
        with torch.no_grad():
            for model in models:
                for p, value in zip(model.parameters(), new):
                    p.copy_(value)
    return [p.detach() for p in models[0].parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_delta_weight_sgd_with_momentum_matches_a_one_process_reference(ranks_once,
                                                                        world_size):
    results = ranks_once(world_size)
    for local_size in local_sizes(world_size):
        expected = _reference_training(world_size, local_size)
        for rank in range(world_size):
            got = results[rank]["delta_weight"][local_size]
            for i, (g, e) in enumerate(zip(got, expected)):
                assert _same_bits(g, results[0]["delta_weight"][local_size][i]), \
                    f"rank {rank} parameter {i} differs from rank 0's"
                # fp32 training against float64: weights of order 1, 10 steps of a
                # few dozen fp32 roundings each (forward, backward, SGD, AdaSum)
                assert torch.allclose(g.double(), e, rtol=0, atol=1e-5), \
                    f"local_size {local_size}, parameter {i}: " \
                    f"{float((g.double() - e).abs().max()):.3g}"


# ---------------------------------------------------------------- errors

#: the one local_size check's message (node_groups.check_local_size), AdaSum's too
LOCAL_SIZE_ERROR = "local_size must be a positive int dividing the group's size"
EXPECTED_ERRORS = {
    "one more tensor on rank 0": ("RuntimeError", "tensor 8"),
    "another shape on the last rank": ("RuntimeError", "tensor 7"),
    "another dtype on rank 0": ("RuntimeError", "tensor 0"),
    "sparse": ("TypeError", "tensors[1]"),
    "a single tensor": ("TypeError", "single tensor"),
    "integer": ("TypeError", "tensors[1]"),
    "local_size 0": ("ValueError", LOCAL_SIZE_ERROR),
    "local_size True": ("ValueError", LOCAL_SIZE_ERROR),
    "local_size not dividing": ("ValueError", LOCAL_SIZE_ERROR),
    "delta weight local_size not dividing": ("ValueError", LOCAL_SIZE_ERROR),
    "local_size differing between ranks": ("RuntimeError", "local_size"),
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_input_fails_with_a_clear_error_on_every_rank_without_a_hang(ranks_once,
                                                                          world_size):
    results = ranks_once(world_size)
    if world_size == 2:
        assert set(results[0]["errors"]) == set(EXPECTED_ERRORS)
    for rank, result in enumerate(results):
        for name, error in result["errors"].items():
            kind, fragment = EXPECTED_ERRORS[name]
            assert error is not None, f"rank {rank}: {name}: no error"
            assert error[0] == kind and fragment in error[1], f"rank {rank}: {name}: {error}"
        for got, expected in zip(result["after_errors"], results[0]["adasum"][1, 25.0]):
            assert _same_bits(got, expected), f"rank {rank}: the ranks fell out of step"


def test_adasum_allreduce_without_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        adasum_allreduce([torch.ones(3)])


def test_delta_weight_without_a_process_group_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        AdaSumByDeltaWeight(sgd(mlp()))
