"""Uneven inputs: ``DistributedOptimizer`` and ``DistributedGradReducer`` as
participants of ``torch.distributed.algorithms.Join``.

torch's protocol: every communicating iteration of a rank that still has
data starts with ``Join.notify_join_context`` (an all-reduce of 1); a rank
that ran out of data loops in ``Join.__exit__``, matching that all-reduce
and then running each participant's ``main_hook``, which must issue the
collectives of the other ranks' iteration; when every rank has run out,
each runs ``post_hook(is_last_joiner)``.

Here an iteration is a communicating backward pass: the overlap engine
calls the participant's notification at the start of each one
(``BackwardOverlap.announce``), before any of its collectives, and the main
hook is a shadow pass (``BackwardOverlap.shadow_pass``): the same code path
with no gradient of this rank, so every option that shapes the pass's
collectives (buckets, ``wire_dtype``, ``local_size``, clipping,
``find_unused_parameters``, AdaSum) is shadowed by construction. The
zeros count in the mean, which is DDP's default
(``divide_by_initial_world_size=True``).

Without ``shard`` a rank that ran out of data does not step: it cannot
know whether the others' ``GradScaler`` skipped their step. So, as in DDP,
its parameters fall behind until the post hook, which gives every rank
those of the last rank to join; the optimizer also sends its state, its
step count and its ``buffers=``. Inside the context the optimizer's
per-step broadcasts (``bcast_period``, ``buffers=``) wait for that final
one: a rank that ran out of data could not tell when they happen.

With ``shard=True`` a rank that ran out owns part of the parameters and
their state, so after each shadow pass it steps that part on the reduced
gradients its pass received and joins the gather: the others must step
after every communicating pass (a ``GradScaler``'s skips and scale reach
it through ``join_scaling``) and without a collective of their own in between
(torch's clip over the shares, ``clip_grad_norm_()``: refused; clip with
``max_grad_norm=``, which the shadow pass runs too). Before each such step
the rank that ran out takes the hyperparameters the others set for it
(``agree_hyperparameters``): their LR schedule goes on without it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from . import join_scaling
from .broadcast import broadcast_optimizer_state, broadcast_tensors
from .process_group import comm_device


def disabled_join_config() -> _JoinConfig:
    """A participant's configuration outside any ``Join`` context."""
    return _JoinConfig.construct_disabled_join_config()


def in_join(participant) -> bool:
    """Whether ``participant`` is inside an enabled ``Join`` context."""
    return participant._join_config.enable


class JoinParticipant:
    """What ``Join`` reads of a participant that communicates over
    ``self.group`` (``join_hook`` is the participant's own)."""

    #: outside any ``Join`` context (``Join`` sets this rank's)
    _join_config = disabled_join_config()
    group: object

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s all-reduces over ``group`` run."""
        return comm_device(self.group)

    @property
    def join_process_group(self):
        """``Join``'s process group: ``group`` (the default group for None)."""
        return dist.group.WORLD if self.group is None else self.group


