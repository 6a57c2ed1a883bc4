"""fusedreduce.hooks registered on DistributedDataParallel over local gloo ranks.

Starting ranks costs seconds (DDP's first construction alone imports
torch._dynamo in every process) and a DDP step of these models milliseconds,
so all the two-rank work runs in one spawn and all the four-rank work in
another, each once per session (shared by xdist workers through a file); every
test then checks its own entry. Each entry runs DDP without a hook (which
validates the harness itself) and every hook. What the ranks run (models,
data, the jobs) is in hook_runs.py.

Each step the workers also compute every rank's *local* gradient with a plain
copy of the model at the same parameters (the same ops, so bitwise what DDP put
in its buckets). The parent process checks the hooked gradients against a
float64 reference built from those local gradients (reference.py), with error
bounds derived from the precision each hook computes in, and checks that all
ranks hold bitwise the same gradients and parameters. Over 300 lines: the
hooks' error-bound models (one per way a hook rounds) live with the checks
that use them.
"""
import functools
import inspect
import math

import pytest
import torch
import torch.distributed as dist

from fusedreduce import hooks
from fusedreduce.hooks import HookState
from harness import TIMEOUT, once_per_session, run_ranks
from hook_runs import (BAD_STATE_KWARGS, DISAGREEING, EVERY_HOOK, FOUR_RANK_JOBS, FOUR_RANK_RUNS, HOOKS,
                       MIXED_RUNS, SUBGROUP, TWO_RANK_JOBS, run_each)
from reference import (NORM_FLOOR, SIXTEEN_BIT, adasum_coefficient, adasum_pair, adasum_stats,
                       adasum_tree, subnormal_spacing)


# ------------------------------------------------------------------ float64 references


def _mean_reference(per_rank, wire, before):
    """(reference, bound) for a mean reduced by summing ``x * before`` in ``wire``
    and multiplying by ``after = 1 / (world_size * before)``.

    Each addend rounds once to ``wire`` (relative eps, or a subnormal spacing near
    0) and each of the world_size - 1 additions once more, relative to the sum of
    magnitudes; ``after`` scales those errors and rounds once in fp32; the cast
    back to the gradient's dtype rounds once. Bounds use eps, not eps / 2.
    """
    world_size, dtype = len(per_rank), per_rank[0].dtype
    values = [g.double() for g in per_rank]
    reference = sum(values) / world_size
    magnitude = sum(v.abs() for v in values) / world_size
    after = 1.0 / (world_size * before)
    eps32 = torch.finfo(torch.float32).eps
    bound = (world_size * torch.finfo(wire).eps + 2 * eps32) * magnitude \
        + world_size * subnormal_spacing(wire) * abs(after) \
        + torch.finfo(dtype).eps * reference.abs() + subnormal_spacing(dtype)
    return reference, bound


def _adasum_pair_with_bound(left, right, eps):
    """AdaSum of two ``(value, error bound)`` leaves: the float64 reference's
    value and a first-order bound on the hook's error.

    The hook combines in fp32 (``eps``) with fp64 statistics: the propagated
    input errors, the coefficients' sensitivity to them, and the rounding of
    the coefficients and of ``ca·a + cb·b``.
    """
    (a, error_a), (b, error_b) = left, right
    dot, a2, b2 = adasum_stats(a, b, [0, a.numel()])[0].tolist()
    norm_a, norm_b = math.sqrt(a2), math.sqrt(b2)
    err_a, err_b = float(error_a.norm()), float(error_b.norm())

    def sensitivity(norm2, norm, err):
        if norm2 < NORM_FLOOR:  # the coefficient is exactly 1
            return 0.0
        return (err_a * norm_b + norm_a * err_b) / (2 * norm2) + abs(dot) * err / (norm2 * norm)

    ca, cb = adasum_coefficient(dot, a2), adasum_coefficient(dot, b2)
    dca, dcb = sensitivity(a2, norm_a, err_a), sensitivity(b2, norm_b, err_b)
    error = abs(ca) * error_a + abs(cb) * error_b + dca * a.abs() + dcb * b.abs() \
        + 3 * eps * (abs(ca) * a.abs() + abs(cb) * b.abs())
    return adasum_pair(a, b), error


