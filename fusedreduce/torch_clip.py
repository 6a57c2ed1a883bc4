"""torch's own ``clip_grad_norm_`` on the gradients of a sharded optimizer.

After a reducing backward with ``DistributedOptimizer(shard=True)`` each
rank's ``.grad`` holds the reduced gradient on the elements it owns and zeros
elsewhere (``shard_gradients=True``: ``None`` for the parameters it owns
nothing of). ``torch.nn.utils.clip_grad_norm_`` left in the training loop
would measure each rank's share and scale each by its own coefficient: a
model other than DDP's, silently. Every element lives on exactly one rank,
so the whole gradient's norm is the rank shares' norms combined (a sum of
p-th powers, or a max) by one scalar all-reduce, and torch's own
``_clip_grads_with_norm_`` then scales every share by the same coefficient:
DDP's step.

torch >= 2.6 splits ``clip_grad_norm_`` into ``_get_total_norm`` and
``_clip_grads_with_norm_`` and looks the former up in its module at every
call, so one wrapper there sees every ``clip_grad_norm_`` call, however the
script imported it. It is installed when the first sharded optimizer of
more than one rank is made and passes straight to torch's function unless
such an optimizer is alive with reduced gradients not yet stepped on, and
the norm asked for is over its parameters: then it is collective.

Older torch computes the norm inside ``clip_grad_norm_``, out of reach: the
sharded optimizer warns at construction instead. Watching the gradients'
version counters at ``step()`` could not tell a norm clip from the
elementwise in-place changes that are right under sharding
(``GradScaler.unscale_``, ``clip_grad_value_``, a division by the
accumulation count), so nothing is checked there: a false alarm on every
GradScaler loop would be worse.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from typing import List, Optional, Sequence

import torch
import torch.nn.utils.clip_grad as _torch_clip

from .clipping import norm_over_ranks
from .uneven_inputs import refuse_in_sharded_join

#: the sharded optimizers of more than one rank alive in this process
_SHARDED: "weakref.WeakSet" = weakref.WeakSet()
#: torch's ``_get_total_norm``, as it was before the wrapper replaced it
_torch_total_norm = getattr(_torch_clip, "_get_total_norm", None)
#: the code of torch's ``clip_grad_norm_`` (under its ``_no_grad`` decorator):
#: called from there, the wrapper reads the caller's ``parameters``, which
#: holds the parameters a rank has no ``.grad`` of too (``shard_gradients``)
_CLIP_CODE = getattr(inspect.unwrap(_torch_clip.clip_grad_norm_), "__code__", None)

#: the sharded optimizer's own clipping, which every message offers
FIX = "DistributedOptimizer(..., max_grad_norm=...) or optimizer.clip_grad_norm_(max_norm)"


def track(optimizer) -> None:
    """Make torch's ``clip_grad_norm_`` collective over ``optimizer``'s
    reduced gradients (a ``DistributedOptimizer(shard=True)`` over more than
    one rank) for as long as it lives; on torch without ``_get_total_norm``
    (< 2.6), warn that it cannot be."""
    if _torch_total_norm is None:
        warnings.warn(
            f"torch {torch.__version__} computes torch.nn.utils.clip_grad_norm_'s norm where "
            f"fusedreduce cannot reach it: over the gradients of DistributedOptimizer("
            f"shard=True) it would measure only each rank's share and clip each rank by a "
            f"different coefficient (torch >= 2.6 gives the whole gradient's norm). Clip with "
            f"{FIX} instead",
            stacklevel=3)
        return
    if _torch_clip._get_total_norm is not _total_norm:
        _torch_clip._get_total_norm = _total_norm
        if torch.nn.utils.get_total_norm is _torch_total_norm:
            torch.nn.utils.get_total_norm = _total_norm
    _SHARDED.add(optimizer)


def _total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                foreach: Optional[bool] = None) -> torch.Tensor:
    """torch's ``_get_total_norm``, and over a sharded optimizer's reduced
    gradients the whole gradient's norm (collective on its group)."""
    if not _SHARDED:
        return _torch_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    caller = sys._getframe(1)
    params = caller.f_locals.get("parameters") if caller.f_code is _CLIP_CODE else None
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    else:
        tensors = list(tensors)
    owner, params = _owner(tensors, params)
    if owner is None:
        return _torch_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    return _whole_norm(owner, params, float(norm_type), error_if_nonfinite, foreach)


def _owner(tensors: List[torch.Tensor], params: Optional[Sequence[torch.Tensor]]):
    """The sharded optimizer whose reduced gradients the norm is asked over,
    and the parameters asked for (None, None: no such optimizer, torch's
    norm). ``params``: the parameters ``clip_grad_norm_`` was given, else
    the ``tensors`` are matched to the optimizers' ``.grad`` by identity."""
    live = [opt for opt in _SHARDED if opt.reducer.reduced]
    if not live:
        return None, None
    owners = {id(p): opt for opt in live for p in opt._all_params()}
    if params is None:
        by_grad = {id(p.grad): p for opt in live for p in opt._all_params()
                   if p.grad is not None}
        ours = [by_grad[id(t)] for t in tensors if id(t) in by_grad]
        others = len(ours) < len(tensors)
    else:
        # one of ours counts even without a gradient (with shard_gradients
        # another rank may hold it); another parameter if it has one
        ours = [p for p in params if id(p) in owners]
        others = any(p.grad is not None for p in params if id(p) not in owners)
    found = {owners[id(p)] for p in ours}
    if not found:
        return None, None
    if len(found) == 1 and not others:
        return found.pop(), ours
    whose = ("of two sharded DistributedOptimizers" if len(found) > 1 else
             "of a DistributedOptimizer(shard=True) together with gradients it does not hold")
    raise RuntimeError(
        f"torch.nn.utils.clip_grad_norm_ (or get_total_norm) was given the reduced gradients "
        f"{whose}: each rank holds only its share of a sharded optimizer's gradients, so "
        f"their norm is collective on its group and cannot be combined with others in one "
        f"call; clip each optimizer's parameters in a call of their own, or clip with {FIX}")


def _whole_norm(optimizer, params: Sequence[torch.Tensor], norm_type: float,
                error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
    """The norm of order ``norm_type`` of ``params``' whole reduced gradient:
    torch's norm over this rank's owned slices (in the gradients' precision,
    as torch takes it), combined over the group in fp64 and returned in the
    dtype and on the device torch's would have, the same bits on every rank."""
    refuse_in_sharded_join(
        optimizer, "torch.nn.utils.clip_grad_norm_ (or get_total_norm) over its gradients "
        "(collective with shard=True)")
    if norm_type <= 0:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_norm_ with norm_type={norm_type} over the reduced "
            f"gradients of a DistributedOptimizer(shard=True): an order of 0 or below cannot "
            f"be combined from the ranks' shares; use a positive order, or clip with " + FIX)
    sharded = optimizer.sharded
    slices = sharded.owned_grad_slices(params)
    # decided from the parameters, not this rank's gradients, so that every
    # rank returns the same dtype and device (with shard_gradients a rank may
    # hold none of the gradients)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
    device = params[0].device
    with torch.no_grad():
        if slices:
            local = _torch_total_norm(slices, norm_type, False, foreach)
            local = local.to(device=device, dtype=torch.float64)
        else:
            local = torch.zeros((), dtype=torch.float64, device=device)
        # the p-th powers of the shares' norms add up to the whole's
        total = norm_over_ranks(local, norm_type, sharded.group, sharded.world_size).to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total
