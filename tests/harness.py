"""What the tests share to run code on gloo ranks, and to run costly setups once.

``run_ranks`` runs a function on N local ranks through the library's own
spawner (``fusedreduce.local_ranks``, which the examples and benchmarks use
too), with a timeout, so a rank that hangs fails a test instead of the suite.
``once_per_session`` runs a costly computation (starting ranks, a benchmark)
once per test session and shares its pickled result with every pytest-xdist
worker. The rest are helpers for rank functions that check errors.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Union

import torch
import torch.distributed as dist
from filelock import FileLock  # a dependency of torch

from fusedreduce.local_ranks import RankFailure, run_on_local_ranks

#: the checkout the tests run from
ROOT = Path(__file__).resolve().parents[1]
#: a bucket cap of one byte, in MiB: every tensor in a bucket of its own
ONE_BYTE_MB = 1 / 2 ** 20
# seconds a run_ranks call may take: far above the few seconds one takes on an
# idle machine, so that a shared, loaded one does not fail a correct test
TIMEOUT = 300
# where a bug makes gloo abort one rank, the call can only end by this timeout
CRASH_TIMEOUT = 30


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0,
              collective_timeout: float = 60.0):
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process.

    ``fn`` must be a module-level function (it is pickled by reference) and its
    results picklable. Raises ``fusedreduce.local_ranks.RankFailure`` with
    every failing rank's traceback, or ``TimeoutError`` naming the ranks that
    never finished. ``collective_timeout``: gloo's, for each collective.
    """
    return run_on_local_ranks(fn, world_size, *args, timeout=timeout,
                              collective_timeout=collective_timeout)


def rank_errors(fn, world_size: int, *args, timeout: float = 120.0):
    """Like ``run_ranks`` but ``fn`` is expected to raise on every rank; returns
    ``[(exception type name, message)]`` per rank (a rank that returned gives None)."""
    return run_ranks(_expect_error, world_size, fn, *args, timeout=timeout)


def _expect_error(rank, world_size, fn, *args):
    try:
        fn(rank, world_size, *args)
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))
    return None


def shared_directory(tmp_path_factory, name: str) -> Path:
    """The directory ``name`` that every pytest-xdist worker of this session shares."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    directory = base / name
    directory.mkdir(exist_ok=True)
    return directory


def once_per_session(tmp_path_factory, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(directory)`` once per test session; its (pickled) result.

    pytest-xdist runs a session fixture once per worker; the first worker to
    take the lock computes and leaves the result in the session's shared
    directory (xdist's documented pattern), the others wait and read it.
    ``directory`` is ``name``'s own, for any files ``compute`` writes.
    """
    directory = shared_directory(tmp_path_factory, name)
    result = directory / "result.pickle"
    with FileLock(str(directory / "lock")):
        if not result.exists():
            result.write_bytes(pickle.dumps(compute(directory)))
    return pickle.loads(result.read_bytes())


def world_sizes_selected(session, module_name: str) -> set:
    """The ``world_size`` parameters of ``module_name``'s tests that this
    session runs (``-k`` and ``-m`` respected)."""
    return {item.callspec.params["world_size"] for item in session.items
            if item.module.__name__ == module_name and "world_size" in
            getattr(getattr(item, "callspec", None), "params", {})}