class JoiningOptimizer(JoinParticipant):
    """What ``Join`` and a ``GradScaler`` see of ``DistributedOptimizer``:
    its join hook, and whether ``GradScaler.step`` hands ``step()`` the
    scale and inf check (inside a sharded ``Join`` every rank must reach
    ``step()``). ``shard`` is the optimizer's."""

    shard: bool

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``GradScaler.step`` hands ``step()`` its scale and inf
        check (``grad_scale``, ``found_inf``) instead of skipping it: where
        the wrapped optimizer takes them (a fused Adam), and inside ``Join``
        with ``shard=True``, where every rank must reach ``step()``
        (``join_scaling``)."""
        return bool(self.__dict__.get("_step_supports_amp_scaling", False)) or (
            self.shard and in_join(self))

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_step_supports_amp_scaling"] = value

    def join_hook(self, **kwargs):
        """Take part in ``torch.distributed.algorithms.Join`` (uneven inputs:
        ranks that run out of batches at different steps). A rank that ran
        out runs, for each communicating backward pass of the others, the
        same collectives with zeros and no parameter used (the mean still
        divides by the whole world size: DDP's default), and does not step;
        with ``shard=True`` it steps its part of the parameters on what the
        pass reduced and joins their gather, so the other ranks must not use
        a collective clip (``RuntimeError`` when they do; ``max_grad_norm=``
        works), and it skips, unscales and clips as the others' GradScaler
        does. When every rank has run out, every rank takes the step count,
        ``buffers=`` and GradScaler state of the last one to join, and
        without ``shard`` its parameters and optimizer state. Inside the
        context the per-step broadcasts (``bcast_period``, ``buffers=``)
        wait for that final one.

        ``Join([opt], grad_scaler=scaler)`` names the ``torch.amp.GradScaler``
        that steps ``opt``; without it a rank knows its scaler from its own
        steps inside the context, so a rank that has no batch at all then
        cannot follow a scaled ``max_grad_norm`` clip (``RuntimeError`` on that
        rank) and keeps its scaler as it was.

        Raises:
            TypeError: ``shard=True`` with ``overlap_param_gather=True``;
                ``grad_scaler`` not a ``torch.amp.GradScaler``.
            ValueError: ``divide_by_initial_world_size=False`` with
                ``reduce_method='mean'``.

        Examples:
            >>> from torch.distributed.algorithms import Join      # doctest: +SKIP
            >>> with Join([opt]):                                   # doctest: +SKIP
            ...     for x, y in loader:
            ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        return optimizer_join_hook(self, kwargs)


def check_join_kwargs(owner: str, kwargs: dict, divides: bool) -> None:
    """The ``Join(..., **kwargs)`` a participant accepts: DDP's
    ``divide_by_initial_world_size`` only as True (the zeros of the ranks
    that ran out of data count in the mean). Other keys are other
    participants' and are ignored, as DDP and ZeRO do.

    Raises:
        ValueError: ``divide_by_initial_world_size`` is not True for a
            reduction that divides.
    """
    value = kwargs.get("divide_by_initial_world_size", True)
    if divides and value is not True:
        raise ValueError(
            f"{owner} under Join divides by the initial world size (the ranks that ran out of "
            f"data contribute zeros, DDP's default): divide_by_initial_world_size={value!r} "
            f"cannot be honoured; leave it out")


def take_grad_scaler(participant, owner: str, kwargs: dict) -> None:
    """``Join(..., grad_scaler=scaler)``: the ``torch.amp.GradScaler`` that
    ``participant``'s rank follows once it ran out, and whose state every
    rank takes from the last joiner at the end (``join_scaling``).

    Raises:
        TypeError: ``grad_scaler`` is not a ``torch.amp.GradScaler``.
    """
    participant.__dict__.pop("_join_scaler", None)
    scaler = kwargs.get("grad_scaler")
    if scaler is None:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"{owner} under Join(..., grad_scaler=): a torch.amp.GradScaler, "
                        f"not {type(scaler).__name__}")
    join_scaling.record_scaler(participant, 0, scaler)


