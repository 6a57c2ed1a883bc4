"""Checks of the user APIs' plain arguments, with errors that name the argument."""
from __future__ import annotations

from typing import List, Optional

import torch

from . import kernels


def check_int(value, name: str, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``.

    Raises:
        ValueError: anything else, naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def check_prescale(prescale) -> Optional[float]:
    """``prescale`` (None: the API's default split of the mean).

    Raises:
        TypeError: not a Python number.
        ValueError: not finite, or 0 (the sum would be lost).
    """
    if prescale is not None:
        kernels.check_scale(prescale, "prescale")
        if prescale == 0:
            raise ValueError("prescale must not be 0: the sum would be lost")
    return prescale


def check_instance(value, name: str, kind: type, wanted: str, hint: str = "") -> None:
    """``value`` is a ``kind`` (``wanted`` spells it for the user, ``hint``
    says what to do instead).

    Raises:
        TypeError: anything else, naming ``name`` and what it got.
    """
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__}{hint}")


def tensor_list(value, name: str) -> list:
    """``value`` (any iterable of tensors but a tensor itself) as a list.

    Raises:
        TypeError: ``value`` is a tensor (iterating it would give its rows) or
            not iterable, naming ``name``.
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a list or tuple of tensors, got a single tensor; "
                        f"wrap it in a list: [tensor]")
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of tensors, got "
                        f"{type(value).__name__}") from None


def check_distinct(tensors: List[torch.Tensor], name: str) -> None:
    """No tensor appears twice in ``tensors``.

    Raises:
        ValueError: naming both positions of the first repeated tensor.
    """
    first = {}
    for i, t in enumerate(tensors):
        j = first.setdefault(id(t), i)
        if j != i:
            raise ValueError(f"{name}[{i}] is {name}[{j}] again: each tensor may be passed "
                             f"once (its gradient would be reduced twice)")
