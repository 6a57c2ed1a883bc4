"""``DistributedOptimizer``'s checkpoints: the state dict in both flavours,
the per-rank files, and the state ``torch.distributed.checkpoint`` makes.

- The shared part: ``check_loadable`` (a dict matched to the parameters
  before anything changes), ``check_state_dict_args``,
  ``param_groups_only``, the per-rank files (``sharded_state_dict``,
  ``load_sharded_state_dict``), and the state made without a training step
  (``init_state``, ``is_checkpoint_initialisation``, ``initialise_state``).
- ``CheckpointMethods``: the public methods (``state_dict``,
  ``load_state_dict``, ``sharded_state_dict``, ``load_sharded_state_dict``,
  ``init_state``), mixed into ``DistributedOptimizer``.
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


class CheckpointMethods:
    """``DistributedOptimizer``'s checkpoint methods, mixed in just before the
    wrapped optimizer's class, whose methods ``super()`` reaches here. They
    read the optimizer's ``reducer``, ``_step`` (its step strategy),
    ``_steps`` and ``finish_param_gather()``."""

    def init_state(self) -> None:
        """Make the optimizer state now, as ``torch.distributed.checkpoint``
        does before its first save or load: the state of one step on zero
        gradients at learning rate 0, for every trainable parameter that has
        none (with ``shard=True``, this rank's part: the parameters it owns
        elements of). Parameters that have state keep it.

        Not a step: the parameters (and ``shard=True``'s masters), the
        ``.grad`` tensors and the learning rates are as before the call, and
        it is not counted. Not collective: nothing is communicated, each
        rank makes its own part, so it may be called on some ranks only.
        The state is DCP's: AdamW's ``step`` reads 1 and its moments 0, as
        for a plain torch optimizer after ``get_state_dict``, so a training
        step taken from it is AdamW's second (as after DCP): call it where
        DCP would make the state (before a save or a load), not before a
        run from scratch. Once the state is there, ``get_state_dict`` /
        ``set_state_dict`` take no step of their own; they still do where
        ``optimizer.state`` stays empty (an optimizer that keeps none, such
        as SGD without momentum, or a sharded rank that owns nothing), and
        ``step()`` makes the state there the same way. It raises no error
        of its own (the wrapped optimizer's step may).

        Examples:
            >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters()),  # doctest: +SKIP
            ...                            shard=True)
            >>> opt.init_state()                                      # doctest: +SKIP
            >>> model_state, opt_state = get_state_dict(model, opt)  # no step inside  # doctest: +SKIP
        """
        init_state(self, self._step, super())

    def state_dict(self, *, to: Optional[int] = None,
                   cpu_offload: bool = False) -> Optional[dict]:
        """``torch.optim.Optimizer.state_dict``, always in the unsharded form.

        With ``shard=True`` this is **collective**: every rank of the group
        must call it, and each gets the same full dict, with the keys and
        shapes the wrapped optimizer would have without fusedreduce (plus,
        for 16-bit parameters that have state, their fp32 master copy under
        ``"master_weight"``). Call it on every rank and save on one:
        ``if rank == 0: opt.state_dict()`` raises a ``RuntimeError`` on rank
        0 once ``checkpoint_timeout`` (constructor; default 60 s) has passed
        without the other ranks calling it, and leaves their training
        untouched: the call first meets the other ranks on a gloo group of
        its own, and everything it sends goes through that group, never the
        training group. ``to=k`` materialises the dict on group rank ``k``
        only (the others get None), saving the others' memory. Without sharding the
        state is already whole on every rank and nothing is communicated;
        ``to=k`` still gives None on the other ranks, so that
        ``if state is not None: torch.save(state, path)`` saves once in
        both modes.

        The tensors sit where the wrapped optimizer keeps them unsharded:
        per-element state on its parameter's device, a non-capturable
        ``step`` on the host. With ``shard=True`` they are fresh tensors
        (never the live state). ``cpu_offload=True`` puts every tensor on
        the host, as torch's ``StateDictOptions(cpu_offload=True)`` does
        (tensors already there are returned as they are); with
        ``shard=True`` the whole state is then put together on the host and
        never sits in device memory. The ranks' parts travel through host
        memory (under NCCL too), in rounds of at most
        ``GATHER_CHUNK_BYTES`` per rank (``fusedreduce.sharded_optimizer``).

        Args:
            to: the group rank that gets the dict (the others get None);
                None: every rank.
            cpu_offload: every tensor on the host.

        Raises:
            ValueError: ``to`` is not a rank of the group.
            TypeError: ``cpu_offload`` is not a bool.
            RuntimeError: with ``shard=True``, the ranks pass different
                ``to`` (raised on every rank, before the state is gathered);
                or not every rank called it within ``checkpoint_timeout``, or
                a rank has left the job (``DistributedOptimizer.state_dict()
                with shard=True is collective: ...``, with the fix, raised on
                the ranks that called it; the checkpoint's connections are
                closed after it, so later collective checkpoint calls fail
                too, while training goes on).

        Examples:
            >>> state = opt.state_dict(to=0, cpu_offload=True)  # on every rank  # doctest: +SKIP
            >>> if state is not None: torch.save(state, "opt.pt")  # rank 0 only  # doctest: +SKIP
        """
        check_state_dict_args(to, cpu_offload, self.reducer.world_size)
        return self._step.state_dict(self, super(), to, cpu_offload)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict`` from the unsharded form
        that ``state_dict()`` returns (or a plain optimizer's), at any world
        size, sharded or not; the loaded hyperparameters win over the
        constructor's, as in torch. With ``shard=True`` each rank keeps its
        part (a master copy comes from ``"master_weight"`` when present, else
        from the parameter), and the dict is cut down to that part before
        anything moves: a dict on the host (``state_dict(cpu_offload=True)``,
        or ``torch.load(..., map_location="cpu")``) puts 1/N of the state
        on the device, never the whole. Every rank loads the same dict.

        Raises:
            ValueError: the dict's groups or per-element state do not match the
                parameters (a state dict of another model); nothing is changed.
        """
        check_loadable(self, state_dict)
        self.finish_param_gather()
        self._step.load_checked(self, super(), self._step.own_part(state_dict))

    def sharded_state_dict(self) -> dict:
        """The state this rank holds, for a checkpoint saved one file per
        rank: not collective, and nothing is gathered, so no rank holds more
        than its own part. With ``shard=True`` it is this rank's part of the
        state (and of the 16-bit parameters' masters); without sharding, the
        state of every ``world_size``-th parameter from this rank's group
        rank on (the state is whole on every rank then). Per-element state is
        kept as ranges of each parameter's elements, so the save loads at any
        world size, sharded or not (``load_sharded_state_dict``), and
        ``fusedreduce.consolidate_sharded_state_dict`` turns all ranks'
        dicts into the whole ``state_dict()`` form in one process.

        The tensors are fresh copies on the host (never the live state,
        which later steps update in place); save the dict with
        ``torch.save``.

        Returns:
            ``{"format", "version", "rank", "world_size", "shapes",
            "param_groups", "state"}``: ``param_groups`` as in
            ``state_dict()``, ``state`` this rank's elements of each
            parameter's state, packed into a few tensors (one per state key
            and dtype; ``fusedreduce.sharded_checkpoint``); with
            ``error_feedback``, also ``"error_feedback"``: this rank's
            residuals (``DistributedGradReducer.error_feedback_state()``),
            which ``load_sharded_state_dict`` puts back when the run has
            the layout they were saved in, and otherwise warns that error
            feedback starts at zero.

        Examples:
            >>> torch.save(opt.sharded_state_dict(), f"ckpt/optim.{dist.get_rank()}.pt")  # doctest: +SKIP
            >>> opt.load_sharded_state_dict([f"ckpt/optim.{r}.pt" for r in range(8)])  # doctest: +SKIP
        """
        self.finish_param_gather()
        return sharded_state_dict(self, self._step, super(), self._steps)

    def load_sharded_state_dict(self, shards: Sequence[ShardSource]) -> None:
        """Load a checkpoint that every rank saved with ``sharded_state_dict()``,
        at this world size (the same or another), sharded or not. Each rank
        reads only the elements it holds now: with files, opened with
        ``mmap=True``, the rest is not read from disk. Not collective; every
        rank passes the whole save. The loaded hyperparameters win over the
        constructor's, as in ``load_state_dict``.

        Args:
            shards: every saved rank's dict, or the path of the file each was
                saved to, in any order.

        Raises:
            TypeError: ``shards`` is not a list or tuple, or an item is
                neither a dict nor a path.
            ValueError: the items are not one complete save of this
                optimizer's parameters (a rank missing or twice, shards of
                different saves, another model's shapes or groups); nothing
                is changed.

        Examples:
            >>> opt.load_sharded_state_dict([f"ckpt/optim.{r}.pt" for r in range(8)])  # doctest: +SKIP
        """
        load_sharded_state_dict(self, self._step, super(), shards)
