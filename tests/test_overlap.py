"""DistributedGradReducer.register_hooks on local gloo ranks: the overlap engine.

These check what ``fusedreduce/overlap.py`` adds to the reducer: buckets
start their all-reduce during backward, in bucket order; a parameter that
gets no gradient in an iteration contributes zeros and still receives the
others' mean; ``no_sync`` and ``passes_per_sync`` accumulate locally, then
reduce the accumulated sum; and a backward that raised after some buckets
started does not stop the next one from reducing. The parent works out the
expected float64 gradients itself, from each rank's model and data.

The rank functions return what they saw and never assert, since a rank that
raised would leave the others blocked in a collective; they are module-level
because the spawned ranks import this module to unpickle them.
"""
import torch
from torch import nn

from harness import (ONE_BYTE_MB, TIMEOUT, FailingBackward, outcomes, record_collectives,
                     run_ranks)
from fusedreduce import DistributedGradReducer



def _mlp():
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def _mlp_batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randn(6, 8, generator=gen, dtype=torch.float64),
            torch.randn(6, 4, generator=gen, dtype=torch.float64))


def _overlap(rank, world_size, cap):
    model = _mlp()
    DistributedGradReducer(model.parameters(), bucket_cap_mb=cap).register_hooks()
    events = []
    record_collectives(events)
    for step in range(2):  # the first iteration also verifies the plan across ranks
        events.clear()
        model.zero_grad()
        x, y = _mlp_batch(rank, step)
        hidden = model[0](x)
        hidden.register_hook(lambda grad: events.append("backward reached the first layer"))
        ((model[1:](hidden) - y) ** 2).sum().backward()
        events.append("backward returned")
    return events, [p.grad for p in model.parameters()]


def _local_mlp_grads(rank, steps):
    model = _mlp()
    for s in steps:
        x, y = _mlp_batch(rank, s)
        ((model(x) - y) ** 2).sum().backward()
    return [p.grad for p in model.parameters()]


def test_buckets_start_their_all_reduce_during_backward():
    events, grads = zip(*run_ranks(_overlap, 2, ONE_BYTE_MB, timeout=TIMEOUT))
    for rank_events in events:
        first_layer = rank_events.index("backward reached the first layer")
        # one bucket per tensor, last layer first: its buckets go out before
        # backward has even reached the first layer
        assert rank_events[:first_layer].count("all_reduce") >= 2, rank_events
        assert rank_events.count("all_reduce") == 6, rank_events
        assert rank_events[-1] == "backward returned"
    expected = [(a + b) / 2 for a, b in zip(_local_mlp_grads(0, steps=(1,)),
                                            _local_mlp_grads(1, steps=(1,)))]
    for rank_grads in grads:
        for got, want in zip(rank_grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def _four_layers_and_input(rank):
    """Four linear layers; layer 1 is used only on rank 0, layer 2 on no rank."""
    gen = torch.Generator().manual_seed(11)
    layers = nn.ModuleList(nn.Linear(4, 3).double() for _ in range(4))
    with torch.no_grad():
        for p in layers.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    used = [0, 1, 3] if rank == 0 else [0, 3]
    return layers, lambda: sum((layers[k](x) ** 2).sum() for k in used)


def _partly_used(rank, world_size):
    """Per bucket cap, two iterations' gradients."""
    grads = {}
    for cap in (ONE_BYTE_MB, 25.0):  # a late bucket in the middle of the order; one bucket
        layers, loss = _four_layers_and_input(rank)
        DistributedGradReducer(layers.parameters(), bucket_cap_mb=cap).register_hooks()
        for step in range(2):
            layers.zero_grad()
            loss().backward()
            grads[cap, step] = [p.grad for p in layers.parameters()]
    return grads


def _partly_used_local(rank):
    layers, loss = _four_layers_and_input(rank)
    loss().backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in layers.parameters()]


