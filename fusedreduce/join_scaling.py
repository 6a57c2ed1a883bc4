"""A ``torch.amp.GradScaler`` inside ``Join`` (uneven inputs).

Outside ``Join`` a GradScaler that finds an inf or NaN skips
``optimizer.step()`` on every rank alike. Inside ``Join`` with
``shard=True`` a rank that ran out of data steps its part of the
parameters at every pass of the others (``uneven_inputs``), so it must
learn what their scaler decided and by what scale their gradients are
multiplied:

- ``GradScaler.step`` calls the optimizer's ``step()`` even where it found
  an inf (``DistributedOptimizer._step_supports_amp_scaling``), handing it
  the scale (``grad_scale``, None after ``unscale_``) and the check
  (``found_inf``) instead; ``step()`` skips and unscales as GradScaler
  would, with GradScaler's own kernel;
- at the steps where the ranks agree on the hyperparameters (a rank ran
  out), the ranks with data add their scaler's state (``scaler_slots``):
  its scale, growth tracker, inf check and growth parameters;
- the rank that ran out (``FollowedScaler``) unscales by that scale, skips
  where the others skip, and updates its own scaler as their
  ``update()`` will, so that its scale, and with it a fused clip's
  ``loss_scale``, stays theirs.

Every participant also ends the context with every rank's scaler equal to
the last joiner's (``sync_scaler``): a rank whose loop stopped early would
otherwise scale its next epoch's losses by a stale scale, and the mean of
gradients scaled apart is no gradient at all.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import List, Optional

import torch

from .broadcast import broadcast_tensors
from .clipping import stepping_grad_scaler

#: the scaler's state among the agreed values: present (1, else -inf), scale,
#: growth tracker, inf check, growth factor, backoff factor, growth interval,
#: and the loss scale a finite fused clip divided the norm by (-inf: none)
SCALER_SLOTS = 8


def record_scaler(opt, depth: int, scaler=None) -> None:
    """Remember the enabled GradScaler stepping ``opt`` (``depth`` frames up
    from here to ``step()``'s caller), or ``scaler`` (``Join``'s
    ``grad_scaler=``): the one this rank follows once it ran out. The frames
    are read only until a scaler is recorded (once per context)."""
    if scaler is None:
        ref = opt.__dict__.get("_join_scaler")
        if ref is not None and ref() is not None:
            return
        scaler = stepping_grad_scaler(depth + 1)
    if scaler is not None and scaler.is_enabled():
        opt._join_scaler = weakref.ref(scaler)


def clip_scale(opt) -> Optional[torch.Tensor]:
    """The loss scale a finite fused clip divides the norm by (float64, 0-d),
    or None."""
    limit, scale = opt.reducer.max_grad_norm, opt.loss_scale
    if limit is None or limit == float("inf") or scale is None:
        return None
    return torch.as_tensor(scale, dtype=torch.float64).reshape(())


def recorded_scaler(opt) -> Optional["torch.amp.GradScaler"]:
    """The recorded scaler, its scale and growth tracker made where it never
    scaled a loss yet (a rank that ran out before its first batch)."""
    ref = opt.__dict__.get("_join_scaler")
    scaler = ref() if ref is not None else None
    if scaler is not None and scaler._scale is None:
        device = opt.join_device
        if device.type != scaler._device:
            device = torch.device(scaler._device)
        scaler._lazy_init_scale_growth_tracker(device)
    return scaler


class ScalerHand:
    """What ``GradScaler.step`` handed ``step()`` (``grad_scale``,
    ``found_inf``), taken off the optimizer while the wrapped step runs (a
    fused Adam would otherwise unscale again) and put back after."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self.grad_scale = opt.__dict__.pop("grad_scale", None)
        self.found_inf = opt.__dict__.pop("found_inf", None)

    def restore(self) -> None:
        if self.found_inf is not None:
            self.opt.grad_scale, self.opt.found_inf = self.grad_scale, self.found_inf

    @property
    def handed(self) -> bool:
        return self.found_inf is not None

    def skips(self) -> bool:
        """Whether GradScaler's check found an inf or NaN (one host read)."""
        return self.handed and bool(self.found_inf.item() > 0)

    def unscale(self) -> None:
        if self.grad_scale is not None:
            unscale_gradients(self.opt, self.grad_scale)


def unscale_gradients(opt, scale: torch.Tensor) -> None:
    """``.grad`` of every parameter of ``opt``'s groups divided by ``scale``
    as ``GradScaler.unscale_`` divides them (its kernel, by the fp32
    reciprocal of the scale taken in fp64)."""
    inverse = scale.double().reciprocal().float()
    groups = defaultdict(list)
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                groups[(p.grad.device, p.grad.dtype)].append(p.grad)
    for (device, _), grads in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse.to(device))


