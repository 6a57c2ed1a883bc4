"""``DistributedOptimizer(shard=True)`` with the node-aware options, on 4 gloo
ranks as two nodes of two (``local_size=2``): the state sharded over the
world, each rank owning the chunk the levels leave it (``node_scatter``).

The deterministic sum is a fixed-order fp32 sum whatever the layout, and
AdamW's step is elementwise, so the sharded runs must give the unsharded
runs' bits (parameters and the whole optimizer state), flat or two-level,
kept or released gradients (ZeRO-1/2), gathered at once or deferred. A
compressed wire's sharded sum is the unsharded one before its gather back,
so it must give the bits of the unsharded run that gathers in fp32. The
backend's own reduce-scatter per level (``gradient_collective=
"reduce_scatter"``) sums in gloo's order: within fp32 rounding of the
deterministic run. Rank functions never assert: they return what they saw.
"""
import pytest
import torch
from torch import nn

from harness import assert_raised_before_any_collective, outcomes_and_collectives, run_ranks
from fusedreduce import DistributedOptimizer


def _model():
    torch.manual_seed(0)
    # odd sizes, so that part boundaries cut tensors; the last layer is unused
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.Linear(5, 3))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)


def _step(model, opt, rank, step):
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model[:3](x), y).backward()
    opt.step()
    opt.zero_grad()


def _make(model, options):
    gather_in_fp32 = options.pop("_gather_in_fp32", False)
    nccl_order = options.pop("_nccl_order", False)
    # SGD where the clip is checked: AdamW's step hardly depends on a
    # gradient's scale
    make = torch.optim.SGD if options.pop("_sgd", False) else torch.optim.AdamW
    opt = DistributedOptimizer(make(model.parameters(), lr=0.01 if make is torch.optim.AdamW
                                    else 0.5),
                               find_unused_parameters=True, param_pack_thd=600, **options)
    if gather_in_fp32:  # the unsharded wire sum's all-gather back in fp32
        opt.reducer._engine.collective.gather_wire = False
    if nccl_order:
        # NCCL's branch (every phase issued when the bucket starts) on gloo,
        # whose blocking waits run it just as well: no GPU here
        opt.reducer._engine.collective.blocking = False
    return opt


def _run(rank, options, steps=3):
    model = _model()
    opt = _make(model, dict(options))
    for step in range(steps):
        _step(model, opt, rank, step)
    state = opt.state_dict()  # collective: the whole state on every rank
    return {"params": [p.detach().clone() for p in model.parameters()],
            "state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                          for n, v in entry.items()} for k, entry in state["state"].items()},
            "unused": [p.grad is None for p in model[3].parameters()],
            "collective": type(opt.reducer._engine.collective).__name__,
            "parts": list(opt.layout.parts) if opt.layout is not None else None,
            "sizes": [b.size for b in opt.reducer.plan.buckets],
            "buffer bytes": opt.buffer_bytes}


def _resumed(rank, options, saved_with=None):
    """Two steps (with ``saved_with``'s options, default ``options``), a whole
    checkpoint, a fresh model and optimizer with ``options`` loaded from it,
    the third step."""
    model = _model()
    opt = _make(model, dict(saved_with or options))
    for step in range(2):
        _step(model, opt, rank, step)
    saved, weights = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    fresh = _model()
    with torch.no_grad():
        for p, w in zip(fresh.parameters(), weights):
            p.copy_(w)
    opt = _make(fresh, dict(options))
    opt.load_state_dict(saved)
    _step(fresh, opt, rank, 2)
    return [p.detach().clone() for p in fresh.parameters()]


