"""One parameter's slice on this rank, as the sharded optimizer steps it.

A ``ShardLayout`` says which elements of which parameter this rank owns;
``ParamShard`` adds what the wrapped optimizer steps for them: the
parameter itself (wholly owned, in its own dtype), a 1-D view of its memory
(cut by a part boundary), or a master copy (16-bit parameters stepped in
``master_dtype``, or a cut parameter that is not contiguous). The sharded
parameters (``sharded_params``) and the state's transport
(``shard_transport``) both read these records.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .precision import master_dtype_of
from .sharded import PartRange


@dataclass
class ParamShard:
    """One parameter's slice on this rank.

    Attributes:
        param: the parameter.
        index: its index in the optimizer's parameter order.
        range: the elements this rank owns (``start``/``end`` in the
            parameter's flattened order, ``offset`` in the bucket's part).
        tensor: what the wrapped optimizer steps for them.
        whole: the range is the whole parameter (``tensor`` has its shape).
        master: ``tensor`` is a copy, not the parameter's memory.
    """

    param: torch.Tensor
    index: int
    range: PartRange
    tensor: torch.Tensor
    whole: bool
    master: bool

    @property
    def swapped(self) -> bool:
        return self.tensor is not self.param

    def slice_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elements of ``tensor`` (shaped like ``param``) this slice
        holds: the tensor itself for a whole parameter, else a 1-D slice."""
        return tensor if self.whole else tensor.reshape(-1)[self.range.start:self.range.end]


def param_shard(param: torch.Tensor, index: int, r: PartRange,
                master_dtype: torch.dtype) -> ParamShard:
    """``param``'s slice ``r`` (parameter ``index``), stepped as the
    parameter, a view of it, or a master copy in ``master_dtype_of(param,
    master_dtype)``."""
    dtype = master_dtype_of(param, master_dtype)
    whole = r.start == 0 and r.end == param.numel()
    if whole and dtype == param.dtype:
        return ParamShard(param, index, r, param, True, False)
    if not whole and dtype == param.dtype and param.is_contiguous():
        return ParamShard(param, index, r, param.detach().view(-1)[r.start:r.end], False, False)
    shard = ParamShard(param, index, r, param, whole, True)
    shard.tensor = shard.slice_of(param.detach()).to(dtype, copy=True)
    return shard