def runs_per_world_size(tmp_path_factory, name: str, fn, world_sizes: Iterable[int],
                        timeout: float) -> Dict[int, Union[list, str]]:
    """``{n: run_ranks(fn, n)}`` for every world size, once per test session;
    a run that failed gives its error as text (for the tests that read it).

    Runs go three at a time, largest first: starting ranks is mostly waiting
    and importing, so they overlap well even on two cores.
    """
    def run(world_size):
        try:
            return run_ranks(fn, world_size, timeout=timeout)
        except (RankFailure, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    def run_all(_directory):
        largest_first = sorted(world_sizes, reverse=True)
        with ThreadPoolExecutor(max_workers=3) as pool:
            return dict(zip(largest_first, pool.map(run, largest_first)))

    return once_per_session(tmp_path_factory, name, run_all)


def ranks_once_getter(request, tmp_path_factory, name: str, fn, module_name: str,
                      timeout: float) -> Callable[[int], list]:
    """For a session fixture: ``get(world_size)``, ``fn``'s results on every
    rank. The first test to ask runs every world size the session selected
    for ``module_name``'s tests, once for the whole session and all its
    pytest-xdist workers; a failed run fails the test that asks, with its
    error."""
    import pytest
    runs = runs_per_world_size(tmp_path_factory, name, fn,
                               world_sizes_selected(request.session, module_name), timeout)

    def get(world_size: int) -> list:
        if isinstance(runs[world_size], str):
            pytest.fail(f"the {world_size} ranks failed:\n{runs[world_size]}")
        return runs[world_size]

    return get


# ------------------------------------------------- helpers for rank functions

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_object", "broadcast_object_list",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather_single", "all_to_all_single")


def record_collectives(events):
    """From now on, append the name of every torch.distributed collective this
    process issues to ``events`` (the rank process exits afterwards)."""
    for name in (n for n in COLLECTIVES if hasattr(dist, n)):
        def recording(*args, _real=getattr(dist, name), _name=name, **kwargs):
            events.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, recording)


def outcomes(cases):
    """Run each of ``cases`` ({name: callable}); per name, None if it returned,
    else (exception type name, message). A rank that lets an exception out
    would leave the others waiting in a collective."""
    seen = {}
    for name, case in cases.items():
        try:
            case()
            seen[name] = None
        except Exception as exc:  # noqa: BLE001
            seen[name] = (type(exc).__name__, str(exc))
    return seen


def outcomes_and_collectives(cases):
    """``outcomes(cases)`` and the collectives they issued."""
    events = []
    record_collectives(events)
    return outcomes(cases), events


def assert_raised_before_any_collective(results, expected):
    """``results``: per rank, ``outcomes_and_collectives``; ``expected``:
    {case: (exception type name, a fragment of its message)}."""
    for rank, (seen, collectives) in enumerate(results):
        assert not collectives, f"rank {rank} communicated before raising: {collectives}"
        for name, (kind, fragment) in expected.items():
            got = seen[name]
            assert got is not None, f"rank {rank}: {name} did not raise"
            assert got[0] == kind and fragment in got[1], f"rank {rank}: {name}: {got}"


#: what a torchrun'd gloo rank prints when it aborts in the interpreter's exit,
#: after its work is done: gloo's threads outlived destroy_process_group because
#: something still held the group (see pytorch/pytorch#190489, and
#: tests/test_teardown.py for the holders fusedreduce removes): not a failure
#: of the code under test
EXIT_ABORT = "terminate called without an active exception"


def run_torchrun(args, **kwargs) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run *args``, launched again once if a rank
    died of ``EXIT_ABORT``. On the 2-core CI VM, with the suite loading both
    cores, that abort failed one or two of the suite's torchrun launches in
    two of four full runs (2026-11-24); the second launch must succeed in
    full, so a real failure still fails."""
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    process = subprocess.run(command, **kwargs)
    if process.returncode != 0 and EXIT_ABORT in (process.stderr or ""):
        process = subprocess.run(command, **kwargs)
    return process


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises ``RuntimeError("a backward
    error")``, as a user's custom op might."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward error")


class InfOnOneRank:
    """A gradient hook that puts an inf into the middle element of the
    parameter's gradient on the last rank, in the step ``step`` is set to
    (``hook.step = k`` before each backward)."""

    def __init__(self, rank: int, world_size: int, at_step: int = 1) -> None:
        self.poisons = rank == world_size - 1
        self.at_step = at_step
        self.step = 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.poisons and self.step == self.at_step:
            grad = grad.clone()
            grad.view(-1)[grad.numel() // 2] = float("inf")
        return grad
