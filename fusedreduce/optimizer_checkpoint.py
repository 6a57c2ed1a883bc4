"""``DistributedOptimizer``'s checkpoints: the state dict in both flavours,
the per-rank files, and the state ``torch.distributed.checkpoint`` makes.

- The shared part: ``check_loadable`` (a dict matched to the parameters
  before anything changes), ``check_state_dict_args``,
  ``param_groups_only``, the per-rank files (``sharded_state_dict``,
  ``load_sharded_state_dict``), and the state made without a training step
  (``init_state``, ``is_checkpoint_initialisation``, ``initialise_state``).
- The flavours, mixed into the step strategies: ``ReplicatedCheckpoint``
  (the state is whole on every rank: nothing communicated) and
  ``ShardedCheckpoint`` (each rank holds its part: ``state_dict()`` puts the
  parts together on the checkpoint group, a load keeps this rank's part,
  through ``ShardedParameters``' transport).

Every function takes the optimizer (``opt``: its ``param_groups`` and
``state``) and, where the wrapped optimizer's own method runs, ``wrapped``:
``super()`` of ``DistributedOptimizer`` (its ``step``, ``state_dict``,
``load_state_dict``).
"""
from __future__ import annotations

import copy
import itertools
import warnings
from typing import List, Optional, Sequence

import torch

from ._checks import check_instance, check_int
from .checkpoint_group import checkpoint_group, meet_for, rank_in
from .param_swap import params_of, swapped, wrapped_class
from .process_group import verify_same_on_all_ranks
from .sharded_checkpoint import (ShardSource, check_shapes, make_piece, pieces_by_index,
                                 read_shards, sharded_state, state_over, whole_state_dict)
from .sharded_optimizer import ELEMENTWISE_OPTIMIZERS, master_dtype_of

#: what a rank that calls the collective ``state_dict()`` alone is told to do
STATE_DICT_FIX = ("Call `state = opt.state_dict(to=0)` on every rank and save it on one "
                  "(`if state is not None: torch.save(state, path)`), or save "
                  "`opt.sharded_state_dict()` on every rank, one file per rank (not collective)")


def on_host(state_dict: dict) -> dict:
    """``state_dict`` with its state's tensors on the host (those already
    there as they are, as torch's ``StateDictOptions(cpu_offload=True)``)."""
    state = {k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in entry.items()}
             for k, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def without_master_weights(state_dict: dict) -> dict:
    """``state_dict`` without the sharded mode's ``master_weight`` entries
    (an unsharded optimizer steps the parameters themselves)."""
    if not any("master_weight" in entry for entry in state_dict["state"].values()):
        return state_dict
    state = {k: {n: v for n, v in entry.items() if n != "master_weight"}
             for k, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def check_state_dict_args(to: Optional[int], cpu_offload: bool, world_size: int) -> None:
    """``state_dict()``'s arguments, checked before anything is gathered."""
    if to is not None:
        check_int(to, "to", minimum=0)
        if to >= world_size:
            raise ValueError(f"to={to} is not a rank of the group ({world_size} ranks)")
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload must be True or False, got {cpu_offload!r}")


def check_loadable(opt, state_dict: dict) -> None:
    """Match ``state_dict`` to the parameters before anything changes."""
    check_instance(state_dict, "state_dict", dict, "a dict from state_dict()")
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must have 'state' and 'param_groups' entries (the "
                         "form state_dict() returns)")
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(groups)} parameter groups, the optimizer "
                         f"{len(opt.param_groups)}")
    ids = []
    for i, (saved, own) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(own["params"]):
            raise ValueError(f"state_dict's param_groups[{i}] has {len(saved['params'])} "
                             f"parameters, the optimizer's {len(own['params'])}")
        ids += list(saved["params"])
    params = dict(zip(ids, params_of(opt)))
    # an elementwise optimizer's tensors are per element of their parameter;
    # others keep state of other shapes (LBFGS: flat directions over every
    # parameter, under the first), which their own load takes as it is
    per_element = opt.shard or wrapped_class(opt) in ELEMENTWISE_OPTIMIZERS
    for key, entry in state_dict["state"].items():
        p = params.get(key)
        if p is None:
            raise ValueError(f"state_dict's state has an entry for parameter {key!r}, "
                             f"which no parameter group lists")
        for name, value in entry.items():
            if per_element and isinstance(value, torch.Tensor) and value.dim() > 0 and \
                    value.shape != p.shape:
                raise ValueError(
                    f"state_dict's state[{key!r}][{name!r}] has shape {tuple(value.shape)} "
                    f"but the parameter it belongs to has {tuple(p.shape)}: a state dict "
                    f"of another model")


