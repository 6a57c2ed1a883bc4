"""Checks of the user APIs' plain arguments, with errors that name the argument."""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence

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


def check_bool(value, name: str) -> bool:
    """``value`` if it is a bool (a string such as ``"False"`` would be true).

    Raises:
        TypeError: anything else, naming ``name``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return value


def check_choice(value, name: str, choices: Sequence[str], *, optional: bool = False):
    """``value`` if it is one of the strings ``choices`` (or None, with ``optional``).

    Raises:
        TypeError: not a string (nor None, with ``optional``), naming ``name``.
        ValueError: a string that is not one of ``choices``, naming ``name``.

    Examples:
        >>> check_choice("verify", "initial_parameters", ("verify", "broadcast"))
        'verify'
    """
    if optional and value is None:
        return value
    wanted = f"{name} must be {'None or ' if optional else ''}one of " \
             f"{', '.join(map(repr, choices))}, got {value!r}"
    if not isinstance(value, str):
        raise TypeError(wanted)
    if value not in choices:
        raise ValueError(wanted)
    return value


def refuse_join(owner: str):
    """What ``owner.join_hook`` raises: ``torch.distributed.algorithms.Join``
    asks a participant for its hook, and this one does not shadow the
    collectives of ranks that still have data.

    Raises:
        TypeError: always, naming what works for uneven inputs.
    """
    raise TypeError(
        f"{owner} does not take part in torch.distributed.algorithms.Join (uneven inputs): "
        f"every rank must run the same number of steps. Join works with "
        f"DistributedOptimizer, with a DistributedGradReducer whose hooks are "
        f"registered, and with DistributedDataParallel and a fusedreduce hook under "
        f"ddp.join(); or give every rank the same number of batches "
        f"(DistributedSampler(..., drop_last=True))")


def check_loss_scale(value):
    """``value`` as a gradient loss scale: None, a finite Python number > 0,
    or a one-element floating tensor, not on the meta device.

    A tensor's value is not read (that would synchronise with its device):
    the norm kernels make the unscaled norm NaN where it is not finite and
    > 0, so the gradients are not silently zeroed or flipped (see the
    clipping guide).

    Raises:
        TypeError: not None, a real number (bools excluded) or a tensor; a
            tensor that is not floating, naming ``loss_scale``.
        ValueError: a number that is not finite and > 0; a tensor of more
            than one element, or on the meta device.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"loss_scale must be a floating tensor, got dtype {value.dtype}")
        if value.numel() != 1:
            raise ValueError(f"loss_scale must be a one-element tensor (the scale the "
                             f"gradients carry), got shape {tuple(value.shape)}")
        if value.device.type == "meta":
            raise ValueError("loss_scale must not be a meta tensor: it holds no value; "
                             "pass scaler.scale(torch.ones((), device=...))")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"loss_scale must be None, a Python number or a one-element "
                        f"tensor, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"loss_scale must be finite and > 0 (the scale the gradients "
                         f"carry), got {value!r}")
    return value
