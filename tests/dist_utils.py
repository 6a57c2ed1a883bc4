"""Run a function on N local gloo ranks, with a timeout, and collect the results.

A rank that raises sends its traceback back; a rank that hangs (a collective
another rank never joined) is killed when the timeout expires and the test
fails with a clear message instead of hanging the suite.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(AssertionError):
    """One or more ranks raised; the message holds each rank's traceback."""


def _worker(rank, world_size, init_file, fn, args, queue):
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        # every pair connected before anyone can fail fast and close its sockets
        dist.barrier()
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # plain pickle copies tensor data: torch's queue would share it through
        # file descriptors that die with this process
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process.

    ``fn`` must be a module-level function (it is pickled by reference) and its
    results picklable. Raises ``RankError`` with every failing rank's
    traceback, or ``TimeoutError`` naming the ranks that never finished.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        results, failures = {}, {}
        try:
            for _ in range(world_size):
                rank, ok, payload = queue.get(timeout=timeout)
                (results if ok else failures)[rank] = payload
        except queue_module.Empty as exc:  # someone hung
            missing = sorted(set(range(world_size)) - set(results) - set(failures))
            for p in procs:
                p.kill()
            detail = "".join(f"\n--- rank {r}: {e[0]}: {e[1]}\n{e[2]}" for r, e in failures.items())
            raise TimeoutError(f"ranks {missing} did not finish within {timeout}s" + detail) from exc
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if failures:
        raise RankError("".join(f"\n--- rank {r}: {name}: {msg}\n{tb}"
                                for r, (name, msg, tb) in sorted(failures.items())))
    return [pickle.loads(results[r]) for r in range(world_size)]


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


# ------------------------------------------------- helpers for rank functions

# seconds a run_ranks call may take: far above the few seconds one takes on an
# idle machine, so that a shared, loaded one does not fail a correct test
TIMEOUT = 300
# where a bug makes gloo abort one rank, the call can only end by this timeout
CRASH_TIMEOUT = 30

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_object", "broadcast_object_list")


def record_collectives(events):
    """From now on, append the name of every torch.distributed collective this
    process issues to ``events`` (the rank process exits afterwards)."""
    for name in COLLECTIVES:
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