def _adasum_expected(per_rank, local_size):
    """AdaSum over the means of blocks of ``local_size`` consecutive ranks."""
    dtype = per_rank[0].dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    eps = torch.finfo(compute).eps
    flat = [g.double().reshape(-1) for g in per_rank]
    leaves = []
    for start in range(0, len(flat), local_size):
        block = flat[start:start + local_size]
        # the block mean is an fp32 sum of exactly scaled values (power-of-two sizes)
        leaves.append((sum(block) / local_size,
                       (local_size - 1) * eps * sum(b.abs() for b in block) / local_size))
    pair = functools.partial(_adasum_pair_with_bound, eps=eps)
    reference, error = adasum_tree(leaves, pair=pair)
    # factor 2: the error model is first-order
    bound = 2 * error + torch.finfo(dtype).eps * reference.abs() + subnormal_spacing(dtype)
    return reference.view(per_rank[0].shape), bound.view(per_rank[0].shape)


def expected(hook_name, state_kwargs, per_rank):
    """(float64 reference, elementwise bound) for one parameter's reduced gradient."""
    state_kwargs = state_kwargs or {}
    dtype, world_size = per_rank[0].dtype, len(per_rank)
    if hook_name == "adasum":
        return _adasum_expected(per_rank, state_kwargs.get("local_size", 1))
    prescale = state_kwargs.get("prescale")
    if hook_name is None:  # DDP's own: divide in the bucket's dtype, sum in it
        wire, before = dtype, 1.0 / world_size
    elif hook_name == "allreduce":
        wire = torch.float32 if dtype in SIXTEEN_BIT else dtype
        before = prescale or 1.0 / world_size
    else:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[hook_name]
        before = prescale or 1.0 / world_size
    return _mean_reference(per_rank, wire, before)


# ------------------------------------------------------------------ checks in the parent


def _assert_same_on_every_rank(results, label):
    first = results[0][label]
    for rank, result in enumerate(results[1:], start=1):
        for step, (mine, theirs) in enumerate(zip(first["steps"], result[label]["steps"])):
            for i, (a, b) in enumerate(zip(mine["grads"], theirs["grads"])):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                    f"{label}: rank {rank} differs from rank 0 on gradient {i} at step {step}"
        for i, (a, b) in enumerate(zip(first["params"], result[label]["params"])):
            assert torch.equal(a, b), f"{label}: rank {rank} differs on parameter {i}"


def _check_against_reference(results, label, hook_name, state_kwargs, baseline="ddp"):
    """Every step's gradients within the bound of the float64 reference; a
    parameter DDP leaves without a gradient (unused everywhere) is left so."""
    failures = []
    for step, record in enumerate(results[0][label]["steps"]):
        plain = results[0][baseline]["steps"][step]["grads"] if baseline in results[0] else None
        for i, grad in enumerate(record["grads"]):
            per_rank = [record["local"][r][i] for r in range(len(record["local"]))]
            if grad is None:
                if plain is not None and plain[i] is not None:
                    failures.append(f"step {step} param {i}: no gradient, DDP has one")
                continue
            if plain is not None and plain[i] is None:
                failures.append(f"step {step} param {i}: a gradient where DDP leaves none")
            reference, bound = expected(hook_name, state_kwargs, per_rank)
            assert grad.dtype == per_rank[0].dtype and grad.shape == per_rank[0].shape
            excess = (grad.double() - reference).abs() - bound
            if excess.max() > 0:
                worst = int(excess.argmax())
                failures.append(
                    f"step {step} param {i} ({grad.dtype}): |error| "
                    f"{float((grad.double() - reference).reshape(-1)[worst].abs()):.3g} > bound "
                    f"{float(bound.reshape(-1)[worst]):.3g}")
    assert not failures, f"{label}:\n" + "\n".join(failures[:10])


def _check_adasum_is_adasum_allreduce(results, label):
    for rank, result in enumerate(results):
        for step, record in enumerate(result[label]["steps"]):
            for i, (grad, direct) in enumerate(zip(record["grads"], record["adasum_allreduce"])):
                if grad is None:  # unused on every rank: DDP leaves it, AdaSum(0, 0) = 0
                    assert not direct.any()
                    continue
                assert torch.equal(grad, direct), \
                    f"{label}: rank {rank} step {step} param {i} differs from adasum_allreduce"


