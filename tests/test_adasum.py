"""adasum_allreduce and AdaSumByDeltaWeight on local gloo ranks.

The reference is the documented tree worked out in float64 in this process:
with P the largest power of two <= n, rank r >= P is first combined into r - P,
then ranks 0..P-1 combine at distances 1, 2, 4, ...; with ``local_size`` k the
ranks of each block of k are averaged first.

Starting ranks costs seconds each (a fresh interpreter imports torch, and the
first optimizer a process builds imports torch._dynamo), so each world size is
run once per session (``ranks_once``): one ``run_ranks`` call computes
everything the tests below judge for that world size, and the result is shared
by the tests, across pytest-xdist workers too (``harness.once_per_session``). Rank functions never
assert (a rank that raised would leave the others waiting in a collective):
they return what they saw and the parent judges it.

Gradients of different ranks are correlated and of different sizes, so the
AdaSum coefficients are far from 1 and a wrong pairing of the tree is far
outside the tolerances.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import AdaSumByDeltaWeight, adasum_allreduce, adasum_allreduce_flat
from fusedreduce.kernels import ADASUM_CHUNK, adasum_combine, adasum_stats, packed_boundaries
from fusedreduce.local_ranks import RankFailure
from harness import once_per_session, run_ranks
from reference import adasum_of_blocks, adasum_tree

SHAPES = [(3, 5), (0,), (1,), (257,), (4, 4, 3), (1001,), (7,), (2,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float32,
          torch.float64, torch.bfloat16, torch.float16]
ONE_BYTE_MB = 1 / 2 ** 20  # a cap of one byte: every tensor in a bucket of its own


def _world_sizes(sizes):
    # 8 processes on a small shared machine take tens of seconds just to start
    return [pytest.param(n, marks=pytest.mark.slow) if n >= 8 else n for n in sizes]


WORLD_SIZES = _world_sizes([1, 2, 3, 4, 5, 8])
POWERS_OF_TWO = _world_sizes([1, 2, 4, 8])
TIMEOUT = 400.0
STEPS = 10


def _local_sizes(world_size):
    return [1, 2] if world_size % 2 == 0 else [1]


# ---------------------------------------------------------------- what the ranks hold

def _gradients(rank):
    """Per tensor: a direction shared by all ranks plus this rank's noise, of a
    rank-dependent size; the last tensor is zero on odd ranks (AdaSum(g, 0) = g),
    the (4, 4, 3) one a transposed, non-contiguous view."""
    shared = torch.Generator().manual_seed(99)
    own = torch.Generator().manual_seed(1000 + rank)
    scale = 2.0 ** (rank % 3) * (1 + 0.25 * rank)
    grads = []
    for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES)):
        base = torch.randn(shape, generator=shared, dtype=torch.float64)
        noise = torch.randn(shape, generator=own, dtype=torch.float64)
        value = scale * (base + 0.5 * noise)
        if i == len(SHAPES) - 1 and rank % 2:
            value = torch.zeros(shape, dtype=torch.float64)
        grads.append(value.to(dtype).transpose(0, -1) if len(shape) == 3 else value.to(dtype))
    return grads


def _parallel_multiple(rank):
    """c_r with a power-of-two tree of exact dyadic block means (1, 3 -> 2; 2, 6 -> 4;
    2, 4 -> 3 ...), so every coefficient and product of AdaSum is exact."""
    return (1 if rank % 2 == 0 else 3) * 2 ** (rank // 2)


def _parallel_gradients(rank):
    direction = torch.randint(-8, 9, (5, 7), generator=torch.Generator().manual_seed(3))
    return [(_parallel_multiple(rank) * direction).to(dtype) for dtype in
            (torch.float16, torch.bfloat16, torch.float32, torch.float64)]


def _horovod_stability(rank, world_size, order):
    """Horovod's stability tests (test_adasum_pytorch.py): every rank holds a·r_rank
    in fp32, a common direction a; ``order`` "tiny" has a ~ N(0, float32 tiny) and
    r ~ N(0, 1); the ladders have a ~ N(0, 1) and r from float32 tiny^((n-i-1)/n)·
    sqrt(float32 max)^((i+1)/n), in rising order or with the extremes paired first."""
    gen = torch.Generator().manual_seed(2)
    info = torch.finfo(torch.float32)
    if order == "tiny":
        a = torch.randn(1024, generator=gen, dtype=torch.float64) * info.tiny
        r = torch.randn(world_size, generator=gen, dtype=torch.float64)
    else:
        a = torch.randn(1024, generator=gen, dtype=torch.float64)
        low, high = math.log(info.tiny), math.log(math.sqrt(info.max))
        ladder = [math.exp(((world_size - i - 1) * low + (i + 1) * high) / world_size)
                  for i in range(world_size)]
        if order == "extremes_paired":  # the smallest and the largest meet at distance 1
            ladder = [ladder[0], ladder[-1]] + ladder[1:-1]
        r = torch.tensor(ladder, dtype=torch.float64)
    return (a * r[rank]).float()


#: tensors of several AdaSum chunks, which the halving cuts between ranks (at
#: chunk boundaries), between small ones that shift where the others sit
LARGE_SHAPES = [(7,), (2 * ADASUM_CHUNK + 77,), (3, 5), (ADASUM_CHUNK + 1,), (40_000,)]
LARGE_DTYPES = [torch.float64, torch.float64, torch.float32, torch.float32, torch.float64]
#: one bucket per dtype; one per tensor; and 0.4 MiB, which groups the fp64 ones otherwise
LARGE_CAPS = (25.0, ONE_BYTE_MB, 0.4)


def _large_gradients(rank):
    shared = torch.Generator().manual_seed(7)
    own = torch.Generator().manual_seed(2000 + rank)
    scale = 1.0 + 0.5 * rank
    return [(scale * (torch.randn(shape, generator=shared, dtype=torch.float64)
                      + 0.7 * torch.randn(shape, generator=own, dtype=torch.float64))).to(dtype)
            for shape, dtype in zip(LARGE_SHAPES, LARGE_DTYPES)]


def _mlp():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _batch(rank, step):
    gen = torch.Generator().manual_seed(50 + 100 * rank + step)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_with_delta_weight(rank, local_size):
    model = _mlp()
    optimizer = AdaSumByDeltaWeight(_sgd(model), local_size=local_size)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the parent judges the type and message
        return type(exc).__name__, str(exc)
    return None


def _bad_calls(rank, world_size):
    """Calls every rank makes alike and that must fail on every rank, in order."""
    grads = _gradients(rank)
    calls = {
        "one more tensor on rank 0": lambda: adasum_allreduce(
            grads + [torch.ones(3)] if rank == 0 else grads),
        "another shape on the last rank": lambda: adasum_allreduce(
            grads[:-1] + [torch.ones(3 if rank == world_size - 1 else 2)]),
        "another dtype on rank 0": lambda: adasum_allreduce(
            [torch.ones(4, dtype=torch.float16 if rank == 0 else torch.float32)]),
        "sparse": lambda: adasum_allreduce([torch.ones(3), torch.ones(4).to_sparse()]),
        "integer": lambda: adasum_allreduce([torch.ones(3), torch.arange(4)]),
        "local_size 0": lambda: adasum_allreduce(grads, local_size=0),
        "local_size True": lambda: adasum_allreduce(grads, local_size=True),
        "local_size not dividing": lambda: adasum_allreduce(
            grads, local_size=2 if world_size % 2 else 3),
    }
    if world_size == 2:  # an optimizer costs seconds to build the first time: once is enough
        calls["delta weight local_size not dividing"] = lambda: AdaSumByDeltaWeight(
            _sgd(_mlp()), local_size=3)
        calls["local_size differing between ranks"] = lambda: adasum_allreduce(
            grads, local_size=1 + rank)
    return {name: _error(call) for name, call in calls.items()}


#: an fp32 buffer of whole and partial AdaSum chunks, and element i of rank r's
#: copy holds i + RANK_MARK * r: a result element tells which rank's input it is
EXCHANGED_SEGMENTS = packed_boundaries([5, 2 * ADASUM_CHUNK + 3, 0, 700])
RANK_MARK = 2 ** 20


def _exchanges_only(rank):
    buffer = torch.arange(EXCHANGED_SEGMENTS[-1], dtype=torch.float32) + RANK_MARK * rank
    adasum_allreduce_flat(buffer, EXCHANGED_SEGMENTS, exchanges_only=True)
    return buffer


def _on_rank(rank, world_size):
    """Everything the tests judge for one world size, computed in one start of the ranks."""
    grads = _gradients(rank)
    before = [g.clone() for g in grads]
    results = {"adasum": {}}
    for local_size in _local_sizes(world_size):
        for cap in (25.0, ONE_BYTE_MB):
            results["adasum"][local_size, cap] = adasum_allreduce(
                grads, local_size=local_size, bucket_cap_mb=cap)
    results["inputs_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, grads))
    results["large"] = {(local_size, cap): adasum_allreduce(_large_gradients(rank),
                                                            local_size=local_size,
                                                            bucket_cap_mb=cap)
                        for local_size in _local_sizes(world_size) for cap in LARGE_CAPS}
    if world_size & (world_size - 1) == 0:
        results["parallel"] = {k: adasum_allreduce(_parallel_gradients(rank), local_size=k)
                               for k in _local_sizes(world_size)}
    if world_size in (2, 4):
        results["horovod"] = {
            order: adasum_allreduce([_horovod_stability(rank, world_size, order)])[0]
            for order in ("tiny", "rising", "extremes_paired")}
        results["delta_weight"] = {k: _train_with_delta_weight(rank, k)
                                   for k in _local_sizes(world_size)}
    if world_size == 3:
        subgroup = dist.new_group([1, 2])  # every rank creates it; only members reduce
        if rank in (1, 2):
            results["subgroup"] = {k: adasum_allreduce(grads, subgroup, local_size=k)
                                   for k in (1, 2)}
    if world_size in (2, 4):
        results["exchanges_only"] = _exchanges_only(rank)
    if world_size in (2, 3):
        results["errors"] = _bad_calls(rank, world_size)
        # the ranks are still in step after every refusal
        results["after_errors"] = adasum_allreduce(grads)
    return results


# ---------------------------------------------------------------- one run per world size

def _run(world_size):
    """Each rank's results, or the error of the run as text (kept like a result)."""
    try:
        return run_ranks(_on_rank, world_size, timeout=TIMEOUT)
    except (RankFailure, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _world_sizes_selected(session):
    """The world sizes of this module's tests that this session runs (-m, -k respected)."""
    return {item.callspec.params["world_size"] for item in session.items
            if item.module.__name__ == __name__ and "world_size" in
            getattr(getattr(item, "callspec", None), "params", {})}


def _run_all(world_sizes):
    """``_run`` of every world size, three at a time, largest first (starting
    ranks is mostly waiting and importing, so runs overlap well even on two cores)."""
    largest_first = sorted(world_sizes, reverse=True)
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(largest_first, pool.map(_run, largest_first)))


