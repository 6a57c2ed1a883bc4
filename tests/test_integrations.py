"""Lightning and Accelerate with fusedreduce, on 2 CPU gloo ranks (torchrun).

Each framework's own default (DDP without a hook) is the reference: the
all-reduce hook must give its weights bitwise, the fp16 compression hook
close to them (and not bitwise: that proves the hook ran), and Lightning with
``DistributedOptimizer`` under ``DistributedOptimizerStrategy`` bitwise, with
and without gradient accumulation. Skipped, with the reason, where a
framework is not installed (``pip install "fusedreduce[integrations]"``).
"""
import importlib.util

import pytest
import torch

from harness import ROOT, TIMEOUT, run_torchrun

FRAMEWORKS = {"accelerate": ("accelerate", "examples/accelerate_hooks.py"),
              "lightning": ("lightning", "examples/lightning_hooks.py")}
STEPS = 12
LR = 0.2


def _train(script, hook, out, *options):
    process = run_torchrun(
        ["--nproc_per_node=2", "--standalone", script, "--hook", hook, "--steps", str(STEPS),
         "--out", str(out), *options], cwd=ROOT, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr[-3000:]
    return torch.load(out)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_hooks_train_like_the_framework_s_own_ddp(framework, tmp_path):
    module, script = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{framework} is not installed (pip install \"fusedreduce[integrations]\")")
    default = _train(script, "none", tmp_path / "none.pt")
    hooked = _train(script, "allreduce_hook", tmp_path / "allreduce.pt")
    compressed = _train(script, "fp16_compress_hook", tmp_path / "fp16.pt")
    for name, weight in default.items():
        assert torch.equal(weight.view(-1).view(torch.uint8),
                           hooked[name].view(-1).view(torch.uint8)), name
    # fp16 on the wire: each step's mean gradient rounded to fp16 (relative
    # error 2**-11); over STEPS steps of SGD at LR on gradients of magnitude
    # below 1 the weights move apart by at most STEPS * LR * 2**-11 ~ 1.2e-3
    differences = [float((default[n] - compressed[n]).abs().max()) for n in default]
    assert max(differences) <= STEPS * LR * 2 ** -11
    assert max(differences) > 0, "the fp16 hook did not run"


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, weight in a.items():
        assert torch.equal(weight.view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)), \
            name


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_distributed_optimizer_in_lightning_trains_like_lightnings_ddp(accumulate, tmp_path):
    # configure_optimizers returns DistributedOptimizer(SGD with momentum); the
    # strategy leaves out DDP, so each gradient is reduced once, by the optimizer
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install \"fusedreduce[integrations]\")")
    script = FRAMEWORKS["lightning"][1]
    options = ("--accumulate", str(accumulate))
    default = _train(script, "none", tmp_path / "ddp.pt", *options)
    ours = _train(script, "none", tmp_path / "ours.pt", "--distributed-optimizer", *options)
    _same_bits(default, ours)


def _strategy_checks(rank, world_size):
    """The strategy's refusals, on one rank (a DistributedOptimizer needs a group)."""
    from types import SimpleNamespace

    import lightning.pytorch as pl
    from torch import nn

    from fusedreduce import DistributedOptimizer
    from fusedreduce.lightning import DistributedOptimizerStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

    def refusal(optimizers, accumulate=1):
        strategy = DistributedOptimizerStrategy()
        module = Module()
        strategy._lightning_module = module
        strategy.optimizers = optimizers(module)
        try:
            strategy._check_optimizers(SimpleNamespace(accumulate_grad_batches=accumulate))
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return None

    sgd = torch.optim.SGD
    return {
        "plain": refusal(lambda m: [sgd(m.parameters(), lr=0.1)]),
        "accumulate": refusal(lambda m: [DistributedOptimizer(sgd(m.parameters(), lr=0.1))], 2),
        "uncovered": refusal(lambda m: [DistributedOptimizer(sgd(m.a.parameters(), lr=0.1))]),
        "right": refusal(lambda m: [DistributedOptimizer(sgd(m.a.parameters(), lr=0.1),
                                                         backward_passes_per_step=2),
                                    DistributedOptimizer(sgd(m.b.parameters(), lr=0.1),
                                                         backward_passes_per_step=2)], 2),
    }


def test_the_strategy_refuses_optimizers_that_would_leave_gradients_unreduced():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install \"fusedreduce[integrations]\")")
    from harness import run_ranks

    seen = run_ranks(_strategy_checks, 1)[0]
    kind, message = seen["plain"]
    assert kind == "TypeError" and "SGD, not a fusedreduce.DistributedOptimizer" in message
    kind, message = seen["accumulate"]
    assert kind == "ValueError" and "every 1 backward pass" in message and "every 2" in message
    kind, message = seen["uncovered"]
    assert kind == "ValueError" and "b.weight, b.bias" in message
    assert seen["right"] is None
