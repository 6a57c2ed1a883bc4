"""DistributedOptimizer(reduce_method="adasum"): Horovod's op=Adasum.

During backward each bucket's gradients combine along AdaSum's tree; the
documented semantics are those of ``adasum_allreduce`` on the gradients
(per-parameter coefficients, any bucketing), which tests/test_adasum.py checks
against the float64 reference. Here: the optimizer's steps are bitwise plain
SGD on ``adasum_allreduce``'s gradients over several steps (several buckets,
mixed fp32/bf16/fp16 parameters, 2, 3 and 4 ranks, ``local_size`` 2, bucket
views, gradient accumulation), the first step's reduced gradients are within
the float64 reference's bound, and bad arguments are refused before anything
is communicated.

Rank functions never assert: they return what they saw and the test judges.
"""
import pytest
import torch
from torch import nn

from fusedreduce import DistributedOptimizer, adasum_allreduce
from harness import (ONE_BYTE_MB, assert_raised_before_any_collective, outcomes_and_collectives,
                     run_ranks)
from reference import adasum_of_blocks

STEPS = 4


def _model():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    # mixed precisions in one model: 16-bit gradients combine in fp32
    model[2].to(torch.bfloat16)
    model[4].to(torch.float16)
    return model


def _loss(model, rank, step, passes=1):
    gen = torch.Generator().manual_seed(100 * rank + 10 * step + passes)
    x = torch.randn(8, 6, generator=gen)
    h = model[1](model[0](x)).to(torch.bfloat16)
    h = model[3](model[2](h)).to(torch.float16)
    return model[4](h).float().square().mean()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(rank, world_size, local_size, cap_mb, bucket_view, passes):
    model = _model()
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     reduce_method="adasum", local_size=local_size,
                                     param_pack_thd=max(1, int(cap_mb * 2 ** 20)),
                                     backward_passes_per_step=passes,
                                     gradient_as_bucket_view=bucket_view)
    reference = _model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    seen = {"params": [], "reference": [], "first_grads": None}
    for step in range(STEPS):
        for k in range(passes):
            _loss(model, rank, step, k).backward()
            _loss(reference, rank, step, k).backward()
        if step == 0:
            seen["first_grads"] = [p.grad.clone() for p in model.parameters()]
            seen["local_grads"] = [p.grad.clone() for p in reference.parameters()]
        combined = adasum_allreduce([p.grad for p in reference.parameters()],
                                    local_size=local_size)
        for p, g in zip(reference.parameters(), combined):
            p.grad = g
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
        plain.zero_grad()
        seen["params"].append(_params(model))
        seen["reference"].append(_params(reference))
    seen["buckets"] = len(optimizer.flat_buffers.gradients)  # one per bucket
    return seen


CONFIGS = [
    # world_size, local_size, bucket cap (MiB), gradient_as_bucket_view, passes per step
    (2, 1, 25.0, False, 1),
    (3, 1, ONE_BYTE_MB, False, 1),
    (4, 2, ONE_BYTE_MB, True, 1),
    (4, 1, 0.0002, False, 2),
]


@pytest.mark.parametrize("world_size,local_size,cap_mb,bucket_view,passes", CONFIGS)
def test_adasum_steps_are_bitwise_sgd_on_adasum_allreduce_gradients(
        world_size, local_size, cap_mb, bucket_view, passes):
    results = run_ranks(_train, world_size, local_size, cap_mb, bucket_view, passes)
    if cap_mb < 1e-3:
        assert results[0]["buckets"] > 1
    for rank, seen in enumerate(results):
        for step in range(STEPS):
            for i, (got, want) in enumerate(zip(seen["params"][step], seen["reference"][step])):
                assert got.dtype == want.dtype and torch.equal(got, want), \
                    f"rank {rank}, step {step}, parameter {i}"
                assert torch.equal(got, results[0]["params"][step][i]), f"rank {rank} differs"
    # the first reduced gradients against the float64 tree over the ranks'
    # local gradients: each level rounds coefficients, products and the sum in
    # fp32 (<= 4 eps32 of the largest input per level, doubled for the block
    # mean and the error carried into the next level), then one rounding to
    # the gradient's dtype
    levels = (world_size // local_size).bit_length() + 1
    for i, got in enumerate(results[0]["first_grads"]):
        per_rank = [seen["local_grads"][i] for seen in results]
        expected = adasum_of_blocks(per_rank, local_size)
        largest = sum(float(t.double().abs().max()) for t in per_rank)
        bound = 8 * levels * torch.finfo(torch.float32).eps * largest \
            + torch.finfo(got.dtype).eps * expected.abs() + torch.finfo(got.dtype).tiny
        assert torch.all((got.double() - expected).abs() <= bound), f"parameter {i}"


def _bad_arguments(rank, world_size):
    def wrap(**kwargs):
        return lambda: DistributedOptimizer(
            torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), bcast_period=-1, **kwargs)
    return outcomes_and_collectives({
        "16-bit reduce_dtype": wrap(reduce_method="adasum", reduce_dtype=torch.bfloat16),
        "local_size not dividing": wrap(reduce_method="adasum", local_size=3),
        "local_size not dividing, mean": wrap(reduce_method="mean", local_size=3),
        "wire_dtype with adasum": wrap(reduce_method="adasum", wire_dtype=torch.bfloat16),
        "error_feedback with adasum": wrap(reduce_method="adasum", error_feedback=True),
        "unknown method": wrap(reduce_method="Adasum"),
    })


def test_bad_adasum_arguments_are_value_errors_before_any_collective():
    assert_raised_before_any_collective(run_ranks(_bad_arguments, 4), {
        "16-bit reduce_dtype": ("ValueError", "AdaSum combines in float32 or float64"),
        "local_size not dividing": ("ValueError", "local_size must be a positive int dividing"),
        "local_size not dividing, mean": ("ValueError", "local_size must be a positive int "
                                                        "dividing"),
        "wire_dtype with adasum": ("ValueError", "wire_dtype, deterministic and error_feedback "
                                                 "do not combine with reduce_method='adasum'"),
        "error_feedback with adasum": ("ValueError", "error_feedback do not combine with "
                                                     "reduce_method='adasum'"),
        "unknown method": ("ValueError", "'sum', 'mean' or 'adasum'"),
    })
