"""``dist.destroy_process_group()`` frees the gloo group when fusedreduce was
imported before ``init_process_group``.

torch.distributed.nn.functional puts ``group.WORLD`` into its functions'
default arguments when it is imported, and building the first torch
optimizer imports it. If that happens after ``init_process_group``, those
defaults hold the world group past ``destroy_process_group()`` and gloo's
threads abort the interpreter's exit now and then. ``import fusedreduce``
imports that module first. Each case runs in a fresh interpreter, on a
1-rank gloo group on a ``HashStore``, because the import can happen only once
per process.
"""
import subprocess
import sys

SCRIPT = """
import sys
{first_import}
import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)  # imports torch.distributed.nn
import torch.distributed.nn.functional as functional

held = [name for name in dir(functional)
        if any(isinstance(default, dist.ProcessGroup)
               for default in getattr(getattr(functional, name), "__defaults__", None) or ())]
dist.destroy_process_group()
print("held:", ",".join(held))
"""


def _held_by_defaults(first_import: str) -> str:
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(first_import=first_import)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_no_default_argument_holds_the_world_group_after_importing_fusedreduce():
    assert _held_by_defaults("import fusedreduce") == "held:"


def test_without_it_torch_binds_the_world_group_into_default_arguments():
    # the mechanism the import above defuses: if torch stops binding the group,
    # this fails and the import in fusedreduce/__init__.py can go
    held = _held_by_defaults("")
    assert "all_reduce" in held and "broadcast" in held, held


RELEASE_SCRIPT = """
import gc
import weakref
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import fusedreduce
from fusedreduce import hooks
from fusedreduce.process_group import consecutive_block


def start():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def step(state, hook):
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(state, hook)
    model(torch.ones(3, 4)).sum().backward()
    return model


start()
explicit = dist.new_group([0])
models = [step(None, hooks.allreduce_hook), step(explicit, hooks.fp16_compress_hook),
          step(hooks.HookState(), hooks.adasum_hook)]
block = consecutive_block(None, 1)
watched = {"world": weakref.ref(dist.group.WORLD), "explicit group": weakref.ref(explicit),
           "block": weakref.ref(block)}
del models, explicit, block
dist.destroy_process_group()
gc.collect()
print("alive:", ",".join(name for name, ref in watched.items() if ref() is not None))

# a world made again gets a block of its own, which works
start()
block = consecutive_block(None, 1)
ones = torch.ones(2)
dist.all_reduce(ones, group=block)
print("new block:", watched["block"]() is None and block is not None and ones.tolist() == [1.0, 1.0])
step(None, hooks.allreduce_hook)
dist.destroy_process_group()
"""


def test_fusedreduce_keeps_no_process_group_past_destroy_process_group():
    # the hooks' states for None and for a group, and AdaSum's blocks of
    # consecutive ranks, are kept per group object: if they held it, gloo's
    # threads would live into the interpreter's exit and could abort it
    run = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.strip() for line in run.stdout.strip().splitlines()]
    assert lines[-2:] == ["alive:", "new block: True"], run.stdout