def _check_all(results, runs):
    for label, hook_name, state_kwargs, *own_model in runs:
        _assert_same_on_every_rank(results, label)
        # DDP's run is the baseline for which gradients exist, on the same model
        _check_against_reference(results, label, hook_name, state_kwargs,
                                 baseline=None if own_model else "ddp")
        if hook_name == "adasum":
            _check_adasum_is_adasum_allreduce(results, label)


def _results_of(results, name, members=None):
    """The member ranks' results of config ``name``; fails with a rank's traceback."""
    per_rank = [results[r][name] for r in (members or range(len(results)))]
    for rank, result in enumerate(per_rank):
        if isinstance(result, str):
            pytest.fail(f"config {name!r} raised on rank {rank}:\n{result}", pytrace=False)
    return per_rank


# ------------------------------------------------------------------ the spawns


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    return once_per_session(tmp_path_factory, "test_hooks-two-ranks",
                            lambda _: run_ranks(run_each, 2, TWO_RANK_JOBS, timeout=TIMEOUT))


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    return once_per_session(tmp_path_factory, "test_hooks-four-ranks",
                            lambda _: run_ranks(run_each, 4, FOUR_RANK_JOBS, timeout=TIMEOUT))


# ------------------------------------------------------------------ four ranks
# (first in the file: under xdist its spawn starts while another worker runs
# the two-rank one)


def test_four_ranks_mixed_dtypes_and_state_options(four_ranks):
    _check_all(_results_of(four_ranks, "mixed"), FOUR_RANK_RUNS)


# ------------------------------------------------------------------ parity


def test_ten_sgd_steps_with_each_hook_match_ddp_or_the_float64_reference(two_ranks):
    results = _results_of(two_ranks, "parity")
    _check_all(results, EVERY_HOOK)
    # allreduce_hook against DDP's own all-reduce on fp32 gradients: both
    # multiply each addend by fp32(1/world) in place and sum the same buffer
    # with gloo, so every gradient and every parameter is bitwise DDP's
    plain, hooked = results[0]["ddp"], results[0]["allreduce"]
    for step, (a, b) in enumerate(zip(plain["steps"], hooked["steps"])):
        for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga.dtype == torch.float32 and torch.equal(ga, gb), (step, i)
    for i, (pa, pb) in enumerate(zip(plain["params"], hooked["params"])):
        assert torch.equal(pa, pb), f"parameter {i} after 10 steps"


# ------------------------------------------------------------------ DDP options


def test_hooks_with_gradient_as_bucket_view(two_ranks):
    results = _results_of(two_ranks, "bucket_view")
    _check_all(results, EVERY_HOOK)
    for label, *_ in EVERY_HOOK:
        for record in results[0][label]["steps"]:
            # the gradients really are views of (one) bucket
            assert record["grad_storages"] == 1, label


def test_hooks_with_static_graph(two_ranks):
    _check_all(_results_of(two_ranks, "static_graph"), EVERY_HOOK)


def test_hooks_reduce_gradients_accumulated_under_no_sync(two_ranks):
    _check_all(_results_of(two_ranks, "no_sync"), EVERY_HOOK)


def test_hooks_with_several_buckets_rebuilt_after_the_first_iteration(two_ranks):
    results = _results_of(two_ranks, "buckets")
    _check_all(results, EVERY_HOOK)
    for label, hook_name, _ in EVERY_HOOK[1:]:
        per_step, current = [], None
        for entry in results[0][label]["log"]:
            if entry == "step":
                current = []
                per_step.append(current)
            else:
                current.append(entry)
        # the precondition of this test: one bucket on the first iteration,
        # several (a different layout) once DDP has rebuilt them
        assert len(per_step[0]) == 1 and all(len(s) > 1 for s in per_step[1:]), \
            (label, [[e["numel"] for e in s] for s in per_step])
        for entry in (e for s in per_step for e in s):
            assert entry["is_future"], label
            assert entry["shape"] == (entry["numel"],) and entry["result_dtype"] == entry["dtype"]
            assert entry["in_place"], f"{label}: the result is not the bucket's own buffer"
            if hook_name == "adasum":  # documented: runs before returning
                assert entry["done_at_return"]


