"""Run a Python script on local ranks as torchrun runs it, without an
interpreter start and torch's import per rank.

Each rank is a fork of a server process (multiprocessing's forkserver) that
imported ``PRELOAD`` once: what a script's first lines import anyway (torch,
torch.distributed, the torch._dynamo that building an optimizer imports, and
fusedreduce), about 4 s of CPU per rank on the 2-core machines. A rank then
runs like ``python script.py``: the environment replaced by the one given
(RANK, WORLD_SIZE, MASTER_ADDR, ...), the script's directory as the working
directory and ``sys.path[0]``, ``sys.argv`` its file name, the script run as
``__main__``; its stdout and stderr (Python's and the C++ libraries', fds 1
and 2) go to a log file. Its exit status is 0 when the script returns, its
``SystemExit`` code, or 1 after an exception (the traceback is in the log).

What differs from a fresh interpreter: the preloaded modules were imported
before the script set any environment variable (no docs script reads one
at import), and the interpreter exits without its teardown (``atexit``
handlers, the last garbage collection), so a script must release what it
holds itself, as the docs' scripts do (``destroy_process_group``).
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import traceback
from typing import Dict

#: what the fork server imports before it forks any rank
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "fusedreduce"]

_context = None


def context():
    """The forkserver context (its server starts with the first rank)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(script: str, environment: Dict[str, str], log_path: str) -> None:
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - the process ends with it
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.clear()
    os.environ.update(environment)
    directory, name = os.path.split(os.path.abspath(script))
    os.chdir(directory)
    # where a new interpreter would have started: multiprocessing's spawned
    # children find a relative __main__ path from it
    multiprocessing.process.ORIGINAL_DIR = directory
    sys.path[0] = directory
    sys.argv = [name]  # as `python name` in its directory
    code = 0
    try:
        threads = environment.get("OMP_NUM_THREADS")
        if threads:
            # read by torch when its thread pool starts; the server's import started none
            import torch
            torch.set_num_threads(int(threads))
        runpy.run_path(name, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=log)
    except BaseException:  # noqa: BLE001 - reported as the script's failure
        traceback.print_exc(file=log)
        code = 1
    log.flush()
    os._exit(code)


def start(script: str, environment: Dict[str, str], log_path: str):
    """One rank running ``script``: a started ``multiprocessing.Process``
    (``exitcode`` None while it runs; ``kill()`` to stop it)."""
    process = context().Process(target=_run, args=(script, environment, log_path))
    process.start()
    return process