def test_a_parameter_without_gradient_contributes_zeros_and_receives_the_others_mean():
    results = run_ranks(_partly_used, 2, timeout=TIMEOUT)
    expected = [(a + b) / 2 for a, b in zip(_partly_used_local(0), _partly_used_local(1))]
    for rank, seen in enumerate(results):
        for key, grads in seen.items():
            assert all(g is not None for g in grads), f"rank {rank}, cap and step {key}"
            for i, (got, want) in enumerate(zip(grads, expected)):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                           msg=f"rank {rank}, cap and step {key}, "
                                               f"parameters[{i}]")
            # layer 2 is used by no rank: zeros, not None
            assert torch.equal(grads[4], torch.zeros(3, 4, dtype=torch.float64))
            assert torch.equal(grads[5], torch.zeros(3, dtype=torch.float64))
    for key in results[0]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][key], results[1][key]))


def _accumulate(rank, world_size):
    events = []
    record_collectives(events)
    seen = {}
    # no_sync(): two local passes, then one that reduces the accumulated sum
    model = _mlp()
    reducer = DistributedGradReducer(model.parameters()).register_hooks()
    for step in range(3):
        x, y = _mlp_batch(rank, step)
        events.clear()
        if step < 2:
            with reducer.no_sync():
                ((model(x) - y) ** 2).sum().backward()
        else:
            ((model(x) - y) ** 2).sum().backward()
        seen[f"no_sync pass {step}"] = (len(events), reducer.reduced,
                                        [p.grad.clone() for p in model.parameters()])
    # passes_per_sync=3, over two rounds: the count restarts after each reduction
    model = _mlp()
    reducer = DistributedGradReducer(model.parameters()).register_hooks(passes_per_sync=3)
    for round_ in range(2):
        model.zero_grad()
        for step in range(3):
            x, y = _mlp_batch(rank, 3 * round_ + step)
            events.clear()
            ((model(x) - y) ** 2).sum().backward()
            seen[f"round {round_} pass {step}"] = (len(events), reducer.reduced,
                                                  [p.grad.clone() for p in model.parameters()])
    return seen


def test_no_sync_and_passes_per_sync_accumulate_locally_then_reduce_the_sum():
    results = run_ranks(_accumulate, 2, timeout=TIMEOUT)
    mean = lambda grads: [(a + b) / 2 for a, b in zip(*grads)]  # noqa: E731
    checks = {"no_sync pass": (0, range(3)), "round 0 pass": (0, range(3)),
              "round 1 pass": (3, range(3, 6))}
    for prefix, (first, steps) in checks.items():
        for k in range(3):
            name = f"{prefix} {k}"
            local = [_local_mlp_grads(r, steps=steps[:k + 1]) for r in range(2)]
            for rank, seen in enumerate(results):
                communicated, reduced, grads = seen[name]
                if k < 2:
                    assert communicated == 0 and not reduced, f"rank {rank}, {name}"
                    want = local[rank]
                else:
                    assert communicated >= 1 and reduced, f"rank {rank}, {name}"
                    want = mean(local)
                for got, w in zip(grads, want):
                    torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12,
                                               msg=f"rank {rank}, {name}")


def _after_a_failed_backward(rank, world_size):
    first, last = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
    with torch.no_grad():
        for p in list(first.parameters()) + list(last.parameters()):
            p.fill_(0.5)
    params = list(first.parameters()) + list(last.parameters())
    reducer = DistributedGradReducer(params, bucket_cap_mb=ONE_BYTE_MB).register_hooks()
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
    # the last layer's hooks fire (its buckets start), then backward raises
    failed = outcomes({"failing": lambda: last(FailingBackward.apply(first(x))).sum().backward()})
    first.zero_grad()
    last.zero_grad()
    last(first(x)).sum().backward()
    return failed["failing"], reducer.reduced, [p.grad for p in params]


def _local_two_layer_grads(rank):
    first, last = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
    with torch.no_grad():
        for p in list(first.parameters()) + list(last.parameters()):
            p.fill_(0.5)
    last(first(torch.full((2, 3), float(rank + 1), dtype=torch.float64))).sum().backward()
    return [p.grad for p in list(first.parameters()) + list(last.parameters())]


def test_a_backward_that_raised_does_not_stop_the_next_one_from_reducing():
    results = run_ranks(_after_a_failed_backward, 2, timeout=TIMEOUT)
    expected = [(a + b) / 2 for a, b in zip(_local_two_layer_grads(0), _local_two_layer_grads(1))]
    for rank, (failed, reduced, grads) in enumerate(results):
        assert failed is not None and "a backward error" in failed[1]
        assert reduced, f"rank {rank}: the gradients were not reduced"
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