class ShadowingJoinHook(JoinHook):
    """The join hook of a reducer's owner.

    Args:
        owner: the participant (its ``join_process_group`` and
            ``join_device`` carry the post hook's agreement).
        reducer: returns the reducer whose passes are shadowed (the owner
            may rebuild it between passes).
        final_sync: ``final_sync(src, steps)``: make this rank's state that of
            group rank ``src``, ``steps`` being the most steps any rank took
            (collective; the same calls on every rank).
        steps: returns this rank's step count (0 where steps are not counted).
        shadow_step: run after each shadow pass where this rank steps its
            part of the parameters (``shard=True``), or None.
        before_pass: run before each shadow pass, or None.
    """

    def __init__(self, owner, reducer: Callable, final_sync: Callable[[int, int], None],
                 steps: Callable[[], int], shadow_step: Optional[Callable[[], None]] = None,
                 before_pass: Optional[Callable[[], None]] = None) -> None:
        self.owner, self.reducer = owner, reducer
        self.final_sync, self.steps, self.shadow_step = final_sync, steps, shadow_step
        self.before_pass = before_pass
        leave_when_released(owner, self)

    def main_hook(self) -> None:
        """The collectives of one communicating pass of the ranks with data
        (and with ``shadow_step``, of their step); no warning of missing
        gradients, which are all missing by design. The pass leaves no
        gradient: this rank's ``.grad`` are None after it, as a DDP rank's
        after its join (untouched there since the loop zeroed them), so a
        loop that zeroes after ``step()`` does not add the others' last
        reduced gradients to its next step after the context."""
        reducer = self.reducer()
        reducer.consume()
        if self.before_pass is not None:
            self.before_pass()
        engine = reducer._engine
        warns, engine.warn_missing = engine.warn_missing, False
        try:
            engine.overlap.shadow_pass()
        finally:
            engine.warn_missing = warns
        if self.shadow_step is not None:
            self.shadow_step()
        for p in engine.overlap.parameters:
            p.grad = None
        reducer.consume()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the state of the last rank to join, and leaves
        the context (its passes stop notifying)."""
        group = self.owner.join_process_group
        rank = dist.get_rank(group)
        agreed = torch.tensor([rank if is_last_joiner else -1, self.steps()],
                              dtype=torch.int64, device=self.owner.join_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        src, steps = agreed.tolist()
        self.owner._join_config = disabled_join_config()
        self.final_sync(src, steps)


def _leave(participant_ref, token) -> None:
    participant = participant_ref()
    if participant is not None and participant.__dict__.get("_join_token") is token:
        participant._join_config = disabled_join_config()


def leave_when_released(participant, hook: JoinHook) -> None:
    """Take ``participant`` out of its ``Join`` context once ``hook`` (which
    the context holds) is released, unless a newer context took it in.

    torch's ``Join`` runs no post hook when its block raises, and
    ``throw_on_early_termination`` ends every block with an exception, so
    the context would otherwise stay enabled: each pass would go on
    notifying and the per-step broadcasts would stay deferred (replicas'
    buffers drifting apart). The context object is released when the
    ``with`` statement and any handling of its exception end.
    """
    token = participant._join_token = object()
    weakref.finalize(hook, _leave, weakref.ref(participant), token)


def _notify(participant) -> None:
    """``Join``'s notification of one communicating pass; its work is kept
    (``someone_ran_out`` reads its count)."""
    participant._join_notice = Join.notify_join_context(participant)


def announce_passes(reducer, participant) -> None:
    """From now on, every communicating pass of ``reducer``'s hooks first
    tells ``Join`` that this rank has data for it (nothing outside an
    enabled context). Set at each ``Join``: the trained set, and with it the
    reducer, cannot change inside one (``_check_between_steps``)."""
    participant._join_notice = None
    reducer._engine.overlap.announce = functools.partial(_notify, participant)


def someone_ran_out(participant) -> bool:
    """On a rank with data: whether another rank had run out of data by the
    last communicating pass, so that it shadows that pass (and, sharded, its
    step). ``Join``'s notification is an all-reduce of ones that those ranks
    answer with zeros, so its sum counts the ranks with data. True where
    that count is unknown (``participant`` is not the context's first, which
    does not notify): every rank with data decides alike either way. The
    count is read once per pass.
    """
    work, participant._join_notice = participant.__dict__.get("_join_notice"), None
    if work is None:
        return True
    # the future's value, not the deprecated Work.result(), which warns
    count = work.get_future().wait()[0]
    return int(count.item()) < dist.get_world_size(participant.join_process_group)


def reducer_join_hook(reducer, kwargs: dict) -> ShadowingJoinHook:
    """``DistributedGradReducer.join_hook``: shadow its hooked passes; at
    the end every rank takes the parameters of the last rank to join.

    Raises:
        RuntimeError: the reducer has no hooks (``register_hooks``): its
            calls are the caller's, which no hook can shadow.
        ValueError: see ``check_join_kwargs``.
    """
    owner = type(reducer).__name__
    if not reducer._engine.overlap.attached:
        raise RuntimeError(
            f"{owner} takes part in Join only with its hooks registered "
            f"(reducer.register_hooks()): the ranks that ran out of data shadow the hooks' "
            f"backward passes; a reducer called directly is driven by the caller")
    check_join_kwargs(owner, kwargs, reducer.mean)
    take_grad_scaler(reducer, owner, kwargs)
    announce_passes(reducer, reducer)

    def final_sync(src: int, steps: int) -> None:
        with torch.no_grad():
            broadcast_tensors([p.data for p in reducer.parameters], src, group=reducer.group,
                              names=[f"parameters[{i}]" for i in range(len(reducer.parameters))])
        join_scaling.sync_scaler(reducer, src, reducer.group)
    return ShadowingJoinHook(reducer, lambda: reducer, final_sync, lambda: 0)


def optimizer_join_hook(opt, kwargs: dict) -> ShadowingJoinHook:
    """``DistributedOptimizer.join_hook``: shadow its reducer's passes (with
    ``shard=True`` also the step of this rank's part and its gather); at the
    end every rank takes the step count and ``buffers=`` of the last rank to
    join, and without ``shard`` its parameters and optimizer state.

    Raises:
        TypeError: ``shard=True`` with ``overlap_param_gather=True`` (its
            gathers wait for a forward that a rank without data never runs).
        ValueError: see ``check_join_kwargs``.
    """
    if opt.shard and opt.overlap_param_gather:
        raise TypeError(
            "DistributedOptimizer(shard=True, overlap_param_gather=True) does not take part in "
            "Join (uneven inputs): the parameters' gathers wait for the next forward, which a "
            "rank that ran out of data never runs. Pass overlap_param_gather=False under Join")
    check_join_kwargs("DistributedOptimizer", kwargs, opt.reduce_method == "mean")
    take_grad_scaler(opt, "DistributedOptimizer", kwargs)
    announce_passes(opt.reducer, opt)

    def final_sync(src: int, steps: int) -> None:
        opt._steps = steps
        if not opt.shard:  # a sharded rank that ran out stepped its part all along
            opt.broadcast_parameters(src)
            broadcast_optimizer_state(opt, src, opt.group)
        else:  # with the others' hyperparameters; the last joiner's as the state's
            agree_hyperparameters(opt, has_data=dist.get_rank(opt.join_process_group) == src)
        join_scaling.sync_scaler(opt, src, opt.group)
        sync = opt._buffer_sync
        if sync.communicates:
            with torch.no_grad():
                broadcast_tensors(sync.tensors, src, group=opt.group, names=sync.names())
    shadow_step = opt._shadow_step if opt.shard else None
    return ShadowingJoinHook(opt, lambda: opt.reducer, final_sync, lambda: opt._steps,
                             shadow_step, functools.partial(join_scaling.before_shadow_pass, opt))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hyperparameter_slots(opt):
    """The numeric hyperparameters of ``opt``'s groups, in order:
    ``(group, key, index)`` with ``index`` None for a number or a one-element
    tensor, and the position inside a tuple or list (``betas``)."""
    slots = []
    for group in opt.param_groups:
        for key, value in group.items():
            if key == "params":
                continue
            if _is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                     and value.is_floating_point()):
                slots.append((group, key, None))
            elif (isinstance(value, (tuple, list)) and value
                  and all(_is_number(v) for v in value)):
                slots.extend((group, key, i) for i in range(len(value)))
    return slots


def agree_hyperparameters(opt, has_data: bool,
                          extra: Optional[torch.Tensor] = None) -> Optional[list]:
    """Before a sharded step inside ``Join``: a rank that ran out of data takes
    the hyperparameters (``lr``, ``betas``, ``weight_decay``, ...) that the
    ranks with data set for this step (an LR schedule goes on in their loop,
    not in its), so its part of the parameters steps as under DDP, where a
    rank with data steps them all. One small all-reduce (max; the ranks
    without data contribute -inf), collective: made at each step after a
    pass that a rank which ran out shadows (``someone_ran_out``), and at the
    end of the context. ``extra``: more float64 values on ``opt.join_device``
    agreed in the same all-reduce (``join_scaling.scaler_slots``), returned
    where this rank ran out (None where it has data).
    """
    slots = _hyperparameter_slots(opt)
    if not slots and extra is None:
        return None
    if has_data:
        mine = []
        for group, key, index in slots:
            value = group[key] if index is None else group[key][index]
            mine.append(float(value))
    else:
        mine = [float("-inf")] * len(slots)
    agreed = torch.tensor(mine, dtype=torch.float64, device=opt.join_device)
    if extra is not None:
        agreed = torch.cat([agreed, extra])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=opt.group)
    if has_data:
        return None
    values = agreed.tolist()
    values, rest = values[:len(slots)], values[len(slots):]
    tuples = {}
    for (group, key, index), value in zip(slots, values):
        old = group[key]
        if index is not None:
            tuples.setdefault((id(group), key), (group, key, list(old)))[2][index] = \
                type(old[index])(value)
        elif isinstance(old, torch.Tensor):
            old.fill_(value)
        else:
            group[key] = type(old)(value)
    for group, key, items in tuples.values():
        group[key] = type(group[key])(items)
    return rest


#: what replaces a collective clip inside a sharded ``Join``
CLIP_FIX = "clip with max_grad_norm= (the reduction's own clip, which a shadow pass runs too)"


def refuse_in_sharded_join(opt, what: str, fix: str = CLIP_FIX) -> None:
    """A sharded step's collective that a rank that ran out of data cannot
    know of, refused inside ``Join`` on the ranks that make it.

    Raises:
        RuntimeError: ``opt`` has ``shard=True`` and is inside an enabled
            ``Join`` context.
    """
    if opt.shard and in_join(opt):
        raise RuntimeError(
            f"{what} inside a Join context with DistributedOptimizer(shard=True): a rank that "
            f"ran out of data steps its part of the parameters at every pass of the others, "
            f"and cannot know of this; {fix}")
