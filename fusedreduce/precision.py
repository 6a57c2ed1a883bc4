"""How gradients travel: the communication dtype, and where a mean's division happens.

Every user API (the reducer, the optimizer, AdaSum, the DDP hooks) reads these
rules from here, so a gradient of a given dtype travels the same way whichever
API reduces it.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from .kernels import SIXTEEN_BIT_DTYPES


def communication_dtype(grad_dtype: torch.dtype,
                        reduce_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a gradient travels (and is summed or combined) in.

    A 16-bit ``reduce_dtype`` compresses every gradient to it; otherwise 16-bit
    gradients widen to ``reduce_dtype`` and nothing narrows: fp64 stays fp64.
    With the default, 16-bit gradients are reduced in fp32 and fp32/fp64 in
    their own dtype (what AdaSum and ``allreduce_hook`` do).

    Examples:
        >>> communication_dtype(torch.bfloat16), communication_dtype(torch.float64)
        (torch.float32, torch.float64)
        >>> communication_dtype(torch.float32, torch.float16)
        torch.float16
    """
    if reduce_dtype in SIXTEEN_BIT_DTYPES:
        return reduce_dtype
    if grad_dtype == torch.float64:
        return torch.float64
    return reduce_dtype


def split_scale(total: float, prescale: Optional[float], default: float) -> Tuple[float, float]:
    """``(before, after)`` with ``before * after == total``: the factor applied
    before the collective (``prescale``, or ``default`` when it is None) and
    the rest of ``total`` after it.

    Examples:
        >>> split_scale(0.25, None, 1.0)
        (1.0, 0.25)
    """
    before = default if prescale is None else prescale
    return before, total / before


def master_dtype_of(param: torch.Tensor, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``param``'s slice is stepped in: ``master_dtype`` for 16-bit
    parameters, the parameter's own dtype otherwise.

    Examples:
        >>> master_dtype_of(torch.zeros(2, dtype=torch.bfloat16), torch.float32)
        torch.float32
        >>> master_dtype_of(torch.zeros(2, dtype=torch.float64), torch.float32)
        torch.float64
    """
    return master_dtype if param.dtype in SIXTEEN_BIT_DTYPES else param.dtype


def exact_common_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """One dtype that carries a value of each of ``dtypes`` exactly: the
    widest, and fp32 for fp16 beside bf16 (neither holds the other).

    Examples:
        >>> exact_common_dtype([torch.float16, torch.bfloat16])
        torch.float32
        >>> exact_common_dtype([torch.bfloat16, torch.float64])
        torch.float64
    """
    dtypes = set(dtypes)
    if len(dtypes) == 1:
        return dtypes.pop()
    widest = max(dtypes, key=lambda d: torch.empty((), dtype=d).element_size())
    return torch.float32 if widest in SIXTEEN_BIT_DTYPES else widest
