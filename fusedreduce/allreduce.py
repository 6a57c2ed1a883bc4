"""The fused all-reduce pipeline over a BucketPlan: flatten → one collective → unflatten.

Each bucket is flattened into its flat buffer (cast to the communication dtype
and prescaled in the same pass), all-reduced with one asynchronous collective,
and scattered back (cast and postscaled in the same pass). Buckets are started
one after the other and finished afterwards, so the flatten of bucket k+1
overlaps bucket k's communication. ``DistributedGradReducer``,
``DistributedOptimizer`` and ``all_reduce_plan`` all reduce through
``start_bucket_all_reduce`` / ``finish_bucket``; the DDP hooks, whose buckets
DDP has already flattened, through ``start_cast_all_reduce`` / ``cast_back``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import kernels
from ._checks import tensor_list
from .buckets import Bucket, BucketPlan
from .process_group import require_process_group


@dataclass
class PendingBucket:
    """A bucket whose collective is in flight: finish it with ``finish_bucket``.

    Attributes:
        bucket: the plan's bucket.
        flat: the bucket's elements of the flat buffer (reduced once finished).
        work: the collective's handle, or None on a world of one rank.
        nonfinite_ranks: with ``count_nonfinite``, a 0-d view of the spare
            element: once finished, how many ranks' inputs held an inf or NaN.
    """

    bucket: Bucket
    flat: torch.Tensor
    work: Optional[Any]
    nonfinite_ranks: Optional[torch.Tensor] = None


def start_bucket_all_reduce(plan: BucketPlan, bucket: Bucket, tensors: Sequence[torch.Tensor],
                            buffer: torch.Tensor, *, group, world_size: int,
                            prescale: float = 1.0, backend: str = "auto",
                            count_nonfinite: bool = False,
                            mark_spare: Optional[int] = None) -> PendingBucket:
    """Flatten ``bucket`` into ``buffer`` (times ``prescale``) and start its all-reduce.

    With ``count_nonfinite``, ``buffer`` (``plan.new_buffer(bucket, spare=1)``) has
    one element more than the bucket: it carries 1 where this rank's inputs
    held an inf/NaN (else 0), so after the sum it counts the ranks that did, at
    no extra collective. ``mark_spare=k``: spare element ``k`` (after the
    bucket's, counted from 0) is set to 1 before the collective (the flatten
    zeroed it), so its sum counts the ranks that marked it. ``world_size`` is
    the group's: a world of one rank starts no collective.
    """
    spare = flatten_bucket(plan, bucket, tensors, buffer, prescale=prescale, backend=backend,
                           count_nonfinite=count_nonfinite, mark_spare=mark_spare)
    return start_all_reduce(bucket, buffer, group=group, world_size=world_size, spare=spare)


def flatten_bucket(plan: BucketPlan, bucket: Bucket, tensors: Sequence[torch.Tensor],
                   buffer: torch.Tensor, *, prescale: float = 1.0, backend: str = "auto",
                   count_nonfinite: bool = False,
                   mark_spare: Optional[int] = None) -> Optional[torch.Tensor]:
    """``start_bucket_all_reduce``'s flatten: ``bucket`` into ``buffer`` (times
    ``prescale``) with its spare elements set; returns the non-finite flag's
    spare element (``count_nonfinite``), else None."""
    # the buffer itself (never a fresh slice of it) goes to the kernels, so that
    # their launch prepared for it is found again next step; the spare element
    # lies past the bucket's segments and is zeroed with them, then set
    flat, spare = plan.flatten(bucket, tensors, out=buffer, scale=prescale,
                               check_finite=count_nonfinite, backend=backend), None
    if count_nonfinite:
        flat, flag = flat
        spare = buffer[bucket.size]
        spare.copy_(flag)
    if mark_spare is not None:
        buffer[bucket.size + mark_spare] = 1
    return spare


def start_all_reduce(bucket: Bucket, buffer: torch.Tensor, *, group, world_size: int,
                     spare: Optional[torch.Tensor] = None) -> PendingBucket:
    """Start the sum of ``buffer`` (``bucket``'s flat buffer, already filled) over
    ``group``; a world of one rank starts no collective."""
    work = dist.all_reduce(buffer, group=group, async_op=True) if world_size > 1 else None
    return PendingBucket(bucket, buffer, work, spare)


def start_cast_all_reduce(tensor: torch.Tensor, wire: torch.Tensor, *, group,
                          prescale: float = 1.0,
                          backend: str = "auto") -> torch.futures.Future:
    """Start the sum over ``group`` of an already flat ``tensor`` (a DDP bucket)
    in ``wire`` (kept by the caller, so that the kernels' launch prepared for it
    is found again); returns the collective's future. Finish with ``cast_back``.

    ``wire`` is ``tensor`` itself when no cast is needed: ``tensor`` is then
    multiplied by ``prescale`` in place (DDP's own rounding: each addend times
    the scale, then the sum), else cast into ``wire`` times ``prescale`` in one
    fused pass. The collective starts on a world of one rank too, as DDP's own
    hooks do.
    """
    if wire is tensor:
        if prescale != 1.0:
            tensor.mul_(prescale)
    else:
        kernels.flatten_cast_scale([tensor], wire, scale=prescale, backend=backend)
    return dist.all_reduce(wire, group=group, async_op=True).get_future()


def cast_back(wire: torch.Tensor, tensor: torch.Tensor, postscale, *,
              backend: str = "auto") -> torch.Tensor:
    """Write ``start_cast_all_reduce``'s reduced ``wire`` into ``tensor`` times
    ``postscale`` (a number, or a one-element device tensor) and return
    ``tensor``: one fused cast-back pass, or a multiply in place when ``wire``
    is ``tensor``."""
    if wire is not tensor:
        kernels.unflatten_cast_scale(wire, [tensor], scale=postscale, backend=backend)
        return tensor
    if isinstance(postscale, torch.Tensor):
        return tensor.mul_(postscale.to(tensor.dtype))
    return tensor.mul_(postscale) if postscale != 1.0 else tensor


def finish_bucket(plan: BucketPlan, pending: PendingBucket, outputs: Sequence[torch.Tensor], *,
                  postscale: float = 1.0, backend: str = "auto") -> None:
    """Wait for ``pending``'s collective and write its buffer into ``outputs``."""
    wait_for(pending)
    plan.unflatten(pending.bucket, pending.flat, outputs, scale=postscale, backend=backend)


def wait_for(pending: PendingBucket) -> None:
    """Wait for ``pending``'s collective, if it started one."""
    if pending.work is not None:
        pending.work.wait()


def check_buffers(plan: BucketPlan, buffers: Sequence[torch.Tensor], name: str = "buffers",
                  numel: Callable[[Bucket], int] = operator.attrgetter("size")) -> None:
    """Raise ValueError unless ``buffers`` fit the plan's buckets one by one:
    one contiguous tensor of the bucket's dtype and device per bucket, of
    ``numel(bucket)`` elements (the whole bucket by default; a part of it for
    the sharded pipelines)."""
    if len(buffers) != len(plan.buckets):
        raise ValueError(f"{name} has {len(buffers)} entries for {len(plan.buckets)} buckets")
    for bucket, buffer in zip(plan.buckets, buffers):
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != bucket.dtype \
                or buffer.device != bucket.device or buffer.shape != (numel(bucket),) \
                or not buffer.is_contiguous():
            raise ValueError(
                f"{name}[{bucket.index}] must be a contiguous {bucket.dtype} tensor of shape "
                f"({numel(bucket)},) on {bucket.device}")


def all_reduce_plan(
    plan: BucketPlan,
    tensors: Sequence[torch.Tensor],
    *,
    outputs: Optional[Sequence[torch.Tensor]] = None,
    group: Optional[dist.ProcessGroup] = None,
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
        prescale: a finite factor applied before the sum.
        postscale: a finite factor applied after the sum.
        buffers: persistent flat buffers, one per bucket (default: fresh ones).
        backend: the kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Returns:
        The flat buffers holding the reduced (not yet postscaled) buckets.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: tensors, outputs or buffers do not match the
            plan, or a bad scale; raised before any collective starts.

    Examples:
        >>> plan = BucketPlan(grads, comm_dtype=torch.float32)      # doctest: +SKIP
        >>> all_reduce_plan(plan, grads, postscale=1 / dist.get_world_size())  # doctest: +SKIP
    """
    tensors = tensor_list(tensors, "tensors")
    if outputs is not None:
        outputs = tensor_list(outputs, "outputs")
    world_size = require_process_group(group)
    plan.check(tensors, "tensors")
    outputs = tensors if outputs is None else outputs
    plan.check(outputs, "outputs")
    for name, value in (("prescale", prescale), ("postscale", postscale)):
        kernels.check_scale(value, name)
    buffers = [plan.new_buffer(b) for b in plan.buckets] if buffers is None else list(buffers)
    check_buffers(plan, buffers)
    pending = [start_bucket_all_reduce(plan, bucket, tensors, buffer, group=group,
                                       world_size=world_size, prescale=prescale,
                                       backend=backend)
               for bucket, buffer in zip(plan.buckets, buffers)]
    for p in pending:
        finish_bucket(plan, p, outputs, postscale=postscale, backend=backend)
    return buffers
