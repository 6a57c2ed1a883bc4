"""Prepared handles: a flatten or unflatten of fixed tensors, validated once.

``flatten_cast_scale`` recognises a steady-state call by reading every
tensor's address and metadata (``_prepared.py``), because its caller may
hand it other tensors at any call. A loop that always moves the same tensors
(gradients living at fixed places, fp32 master weights written back into the
model's 16-bit parameters every step, buffers broadcast by the same list)
can say so once: ``prepare_flatten`` / ``prepare_unflatten`` validate and
prepare the launch, and the handle they return keeps the tensors and runs the
launch on each call with no per-tensor work at all: what a loop over
``torch._foreach_*`` ops costs, with the kernels' element rule and strategy
choice.

What a handle checks at each call is what its launch's memory safety needs:

- the scale (type, value, device) and the flags, as the functions do;
- the buffer's address: both backends hold views or addresses of it;
- on a backend whose launch holds the tensors' addresses (Triton's table),
  every tensor's address, in one C-level pass: a tensor moved since the
  handle was made would otherwise be read or written at memory it no longer
  owns. The torch fallback hands the tensor objects themselves to torch's
  ops, which read them wherever they are and check their shapes, so it
  reads no address.

Anything moved raises a ``RuntimeError`` naming it before anything is
written; the remedy is a new handle (or the checked functions, which follow
moved tensors). A tensor given another shape or dtype in place (``set_``,
``resize_``, ``.data =``) is outside the contract: the handle does not look.
"""
from __future__ import annotations

from typing import Callable, Tuple, Union

import torch

from . import _checks

_data_ptr = torch.Tensor.data_ptr


class _Handle:
    """What both handles share: the kept tensors, buffer and launch, and the
    per-call check of the scale, the flag and where they all are. ``_op``
    and ``_buffer_name`` are each kind's."""

    __slots__ = ("tensors", "buffer", "_launch", "_buffer_ptr", "_ptrs", "_backend")
    _op = _buffer_name = ""

    def __init__(self, tensors: Tuple[torch.Tensor, ...], buffer: torch.Tensor,
                 launch: Callable, backend_name: str) -> None:
        self._backend = backend_name
        self.tensors = tensors
        self.buffer = buffer
        self._launch = launch
        self._buffer_ptr = buffer.data_ptr()
        # the torch fallback hands the tensor objects to torch's ops; other
        # backends' launches hold their addresses
        self._ptrs = None if backend_name == "torch" else list(map(_data_ptr, tensors))

    def __repr__(self) -> str:
        b = self.buffer
        n = len(self.tensors)
        return (f"{type(self).__name__}({n} tensor{'' if n == 1 else 's'}, "
                f"{self._buffer_name}={str(b.dtype)[6:]}[{b.numel()}] on {b.device}, "
                f"backend={self._backend!r})")

    def _ready(self, scale, flag, flag_name: str):
        """The checked scale, once the flag is a bool and nothing has moved."""
        scale = _checks.scale_argument(scale)
        _checks.check_scale_device(scale, self.buffer.device)
        if type(flag) is not bool:
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
        if self.buffer.data_ptr() != self._buffer_ptr:
            raise RuntimeError(
                f"this {self._op} handle's {self._buffer_name} is no longer where it was "
                f"prepared (its storage was moved or resized): make a new handle with "
                f"prepare_{self._op}, or call {self._op}_cast_scale, which follows it")
        if self._ptrs is not None and list(map(_data_ptr, self.tensors)) != self._ptrs:
            moved = next(i for i, (t, p) in enumerate(zip(self.tensors, self._ptrs))
                         if t.data_ptr() != p)
            raise RuntimeError(
                f"tensors[{moved}] of this {self._op} handle is no longer where it was "
                f"prepared (its storage was replaced): make a new handle with "
                f"prepare_{self._op}, or call {self._op}_cast_scale, which follows moved "
                f"tensors")
        return scale


class PreparedFlatten(_Handle):
    """``flatten_cast_scale`` of fixed tensors into a fixed buffer; made by
    ``prepare_flatten``. ``tensors`` (a tuple) and ``out`` are the ones it
    was prepared with.

    Examples:
        >>> from fusedreduce.kernels import prepare_flatten
        >>> grads = [torch.ones(2, 3, dtype=torch.float16), torch.full((4,), 2.0)]
        >>> flatten = prepare_flatten(grads, torch.empty(10))
        >>> flatten(scale=0.5).tolist()
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    """

    __slots__ = ()
    _op, _buffer_name = "flatten", "out"

    @property
    def out(self) -> torch.Tensor:
        return self.buffer

    def __call__(self, scale: Union[float, torch.Tensor] = 1.0, *, check_finite: bool = False
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Fill ``out`` from the tensors as they are now, each element
        ``cast(x) * scale``; ``out``, or ``(out, found_nonfinite)`` with
        ``check_finite`` (as ``flatten_cast_scale``).

        Raises:
            TypeError: a non-number ``scale``, a non-bool ``check_finite``.
            ValueError: a non-finite ``scale``, or a tensor scale of more than
                one element or on another device.
            RuntimeError: ``out``, or on Triton a tensor, moved since
                preparation. Nothing is written when an error is raised.
        """
        scale = self._ready(scale, check_finite, "check_finite")
        flag = self._launch(self.tensors, self.buffer, scale, check_finite)
        return (self.buffer, flag) if check_finite else self.buffer


class PreparedUnflatten(_Handle):
    """``unflatten_cast_scale`` of a fixed buffer into fixed tensors; made by
    ``prepare_unflatten``. ``flat`` and ``tensors`` (a tuple) are the ones it
    was prepared with.

    Examples:
        >>> from fusedreduce.kernels import prepare_unflatten
        >>> params = [torch.zeros(2, 2, dtype=torch.float16), torch.zeros(3)]
        >>> write_back = prepare_unflatten(torch.arange(7.0), params)
        >>> write_back(scale=2.0)
        >>> params[1]
        tensor([ 8., 10., 12.])
    """

    __slots__ = ()
    _op, _buffer_name = "unflatten", "flat"

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer

    def __call__(self, scale: Union[float, torch.Tensor] = 1.0, *,
                 accumulate: bool = False) -> None:
        """Write (or, with ``accumulate``, add) ``flat``'s segments, scaled,
        into the tensors, in place (as ``unflatten_cast_scale``).

        Raises:
            TypeError: a non-number ``scale``, a non-bool ``accumulate``.
            ValueError: a non-finite ``scale``, or a tensor scale of more than
                one element or on another device.
            RuntimeError: ``flat``, or on Triton a tensor, moved since
                preparation. Nothing is written when an error is raised.
        """
        scale = self._ready(scale, accumulate, "accumulate")
        self._launch(self.buffer, self.tensors, scale, accumulate)
