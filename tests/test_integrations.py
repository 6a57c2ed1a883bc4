"""Lightning and Accelerate with fusedreduce, on 2 CPU gloo ranks (torchrun).

Each framework's own default (DDP without a hook) is the reference, trained
again in the same launch (the examples' ``--compare-ddp``): the all-reduce
hook must give its weights bitwise, the fp16 compression hook close to them
(and not bitwise: that proves the hook ran), and Lightning with
``DistributedOptimizer`` under ``DistributedOptimizerStrategy`` bitwise, with
and without gradient accumulation. The examples' report (the final loss, a
weights digest, the comparison) says so, and the saved weights agree with
it; the reference is the same run in every launch. Skipped, with the
reason, where a framework is not installed
(``pip install -e ".[integrations]"``).
"""
import hashlib
import importlib.util
import re

import pytest
import torch

from harness import ROOT, TIMEOUT, run_torchrun

FRAMEWORKS = {"accelerate": ("accelerate", "examples/accelerate_hooks.py"),
              "lightning": ("lightning", "examples/lightning_hooks.py")}
REFERENCES = {"accelerate": "Accelerate's DDP", "lightning": "Lightning's DDP"}
STEPS = 12
LR = 0.2
# what rank 0 prints at the end: per run "<what>: final loss <x>, weights <digest>",
# and with --compare-ddp "<what> vs <reference>: <verdict>"
FINAL = re.compile(r"^(.+): final loss (\d+\.\d{4}), weights ([0-9a-f]{16})$", re.MULTILINE)
VERSUS = re.compile(r"^(.+) vs (.+): (bitwise equal|not bitwise equal, max abs difference "
                    r"(\S+))$", re.MULTILINE)


