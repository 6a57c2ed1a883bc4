"""Run a function on N local processes joined in one process group.

For examples, tests and benchmarks on one machine, where ``torchrun`` is more
than the job needs. Each rank is a fresh spawned interpreter (or, with
``start_method="forkserver"``, a fork of a server that imported torch and
torch._dynamo once: the same fresh state, without those imports per rank) that joins a
``gloo`` (or ``nccl``, one GPU per rank) group through a file rendezvous,
runs ``fn(rank, world_size, *args)`` and sends its result back pickled (tensor
data is copied, so results outlive the rank). A rank that raises sends its
traceback; ranks that never finish (waiting in a collective another rank never
joined) are killed at the timeout, so a caller never hangs.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

#: how ranks start: ``"spawn"`` (a new interpreter each) or ``"forkserver"``
#: (forked from a server process that imported ``FORKSERVER_PRELOAD`` once;
#: about 30x faster to start on a 2-core machine, 0.06 s against 1.8 s for
#: two ranks)
START_METHODS = ("spawn", "forkserver")
#: the environment variable that picks the start method when the call does not
START_METHOD_VARIABLE = "FUSEDREDUCE_START_METHOD"
#: what the fork server imports before it forks any rank: torch._dynamo too,
#: which the first optimizer a process builds imports (about 1.8 s of CPU per
#: rank on a 2-core machine otherwise); importing it touches no GPU, and with
#: no process group in the server torch.distributed.nn.functional's defaults
#: bind None (see fusedreduce/__init__.py)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
#: after one rank fails, how long the others get to report (they usually fail
#: within milliseconds, when the failed rank's sockets close) before they are killed
FAILURE_GRACE_S = 10.0


class RankFailure(RuntimeError):
    """One or more ranks raised, or never finished.

    Attributes:
        failures: rank -> the traceback (or the reason) of each failed rank.
    """

    def __init__(self, failures: Dict[int, str], missing: List[int]) -> None:
        self.failures = dict(sorted(failures.items()))
        self.missing = missing
        text = "".join(f"\n--- rank {r}:\n{tb}" for r, tb in self.failures.items())
        if missing:
            text += f"\n--- ranks {missing} did not finish and were killed"
        super().__init__(f"{len(self.failures)} rank(s) failed:{text}")


def _in_environment(environment: Dict[str, str], target: Callable, args: tuple,
                    results) -> None:
    # the caller's environment as it is now: a forked rank inherits the fork
    # server's, from when the server started
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)
    target(*args, results)


def join_and_run(rank: int, world_size: int, init_method: str, backend: str,
                 collective_timeout: float, threads: Optional[int], fn: Callable,
                 args: tuple, setup: Optional[Callable[[], None]], results) -> None:
    """One rank's body under ``run_rank_processes``: ``setup()`` (when given),
    join the process group at ``init_method``, run ``fn(rank, world_size,
    *args)``, leave the group, and put the pickled result (or the traceback) on
    ``results``."""
    import torch
    import torch.distributed as dist
    try:
        if setup is not None:
            setup()
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        try:
            # every pair connected before any rank can fail fast and close its sockets
            dist.barrier()
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                       backend: str = "gloo", timeout: float = 300.0,
                       collective_timeout: float = 60.0,
                       threads: Optional[int] = None,
                       start_method: Optional[str] = None) -> List[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank its own process.

    Args:
        fn: a module-level function (it is pickled by reference) returning a
            picklable result; it runs inside the initialised process group.
        world_size: how many ranks.
        args: passed to ``fn`` after ``rank`` and ``world_size`` (picklable).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r).
        timeout: seconds to wait for every rank's result.
        collective_timeout: the process group's timeout, in seconds.
        threads: torch threads per rank (default: torch's own choice);
            ``os.cpu_count() // world_size`` keeps ranks off each other's cores.
        start_method: ``"spawn"`` or ``"forkserver"`` (``START_METHODS``);
            default: ``$FUSEDREDUCE_START_METHOD``, else ``"spawn"``. Either
            way a rank runs with the caller's current environment variables.

    Returns:
        Each rank's result, in rank order.

    Raises:
        ValueError: an unknown ``start_method`` (or environment variable).
        RankFailure: a rank raised (every failed rank's traceback is in the
            message); the others were given ``FAILURE_GRACE_S`` to report.
        TimeoutError: some ranks did not finish within ``timeout`` (they are
            killed; the message names them and holds any failures).

    Examples:
        >>> def total(rank, world_size):                        # doctest: +SKIP
        ...     t = torch.ones(1) * rank
        ...     torch.distributed.all_reduce(t)
        ...     return float(t)
        >>> run_on_local_ranks(total, 3)                         # doctest: +SKIP
        [3.0, 3.0, 3.0]
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        return run_rank_processes(
            join_and_run, [(r, world_size, f"file://{init_file}", backend, collective_timeout,
                            threads, fn, args, None) for r in range(world_size)],
            timeout=timeout, start_method=start_method)


def run_rank_processes(target: Callable[..., None], rank_args: List[tuple], *,
                       timeout: float, start_method: Optional[str] = None) -> List[Any]:
    """``target(*rank_args[r], results)`` for each rank r, each its own process
    (with the caller's current environment variables), and what each sends
    back: the engine under ``run_on_local_ranks``, for launchers that start
    their ranks differently (``fusedreduce.bench.cluster`` starts each inside a
    network namespace).

    ``target`` is a module-level function; it must put ``(rank, True,
    pickle.dumps(result))`` or ``(rank, False, traceback text)`` on the queue
    ``results`` exactly once. ``start_method``, ``timeout``, the errors and the
    failure grace are ``run_on_local_ranks``'s.

    Returns:
        Each rank's result, in rank order.

    Raises:
        ValueError: an unknown ``start_method`` (or environment variable).
        RankFailure: ranks reported failures.
        TimeoutError: ranks did not report within ``timeout`` (they are killed).
    """
    import torch.multiprocessing as mp
    if start_method is None:
        start_method = os.environ.get(START_METHOD_VARIABLE) or "spawn"
        where = f"${START_METHOD_VARIABLE}"
    else:
        where = "start_method"
    if start_method not in START_METHODS:
        raise ValueError(f"{where} must be one of {START_METHODS}, got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when the server starts
    results = ctx.Queue()
    world_size = len(rank_args)
    procs = [ctx.Process(target=_in_environment, args=(dict(os.environ), target, args, results))
             for args in rank_args]
    for p in procs:
        p.start()
    done: Dict[int, bytes] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) + len(failures) < world_size:
            wait = deadline - time.monotonic()
            if failures:
                wait = min(wait, FAILURE_GRACE_S)
            try:
                rank, ok, payload = results.get(timeout=max(wait, 0.0))
            except queue_module.Empty:
                break
            (done if ok else failures)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(done) + len(failures) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(range(world_size)) - set(done) - set(failures))
    if failures:
        raise RankFailure(failures, missing)
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    return [pickle.loads(done[r]) for r in range(world_size)]