def param_groups_only(opt, wrapped) -> list:
    """``state_dict()["param_groups"]``, without gathering any state."""
    with swapped(opt, state={}):
        return wrapped.state_dict()["param_groups"]


def sharded_state_dict(opt, strategy, wrapped, steps: int) -> dict:
    """``DistributedOptimizer.sharded_state_dict``: this rank's pieces, as
    ``strategy`` holds them, and the groups (nothing gathered)."""
    params = params_of(opt)
    world_size = strategy.reducer.world_size
    rank = strategy.options.rank
    pieces = strategy.checkpoint_pieces(opt, rank, world_size)
    state = sharded_state(rank, world_size, [p.shape for p in params],
                          param_groups_only(opt, wrapped), pieces, steps=steps)
    feedback = strategy.reducer.error_feedback_state()
    if feedback is not None:
        state["error_feedback"] = feedback
    return state


def load_sharded_state_dict(opt, strategy, wrapped, shards: Sequence[ShardSource]) -> None:
    """``DistributedOptimizer.load_sharded_state_dict``: the save checked
    against the parameters, then the elements ``strategy`` holds loaded."""
    loaded = read_shards(shards)
    check_shapes(loaded, [p.shape for p in params_of(opt)],
                 [len(g["params"]) for g in opt.param_groups])
    by_index = pieces_by_index(loaded)
    strategy.finish_param_gather()
    strategy.load_pieces(opt, wrapped, loaded, by_index)
    _continue_error_feedback(strategy.reducer, strategy.options.rank, loaded)


def _continue_error_feedback(reducer, rank: int, loaded: Sequence[dict]) -> None:
    """Put back this rank's saved error-feedback residuals where the save
    has them in this run's layout; where it has residuals this run cannot
    take, warn that error feedback starts at zero (never raise: the state
    is loaded by then, and the residuals are not needed to go on)."""
    if not reducer.keeps_error_feedback:
        return  # no error feedback now: nothing to continue
    own = [item for item in loaded
           if item["world_size"] == reducer.world_size and item["rank"] == rank]
    saved = own[0].get("error_feedback") if own else None
    if saved is None:
        if any("error_feedback" in item for item in loaded):
            warnings.warn(
                f"the checkpoint has error-feedback residuals of {loaded[0]['world_size']} "
                f"ranks, this run has {reducer.world_size}: error feedback starts at zero "
                f"(residuals load only into the layout they were saved in)", stacklevel=4)
        return
    try:
        reducer.load_error_feedback_state(saved)
    except (TypeError, ValueError) as error:
        warnings.warn(f"the error_feedback of rank {rank}'s shard: {error}; error feedback "
                      f"starts at zero", stacklevel=4)


def is_checkpoint_initialisation(opt, reducer) -> bool:
    """Whether this ``step()`` is ``torch.distributed.checkpoint``'s way
    of making the state: ``_init_optim_state``
    (``torch/distributed/checkpoint/state_dict.py``, lines 629-668 in
    torch 2.13), when ``optim.state`` is empty and no ``.grad`` is set,
    assigns ``torch.zeros_like(param)`` to every trainable parameter,
    sets each group's ``"lr"`` to 0 and calls ``optim.step(closure=None)``.

    It is recognised by what it sets up because nothing else of DCP
    reaches the optimizer first: ``get_state_dict``,
    ``get_optimizer_state_dict`` (line 916) and the ``set_*`` forms
    (line 1093) call it before ``state_dict()`` / ``load_state_dict()``
    (lines 917 and 1186), so state-dict pre-hooks run too late; and its
    one test, ``if optim.state`` (line 633), cannot be answered ahead:
    a state made at construction, by the one generic means (a step on
    zeros), would change every run (AdamW would count that step, and
    ``state_dict()`` before the first step would not be empty), and with
    ``shard=True`` a rank that owns no element keeps an empty state for
    good, so DCP calls ``step()`` there, alone, at every save and load.
    ``init_state()`` makes the same state explicitly.

    Each condition is needed for a step that communicates nothing:
    gradients no backward reduced (a warm-up's step at lr 0 on a
    backward's zeros is an ordinary step), all zeros (reduced, they are
    the same zeros, so the state is the same on every rank), lr 0
    (nothing moves, so nothing is gathered), and no state on this rank
    (DCP's own condition; with state, gradients no backward reduced are
    refused as before)."""
    if reducer.reduced or opt.state or \
            any(float(g.get("lr", 1.0)) != 0.0 for g in opt.param_groups):
        return False
    grads = [p.grad for p in params_of(opt) if p.grad is not None]
    return bool(grads) and not any(bool(g.any()) for g in grads)