def _train(script, hook, out, *options):
    """(the saved weights, {what: (final loss, digest)}, [(what, reference,
    verdict, max abs difference or None)]) of one launch."""
    process = run_torchrun(
        ["--nproc_per_node=2", "--standalone", script, "--hook", hook, "--steps", str(STEPS),
         "--out", str(out), *options], cwd=ROOT, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr[-3000:]
    weights = torch.load(out)
    finals = FINAL.findall(process.stdout)
    # the first report is of the run whose weights were saved
    assert finals and finals[0][2] == _digest(weights), process.stdout
    comparisons = [(what, reference, verdict, float(difference) if difference else None)
                   for what, reference, verdict, difference in VERSUS.findall(process.stdout)]
    return weights, {what: (float(loss), digest) for what, loss, digest in finals}, comparisons


def _digest(weights: dict) -> str:
    """examples/train_digits.py's weights digest, of a state dict holding only parameters."""
    digest = hashlib.sha256()
    for weight in weights.values():
        digest.update(weight.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_hooks_train_like_the_framework_s_own_ddp(framework, tmp_path):
    module, script = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{framework} is not installed (pip install -e \".[integrations]\")")
    reference = REFERENCES[framework]
    # --compare-ddp: the framework's own DDP trained again in the same launch
    hooked, hooked_report, hooked_versus = _train(script, "allreduce_hook",
                                                  tmp_path / "allreduce.pt", "--compare-ddp")
    compressed, compressed_report, compressed_versus = _train(
        script, "fp16_compress_hook", tmp_path / "fp16.pt", "--compare-ddp")
    # the all-reduce hook gives DDP's loss and weights digest, and the saved
    # weights are those (``_train`` checks the digest of what was saved)
    ddp = hooked_report[reference]
    assert hooked_report == {"allreduce_hook": ddp, reference: ddp}, hooked_report
    assert hooked_versus == [("allreduce_hook", reference, "bitwise equal", None)]
    # the framework's DDP is the same run in another launch
    assert compressed_report[reference] == ddp
    # fp16 on the wire: each step's mean gradient rounded to fp16 (relative
    # error 2**-11); over STEPS steps of SGD at LR on gradients of magnitude
    # below 1 the weights move apart by at most STEPS * LR * 2**-11 ~ 1.2e-3
    differences = [float((hooked[n] - compressed[n]).abs().max()) for n in hooked]
    assert max(differences) <= STEPS * LR * 2 ** -11
    assert max(differences) > 0, "the fp16 hook did not run"
    assert compressed_report["fp16_compress_hook"][1] != ddp[1]
    [(what, versus, verdict, difference)] = compressed_versus
    assert (what, versus) == ("fp16_compress_hook", reference), compressed_versus
    assert verdict.startswith("not bitwise equal"), verdict
    # printed with 3 significant digits: the saved weights' own difference, rounded
    assert difference == pytest.approx(max(differences), rel=1e-2)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_distributed_optimizer_in_lightning_trains_like_lightnings_ddp(accumulate, tmp_path):
    # configure_optimizers returns DistributedOptimizer(SGD with momentum); the
    # strategy leaves out DDP, so each gradient is reduced once, by the optimizer
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install -e \".[integrations]\")")
    script = FRAMEWORKS["lightning"][1]
    # --compare-ddp: Lightning's DDP trained again in the same launch
    _, report, comparisons = _train(script, "none", tmp_path / "ours.pt",
                                    "--distributed-optimizer", "--accumulate", str(accumulate),
                                    "--compare-ddp")
    assert report["DistributedOptimizer"] == report["Lightning's DDP"], report
    assert comparisons == [("DistributedOptimizer", "Lightning's DDP", "bitwise equal", None)]


@pytest.mark.timeout(TIMEOUT)
def test_sharded_distributed_optimizer_in_lightning_trains_like_lightnings_ddp(tmp_path):
    # shard=True under the strategy: SGD with momentum on each rank's part is
    # the unsharded step, so the weights are DDP's bitwise (a mean of two ranks
    # is exact in any order); Lightning's checkpoint, saved from every rank,
    # holds the whole optimizer state
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (pip install -e \".[integrations]\")")
    script = FRAMEWORKS["lightning"][1]
    checkpoint = tmp_path / "sharded.ckpt"
    ours, report, comparisons = _train(script, "none", tmp_path / "ours.pt",
                                       "--distributed-optimizer", "--shard", "--compare-ddp",
                                       "--checkpoint", str(checkpoint))
    assert [c[2] for c in comparisons] == ["bitwise equal"], comparisons
    state = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    shapes = [tuple(w.shape) for w in ours.values()]
    assert [tuple(state[i]["momentum_buffer"].shape) for i in range(len(shapes))] == shapes


#: the momentum of the examples' SGD: a difference in one step's gradient
#: moves the weights by at most 1 / (1 - momentum) times as much, summed
MOMENTUM_GAIN = 1 / (1 - 0.9)
EPS32 = torch.finfo(torch.float32).eps
NORM = re.compile(r"^(.+): last norm before clipping (\d+\.\d{4})$", re.MULTILINE)


#: (framework, the example's options, the clipped run's label, the reference's)
CLIPPED = {
    "lightning_hook": ("lightning", ["--hook", "allreduce_hook"], "allreduce_hook",
                       "Lightning's DDP, gradient_clip_val={limit:g}"),
    "lightning_distributed_optimizer": ("lightning", ["--hook", "none",
                                                      "--distributed-optimizer"],
                                        "DistributedOptimizer",
                                        "Lightning's DDP, gradient_clip_val={limit:g}"),
    "accelerate_hook": ("accelerate", ["--hook", "allreduce_hook"], "allreduce_hook",
                        "Accelerate's DDP, clip_grad_norm_ {limit:g}"),
}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", sorted(CLIPPED))
def test_fused_clipping_in_the_frameworks_trains_like_their_own_clipping(case):
    # --max-grad-norm: HookState(max_grad_norm) on the hook, or
    # DistributedOptimizer(max_grad_norm); the reference is the framework's
    # DDP clipping with its own call (Lightning's gradient_clip_val,
    # Accelerate's clip_grad_norm_: torch's clip_grad_norm_ after the reduction)
    framework, options, ours, reference = CLIPPED[case]
    module, script = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{framework} is not installed (pip install -e \".[integrations]\")")
    limit = 0.05
    process = run_torchrun(
        ["--nproc_per_node=2", "--standalone", script, *options, "--steps", str(STEPS),
         "--max-grad-norm", str(limit), "--compare-ddp"], cwd=ROOT, timeout=TIMEOUT)
    assert process.returncode == 0, process.stderr[-3000:]
    finals = {what: loss for what, loss, _ in FINAL.findall(process.stdout)}
    assert set(finals) == {f"{ours}, max_grad_norm={limit:g}", reference.format(limit=limit)}, \
        process.stdout
    # the last step's norm was above the limit: the coefficient was below 1
    [(_, norm)] = NORM.findall(process.stdout)
    assert float(norm) > limit, process.stdout
    [(_, _, verdict, difference)] = VERSUS.findall(process.stdout)
    # the same clipping, the norm summed in another order: each step's
    # coefficient differs by the norm's rounding (rows of 2048 in fp32, then
    # fp64: at most 4 log2(2048) eps32 relative) and the clipped gradient (of
    # norm `limit`) by one more rounding; SGD at LR (with momentum 0.9 in the
    # Lightning example) carries a step's difference into the weights at most
    # MOMENTUM_GAIN times over
    bound = STEPS * LR * MOMENTUM_GAIN * limit * (4 * 11 + 2) * EPS32
    assert verdict == "bitwise equal" or float(difference) <= bound, (verdict, bound)


def _strategy_checks(rank, world_size):
    """The strategy's refusals, on one rank (a DistributedOptimizer needs a group)."""

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
        strategy.connect(module)
        strategy.optimizers = optimizers(module)
        try:
            strategy.check_optimizers(accumulate)
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
        pytest.skip("lightning is not installed (pip install -e \".[integrations]\")")
    from harness import run_ranks

    seen = run_ranks(_strategy_checks, 1)[0]
    kind, message = seen["plain"]
    assert kind == "TypeError" and "SGD, not a fusedreduce.DistributedOptimizer" in message
    kind, message = seen["accumulate"]
    assert kind == "ValueError" and "every 1 backward pass" in message and "every 2" in message
    kind, message = seen["uncovered"]
    assert kind == "ValueError" and "b.weight, b.bias" in message
    assert seen["right"] is None
