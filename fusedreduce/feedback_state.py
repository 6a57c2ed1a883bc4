"""Error feedback's residuals, saved and loaded: a compressed run resumed exactly.

With ``wire_dtype`` (bfloat16, float8, int8) and ``error_feedback=True``,
each rank keeps per bucket the quantization error of the compressing level
and adds it to the next step's gradients (``wire_collectives.WireSum``).
The residual is part of the training state: a run resumed without it
restarts its error feedback at zero and takes other steps than the run it
continues (by about one step's quantization error; it does not diverge).

The residual is this rank's own, in this run's layout: the elements of
each bucket (or, on two levels, of this rank's part of the node's sum) that
the compressing level quantized. So a state holds the layout it was saved
in (``layout``: world size, rank, the collective's levels and formats, each
bucket's residual size) and loads only into a reducer of the same layout;
a save from another world size, another ``local_size`` or other buckets
cannot be mapped onto this one's residuals.

The state: ``{"format": FORMAT, "version": VERSION, "layout": {...},
"residuals": {bucket index: 1-D fp32 tensor on the host}}``, plain types
only, so ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

#: the ``"format"`` entry of an error-feedback state
FORMAT = "fusedreduce.error_feedback"
VERSION = 1


def layout_of(collective) -> Optional[dict]:
    """The layout a state of ``collective``'s residuals is saved in (its
    ``residual_sizes()``), or None where it keeps none: plain ints and
    strings."""
    numels = collective.residual_sizes()
    if numels is None:
        return None
    return {"world_size": collective.world_size, "rank": dist.get_rank(collective.group),
            "levels": [[level.ranks, str(level.dtype)] for level in collective.levels],
            "numels": numels}


def state_of(collective) -> Optional[dict]:
    """This rank's residuals as a state (fresh copies on the host), or None
    where ``collective`` keeps none. A bucket not reduced yet has a zero
    residual, saved as such."""
    layout = layout_of(collective)
    if layout is None:
        return None
    residuals = {}
    for bucket, numel in zip(collective.plan.buckets, layout["numels"]):
        kept = collective.residuals.get(bucket.index)
        residuals[bucket.index] = (torch.zeros(numel, dtype=torch.float32) if kept is None
                                   else kept.detach().to("cpu", copy=True))
    return {"format": FORMAT, "version": VERSION, "layout": layout, "residuals": residuals}


def check_state(state, collective, name: str) -> Dict[int, torch.Tensor]:
    """The residuals of ``state`` by bucket index, checked against this
    reducer's layout.

    Raises:
        TypeError: ``state`` is not a dict, or a residual is not a tensor.
        ValueError: this reducer keeps no residuals, ``state`` is not an
            error-feedback state (or of another version), or it was saved in
            another layout (the differing entry is named), or a residual
            has another size, is not floating point or is a meta tensor.
    """
    if not isinstance(state, dict):
        raise TypeError(f"{name} must be a dict from error_feedback_state(), got "
                        f"{type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"{name} is not an error-feedback state (from "
                         f"error_feedback_state()): its format is {state.get('format')!r}")
    if state.get("version") != VERSION:
        raise ValueError(f"{name} has version {state.get('version')!r}; this fusedreduce "
                         f"reads version {VERSION}")
    layout = layout_of(collective)
    if layout is None:
        raise ValueError(f"{name} holds error-feedback residuals, but this reducer keeps "
                         f"none: construct it with a compressing wire_dtype and "
                         f"error_feedback=True")
    saved = state.get("layout")
    if not isinstance(saved, dict):
        raise ValueError(f"{name} has no layout: not a whole error_feedback_state()")
    for key, mine in layout.items():
        if saved.get(key) != mine:
            raise ValueError(
                f"{name} was saved with {key} {saved.get(key)!r}, this reducer has {mine!r}: "
                f"residuals are per rank and per bucket, and load only into the layout they "
                f"were saved in (the same world size, rank, local_size, wire_dtype and "
                f"buckets)")
    buckets = collective.plan.buckets
    residuals = state.get("residuals")
    # a set: keys of mixed types (a damaged file) cannot be sorted
    if not isinstance(residuals, dict) or set(residuals) != {b.index for b in buckets}:
        raise ValueError(f"{name}['residuals'] must hold one tensor per bucket "
                         f"({len(buckets)})")
    for bucket, numel in zip(buckets, layout["numels"]):
        residual = residuals[bucket.index]
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{name}['residuals'][{bucket.index}] must be a tensor, got "
                            f"{type(residual).__name__}")
        if not residual.is_floating_point() or residual.numel() != numel or residual.is_meta:
            raise ValueError(f"{name}['residuals'][{bucket.index}] must be a floating tensor "
                             f"of {numel} elements holding data, got {residual.dtype} "
                             f"{tuple(residual.shape)} on {residual.device}")
        # the kernels never leave a non-finite residual (a block holding inf or
        # NaN resets its residual to 0): one would poison every later step
        if not bool(torch.isfinite(residual).all()):
            raise ValueError(f"{name}['residuals'][{bucket.index}] holds inf or NaN: not a "
                             f"saved residual")
    return residuals


def load_into(collective, residuals: Dict[int, torch.Tensor]) -> None:
    """Replace ``collective``'s residuals with checked ``residuals`` (copies
    on each bucket's device, fp32)."""
    collective.residuals = {
        bucket.index: residuals[bucket.index].detach().reshape(-1).to(
            device=bucket.device, dtype=torch.float32, copy=True)
        for bucket in collective.plan.buckets}
