"""Checks of the user APIs' plain arguments, with errors that name the argument."""
from __future__ import annotations

from typing import Optional

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