DET = dict(deterministic=True)
INT8 = dict(wire_dtype=torch.int8, error_feedback=True)
RUNS = {
    "flat deterministic": dict(DET),
    "two-level deterministic": dict(DET, local_size=2),
    "sharded flat deterministic": dict(DET, shard=True),
    "sharded deterministic": dict(DET, local_size=2, shard=True),
    "sharded deterministic, ZeRO-2": dict(DET, local_size=2, shard=True, shard_gradients=True),
    "sharded deterministic, deferred gather": dict(DET, local_size=2, shard=True,
                                                   overlap_param_gather=True),
    "sharded local_size=2": dict(local_size=2, shard=True),
    "sharded local_size=2, ZeRO-2": dict(local_size=2, shard=True, shard_gradients=True),
    "sharded reduce-scatter": dict(local_size=2, shard=True, gradient_collective="reduce_scatter"),
    "sharded reduce-scatter, ZeRO-2": dict(local_size=2, shard=True, shard_gradients=True,
                                           gradient_collective="reduce_scatter"),
    "two-level int8, fp32 gather": dict(INT8, local_size=2, _gather_in_fp32=True),
    "sharded int8": dict(INT8, local_size=2, shard=True),
    "sharded int8, ZeRO-2": dict(INT8, local_size=2, shard=True, shard_gradients=True),
    "two-level int8, clipped, fp32 gather": dict(INT8, local_size=2, max_grad_norm=0.05,
                                                 _gather_in_fp32=True, _sgd=True),
    "sharded int8, clipped": dict(INT8, local_size=2, shard=True, max_grad_norm=0.05,
                                  _sgd=True),
    "sharded int8, SGD": dict(INT8, local_size=2, shard=True, _sgd=True),
    "sharded reduce-scatter, NCCL's order": dict(local_size=2, shard=True, _nccl_order=True,
                                                 gradient_collective="reduce_scatter"),
    "sharded int8, NCCL's order": dict(INT8, local_size=2, shard=True, _nccl_order=True),
    "two-level, NCCL's order": dict(local_size=2, _nccl_order=True),
    "two-level int8, NCCL's order": dict(INT8, local_size=2, _nccl_order=True),
    "two-level int8": dict(INT8, local_size=2),
    "sharded one node": dict(local_size=4, shard=True),
    "sharded flat": dict(shard=True),
}


def _nonfinite(rank, options):
    """A NaN in rank 1's gradients only: every rank's reducer must see it."""
    model = _model()
    opt = _make(model, dict(options))
    x, y = _batch(rank, 0)
    if rank == 1:
        x[2, 3] = float("nan")
    nn.functional.mse_loss(model[:3](x), y).backward()
    return bool(opt.reducer.found_nonfinite)


def _four_ranks(rank, world_size):
    results = {name: _run(rank, options) for name, options in RUNS.items()}
    for name in ("sharded int8", "sharded deterministic", "sharded reduce-scatter, ZeRO-2"):
        results[f"nonfinite {name}"] = _nonfinite(rank, RUNS[name])
    results["resumed deterministic"] = _resumed(rank, dict(DET, local_size=2, shard=True))
    results["resumed int8"] = _resumed(rank, dict(INT8, local_size=2, shard=True))
    # saved by the flat sharded step (part `rank`), loaded on two levels
    results["resumed on another layout"] = _resumed(rank, dict(DET, local_size=2, shard=True),
                                                    saved_with=dict(DET, shard=True))
    return results


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_ranks, 4, timeout=300)


def _assert_same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: tensor {i}"


