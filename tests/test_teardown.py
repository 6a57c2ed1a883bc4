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