def init_state(opt, strategy, wrapped) -> None:
    """``DistributedOptimizer.init_state``: a step on zero gradients at
    learning rate 0 for every trainable parameter ``strategy`` steps here
    that has no state, the ``.grad`` tensors and rates put back after."""
    missing = {id(p) for p in params_of(opt) if p.requires_grad and not opt.state.get(p)
               and strategy.steps_here(p)}
    if not missing:
        return
    params = params_of(opt)
    grads = [p.grad for p in params]
    zero_lrs = [torch.zeros_like(g["lr"]) if isinstance(g.get("lr"), torch.Tensor) else 0.0
                for g in opt.param_groups]
    try:
        # zeros where state is missing, None elsewhere: torch's step
        # skips a parameter without gradient
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing else None
        with swapped(opt, lr=zero_lrs):
            initialise_state(opt, strategy, wrapped)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def initialise_state(opt, strategy, wrapped) -> None:
    """The wrapped optimizer's step on the zero gradients in ``.grad``,
    at learning rate 0, with nothing communicated (reduced, zeros are
    the same zeros on every rank): it makes the state as a first step
    would, and is not counted as a step. What it stepped (the
    parameters, or with ``shard=True`` this rank's slices and masters,
    so nothing is gathered) is put back as it was: at learning rate 0
    nothing should move, but torch's Adam on fp16 tensors turns them
    into NaN (its ``eps`` of 1e-8 rounds to 0 in fp16, and 0 / 0 times
    a zero step is NaN)."""
    stepped = strategy.locally_stepped(opt)
    with torch.no_grad():
        kept = [t.detach().clone() for t in stepped]
    strategy.step_locally(opt, wrapped)
    with torch.no_grad():
        for tensor, value in zip(stepped, kept):
            tensor.copy_(value)


class ReplicatedCheckpoint:
    """The state-dict flavour where every rank holds the whole state."""

    def state_dict(self, opt, wrapped, to: Optional[int], cpu_offload: bool) -> Optional[dict]:
        if to is not None and self.options.rank != to:
            return None
        whole = wrapped.state_dict()
        return on_host(whole) if cpu_offload else whole

    def own_part(self, state_dict: dict) -> dict:
        return state_dict

    def load_checked(self, opt, wrapped, state_dict: dict) -> None:
        """``load_state_dict`` of a dict matched to the parameters."""
        wrapped.load_state_dict(without_master_weights(state_dict))

    def checkpoint_pieces(self, opt, rank: int, world_size: int) -> dict:
        """This rank's pieces of a per-rank save: every ``world_size``-th
        parameter's state from ``rank`` on."""
        return {i: make_piece(p, 0, p.numel(), opt.state[p])
                for i, p in enumerate(params_of(opt))
                if i % world_size == rank and opt.state.get(p)}

    def load_pieces(self, opt, wrapped, loaded: list, by_index: dict) -> None:
        self.load_checked(opt, wrapped, whole_state_dict(loaded, by_index))


