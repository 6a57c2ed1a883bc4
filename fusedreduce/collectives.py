"""Collectives over a BucketPlan: the one place that talks to torch.distributed.

Every API of fusedreduce reduces through here: flatten a bucket (cast and
prescale in the same pass), one collective per bucket, unflatten (cast back
and postscale in the same pass). Collectives are issued asynchronously, so the
flatten of bucket k+1 overlaps bucket k's communication.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .buckets import BucketPlan


def require_process_group(group=None) -> int:
    """The world size of ``group``; a clear error if torch.distributed is not up.

    Raises:
        RuntimeError: no default process group has been initialised, or this
            process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('nccl' or 'gloo') first (torchrun sets "
            "the environment it reads), or use a world of one process")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return dist.get_world_size(group)


def all_reduce_plan(
    plan: BucketPlan,
    tensors: Sequence[torch.Tensor],
    *,
    outputs: Optional[Sequence[torch.Tensor]] = None,
    group=None,
    prescale: float = 1.0,
    postscale: float = 1.0,
    buffers: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> List[torch.Tensor]:
    """Sum ``tensors`` over ``group`` through the plan's fused buckets.

    Each bucket is flattened (cast to its communication dtype, times
    ``prescale``), summed with one ``all_reduce``, and written into
    ``outputs`` (cast back, times ``postscale``). A mean is
    ``postscale=1/world_size``; ``prescale`` guards low-precision overflow.

    Args:
        plan: a plan made from tensors shaped like ``tensors``, the same on
            every rank.
        tensors: this rank's tensors, in plan order; not modified unless they
            are also the ``outputs``.
        outputs: where the sums go (default: ``tensors``, in place).
        group: the process group (default: the world).
        prescale, postscale: finite factors applied before and after the sum.
        buffers: persistent flat buffers, one per bucket (default: fresh ones).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        The flat buffers holding the reduced (not yet postscaled) buckets.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: tensors or outputs do not match the plan, or a
            bad buffer; raised before any collective starts.

    Example:
        >>> plan = BucketPlan(grads, comm_dtype=torch.float32)      # doctest: +SKIP
        >>> all_reduce_plan(plan, grads, postscale=1 / dist.get_world_size())  # doctest: +SKIP
    """
    world_size = require_process_group(group)
    plan.check(tensors, "tensors")
    outputs = tensors if outputs is None else outputs
    plan.check(outputs, "outputs")
    if buffers is None:
        buffers = [plan.new_buffer(b) for b in plan.buckets]
    elif len(buffers) != len(plan.buckets):
        raise ValueError(f"buffers has {len(buffers)} entries for {len(plan.buckets)} buckets")
    for bucket, buffer in zip(plan.buckets, buffers):
        _check_buffer(bucket, buffer)
    pending = []
    for bucket, buffer in zip(plan.buckets, buffers):
        plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=backend)
        work = dist.all_reduce(buffer, group=group, async_op=True) if world_size > 1 else None
        pending.append((bucket, buffer, work))
    for bucket, buffer, work in pending:
        if work is not None:
            work.wait()
        plan.unflatten(bucket, buffer, outputs, scale=postscale, backend=backend)
    return list(buffers)


def _check_buffer(bucket, buffer) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != bucket.dtype \
            or buffer.device != bucket.device or buffer.shape != (bucket.size,) \
            or not buffer.is_contiguous():
        raise ValueError(
            f"buffers[{bucket.index}] must be a contiguous {bucket.dtype} tensor of shape "
            f"({bucket.size},) on {bucket.device}")
