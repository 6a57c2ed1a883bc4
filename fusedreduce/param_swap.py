"""An optimizer's ``param_groups`` entries and ``state``, swapped for a block.

Several steps run a torch optimizer's own code on something else than what
it holds: its step on this rank's slices (``params`` swapped), a step that
makes the state at learning rate 0 (``lr`` swapped), ``state_dict()`` on the
gathered state (``state`` swapped), ``load_state_dict`` against stand-in
parameters. ``swapped`` is the one way they do it: whatever the block does,
raises included, the optimizer holds what it held before when it ends.

The wrappers (``DistributedOptimizer``, ``AdaSumByDeltaWeight``) take an
optimizer over whole: ``instance_of_both`` makes the object that is both the
wrapper and the wrapped optimizer's class, ``params_of`` lists what it holds.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Sequence, Set

import torch

from ._checks import check_instance

_KEEP = object()
#: the classes ``instance_of_both`` has combined an optimizer with
_WRAPPERS: Set[type] = set()


def instance_of_both(wrapper: type, optimizer) -> object:
    """A bare instance of a class deriving from ``wrapper`` and ``optimizer``'s
    class (``wrapper.__new__`` returns it, so the wrapper *is* an instance of
    the wrapped optimizer's class).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is
            already wrapped by a class this function combined.
    """
    check_instance(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
    _WRAPPERS.add(wrapper)
    base = type(optimizer)
    if issubclass(base, tuple(_WRAPPERS)):
        raise TypeError(f"optimizer is already wrapped ({base.__name__})")
    combined = type(f"{wrapper.__name__.removesuffix('Optimizer')}{base.__name__}",
                    (wrapper, base), {})
    return object.__new__(combined)


def wrapped_class(combined) -> type:
    """The wrapped optimizer's class of an instance ``instance_of_both`` made
    (``torch.optim.AdamW`` for a wrapped AdamW)."""
    return type(combined).__bases__[-1]


def params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter of ``optimizer``'s groups, in group order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


@contextmanager
def swapped(optimizer: torch.optim.Optimizer, state: Any = _KEEP,
            **entries: Sequence[Any]) -> Iterator[None]:
    """For the block, ``optimizer.state`` is ``state`` (when given) and each
    ``entries[key][i]`` is ``param_groups[i][key]``, in the groups that have
    ``key`` (the others are left alone); when the block ends, also by an
    exception, each is put back as it was. The entries go back into the
    groups the optimizer holds then, group by group: torch's
    ``load_state_dict`` replaces the group dicts (keeping their order), and
    the swapped ``params`` must leave its new groups too. Not a check: the
    values are the caller's to get right.

    Examples:
        >>> opt = torch.optim.SGD([torch.zeros(2)], lr=0.1)
        >>> with swapped(opt, lr=[0.0]):
        ...     opt.param_groups[0]["lr"]
        0.0
        >>> opt.param_groups[0]["lr"]
        0.1
    """
    groups = optimizer.param_groups
    kept = {key: [(i, g[key]) for i, g in enumerate(groups) if key in g] for key in entries}
    kept_state = optimizer.state
    try:
        for key, values in entries.items():
            for i, _ in kept[key]:
                groups[i][key] = values[i]
        if state is not _KEEP:
            optimizer.state = state
        yield
    finally:
        groups = optimizer.param_groups
        for key, old in kept.items():
            for i, value in old:
                groups[i][key] = value
        if state is not _KEEP:
            optimizer.state = kept_state
