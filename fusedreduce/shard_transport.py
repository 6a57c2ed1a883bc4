"""A sharded optimizer's state between this rank's part and the whole.

``ShardedParameters`` steps this rank's slices of the parameters; the state
the wrapped optimizer keeps for them is this rank's part of the whole state.
This module moves the state across that cut, never touching the slices:

- in: ``take_state`` keeps this rank's part of a whole state (and sets the
  master copies from it), ``own_part`` cuts a whole state dict down to that
  part before anything moves onto a device;
- out: ``checkpoint_pieces`` gives the part as ``sharded_state_dict()``
  pieces, ``part_to_send`` packs them into a few host tensors,
  ``gather_parts`` gathers every rank's packed part as a byte stream (in
  rounds that each end within the checkpoint group's timeout) and
  ``whole_state`` puts the parts together as an unsharded optimizer keeps
  its state.

Each function takes ``shards``: ``ShardedParameters.by_param``, each
parameter's ``ParamShard`` (the elements this rank holds, and the tensor the
wrapped optimizer steps for them).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .param_shard import ParamShard
from .process_group import comm_device, global_rank
from .sharded_checkpoint import collect_pieces, make_piece, pack_pieces, state_over

#: bytes per rank per round of the collective ``state_dict()``'s gather: each
#: round must end within the checkpoint group's timeout (``checkpoint_timeout``)
GATHER_CHUNK_BYTES = 64 * 2 ** 20

Shards = Mapping[torch.Tensor, ParamShard]


def take_state(shards: Shards, state: Dict[torch.Tensor, dict]) -> Dict[torch.Tensor, dict]:
    """This rank's part of ``state`` (full per-parameter state, keyed by
    parameter): slices of per-element tensors, other entries as they are;
    a ``master_weight`` entry sets the master copy. Parameters this rank
    owns nothing of are left out."""
    kept: Dict[torch.Tensor, dict] = defaultdict(dict)
    for p, entry in state.items():
        s = shards.get(p)
        if s is None:
            continue
        master = entry.get("master_weight")
        if s.master:
            if master is not None and not s.whole and master.shape != p.shape:
                piece = master  # already this rank's elements (a sharded checkpoint)
            else:
                piece = s.slice_of(master if master is not None else p.detach())
            with torch.no_grad():
                s.tensor.copy_(piece)
        part = {}
        for key, value in entry.items():
            if key == "master_weight":
                continue
            if not s.whole and _per_element(value, p):
                value = s.slice_of(value).clone()
            part[key] = value
        if part:
            kept[p] = part
    return kept


def own_part(shards: Shards, state_dict: dict) -> dict:
    """``state_dict`` (a whole one in torch's form, matched to the
    parameters) cut down to this rank's part before anything moves: the
    entries of the parameters it owns elements of, a cut one's
    per-element values (its master too) as 1-D copies of the owned
    elements. Loading that moves 1/N of the state onto the device."""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    state = {}
    for s in shards.values():
        entry = state_dict["state"].get(ids[s.index])
        if entry is None:
            continue
        if not s.whole:
            entry = {key: s.slice_of(value).clone()
                     if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                     for key, value in entry.items()}
        state[ids[s.index]] = entry
    return {**state_dict, "state": state}


def checkpoint_pieces(shards: Shards, state: Dict[torch.Tensor, dict]) -> Dict[int, dict]:
    """This rank's part of ``state`` (and of the masters) as
    ``sharded_state_dict()`` pieces, per parameter index."""
    return {s.index: make_piece(p, s.range.start, s.range.end, state[p],
                                s.tensor if s.master else None)
            for p, s in shards.items() if state.get(p)}


def part_to_send(shards: Shards, state: Dict[torch.Tensor, dict]) -> dict:
    """This rank's part of ``state`` for ``whole_state`` on every rank:
    its pieces packed on the host (a few flat tensors, however many
    parameters), and which of its non-per-element tensors (a capturable
    optimizer's ``step``) the optimizer keeps on a device."""
    pieces = checkpoint_pieces(shards, state)
    on_device = {key for piece in pieces.values() for key, value in piece["values"].items()
                 if isinstance(value, torch.Tensor) and value.device.type != "cpu"}
    return {"state": pack_pieces(pieces), "on_device": sorted(on_device)}


def gather_parts(part: dict, group, to: Optional[int] = None, *,
                 chunk_bytes: int = 0) -> Optional[List[dict]]:
    """Every rank's ``part_to_send`` (collective over ``group``, a gloo
    group over the same ranks: ``checkpoint_group``), in ``group``'s rank
    order, on every rank (``to`` None) or on ``group``'s rank ``to`` only
    (None elsewhere).

    The tensors travel as bytes, from and into host buffers, in rounds of
    at most ``chunk_bytes`` (default ``GATHER_CHUNK_BYTES``) per rank, so
    that each collective ends within the group's timeout however large
    the state; nothing is pickled but the layout."""
    chunk_bytes = chunk_bytes or GATHER_CHUNK_BYTES
    world_size = dist.get_world_size(group)
    state, tensors = _without_data(part["state"])
    layouts = [None] * world_size
    receiving = to is None or dist.get_rank(group) == to
    layout = {"state": state, "on_device": part["on_device"],
              "specs": [(t.dtype, t.numel()) for t in tensors]}
    if to is None:
        dist.all_gather_object(layouts, layout, group=group)
    else:
        dst = global_rank(group, to)
        dist.gather_object(layout, layouts if receiving else None, dst=dst, group=group)
    offsets, size = _offsets(layout["specs"])
    # the ranks other than ``to`` have no layouts: the sizes come apart
    sizes = _all_gather_sizes(size, group, world_size)
    chunk = min(chunk_bytes, max(sizes))
    rounds = -(-max(sizes) // chunk) if chunk else 0
    stream = torch.empty(rounds * chunk, dtype=torch.uint8)
    for at, t in zip(offsets, tensors):
        stream[at:at + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    received = [torch.empty(rounds * chunk, dtype=torch.uint8)
                for _ in range(world_size)] if receiving else None
    for j in range(rounds):
        at = slice(j * chunk, (j + 1) * chunk)
        outs = [r[at] for r in received] if receiving else None
        if to is None:
            dist.all_gather(outs, stream[at], group=group)
        else:
            dist.gather(stream[at], outs, dst=dst, group=group)
    if not receiving:
        return None
    return [{"state": _with_data(got["state"], _read_stream(stream_r, got["specs"])),
             "on_device": got["on_device"]} for got, stream_r in zip(layouts, received)]


def whole_state(params: Sequence[torch.Tensor], parts: Sequence[dict],
                cpu_offload: bool = False) -> Dict[torch.Tensor, dict]:
    """The whole state of ``params`` (the optimizer's, in its order), keyed
    by parameter, from every rank's ``part_to_send`` (in rank order).
    Tensors sit where an unsharded optimizer keeps them: per-element values
    (and masters) on their parameter's device, other tensors on the device
    where the ranks kept them; with ``cpu_offload`` all of them on the host."""
    by_index = collect_pieces([part["state"] for part in parts], [p.shape for p in params])
    on_device = set().union(*(part["on_device"] for part in parts))
    full: Dict[torch.Tensor, dict] = {}
    for index in sorted(by_index):
        p, pieces = params[index], by_index[index]
        entry = state_over(pieces, 0, p.numel(), p.shape)
        if not cpu_offload and p.device.type != "cpu":
            moved = set(pieces[0]["slices"]) | on_device
            entry = {key: value.to(p.device) if key in moved else value
                     for key, value in entry.items()}
        full[p] = entry
    return full


def _without_data(packed: dict) -> Tuple[dict, List[torch.Tensor]]:
    """``packed`` with each flat tensor of slices taken out (in order), and
    those tensors: the layout, small to pickle, and the bytes to send."""
    tensors: List[torch.Tensor] = []
    slices = {}
    for key, entry in packed["slices"].items():
        slices[key] = {**entry, "data": len(entry["data"])}
        tensors.extend(entry["data"])
    return {**packed, "slices": slices}, tensors


def _with_data(layout: dict, tensors: Sequence[torch.Tensor]) -> dict:
    """``_without_data``'s inverse."""
    slices, at = {}, 0
    for key, entry in layout["slices"].items():
        slices[key] = {**entry, "data": list(tensors[at:at + entry["data"]])}
        at += entry["data"]
    return {**layout, "slices": slices}


def _offsets(specs: Sequence[Tuple[torch.dtype, int]]) -> Tuple[List[int], int]:
    """Where each tensor of ``specs`` starts in a byte stream (8-byte
    aligned, so that each is viewed back as its dtype), and the length."""
    offsets, at = [], 0
    for dtype, numel in specs:
        at = -(-at // 8) * 8
        offsets.append(at)
        at += numel * dtype.itemsize
    return offsets, at


def _read_stream(stream: torch.Tensor, specs: Sequence[Tuple[torch.dtype, int]]
                 ) -> List[torch.Tensor]:
    """The tensors of ``specs`` written at their ``_offsets``, as views of ``stream``."""
    offsets, _ = _offsets(specs)
    return [stream[at:at + numel * dtype.itemsize].view(dtype)
            for at, (dtype, numel) in zip(offsets, specs)]


def _all_gather_sizes(size: int, group, world_size: int) -> List[int]:
    """Every rank's ``size``, one small all-gather."""
    mine = torch.tensor([size], dtype=torch.int64, device=comm_device(group))
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _per_element(value, param: torch.Tensor) -> bool:
    """A full state value that holds one entry per element of ``param``."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape
