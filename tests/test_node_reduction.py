"""Node-aware reduction (``local_size``) on gloo ranks: the reducer and the
optimizer summing inside the node, this rank's part across nodes, the parts
gathered inside the node (``node_collectives.TwoLevel``).

Four ranks as two nodes of two (``local_size=2``), and two ranks as one node
(``local_size=2``: the flat all-reduce) or as two (``local_size=1``). Values
are checked against the float64 sum of every rank's inputs
(``tests/reference.py``'s rounding); the default must give the flat
all-reduce's bits, computed here by hand with one ``dist.all_reduce`` of the
same flat buffer. Rank functions never assert: they return what they saw.
"""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import (assert_raised_before_any_collective, outcomes, outcomes_and_collectives,
                     run_ranks)
from fusedreduce import DistributedGradReducer, DistributedOptimizer
from fusedreduce.node_collectives import check_node_options, node_levels
from fusedreduce.node_groups import check_local_size, node_groups
from fusedreduce.sharded import start_all_gather, start_reduce_scatter

SHAPES = [(33, 7), (5,), (129,), (2, 3, 4)]


def _grads(rank, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _params(dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype, requires_grad=True) for s in SHAPES]


def _reduce(rank, world_size, local_size, cap_mb=25.0, dtype=torch.float32, mean=True,
            group=None):
    reducer = DistributedGradReducer(_params(dtype), mean=mean, group=group,
                                     bucket_cap_mb=cap_mb, local_size=local_size)
    out = reducer(_grads(rank, dtype))
    return [g.clone() for g in out], type(reducer._engine.collective).__name__


def _hand_flat_mean(rank, world_size):
    """Today's flat path by hand: the gradients in one zero-padded fp32
    buffer at the plan's offsets, one all_reduce, times 1/world_size."""
    reducer = DistributedGradReducer(_params(), local_size=1)
    bucket = reducer.plan.buckets[0]
    flat = torch.zeros(bucket.size)
    grads = _grads(rank)
    for slot, offset in zip(bucket.tensor_indices, bucket.offsets):
        g = grads[len(SHAPES) - 1 - slot]  # the plan holds the reverse order
        flat[offset:offset + g.numel()] = g.reshape(-1)
    dist.all_reduce(flat)
    flat *= 1.0 / world_size
    return [flat[o:o + n].clone() for o, n in zip(bucket.offsets, bucket.numels)][::-1]


def _four_ranks(rank, world_size):
    results = {
        "two-level": _reduce(rank, world_size, 2),
        "two-level, one bucket per tensor": _reduce(rank, world_size, 2, cap_mb=1 / 2 ** 20),
        "two-level bf16 sum": _reduce(rank, world_size, 2, dtype=torch.bfloat16, mean=False),
        "flat": _reduce(rank, world_size, 1),
        "one node": _reduce(rank, world_size, 4),
        "hand flat": _hand_flat_mean(rank, world_size),
        "sub-group": _reduce(rank, world_size, 2, group=dist.new_group([0, 1, 2, 3])),
        "groups made once": node_groups(None, 2) is node_groups(None, 2),
    }
    groups = node_groups(None, 2)
    results["groups"] = (dist.get_process_group_ranks(groups.intra),
                         dist.get_process_group_ranks(groups.cross))
    return results


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_ranks, 4)


def _expected_sum(world_size, dtype=torch.float32):
    per_rank = [_grads(r, dtype) for r in range(world_size)]
    return [sum(g[i].double() for g in per_rank) for i in range(len(SHAPES))], per_rank


def _assert_close_to_sum(got, world_size, divisor, dtype=torch.float32, terms=None):
    expected, per_rank = _expected_sum(world_size, dtype)
    eps = torch.finfo(torch.float32).eps
    for i, (g, e) in enumerate(zip(got, expected)):
        # an fp32 sum of world_size terms in any order errs by at most
        # (world_size - 1) eps times the sum of magnitudes; the result is then
        # rounded once to the gradient's dtype
        magnitude = sum(p[i].double().abs() for p in per_rank)
        bound = (world_size - 1) * eps * magnitude / divisor \
            + torch.finfo(dtype).eps * (e / divisor).abs() + torch.finfo(dtype).tiny
        assert torch.all((g.double() - e / divisor).abs() <= bound), f"gradient {i}"


def test_two_level_mean_is_the_sum_over_every_rank_within_fp32_rounding(four_ranks):
    for results in four_ranks:
        got, kind = results["two-level"]
        assert kind == "TwoLevel"
        _assert_close_to_sum(got, 4, 4)


def test_two_level_bf16_sum_reduces_in_fp32_and_rounds_once(four_ranks):
    for results in four_ranks:
        got, _ = results["two-level bf16 sum"]
        _assert_close_to_sum(got, 4, 1, dtype=torch.bfloat16)


def test_two_level_results_are_bitwise_identical_on_every_rank_and_bucket_cap(four_ranks):
    first = four_ranks[0]["two-level"][0]
    for results in four_ranks:
        for name in ("two-level", "two-level, one bucket per tensor", "sub-group"):
            got = results[name][0]
            assert all(torch.equal(a, b) for a, b in zip(got, first)), name


def test_default_local_size_keeps_the_flat_all_reduce_bits(four_ranks):
    for results in four_ranks:
        got, kind = results["flat"]
        assert kind == "AllReduce"
        assert all(torch.equal(a.reshape(-1), b) for a, b in zip(got, results["hand flat"]))
        # one node holding the whole group is the flat all-reduce too
        one_node, kind = results["one node"]
        assert kind == "AllReduce"
        assert all(torch.equal(a, b) for a, b in zip(got, one_node))


def test_node_groups_are_the_contiguous_nodes_and_made_once(four_ranks):
    for rank, results in enumerate(four_ranks):
        assert results["groups made once"]
        node, local = divmod(rank, 2)
        assert results["groups"] == ([2 * node, 2 * node + 1], [local, local + 2])


def _two_ranks(rank, world_size):
    return {"flat": _reduce(rank, world_size, 1), "one node": _reduce(rank, world_size, 2)}


def test_two_ranks_on_one_node_reduce_flat():
    for results in run_ranks(_two_ranks, 2):
        for name in ("flat", "one node"):
            got, kind = results[name]
            assert kind == "AllReduce"
            _assert_close_to_sum(got, 2, 2)
        assert all(torch.equal(a, b) for a, b in zip(results["flat"][0], results["one node"][0]))


# --------------------------------------------------------------- the optimizer
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 2))


