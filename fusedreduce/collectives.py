"""Collectives over a BucketPlan: the one place that talks to torch.distributed.

Every API of fusedreduce reduces through here: flatten a bucket (cast and
prescale in the same pass), one collective per bucket, unflatten (cast back
and postscale in the same pass). Collectives are issued asynchronously, so the
flatten of bucket k+1 overlaps bucket k's communication.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from .buckets import Bucket, BucketPlan


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
            "the environment it reads)")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """Where tensors must live to go through ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_same_on_all_ranks(description: Sequence[Any], names: Sequence[str], group=None,
                             what: str = "parameter") -> None:
    """Raise on every rank unless all ranks hold the same ``description``.

    Costs one all-reduce of two int64s when the ranks agree; only on a mismatch
    are the descriptions gathered, to name the first entry that differs.

    Raises:
        RuntimeError: the ranks disagree; names the first differing ``what``
            (``names[i]``) and what each rank has there.
    """
    digest = hashlib.sha256(pickle.dumps(list(description))).digest()
    value = int.from_bytes(digest[:7], "little")  # 56 bits: exact in int64 arithmetic
    device = comm_device(group)
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):
        return
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (list(description), list(names)), group=group)
    longest = max(len(d) for d, _ in everyone)
    for i in range(longest):
        entries = [d[i] if i < len(d) else "<missing>" for d, _ in everyone]
        if any(e != entries[0] for e in entries):
            name = next(n[i] for d, n in everyone if i < len(n))
            per_rank = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            raise RuntimeError(f"ranks disagree on {what} {i} ({name}): {per_rank}. Every "
                               f"rank must pass the same {what}s in the same order")
    raise RuntimeError(f"ranks disagree on the {what} list")  # unreachable in practice


@dataclass
class PendingBucket:
    """A bucket whose collective is in flight: finish it with ``finish_bucket``."""

    bucket: Bucket
    buffer: torch.Tensor
    work: Optional[Any]


def start_bucket_all_reduce(plan: BucketPlan, bucket: Bucket, tensors: Sequence[torch.Tensor],
                            buffer: torch.Tensor, *, group=None, prescale: float = 1.0,
                            world_size: int = 2, backend: str = "auto") -> PendingBucket:
    """Flatten ``bucket`` into ``buffer`` (times ``prescale``) and start its all-reduce."""
    plan.flatten(bucket, tensors, out=buffer, scale=prescale, backend=backend)
    work = dist.all_reduce(buffer, group=group, async_op=True) if world_size > 1 else None
    return PendingBucket(bucket, buffer, work)


def finish_bucket(plan: BucketPlan, pending: PendingBucket, outputs: Sequence[torch.Tensor], *,
                  postscale: float = 1.0, backend: str = "auto") -> None:
    """Wait for ``pending``'s collective and write its buffer into ``outputs``."""
    if pending.work is not None:
        pending.work.wait()
    plan.unflatten(pending.bucket, pending.buffer, outputs, scale=postscale, backend=backend)


def new_buffers(plan: BucketPlan) -> List[torch.Tensor]:
    return [plan.new_buffer(b) for b in plan.buckets]


def check_buffers(plan: BucketPlan, buffers: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``buffers`` fit the plan's buckets one by one."""
    if len(buffers) != len(plan.buckets):
        raise ValueError(f"buffers has {len(buffers)} entries for {len(plan.buckets)} buckets")
    for bucket, buffer in zip(plan.buckets, buffers):
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != bucket.dtype \
                or buffer.device != bucket.device or buffer.shape != (bucket.size,) \
                or not buffer.is_contiguous():
            raise ValueError(
                f"buffers[{bucket.index}] must be a contiguous {bucket.dtype} tensor of shape "
                f"({bucket.size},) on {bucket.device}")


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
        TypeError, ValueError: tensors, outputs or buffers do not match the
            plan, or a bad scale; raised before any collective starts.

    Example:
        >>> plan = BucketPlan(grads, comm_dtype=torch.float32)      # doctest: +SKIP
        >>> all_reduce_plan(plan, grads, postscale=1 / dist.get_world_size())  # doctest: +SKIP
    """
    world_size = require_process_group(group)
    plan.check(tensors, "tensors")
    outputs = tensors if outputs is None else outputs
    plan.check(outputs, "outputs")
    for name, value in (("prescale", prescale), ("postscale", postscale)):
        kernels.check_scale(value, name)
    buffers = new_buffers(plan) if buffers is None else list(buffers)
    check_buffers(plan, buffers)
    pending = [start_bucket_all_reduce(plan, bucket, tensors, buffer, group=group,
                                       prescale=prescale, world_size=world_size,
                                       backend=backend)
               for bucket, buffer in zip(plan.buckets, buffers)]
    for p in pending:
        finish_bucket(plan, p, outputs, postscale=postscale, backend=backend)
    return buffers


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, *, group=None,
                      bucket_cap_mb: float = 25.0, backend: str = "auto") -> None:
    """Make every rank's ``tensors`` bitwise equal to rank ``src``'s, in place.

    Floating tensors go through fused buckets of their own dtype (one
    ``broadcast`` per bucket, no cast, so the copy is exact); other dtypes
    (integer and bool buffers, say) are packed per dtype with torch and
    broadcast once per dtype. Tensors on a device the backend cannot use
    (CPU tensors under NCCL) travel through a staging copy.

    ``src`` is a global rank, as in ``torch.distributed.broadcast``.
    """
    device = comm_device(group)
    floating = [t for t in tensors if t.dtype in kernels.SUPPORTED_DTYPES]
    others = [t for t in tensors if t.dtype not in kernels.SUPPORTED_DTYPES]
    staged = [t if t.device == device else t.to(device) for t in floating]
    plan = BucketPlan(staged, bucket_cap_mb=bucket_cap_mb)
    with torch.no_grad():
        for bucket in plan.buckets:
            buffer = plan.flatten(bucket, staged, backend=backend)
            dist.broadcast(buffer, src, group=group)
            plan.unflatten(bucket, buffer, staged, backend=backend)
        for t, s in zip(floating, staged):
            if s is not t:
                t.copy_(s)
        for dtype in sorted({t.dtype for t in others}, key=str):
            same = [t for t in others if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1).to(device) for t in same])
            dist.broadcast(flat, src, group=group)
            start = 0
            for t in same:
                t.copy_(flat[start:start + t.numel()].view(t.shape))
                start += t.numel()
