"""Where the collective benchmarks' ranks come from: spawned locally, or a torchrun launch."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch

from fusedreduce.local_ranks import run_on_local_ranks

# a collective that never completes must end the run, not hang it; long enough
# for the other ranks of a torchrun launch to wait while rank 0 times the kernels
RANK_TIMEOUT = timedelta(seconds=1800)


def torchrun_env() -> bool:
    """Whether this process is one rank of an existing launch (``torchrun`` sets these)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _threads_per_rank(backend: str, world_size: int) -> Optional[int]:
    """gloo ranks share this machine's cores: one share each, not all of them."""
    return max(1, (os.cpu_count() or 2) // world_size) if backend == "gloo" else None


def rank_device(backend: str) -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_on_ranks(body, world_size: int, config: dict) -> Dict[int, object]:
    """``{rank: body(rank, world_size, config)}``, each rank a spawned local process
    (``fusedreduce.local_ranks.run_on_local_ranks``).

    ``config["backend"]`` is the process group's backend (``gloo``, or ``nccl``
    with rank r on GPU r). ``body`` must be a module-level function returning a
    picklable record. A rank that raises stops the others and raises here with
    its traceback.
    """
    backend = config["backend"]
    records = run_on_local_ranks(body, world_size, config, backend=backend, timeout=3600,
                                 collective_timeout=RANK_TIMEOUT.total_seconds(),
                                 threads=_threads_per_rank(backend, world_size))
    return dict(enumerate(records))


def join_launch(backend: str) -> Tuple[int, int]:
    """Join the launch ``torchrun`` set up in the environment: ``(rank, world_size)``."""
    import torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=RANK_TIMEOUT)
    threads = _threads_per_rank(backend, dist.get_world_size())
    if threads is not None:
        torch.set_num_threads(threads)
    return dist.get_rank(), dist.get_world_size()


def run_in_launch(body, config: dict) -> Dict[int, object]:
    """``body`` on this rank of a joined launch; every rank's record, on every rank."""
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    records: List[object] = [None] * world_size
    dist.all_gather_object(records, body(rank, world_size, config))
    return dict(enumerate(records))
