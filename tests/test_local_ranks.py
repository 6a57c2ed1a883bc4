"""fusedreduce.local_ranks: the spawner the tests, benchmarks and examples start ranks with.

A rank function that fails or hangs must end the call with an error naming
the rank, never hang the caller.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from fusedreduce.local_ranks import START_METHODS, RankFailure, run_on_local_ranks


def _sum_of_ranks(rank, world_size, scale):
    t = torch.full((2,), float(rank)) * scale
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": t}


@pytest.mark.parametrize("start_method", START_METHODS)
def test_every_rank_runs_the_function_in_one_process_group_and_results_come_back_in_rank_order(
        start_method):
    results = run_on_local_ranks(_sum_of_ranks, 3, 2.0, timeout=120, start_method=start_method)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world_size"] == 3 for r in results)
    for r in results:  # tensors outlive the rank that made them
        assert torch.equal(r["sum"], torch.full((2,), 6.0))


def _one_rank_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one gives up")
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for rank 1, which never comes
    return float(t)


def test_a_rank_that_raises_is_reported_with_its_traceback_and_the_others_do_not_hang_the_call():
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_local_ranks(_one_rank_raises, 2, timeout=120, collective_timeout=60)
    assert 1 in failure.value.failures
    assert "ValueError: rank one gives up" in failure.value.failures[1]
    assert "rank 1" in str(failure.value)
    # the waiting rank fails or is killed after a short grace, not at the timeout
    assert time.monotonic() - started < 60


def _environment(rank, world_size):
    return os.environ.get("FUSEDREDUCE_TEST_VARIABLE"), os.environ.get("FUSEDREDUCE_TEST_GONE")


@pytest.mark.parametrize("start_method", START_METHODS)
def test_ranks_run_with_the_callers_environment_as_it_is_at_the_call(start_method,
                                                                     monkeypatch):
    # a fork server started earlier holds the environment of its start: the
    # ranks must see the caller's now, what it set and what it removed
    monkeypatch.setenv("FUSEDREDUCE_TEST_GONE", "before")
    run_on_local_ranks(_environment, 1, timeout=120, start_method=start_method)
    monkeypatch.delenv("FUSEDREDUCE_TEST_GONE")
    for value, world_size in (("one", 1), ("two", 2)):
        monkeypatch.setenv("FUSEDREDUCE_TEST_VARIABLE", value)
        results = run_on_local_ranks(_environment, world_size, timeout=120,
                                     start_method=start_method)
        assert results == [(value, None)] * world_size


def test_an_unknown_start_method_is_refused_naming_where_it_came_from(monkeypatch):
    with pytest.raises(ValueError, match=r"start_method must be one of .*'fork'"):
        run_on_local_ranks(_environment, 1, start_method="fork")
    monkeypatch.setenv("FUSEDREDUCE_START_METHOD", "threads")
    with pytest.raises(ValueError, match=r"\$FUSEDREDUCE_START_METHOD must be one of"):
        run_on_local_ranks(_environment, 1)


def _rank_zero_sleeps(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def test_ranks_that_never_finish_are_killed_at_the_timeout_and_named():
    started = time.monotonic()
    # long enough for rank 1 to start and return even on a loaded machine
    # (a fork server's rank starts in a tenth of a second, once the server is up)
    forked = os.environ.get("FUSEDREDUCE_START_METHOD") == "forkserver"
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        run_on_local_ranks(_rank_zero_sleeps, 2, timeout=8 if forked else 15)
    assert time.monotonic() - started < 60