def test_hooks_with_find_unused_parameters(two_ranks):
    results = _results_of(two_ranks, "find_unused")
    _check_all(results, EVERY_HOOK)
    steps = results[0]["ddp"]["steps"]
    branch = [i for i, g in enumerate(steps[0]["grads"]) if g is None]
    assert branch, "the branch must be unused at step 0"
    assert all(steps[2]["grads"][i] is not None for i in branch)


def test_hooks_on_a_mixed_fp16_bf16_fp32_model_with_both_kernel_backends(two_ranks):
    results = _results_of(two_ranks, "mixed")
    _check_all(results, MIXED_RUNS)
    dtypes = {g.dtype for g in results[0]["allreduce"]["steps"][0]["grads"]}
    assert dtypes == {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def test_hooks_on_a_three_rank_process_group(four_ranks):
    results = _results_of(four_ranks, "subgroup", SUBGROUP)
    _check_all(results, EVERY_HOOK)
    assert four_ranks[3]["subgroup"] is None


def test_adasum_hook_is_bitwise_adasum_allreduce_for_fp32_gradients(two_ranks):
    for rank, same in enumerate(_results_of(two_ranks, "fp32_adasum")):
        assert all(all(per_seed) for per_seed in same), (rank, same)


def test_adasum_hook_is_bitwise_adasum_allreduce_for_fp64_gradients(two_ranks):
    for rank, same in enumerate(_results_of(two_ranks, "fp64_adasum")):
        assert all(all(per_seed) for per_seed in same), (rank, same)


# ------------------------------------------------------------------ invalid states


def test_invalid_hook_states_fail_clearly_without_hanging(two_ranks):
    results = _results_of(two_ranks, "invalid")
    for rank, outcome in enumerate(results):
        for name, (_, (kind, word)) in BAD_STATE_KWARGS.items():
            got = outcome["construction"][name]
            assert got is not None and got[0] == kind and word in got[1], (rank, name, got)
        # a state of the wrong type: raised inside backward, on every rank
        for name, got in outcome["first_bucket"].items():
            assert got is not None and got[0] == "TypeError" and "HookState" in got[1], \
                (rank, name, got)
    assert results[0]["subgroup"] == ("ok", 1)
    assert results[1]["subgroup"][0] == "RuntimeError" and "member" in results[1]["subgroup"][1]


def test_hook_options_that_differ_by_rank_raise_on_every_rank_instead_of_hanging(two_ranks):
    results = _results_of(two_ranks, "disagreeing")
    for rank, outcome in enumerate(results):
        for name, (_, _, option) in DISAGREEING.items():
            got = outcome[name]
            assert got is not None and got[0] == "RuntimeError", (rank, name, got)
            assert f"({option})" in got[1] and "ranks disagree on hook option" in got[1], \
                (rank, name, got)
        # compared once per state, hook and dtype: at the first bucket of the
        # first step, not at the other bucket nor at later steps
        assert outcome["buckets"] >= 2, outcome
        assert outcome["checks_in_three_steps"] == 1, outcome
        # a copy (as a pickled state comes back) is compared again where it is used
        assert outcome["checks_after_a_copy"] == 2, outcome


def test_hook_state_without_a_process_group_says_how_to_start_one_on_first_use():
    state = HookState()  # lazy: frameworks build it before init_process_group
    with pytest.raises(RuntimeError, match="init_process_group"):
        state.world_size


# ------------------------------------------------------------------ what DDP checks


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hooks_carry_the_annotations_ddp_compares(name):
    signature = inspect.signature(HOOKS[name])
    assert list(signature.parameters) == ["state", "bucket"]
    assert signature.parameters["bucket"].annotation is dist.GradBucket
    assert signature.return_annotation == torch.futures.Future[torch.Tensor]


def test_the_bf16_hook_avoids_the_name_ddp_reserves_for_nccl():
    assert hooks.bf16_compress_hook is hooks.bfloat16_compress_hook
    assert hooks.bf16_compress_hook.__name__ not in ("bf16_compress_hook",
                                                      "bf16_compress_wrapper_hook")
