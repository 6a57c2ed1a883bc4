"""gradient_as_bucket_view=True: each .grad is a view of its bucket, results bitwise the default's.

The reference here is the default mode itself: it is checked against float64
gradients in ``test_overlap.py`` and ``test_reducer.py``, and the promise of
the view mode is bitwise equality with it, step after step, through gradient
accumulation, ``zero_grad`` both ways, mixed dtypes, 16-bit communication,
parameters without gradients, a NaN on one rank and GradScaler. Every
comparison is by bytes (``torch.equal`` would let -0.0 == 0.0 and miss NaNs).

The rank functions return what they saw and never assert (a rank that raised
would leave the others blocked in a collective).
"""
import pytest
import torch
from torch import nn

from harness import ONE_BYTE_MB, TIMEOUT, run_ranks
from fusedreduce import DistributedGradReducer, DistributedOptimizer


def _model():
    """fp16, fp32 and bf16 layers, so buckets hold one dtype or several."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4), nn.Linear(4, 3))
    model[0].half()
    model[4].to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _loss(model, rank, step, micro, nan=False):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(5, 8, generator=gen)
    h = model[2](model[1](model[0](x.half()).float()))
    out = model[4](model[3](h).to(torch.bfloat16)).float()
    if step % 2 == 1:
        out = model[5](out)  # the last layer gets a gradient every other step only
    loss = out.square().sum() * (micro + 1)
    if nan and rank == 1:
        loss = loss * float("nan")
    return loss


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _train(rank, world_size, view, set_to_none, reduce_dtype, cap, passes, check_finite):
    model = _model()
    reducer = DistributedGradReducer(model.parameters(), bucket_cap_mb=cap,
                                     reduce_dtype=reduce_dtype, check_finite=check_finite)
    reducer.register_hooks(passes_per_sync=passes, gradient_as_bucket_view=view)
    seen = []
    for step in range(4):
        for micro in range(passes):
            _loss(model, rank, step, micro, nan=check_finite and step == 2).backward()
        if step == 1 and passes == 1:
            # no_sync accumulates into the reduced grads, the next backward reduces the sum
            with reducer.no_sync():
                _loss(model, rank, step, 7).backward()
            _loss(model, rank, step, 8).backward()
        seen.append([None if p.grad is None else _bytes(p.grad) for p in model.parameters()])
        if check_finite:
            seen.append([_bytes(reducer.found_nonfinite)])
        model.zero_grad(set_to_none=set_to_none)
    return seen


CASES = [  # (reduce_dtype, bucket cap, passes per sync, check_finite)
    (torch.float32, 25.0, 1, False),
    (torch.float32, ONE_BYTE_MB, 2, False),  # a bucket per tensor
    (torch.float32, 0.0005, 1, True),         # a few mixed buckets, a NaN on rank 1
    (torch.float16, 25.0, 2, True),           # 16-bit communication: prescaled in place
    (torch.bfloat16, 0.0005, 1, False),
]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("reduce_dtype,cap,passes,check_finite", CASES)
def test_bucket_views_give_the_default_mode_s_gradients_bitwise(reduce_dtype, cap, passes,
                                                                check_finite, set_to_none):
    args = (set_to_none, reduce_dtype, cap, passes, check_finite)
    default = run_ranks(_train, 2, False, *args)
    viewed = run_ranks(_train, 2, True, *args)
    for rank in range(2):
        assert len(default[rank]) == len(viewed[rank])
        for step, (want, got) in enumerate(zip(default[rank], viewed[rank])):
            for i, (w, g) in enumerate(zip(want, got)):
                assert (w is None) == (g is None), (rank, step, i)
                assert w is None or torch.equal(w, g), f"rank {rank} step {step} tensor {i}"
    # the ranks agree, and the run did train something (not all zeros)
    assert all(torch.equal(a, b) for a, b in zip(viewed[0][-1], viewed[1][-1]))
    assert any(bool(t.any()) for t in viewed[0][0] if t is not None)


def _storages(reducer):
    buffers = [*reducer.flat_buffers.gradients, *reducer.flat_buffers.views]
    return {b.untyped_storage().data_ptr() for b in buffers}


def _views_in_place(rank, world_size):
    model = _model()
    reducer = DistributedGradReducer(model.parameters()).register_hooks(
        gradient_as_bucket_view=True)
    seen = []
    for step in range(3):
        _loss(model, rank, 0, 0).backward()
        grads = [p.grad for p in model.parameters()]
        seen.append({
            "in_buffers": [g.untyped_storage().data_ptr() in _storages(reducer) for g in grads],
            "ids": [id(g) for g in grads],
            "fp32_in_comm_buffer": [
                g.untyped_storage().data_ptr() in
                {b.untyped_storage().data_ptr() for b in reducer.flat_buffers.gradients}
                for g in grads if g.dtype == torch.float32]})
        model.zero_grad(set_to_none=False)
    return seen


@pytest.mark.timeout(TIMEOUT)
def test_every_grad_is_a_view_of_its_bucket_and_stays_the_same_tensor():
    for seen in run_ranks(_views_in_place, 2):
        assert all(all(step["in_buffers"]) for step in seen)
        # fp32 gradients in fp32 buckets live in the communication buffer itself
        assert all(all(step["fp32_in_comm_buffer"]) for step in seen)
        # from the first reduction on, backward accumulates into the same views
        assert seen[1]["ids"] == seen[2]["ids"]


def _call_while_viewed(rank, world_size):
    model = _model()
    reducer = DistributedGradReducer(model.parameters()).register_hooks(
        gradient_as_bucket_view=True)
    _loss(model, rank, 0, 0).backward()
    before = [_bytes(p.grad) for p in model.parameters()]
    extra = reducer([torch.full_like(p, float(rank + 1)) for p in model.parameters()])
    after = [_bytes(p.grad) for p in model.parameters()]
    reducer.remove_hooks()
    _loss(model, rank, 0, 1).backward()  # plain accumulation into the old views
    return before, after, [e.float().mean().item() for e in extra]


@pytest.mark.timeout(TIMEOUT)
def test_calling_the_reducer_while_hooks_hold_views_leaves_the_grads_alone():
    for before, after, extra in run_ranks(_call_while_viewed, 2):
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert all(abs(e - 1.5) < 1e-2 for e in extra)  # the mean of 1 and 2


def _optimizer_run(rank, world_size, view, scaled):
    model = _model().float()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               backward_passes_per_step=2, gradient_as_bucket_view=view)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None
    for step in range(3):
        for micro in range(2):
            gen = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
            loss = model(torch.randn(4, 8, generator=gen)).square().sum()
            (scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return [_bytes(p) for p in model.parameters()]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
def test_distributed_optimizer_with_bucket_views_steps_like_the_default(scaled):
    default = run_ranks(_optimizer_run, 2, False, scaled)
    viewed = run_ranks(_optimizer_run, 2, True, scaled)
    for want, got in zip(default, viewed):
        assert all(torch.equal(w, g) for w, g in zip(want, got))
