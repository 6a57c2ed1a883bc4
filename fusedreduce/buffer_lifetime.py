"""The lifetime of a flat buffer that is not kept between steps (ZeRO-2's
gradient buffers, the sharded all-gather's): its storage is given back
(resized to nothing) when the buffer is done with and given memory again
before its next use, so the tensor object and every view of it stay valid
across the gap, and the kernels' prepared launches, keyed by those objects,
are still found.
"""
from __future__ import annotations

from typing import Optional

import torch


def materialise(buffer: torch.Tensor) -> None:
    """Give ``buffer`` memory again if it was released (its storage resized
    to nothing): the tensor and its views see the new memory."""
    storage = buffer.untyped_storage()
    nbytes = buffer.numel() * buffer.element_size()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)


def release(buffer: torch.Tensor) -> None:
    """Give ``buffer``'s memory back (its storage resized to nothing); the
    tensor and its views stay, for ``materialise``."""
    buffer.untyped_storage().resize_(0)


def reinterpret(buffer: torch.Tensor, dtype: torch.dtype, numel: int) -> Optional[torch.Tensor]:
    """``numel`` elements of ``dtype`` over ``buffer``'s memory, if it is large enough."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > buffer.numel() * buffer.element_size():
        return None
    return buffer.view(torch.uint8)[:nbytes].view(dtype)