class ShardedCheckpoint:
    """The state-dict flavour where each rank holds its part of the state
    (``self.sharded``, a ``ShardedParameters``; ``self.state_gather``, how
    the parts are put together: ``state_gather``)."""

    def full_state(self, opt, call: str, fix: str, to: Optional[int] = None,
                   cpu_offload: bool = False) -> Optional[dict]:
        """Every rank's part of the state put together
        (collective, on the checkpoint group only), keyed by parameter; None
        on ranks other than ``to``. ``call`` and ``fix`` make the error of a
        call the other ranks do not make (``meet_for``)."""
        parts = self.state_gather.parts(self.sharded, opt.state, call, fix, to)
        return None if parts is None else self.sharded.whole_state(parts, cpu_offload)

    def state_dict(self, opt, wrapped, to: Optional[int], cpu_offload: bool) -> Optional[dict]:
        self.finish_param_gather()
        full = self.full_state(opt, "DistributedOptimizer.state_dict() with shard=True",
                               STATE_DICT_FIX, to, cpu_offload)
        if full is None:
            return None
        with swapped(opt, state=full):
            return wrapped.state_dict()

    def own_part(self, state_dict: dict) -> dict:
        return self.sharded.own_part(state_dict)

    def load_checked(self, opt, wrapped, state_dict: dict) -> None:
        """``load_state_dict`` of a dict matched to the parameters, which may
        hold only this rank's parameters, a cut one's per-element values as
        the 1-D slice this rank owns."""
        # loaded against stand-ins in the dtype each slice is stepped in, so
        # torch casts the state to it (not to a 16-bit parameter's dtype)
        params = params_of(opt)
        stand_ins = [torch.empty(0, dtype=master_dtype_of(p, self.options.master_dtype),
                                 device=p.device) for p in params]
        back = {id(s): p for s, p in zip(stand_ins, params)}
        left = iter(stand_ins)
        with swapped(opt, params=[list(itertools.islice(left, len(g["params"])))
                                  for g in opt.param_groups]):
            wrapped.load_state_dict(state_dict)
        full = {back[id(s)]: entry for s, entry in opt.state.items()}
        opt.state = self.sharded.take_state(full)

    def checkpoint_pieces(self, opt, rank: int, world_size: int) -> dict:
        return self.sharded.checkpoint_pieces(opt.state)

    def load_pieces(self, opt, wrapped, loaded: list, by_index: dict) -> None:
        # only the elements this rank owns are put together: a cut
        # parameter's state as the 1-D slice that take_state keeps
        groups = copy.deepcopy(loaded[0]["param_groups"])
        ids = [i for g in groups for i in g["params"]]
        state = {}
        for p, s in self.sharded.by_param.items():
            pieces = by_index.get(s.index)
            if pieces:
                state[ids[s.index]] = state_over(pieces, s.range.start, s.range.end,
                                                 p.shape if s.whole else None)
        self.load_checked(opt, wrapped, {"state": state, "param_groups": groups})


def state_gather(group, world_size: int, timeout) -> "_PartsOverRanks | _PartOfOneRank":
    """How ``ShardedCheckpoint.full_state`` puts the ranks' parts of the state
    together, chosen once: on the checkpoint group (made here: collective
    over ``group``, see ``checkpoint_group``), or, on a world of one rank,
    its part is the whole."""
    if world_size == 1:
        return _PartOfOneRank()
    return _PartsOverRanks(checkpoint_group(group, timeout), group, timeout)


class _PartsOverRanks:
    """Every rank's part, gathered on the checkpoint group once the ranks
    have met there."""

    def __init__(self, checkpoint, group, timeout) -> None:
        self.checkpoint, self.group, self.timeout = checkpoint, group, timeout

    def parts(self, sharded, state, call: str, fix: str,
              to: Optional[int]) -> Optional[List[dict]]:
        """Every rank's part of ``state`` (collective); None on ranks other
        than ``to``."""
        checkpoint = self.checkpoint
        meet_for(checkpoint, self.timeout, call, fix)
        # ranks passing different ``to`` would meet an all-gather with a
        # gather, or gathers to different ranks, and wait in them
        verify_same_on_all_ranks([], [], checkpoint, options=[("state_dict(to=...)", to)])
        return sharded.gather_parts(sharded.part_to_send(state), checkpoint,
                                    None if to is None else rank_in(checkpoint, self.group, to))


class _PartOfOneRank:
    """A world of one rank: its part is the whole state, no one to meet."""

    def parts(self, sharded, state, call: str, fix: str, to: Optional[int]) -> List[dict]:
        return [sharded.part_to_send(state)]
