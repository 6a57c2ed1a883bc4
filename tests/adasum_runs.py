"""What the AdaSum collective tests run on each rank (test_adasum.py judges it).

The rank functions are pickled by reference into spawned rank processes,
which import this module; ``on_rank`` computes everything the tests check for
one world size in one start of the ranks. Gradients of different ranks are
correlated and of different sizes, so the AdaSum coefficients are far from 1
and a wrong pairing of the tree is far outside the tests' tolerances.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import AdaSumByDeltaWeight, adasum_allreduce, adasum_allreduce_flat
from fusedreduce.kernels import ADASUM_CHUNK, packed_boundaries
from harness import ONE_BYTE_MB

SHAPES = [(3, 5), (0,), (1,), (257,), (4, 4, 3), (1001,), (7,), (2,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float32,
          torch.float64, torch.bfloat16, torch.float16]
STEPS = 10


def local_sizes(world_size):
    return [1, 2] if world_size % 2 == 0 else [1]


# ---------------------------------------------------------------- what the ranks hold

def gradients(rank):
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


def parallel_multiple(rank):
    """c_r with a power-of-two tree of exact dyadic block means (1, 3 -> 2; 2, 6 -> 4;
    2, 4 -> 3 ...), so every coefficient and product of AdaSum is exact."""
    return (1 if rank % 2 == 0 else 3) * 2 ** (rank // 2)


def parallel_gradients(rank):
    direction = torch.randint(-8, 9, (5, 7), generator=torch.Generator().manual_seed(3))
    return [(parallel_multiple(rank) * direction).to(dtype) for dtype in
            (torch.float16, torch.bfloat16, torch.float32, torch.float64)]


def horovod_stability(rank, world_size, order):
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


def large_gradients(rank):
    shared = torch.Generator().manual_seed(7)
    own = torch.Generator().manual_seed(2000 + rank)
    scale = 1.0 + 0.5 * rank
    return [(scale * (torch.randn(shape, generator=shared, dtype=torch.float64)
                      + 0.7 * torch.randn(shape, generator=own, dtype=torch.float64))).to(dtype)
            for shape, dtype in zip(LARGE_SHAPES, LARGE_DTYPES)]


def mlp():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def batch(rank, step):
    gen = torch.Generator().manual_seed(50 + 100 * rank + step)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_with_delta_weight(rank, local_size):
    model = mlp()
    optimizer = AdaSumByDeltaWeight(sgd(model), local_size=local_size)
    for step in range(STEPS):
        x, y = batch(rank, step)
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
    grads = gradients(rank)
    calls = {
        "one more tensor on rank 0": lambda: adasum_allreduce(
            grads + [torch.ones(3)] if rank == 0 else grads),
        "another shape on the last rank": lambda: adasum_allreduce(
            grads[:-1] + [torch.ones(3 if rank == world_size - 1 else 2)]),
        "another dtype on rank 0": lambda: adasum_allreduce(
            [torch.ones(4, dtype=torch.float16 if rank == 0 else torch.float32)]),
        "sparse": lambda: adasum_allreduce([torch.ones(3), torch.ones(4).to_sparse()]),
        # a tensor is iterable (over its rows): refused, not taken as a list
        "a single tensor": lambda: adasum_allreduce(torch.ones(4, 3)),
        "integer": lambda: adasum_allreduce([torch.ones(3), torch.arange(4)]),
        "local_size 0": lambda: adasum_allreduce(grads, local_size=0),
        "local_size True": lambda: adasum_allreduce(grads, local_size=True),
        "local_size not dividing": lambda: adasum_allreduce(
            grads, local_size=2 if world_size % 2 else 3),
    }
    if world_size == 2:  # an optimizer costs seconds to build the first time: once is enough
        calls["delta weight local_size not dividing"] = lambda: AdaSumByDeltaWeight(
            sgd(mlp()), local_size=3)
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


def _through_host_everywhere(grads):
    """``adasum_allreduce(grads)`` with every point-to-point message of the tree
    staged through host memory (the path gloo takes for CUDA tensors), and how
    many messages took it."""
    from fusedreduce import adasum as adasum_module
    saved, staged = adasum_module._through_host, []

    def always(tensor, group):
        staged.append(tensor.numel())
        return True

    adasum_module._through_host = always
    try:
        return adasum_allreduce(grads), len(staged)
    finally:
        adasum_module._through_host = saved


def on_rank(rank, world_size):
    """Everything the tests judge for one world size, computed in one start of the ranks."""
    grads = gradients(rank)
    before = [g.clone() for g in grads]
    results = {"adasum": {}}
    for local_size in local_sizes(world_size):
        for cap in (25.0, ONE_BYTE_MB):
            results["adasum"][local_size, cap] = adasum_allreduce(
                grads, local_size=local_size, bucket_cap_mb=cap)
    results["inputs_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, grads))
    results["large"] = {(local_size, cap): adasum_allreduce(large_gradients(rank),
                                                            local_size=local_size,
                                                            bucket_cap_mb=cap)
                        for local_size in local_sizes(world_size) for cap in LARGE_CAPS}
    if world_size & (world_size - 1) == 0:
        results["parallel"] = {k: adasum_allreduce(parallel_gradients(rank), local_size=k)
                               for k in local_sizes(world_size)}
    if world_size in (2, 4):
        results["horovod"] = {
            order: adasum_allreduce([horovod_stability(rank, world_size, order)])[0]
            for order in ("tiny", "rising", "extremes_paired")}
        results["delta_weight"] = {k: _train_with_delta_weight(rank, k)
                                   for k in local_sizes(world_size)}
    if world_size == 3:
        subgroup = dist.new_group([1, 2])  # every rank creates it; only members reduce
        if rank in (1, 2):
            results["subgroup"] = {k: adasum_allreduce(grads, subgroup, local_size=k)
                                   for k in (1, 2)}
    if world_size in (2, 4):
        results["exchanges_only"] = _exchanges_only(rank)
    if world_size in (3, 4):  # send/recv outside the power of two, and the halving's exchanges
        results["through_host"] = _through_host_everywhere(grads)
    if world_size in (2, 3):
        results["errors"] = _bad_calls(rank, world_size)
        # the ranks are still in step after every refusal
        results["after_errors"] = adasum_allreduce(grads)
    return results