@pytest.fixture(scope="session")
def ranks_once(request, tmp_path_factory):
    """``ranks_once(world_size)``: ``_on_rank``'s results on every rank.

    The first test to ask runs every world size the session selected, once for
    the whole session and all its pytest-xdist workers.
    """
    selected = _world_sizes_selected(request.session)
    runs = once_per_session(tmp_path_factory, "adasum-ranks", lambda _: _run_all(selected))

    def get(world_size):
        if isinstance(runs[world_size], str):
            pytest.fail(f"the {world_size} ranks failed:\n{runs[world_size]}")
        return runs[world_size]

    return get


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
    grads = [_gradients(r) for r in range(world_size)]
    for local_size in _local_sizes(world_size):
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_adasum_allreduce_leaves_its_inputs_alone(ranks_once, world_size):
    assert all(r["inputs_unchanged"] for r in ranks_once(world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_bucket_cap_does_not_change_16_and_32_bit_results(ranks_once, world_size):
    # fp64 tensors: test_the_bucket_cap_does_not_change_float64_results
    results = ranks_once(world_size)
    for local_size in _local_sizes(world_size):
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
    for local_size in _local_sizes(world_size):
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
    grads = [_large_gradients(r) for r in range(world_size)]
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
    mean = sum(_parallel_multiple(r) for r in range(world_size)) / world_size
    for local_size, got in results[0]["parallel"].items():
        for g, start in zip(got, _parallel_gradients(0)):
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
    per_rank = [_horovod_stability(r, world_size, order) for r in range(world_size)]
    expected = sum(t.double() for t in per_rank) / world_size
    assert bool(torch.isfinite(got).all())
    # parallel up to the inputs' fp32 rounding: per level, a few fp32 roundings
    # of the largest input (see _tolerance)
    tolerance = _tolerance(expected, per_rank, 1, torch.float32)
    assert bool(((got.double() - expected).abs() <= tolerance).all())


def test_a_subgroup_combines_its_own_ranks_only(ranks_once):
    # the group of global ranks 1 and 2 of 3: group rank 0 is global rank 1
    results = ranks_once(3)
    grads = [_gradients(r) for r in (1, 2)]
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
    models = [_mlp().double() for _ in range(world_size)]
    optimizers = [_sgd(m) for m in models]
    for step in range(STEPS):
        saved = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            x, y = _batch(rank, step)
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
    for local_size in _local_sizes(world_size):
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

EXPECTED_ERRORS = {
    "one more tensor on rank 0": ("RuntimeError", "tensor 8"),
    "another shape on the last rank": ("RuntimeError", "tensor 7"),
    "another dtype on rank 0": ("RuntimeError", "tensor 0"),
    "sparse": ("TypeError", "tensors[1]"),
    "integer": ("TypeError", "tensors[1]"),
    "local_size 0": ("ValueError", "local_size"),
    "local_size True": ("ValueError", "local_size"),
    "local_size not dividing": ("ValueError", "local_size"),
    "delta weight local_size not dividing": ("ValueError", "local_size"),
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
        AdaSumByDeltaWeight(_sgd(_mlp()))
