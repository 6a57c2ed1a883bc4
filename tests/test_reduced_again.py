"""More backward passes before a step than ``backward_passes_per_step``: each
extra reduction adds to gradients already reduced.

Where every rank holds the reduced value and the sum is divided by the
world size (the default mean, unsharded) the next mean is the reduced value
plus the new passes' mean: the result is right, and a warning, once, says
that each reduction was a collective. Where it is not (``shard=True``: each
rank holds only its part; ``reduce_method="sum"``: the next sum counts the
reduced value once per rank; AdaSum: combining combined gradients), the
gradients would silently be others (2 ranks: 0.05 on the weights of the
model below within 5 AdamW steps), so ``step()`` refuses, before stepping.
``zero_grad()`` discards reduced gradients no step took (a step a GradScaler
skipped), so the next backward starts afresh.
"""
import warnings

import pytest
import torch
from torch import nn

import fusedreduce
from harness import run_ranks

WORLD = 2
LR = 0.1
#: SGD steps on gradients that differ from the reference's only in the order
#: of their fp32 additions (reduced sum + new mean, or one mean of everything):
#: a few eps (1.2e-7) relative per gradient element, |gradient| < 1 here, so
#: after 3 steps of lr 0.1 the weights are within 3 * 0.1 * 8 eps of each other
TOLERANCE = 3 * LR * 8 * torch.finfo(torch.float32).eps
EXACT = {"mean": {}, "sharded sum": {"shard": True, "reduce_method": "sum"}}
REFUSED = {"sum": {"reduce_method": "sum"}, "sharded mean": {"shard": True},
           "ZeRO-2": {"shard": True, "shard_gradients": True},
           "adasum": {"reduce_method": "adasum"}}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank, world_size, options, passes_per_step, declared, skipped_first=False):
    """3 steps of ``passes_per_step`` backward passes each, the optimizer told
    ``declared``; the weights and the warnings, or the error and the weights
    at that moment. ``skipped_first``: one reducing backward first that no
    step takes (``zero_grad`` after it, as after a step a GradScaler skipped)."""
    model = _model()
    opt = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                           backward_passes_per_step=declared, **options)
    data = torch.Generator().manual_seed(rank)

    def backward():
        x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if skipped_first:
                for _ in range(declared):
                    backward()
                opt.zero_grad()
            for _ in range(3):
                for _ in range(passes_per_step):
                    backward()
                opt.step()
                opt.zero_grad()
        except RuntimeError as exc:
            return "raised", str(exc), _weights(model)
    said = [str(w.message) for w in caught if "reduced the gradients" in str(w.message)]
    return _weights(model), said


@pytest.mark.parametrize("passes, declared", [(2, 1), (4, 2)])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_extra_reductions_that_sum_right_train_as_one_and_warn_once(name, passes, declared):
    extra = run_ranks(_train, WORLD, EXACT[name], passes, declared)
    once = run_ranks(_train, WORLD, EXACT[name], passes, passes)
    assert torch.equal(extra[0][0], extra[1][0])
    assert float((extra[0][0] - once[0][0]).abs().max()) <= TOLERANCE
    for _, said in extra:
        assert len(said) == 1 and "backward_passes_per_step equal to" in said[0]
    assert [said for _, said in once] == [[], []]


@pytest.mark.parametrize("passes, declared", [(2, 1), (4, 2)])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_extra_reductions_that_would_train_another_model_are_refused(name, passes, declared):
    results = run_ranks(_train, WORLD, REFUSED[name], passes, declared)
    untrained = _weights(_model())
    for outcome, message, weights in results:
        assert outcome == "raised"
        assert "reduced the gradients again before step()" in message
        assert "backward_passes_per_step" in message and "no_sync()" in message
        assert torch.equal(weights, untrained)  # nothing was stepped


@pytest.mark.parametrize("name", sorted(REFUSED) + sorted(EXACT))
def test_zero_grad_discards_a_reduction_no_step_took(name):
    options = {**EXACT, **REFUSED}[name]
    skipped = run_ranks(_train, WORLD, options, 1, 1, True)
    for weights, said in skipped:
        assert isinstance(weights, torch.Tensor) and said == []