def _assert_same_state(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        for name in a[key]:
            x, y = a[key][name], b[key][name]
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"{what}: state of parameter {key}, {name}"


def test_every_rank_holds_the_same_bits_and_unused_parameters_keep_no_gradient(four_ranks):
    for name in RUNS:
        for rank, got in enumerate(four_ranks):
            _assert_same(got[name]["params"], four_ranks[0][name]["params"], f"{name}, rank {rank}")
            assert got[name]["unused"] == [True, True], name


@pytest.mark.parametrize("sharded", ["sharded deterministic", "sharded deterministic, ZeRO-2",
                                     "sharded deterministic, deferred gather",
                                     "sharded flat deterministic",
                                     "sharded local_size=2", "sharded local_size=2, ZeRO-2"])
def test_deterministic_sharded_steps_give_the_unsharded_bits_flat_or_two_level(four_ranks,
                                                                                sharded):
    got = four_ranks[0]
    # local_size=2 is a power of two: the node's partial sums are subtrees of
    # the flat pairwise order, so flat and two-level sums are the same bits;
    # gloo's full-precision sharded default is this all-to-all sum
    for reference in ("two-level deterministic", "flat deterministic"):
        _assert_same(got[sharded]["params"], got[reference]["params"], f"{sharded} / {reference}")
        _assert_same_state(got[sharded]["state"], got[reference]["state"],
                           f"{sharded} / {reference}")
    assert got[sharded]["collective"] == "WireScatter"


@pytest.mark.parametrize("sharded", ["sharded int8", "sharded int8, ZeRO-2"])
def test_compressed_sharded_steps_give_the_unsharded_bits_gathered_in_fp32(four_ranks, sharded):
    got = four_ranks[0]
    _assert_same(got[sharded]["params"], got["two-level int8, fp32 gather"]["params"], sharded)
    _assert_same_state(got[sharded]["state"], got["two-level int8, fp32 gather"]["state"],
                       sharded)


@pytest.mark.parametrize("sharded", ["sharded reduce-scatter", "sharded reduce-scatter, ZeRO-2"])
def test_the_backends_reduce_scatter_per_level_sums_within_rounding(four_ranks, sharded):
    got = four_ranks[0]
    assert got[sharded]["collective"] == "TwoLevelScatter"
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(got[sharded]["params"], got["flat deterministic"]["params"]):
        # three AdamW steps on means summed in another order: the update
        # divides by sqrt(v), so a few ulps of the gradient move the
        # parameters by a few ulps of lr (0.01) per step
        assert torch.allclose(a, b, rtol=0, atol=64 * eps * (1 + b.abs().max().item())), sharded


@pytest.mark.parametrize("nccl, gloo", [
    ("sharded int8, NCCL's order", "sharded int8"),
    ("two-level int8, NCCL's order", "two-level int8"),
    ("sharded reduce-scatter, NCCL's order", "sharded reduce-scatter"),
    ("two-level, NCCL's order", "sharded reduce-scatter")])
def test_the_nccl_branch_gives_the_gloo_branchs_results(four_ranks, nccl, gloo):
    got = four_ranks[0]
    if "int8" in nccl:  # the same all-to-all sum, only issued earlier: the same bits
        _assert_same(got[nccl]["params"], got[gloo]["params"], nccl)
        return
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(got[nccl]["params"], got[gloo]["params"]):
        # reduce-scatters where gloo's branch all-reduces: gloo's order of
        # the sum may differ, within rounding as above
        assert torch.allclose(a, b, rtol=0, atol=64 * eps * (1 + b.abs().max().item())), nccl


def test_the_sharded_clip_takes_the_whole_gradients_norm(four_ranks):
    got = four_ranks[0]
    sharded, unsharded = got["sharded int8, clipped"], got["two-level int8, clipped, fp32 gather"]
    moved = [(a - b).abs().max().item()
             for a, b in zip(sharded["params"], got["sharded int8, SGD"]["params"])]
    assert max(moved) > 1e-4  # the clip changed the run
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(sharded["params"], unsharded["params"]):
        # the same gradients; the norm is summed in another order (each
        # rank's owned squares, then over the ranks), so the clip
        # coefficient may differ by a few ulps: each of the three SGD
        # steps moves a parameter by at most lr * 0.05 (the clipped norm),
        # off by a few ulps of that, and rounds to the parameter's ulp
        assert torch.allclose(a, b, rtol=0, atol=8 * eps * (1 + b.abs().max().item()))


def test_a_nonfinite_gradient_on_one_rank_is_seen_on_every_rank(four_ranks):
    for rank, got in enumerate(four_ranks):
        for name in ("sharded int8", "sharded deterministic", "sharded reduce-scatter, ZeRO-2"):
            assert got[f"nonfinite {name}"], (name, rank)


def test_each_rank_owns_the_chunk_its_levels_leave_it(four_ranks):
    """Rank (node n, local rank j) owns part j * nodes + n of each bucket:
    0, 2, 1, 3 for ranks 0-3; every element of a bucket has one owner."""
    for name in ("sharded deterministic", "sharded int8", "sharded reduce-scatter"):
        for rank, got in enumerate(four_ranks):
            node, local = divmod(rank, 2)
            part = local * 2 + node
            expected = [(part * size // 4, (part + 1) * size // 4)
                        for size in got[name]["sizes"]]
            assert got[name]["parts"] == expected, (name, rank)
    # the flat layouts keep part `rank`
    for rank, got in enumerate(four_ranks):
        assert got["sharded flat deterministic"]["parts"] == \
            [(rank * s // 4, (rank + 1) * s // 4) for s in got["sharded flat deterministic"]["sizes"]]


def test_one_node_falls_back_to_the_flat_sharded_step(four_ranks):
    got = four_ranks[0]
    assert got["sharded one node"]["collective"] == got["sharded flat"]["collective"]
    _assert_same(got["sharded one node"]["params"], got["sharded flat"]["params"], "one node")


def test_a_whole_checkpoint_resumes_the_run_bitwise(four_ranks):
    got = four_ranks[0]
    _assert_same(got["resumed deterministic"], got["sharded deterministic"]["params"],
                 "deterministic")
    _assert_same(got["resumed on another layout"], got["sharded deterministic"]["params"],
                 "another layout")
    # error feedback's residual is not part of the optimizer's state: the
    # resumed int8 run restarts it at zero, so only the deterministic one is
    # bitwise; the int8 one stays within the format's error of it
    for a, b in zip(got["resumed int8"], got["sharded int8"]["params"]):
        assert torch.allclose(a, b, rtol=0, atol=0.01), "int8"


def test_buffer_bytes_count_the_codes_and_the_residuals(four_ranks):
    got = four_ranks[0]["sharded int8"]
    elements = sum(got["sizes"])
    # the fp32 buffers, the int8 codes of the node's sum (at least the
    # bucket's worth) and error feedback's fp32 residual of the node's half
    assert got["buffer bytes"] >= 4 * elements + elements + 4 * elements // 2
    assert four_ranks[0]["sharded flat deterministic"]["buffer bytes"] >= 4 * elements


# ---------------------------------------------------------------- bad inputs
def _bad_arguments(rank, world_size):
    def sgd():
        return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)
    return outcomes_and_collectives({
        "all_reduce with local_size": lambda: DistributedOptimizer(
            sgd(), local_size=2, shard=True, gradient_collective="all_reduce"),
        "exchange with wire": lambda: DistributedOptimizer(
            sgd(), wire_dtype=torch.int8, shard=True, gradient_collective="exchange"),
        "reduce_scatter with deterministic": lambda: DistributedOptimizer(
            sgd(), deterministic=True, shard=True, gradient_collective="reduce_scatter"),
        "broadcast over nodes": lambda: DistributedOptimizer(
            sgd(), local_size=2, shard=True, parameter_gather="broadcast"),
        "broadcast_direct over nodes": lambda: DistributedOptimizer(
            sgd(), local_size=2, shard=True, parameter_gather="broadcast_direct"),
    })


def test_collective_choices_the_node_aware_sharded_step_cannot_take_are_refused():
    assert_raised_before_any_collective(run_ranks(_bad_arguments, 4), {
        "all_reduce with local_size": ("ValueError", "does not combine with local_size > 1"),
        "exchange with wire": ("ValueError", "does not combine with local_size > 1"),
        "reduce_scatter with deterministic": ("ValueError", "their sum is the all-to-all one"),
        "broadcast over nodes": ("ValueError", "gathered back over the nodes' levels"),
        "broadcast_direct over nodes": ("ValueError", "gathered back over the nodes' levels"),
    })
