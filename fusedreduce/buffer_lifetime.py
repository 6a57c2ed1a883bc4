"""The lifetime of a flat buffer that is not kept between steps (ZeRO-2's
gradient buffers, the sharded all-gather's): its storage is given back
(resized to nothing) when the buffer is done with and given memory again
before its next use, so the tensor object and every view of it stay valid
across the gap, and the kernels' prepared launches, keyed by those objects,
are still found.

``KeptBuffer`` and ``ReleasedBuffer`` are the two lifetimes as one object
each, with the same two calls: ``take()`` before a use, ``done()`` after it.
"""
from __future__ import annotations

from typing import Callable, Optional

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


#: with buffers released between uses, how many buckets' whole buffers may
#: have memory at once (in backward and in the all-gather): the bucket
#: starting and the one before it, whose collective may still run
ALIVE = 2


class KeptBuffer:
    """A flat buffer whose memory is held throughout: ``ReleasedBuffer``'s
    calls, doing nothing.

    Args:
        tensor: the buffer.

    Examples:
        >>> held = KeptBuffer(torch.zeros(4))
        >>> held.take() is held.tensor
        True
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: Optional[torch.Tensor] = tensor

    def take(self) -> torch.Tensor:
        """The buffer, with its memory."""
        return self.tensor

    def done(self) -> None:
        """Nothing to give back: the memory stays for the next use."""


class ReleasedBuffer:
    """A flat buffer made on first use whose memory is given back after each
    use (``release``) and given again before the next (``materialise``):
    the same tensor object throughout, so its views and the launches kept
    for it stay valid.

    Args:
        make: makes the buffer (called on the first ``take``).

    Examples:
        >>> held = ReleasedBuffer(lambda: torch.zeros(4))
        >>> buffer = held.take()
        >>> held.done(); buffer.untyped_storage().nbytes()
        0
        >>> held.take() is buffer, buffer.untyped_storage().nbytes()
        (True, 16)
    """

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self._make = make
        self.tensor: Optional[torch.Tensor] = None

    def take(self) -> torch.Tensor:
        """The buffer, with memory: made the first time, its memory given
        again after ``done``."""
        if self.tensor is None:
            self.tensor = self._make()
        else:
            materialise(self.tensor)
        return self.tensor

    def done(self) -> None:
        """Give the buffer's memory back until the next ``take``."""
        release(self.tensor)
