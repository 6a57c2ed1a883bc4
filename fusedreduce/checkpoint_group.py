"""Where a collective checkpoint call communicates: a gloo group of its own.

Most training scripts save from one rank (``if rank == 0:
torch.save(opt.state_dict())``). A checkpoint call that communicates, made
on some ranks only, must never put its collectives between the other ranks'
training collectives: on gloo that aborts the process
(``Received data size doesn't match expected size``), on NCCL it can hang or
mix the data. So such a call runs on a gloo group over the same ranks, made
once for the training group (``checkpoint_group``), and first meets the
other ranks at a ``monitored_barrier`` on it (``meet_for``): where they do
not all come within the timeout (or one has left), the ranks that made the
call get a ``RuntimeError`` naming the call and the fix, and nothing has
touched the training group.

Gloo bounds each operation of a group by the timeout the group was made
with, on every rank (``monitored_barrier``'s own ``timeout`` bounds only
group rank 0's wait), so the timeout is chosen when the group is made.
"""
from __future__ import annotations

import math
import weakref
from datetime import timedelta
from typing import Any, Dict, Union

import torch.distributed as dist

from .process_group import global_rank, global_ranks

#: seconds a collective checkpoint call waits for the other ranks, and each
#: of its operations may take, unless told otherwise
DEFAULT_TIMEOUT_S = 60.0

# held weakly, by the training group object (the world's for None), as
# process_group's blocks are: a world made again after destroy_process_group
# gets a group of its own
_groups: "weakref.WeakKeyDictionary[Any, Dict[float, Any]]" = weakref.WeakKeyDictionary()


def check_timeout(value: Union[float, int, timedelta, None], name: str) -> timedelta:
    """``value`` (seconds, or a ``timedelta``; None: ``DEFAULT_TIMEOUT_S``)
    as a ``timedelta``.

    Raises:
        TypeError: neither a number of seconds nor a ``timedelta`` (a bool
            is refused), naming ``name``.
        ValueError: not finite and above zero, naming ``name``.
    """
    if value is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta, "
                        f"got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be finite and above zero, got {value!r}")
    return timedelta(seconds=seconds)


def checkpoint_group(group, timeout: timedelta):
    """A gloo group over ``group``'s ranks whose operations each end within
    ``timeout``, shared by every caller with the same ``group`` and
    ``timeout``; None for a group of one rank.

    The first call for a (``group``, ``timeout``) is collective over
    ``group``'s members (they all make the group, in the same order, as
    when building a ``DistributedOptimizer``); non-members need not take
    part (``use_local_synchronization``), so a subgroup's members alone
    make theirs. Under NCCL too: what the checkpoint sends travels through
    host memory.
    """
    if dist.get_world_size(group) == 1:
        return None
    by_timeout = _groups.setdefault(dist.group.WORLD if group is None else group, {})
    seconds = timeout.total_seconds()
    if seconds not in by_timeout:
        if group is None:
            made = dist.new_group(backend="gloo", timeout=timeout)
        else:
            _agree_on_group_count(group)
            made = dist.new_group(global_ranks(group), backend="gloo", timeout=timeout,
                                  use_local_synchronization=True)
        by_timeout[seconds] = made
    return by_timeout[seconds]


def _agree_on_group_count(group) -> None:
    """Make the members of ``group`` know as many process groups.

    A group made with ``use_local_synchronization`` is named after its
    ranks and how many groups the calling process knows; a process knows
    only the groups it is a member of, so the members of nested subgroups
    (``new_group([0])``, then ``new_group([0, 1])``) can count differently
    and would wait for each other under different names. Those behind make
    one-rank groups (no communication) until the counts agree.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if names is None:  # a torch without that registry: nothing to align
        return
    counts = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(names), group=group)
    for _ in range(max(counts) - len(names)):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)


def meet_for(checkpoint: Any, timeout: timedelta, call: str, fix: str) -> None:
    """Wait until every rank of ``checkpoint`` (a ``checkpoint_group``) is
    in ``call`` too, at most ``timeout``.

    Raises:
        RuntimeError: the ranks did not all arrive in time, or one has left
            the job; names ``call``, says it is collective and gives
            ``fix``, chained from torch's error (which names the ranks that
            did not arrive). After it, this group's connections between the
            ranks concerned are closed: later collective checkpoint calls
            fail the same way.
    """
    try:
        dist.monitored_barrier(checkpoint, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        seen = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"{call} is collective: every rank of the group must call it, and not all did "
            f"within {timeout.total_seconds():g} s (checkpoint_timeout), or one has left the "
            f"job ({seen}). A call made under `if rank == 0:` does this. {fix}. The "
            f"checkpoint's connections between these ranks are closed now: later collective "
            f"checkpoint calls of this job fail too (training is not affected)") from exc


def rank_in(checkpoint: Any, group, group_rank: int) -> int:
    """``checkpoint``'s rank of the process that is ``group``'s rank ``group_rank``."""
    return dist.get_group_rank(checkpoint, global_rank(group, group_rank))

