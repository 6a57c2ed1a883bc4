"""Lightning and Accelerate with fusedreduce's hooks, on 2 CPU gloo ranks (torchrun).

Each framework's own default (DDP without a hook) is the reference: the
all-reduce hook must give its weights bitwise, the fp16 compression hook
close to them (and not bitwise: that proves the hook ran). Skipped, with the
reason, where a framework is not installed (``pip install "fusedreduce[integrations]"``).
"""
import importlib.util
import subprocess
import sys

import pytest
import torch

from harness import ROOT, TIMEOUT

FRAMEWORKS = {"accelerate": ("accelerate", "examples/accelerate_hooks.py"),
              "lightning": ("lightning", "examples/lightning_hooks.py")}
STEPS = 12
LR = 0.2


def _train(script, hook, out):
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--standalone", script, "--hook", hook, "--steps", str(STEPS), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
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