def scaler_slots(opt, hand: Optional[ScalerHand], device: torch.device) -> torch.Tensor:
    """This rank's scaler state for the agreement (float64 on ``device``):
    -inf throughout where no enabled scaler steps ``opt`` or this rank ran
    out (``hand`` None)."""
    scaler = recorded_scaler(opt) if hand is not None and hand.handed else None
    if scaler is None:
        return torch.full((SCALER_SLOTS,), float("-inf"), dtype=torch.float64, device=device)
    clipped = clip_scale(opt)
    state = torch.cat([_scale_and_tracker(scaler, device),
                       hand.found_inf.reshape(1).to(device, torch.float64)])
    head = torch.ones(1, dtype=torch.float64, device=device)
    tail = torch.tensor([scaler._growth_factor, scaler._backoff_factor,
                         float(scaler._growth_interval), float("-inf")],
                        dtype=torch.float64, device=device)
    if clipped is not None:
        tail[3] = clipped.to(device)
    return torch.cat([head, state, tail])


class FollowedScaler:
    """On a rank that ran out: the others' scale and check for this step."""

    def __init__(self, opt, values: List[float]) -> None:
        """Raises RuntimeError where this rank's shadow pass clipped with
        another loss scale than the others' (nothing stepped)."""
        self.opt = opt
        present, scale, tracker, found, growth, backoff, interval, clipped = values
        self.present = present > 0
        self.found = self.present and found > 0
        self.values = (scale, tracker, found, growth, backoff,
                       int(interval) if self.present else 0)
        mine = clip_scale(opt)
        if self.present and clipped > float("-inf") and (mine is None or float(mine) != clipped):
            raise RuntimeError(
                f"this rank ran out of data inside Join and shadowed a pass that the others "
                f"clipped with max_grad_norm= at loss_scale {clipped:g}, but its own loss_scale "
                f"was {None if mine is None else float(mine)}: it did not know their "
                f"GradScaler, having stepped none inside the context, so its part of the "
                f"parameters would step on gradients clipped by another coefficient. Pass the "
                f"scaler to the context, Join([optimizer], grad_scaler=scaler), on every rank")

    def skips(self) -> bool:
        return self.found

    def restore(self) -> None:
        """Nothing was taken off the optimizer."""

    def unscale(self) -> None:
        if self.present:
            scale = torch.tensor(self.values[0], dtype=torch.float32)
            unscale_gradients(self.opt, scale)

    def update(self) -> None:
        """This rank's scaler updated as the others' ``update()`` updates
        theirs (``torch._amp_update_scale_``, GradScaler's own kernel); a
        finite clip's ``loss_scale`` set to the new scale."""
        if not self.present:
            return
        scale, tracker, found, growth, backoff, interval = self.values
        scaler = recorded_scaler(self.opt)
        device = scaler._scale.device if scaler is not None else torch.device("cpu")
        new_scale = torch.full((), scale, dtype=torch.float32, device=device)
        new_tracker = torch.full((), int(tracker), dtype=torch.int32, device=device)
        torch._amp_update_scale_(new_scale, new_tracker,
                                 torch.full((), found, dtype=torch.float32, device=device),
                                 growth, backoff, interval)
        if scaler is not None:
            scaler._scale.copy_(new_scale.reshape(scaler._scale.shape))
            scaler._growth_tracker.copy_(new_tracker.reshape(scaler._growth_tracker.shape))
        follow_loss_scale(self.opt, new_scale)


def follow_loss_scale(opt, scale: torch.Tensor) -> None:
    """Where ``opt`` clips (a finite ``max_grad_norm``), its ``loss_scale``
    becomes ``scale``: in the form it had (a float, or a tensor on its
    device), a tensor where it had none (the scaler's gradients are clipped
    at its scale: ``refuse_scaled_clip``)."""
    limit, old = opt.reducer.max_grad_norm, opt.loss_scale
    if limit is None or limit == float("inf"):
        return
    if old is None:
        opt.loss_scale = scale.detach().clone().reshape(())
    elif isinstance(old, torch.Tensor):
        opt.loss_scale = scale.to(old.device, old.dtype).reshape(old.shape)
    else:
        opt.loss_scale = float(scale)


def before_shadow_pass(opt) -> None:
    """A rank that ran out clips its shadow pass with its scaler's current
    scale: its last ``update()`` (or ``FollowedScaler.update``) set it."""
    scaler = recorded_scaler(opt)
    if scaler is not None:
        follow_loss_scale(opt, scaler._scale)


def _scale_and_tracker(scaler, device: torch.device) -> torch.Tensor:
    """The scaler's scale and growth tracker, two float64 values on ``device``."""
    return torch.stack([scaler._scale.reshape(()).double(),
                        scaler._growth_tracker.reshape(()).double()]).to(device)


def sync_scaler(opt, src: int, group) -> None:
    """Every rank's recorded scaler takes the scale and growth tracker of
    ``group``'s rank ``src`` (collective: one broadcast of three numbers; a
    rank without a recorded scaler keeps nothing)."""
    scaler = recorded_scaler(opt)
    device = opt.join_device
    if scaler is not None:
        state = torch.cat([torch.ones(1, dtype=torch.float64, device=device),
                           _scale_and_tracker(scaler, device)])
    else:
        state = torch.full((3,), float("-inf"), dtype=torch.float64, device=device)
    broadcast_tensors([state], src, group=group, names=["the GradScaler's scale"])
    present, scale, tracker = state.tolist()
    if scaler is not None and present > 0:
        scaler._scale.fill_(scale)
        scaler._growth_tracker.fill_(int(tracker))