def train(rank, world_size, options):
    """Three SGD steps of ``DistributedOptimizer(**options)`` (the wire
    tests' too): the parameters, whether the unused layer's gradients are
    None, the reducer's collective's name."""
    model = _model()
    unused = model[3]  # never in the graph: its .grad must stay None
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        nn.functional.mse_loss(model[:3](x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "unused grads": [p.grad is None for p in unused.parameters()],
            "collective": type(opt.reducer._engine.collective).__name__}


def _train(rank, world_size, local_size):
    results = train(rank, world_size, dict(local_size=local_size,
                                           find_unused_parameters=True))
    # check_finite: a NaN on rank 1 only is seen on every rank
    checker = DistributedGradReducer(_params(), check_finite=True, local_size=local_size)
    grads = _grads(rank)
    if rank == 1:
        grads[2][5] = float("nan")
    checker(grads)
    results["found nonfinite"] = bool(checker.found_nonfinite)
    return results


def test_optimizer_with_local_size_trains_as_the_flat_one_within_rounding():
    two_level = run_ranks(_train, 4, 2)
    flat = run_ranks(_train, 4, 1)
    eps = torch.finfo(torch.float32).eps
    for got in two_level:
        assert got["collective"] == "TwoLevel"
        assert got["unused grads"] == [True, True]
        assert got["found nonfinite"]
        for a, b, f in zip(got["params"], two_level[0]["params"], flat[0]["params"]):
            assert torch.equal(a, b)  # every rank the same bits
            # three SGD steps on means whose summation order differs: a few
            # ulps of the parameters' magnitude apart
            assert torch.allclose(a, f, rtol=0, atol=64 * eps * (1 + f.abs().max().item()))


# ---------------------------------------------------------------- bad inputs
def _bad_arguments(rank, world_size):
    params = _params()

    def sgd():
        return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    return outcomes_and_collectives({
        "local_size not dividing": lambda: DistributedGradReducer(params, local_size=3),
        "local_size zero": lambda: DistributedGradReducer(params, local_size=0),
        "local_size a bool": lambda: DistributedGradReducer(params, local_size=True),
        "deterministic not a bool": lambda: DistributedGradReducer(params,
                                                                   deterministic="yes"),
        "optimizer local_size not dividing": lambda: DistributedOptimizer(sgd(), local_size=3),
        "wire fp16": lambda: DistributedGradReducer(params, wire_dtype=torch.float16),
        "wire a string": lambda: DistributedGradReducer(params, wire_dtype="int8"),
        "feedback without compression": lambda: DistributedGradReducer(
            params, deterministic=True, error_feedback=True),
        "feedback not a bool": lambda: DistributedGradReducer(params, error_feedback=1),
        "wire with bf16 reduce_dtype": lambda: DistributedGradReducer(
            params, wire_dtype=torch.int8, reduce_dtype=torch.bfloat16),
        "deterministic fp64": lambda: DistributedGradReducer(_params(torch.float64),
                                                             deterministic=True),
        "adasum with deterministic": lambda: DistributedOptimizer(
            sgd(), reduce_method="adasum", deterministic=True),
        "node_levels options a dict": lambda: node_levels(None, world_size, {"local_size": 2}),
        "node_levels another world_size": lambda: node_levels(None, 2, check_node_options(
            1, None, True, False, world_size=world_size, reduce_dtype=torch.float32)),
        # gloo's own checks name neither argument, once the collective is issued
        "reduce-scatter part None": lambda: start_reduce_scatter(None, torch.zeros(8), None),
        "reduce-scatter buffer of another size": lambda: start_reduce_scatter(
            torch.zeros(2), torch.zeros(9), None),
        "reduce-scatter buffer of another dtype": lambda: start_reduce_scatter(
            torch.zeros(2), torch.zeros(8, dtype=torch.float64), None),
        "all-gather part None": lambda: start_all_gather(torch.zeros(8), None, None),
        "all-gather buffer of another size": lambda: start_all_gather(
            torch.zeros(9), torch.zeros(2), None),
    })


@pytest.mark.parametrize("local_size", [0, -2, 3, True, 2.0, "2", None])
def test_one_local_size_check_names_the_group_size_and_torchrun(local_size):
    # the node-aware sums and AdaSum share this check: one message, one kind
    with pytest.raises(ValueError) as raised:
        check_local_size(local_size, 4)
    message = str(raised.value)
    assert message.startswith("local_size must be a positive int dividing the group's size (4)")
    assert "LOCAL_WORLD_SIZE" in message and message.endswith(f"got {local_size!r}")


@pytest.mark.parametrize("local_size", [1, 2, 4])
def test_a_local_size_dividing_the_group_is_returned(local_size):
    assert check_local_size(local_size, 4) == local_size


def test_bad_node_and_wire_options_are_refused_before_any_collective():
    assert_raised_before_any_collective(run_ranks(_bad_arguments, 4), {
        "local_size not dividing": ("ValueError", "local_size must be a positive int dividing"),
        "local_size zero": ("ValueError", "local_size must be a positive int dividing"),
        "local_size a bool": ("ValueError", "local_size must be a positive int dividing"),
        "deterministic not a bool": ("TypeError", "deterministic must be True or False"),
        "optimizer local_size not dividing": ("ValueError", "local_size must be a positive int"),
        "wire fp16": ("ValueError", "wire_dtype must be one of"),
        "wire a string": ("TypeError", "wire_dtype must be None or a torch.dtype"),
        "feedback without compression": ("ValueError", "error_feedback=True keeps"),
        "feedback not a bool": ("TypeError", "error_feedback must be True or False"),
        "wire with bf16 reduce_dtype": ("ValueError", "reduce_dtype must be torch.float32"),
        "deterministic fp64": ("ValueError", "wire_dtype and deterministic sum float32"),
        "adasum with deterministic": ("ValueError", "do not combine with reduce_method"),
        "node_levels options a dict": ("TypeError", "options must be a NodeOptions"),
        "node_levels another world_size": ("ValueError", "world_size must be the group's size"),
        "reduce-scatter part None": ("TypeError", "part must be a tensor"),
        "reduce-scatter buffer of another size": ("ValueError", "buffer must hold the group's"),
        "reduce-scatter buffer of another dtype": ("ValueError", "buffer must hold the group's"),
        "all-gather part None": ("TypeError", "part must be a tensor"),
        "all-gather buffer of another size": ("ValueError", "buffer must hold the group's"),
    })


def _differing_local_size(rank, world_size):
    return outcomes({"differing": lambda: DistributedGradReducer(
        _params(), local_size=2 if rank else 4)})


def test_ranks_passing_different_local_sizes_raise_on_every_rank_instead_of_waiting():
    for seen in run_ranks(_differing_local_size, 4):
        kind, message = seen["differing"]
        assert kind == "RuntimeError" and "local_size" in message


def _groups_after_destroy(rank, world_size):
    """The node groups once the reducers are gone and the world destroyed
    (a kept gloo group's threads could abort the interpreter's exit); a
    world of one is made again for the harness to destroy."""
    reducer = DistributedGradReducer(_params(), local_size=2, deterministic=True)
    groups = node_groups(None, 2)
    watched = [weakref.ref(groups.intra), weakref.ref(groups.cross),
               weakref.ref(dist.group.WORLD)]
    del reducer, groups
    dist.destroy_process_group()
    gc.collect()
    alive = [ref() is not None for ref in watched]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return alive


def test_node_groups_are_not_kept_past_destroy_process_group():
    assert run_ranks(_groups_after_destroy, 4) == [[False, False, False]] * 4


# ------------------------------------------------------------ allreduce_hook
def _hooked(rank, world_size):
    """One DDP backward per HookState, against the reducer's deterministic
    mean of the same local gradients (a power-of-two world: the hook's
    prescale 1/4 before the sum and the reducer's after it are exact)."""
    from torch.nn.parallel import DistributedDataParallel
    from fusedreduce.hooks import HookState, allreduce_hook

    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    local = _model()
    nn.functional.mse_loss(local[:3](x), y).backward()
    grads = [p.grad for p in local[:3].parameters()]
    expected = DistributedGradReducer(list(local[:3].parameters()), deterministic=True)(grads)
    results = {"local": [g.clone() for g in grads], "reducer": [g.clone() for g in expected]}
    for name, options in {"two-level": dict(local_size=2),
                          "deterministic two-level": dict(local_size=2, deterministic=True),
                          "int8 two-level": dict(local_size=2, wire_dtype=torch.int8)}.items():
        model = DistributedDataParallel(_model()[:3], bucket_cap_mb=1e-4)
        model.register_comm_hook(HookState(**options), allreduce_hook)
        for _ in range(2):  # DDP rebuilds its buckets after the first iteration
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        results[name] = [p.grad.clone() for p in model.parameters()]
    return results


def test_allreduce_hook_takes_the_node_options():
    results = run_ranks(_hooked, 4)
    mean = [sum(r["local"][i].double() for r in results) / 4
            for i in range(len(results[0]["local"]))]
    for got in results:
        for name in ("two-level", "deterministic two-level", "int8 two-level"):
            assert all(torch.equal(a, b) for a, b in zip(got[name], results[0][name])), name
        # the deterministic sum is elementwise: DDP's buckets give the reducer's bits
        assert all(torch.equal(a, b) for a, b in zip(got["deterministic two-level"],
                                                     got["reducer"]))
        eps = torch.finfo(torch.float32).eps
        largest = sum(max(float(g.abs().max()) for g in r["local"]) for r in results)
        for a, m in zip(got["two-level"], mean):
            assert (a.double() - m).abs().max() <= 3 * eps * largest / 4 + eps * m.abs().max()
        # int8: one code error per node's partial sum and one for the sum sent back
        for a, m in zip(got["int8 two-level"], mean):
            assert (a.double() - m).abs().max() <= (2 * largest / 254 + 6 * eps * largest) / 4
