"""Optimizer checkpoints saved one file per rank, loaded at any world size.

``DistributedOptimizer.sharded_state_dict()`` gives the state this rank holds
(with ``shard=True`` its part; without sharding, a share of the parameters):
no collective, nothing gathered, so a rank never holds more than its own
part on the host. Each parameter's state is kept as a range of its
flattened elements, which does not depend on the world size or the buckets:
``load_sharded_state_dict`` takes every saved rank's dict (or file) and each
rank reads the elements it owns now, and ``consolidate_sharded_state_dict``
puts the whole torch-form state dict together, for a plain optimizer.

One piece is ``{"start": a, "end": b, "slices": {key: 1-D tensor of b - a},
"values": {key: value}}``: per-element state (moments, master weights) as
the slice of elements ``[a, b)``, everything else (``step``) as it is. A
rank's pieces are saved packed into a few tensors (``pack_pieces``) and
read back as views of them (``pieces_of``). The collective ``state_dict()``
gathers the same packed parts (``ShardedParameters.gather_parts``) and puts
them together with ``state_over``.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import warnings
from typing import Dict, List, Optional, Sequence, Union

import torch

#: the ``"format"`` entry of a sharded optimizer state dict
FORMAT = "fusedreduce.sharded_optimizer_state"
VERSION = 1
# what a load reads from every shard: a dict missing one is a truncated file
REQUIRED_KEYS = ("rank", "world_size", "shapes", "param_groups", "state")

ShardSource = Union[dict, str, "os.PathLike[str]"]


def make_piece(param: torch.Tensor, start: int, end: int, entry: dict,
               master: Optional[torch.Tensor] = None) -> dict:
    """``entry`` (the state of ``param`` over its elements ``[start, end)``:
    per-element values shaped like the parameter when the range is all of
    it, 1-D slices otherwise) as a piece. The values are the live state's
    (tensors as flattened views); ``pack_pieces`` makes the one copy."""
    whole = start == 0 and end == param.numel()
    slices, values = {}, {}
    for key, value in entry.items():
        if _per_element(value, param, start, end, whole):
            slices[key] = value.detach().reshape(-1)
        else:
            values[key] = value.detach() if isinstance(value, torch.Tensor) else value
    if master is not None:
        slices["master_weight"] = master.detach().reshape(-1)
    return {"start": start, "end": end, "slices": slices, "values": values}


def _per_element(value, param: torch.Tensor, start: int, end: int, whole: bool) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return value.shape == param.shape if whole else tuple(value.shape) == (end - start,)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def sharded_state(rank: int, world_size: int, shapes: Sequence[torch.Size],
                  param_groups: list, pieces: Dict[int, dict], steps: int = 0) -> dict:
    """The dict ``sharded_state_dict()`` returns: ``pieces`` per parameter
    index (the optimizer's parameter order) packed (``pack_pieces``), and
    what a load checks them against, with the save's id (``save_id``)."""
    shapes = [list(shape) for shape in shapes]
    return {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": world_size,
            "save_id": save_id(world_size, steps, shapes, param_groups),
            "shapes": shapes, "param_groups": param_groups, "state": pack_pieces(pieces)}


def save_id(world_size: int, steps: int, shapes: list, param_groups: list) -> str:
    """The id every rank's file of one save carries, without a collective:
    a hash of what every rank holds alike at a save (the optimizer's step
    count, its groups' hyperparameters, the shapes, the world size), so two
    saves a step apart (a crash between two ranks' saves) differ."""
    text = repr((world_size, steps, shapes, param_groups))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pack_pieces(pieces: Dict[int, dict]) -> dict:
    """``pieces`` in a few fresh host tensors (each element copied once,
    wherever the state lives): per state key, the slices of every piece
    that has it, one flat tensor per dtype, and where each piece's starts;
    0-d tensor values of one dtype stacked into one tensor. A file of one
    tensor per piece and key loads slowly (torch's weights-only unpickler
    rebuilds each tensor in Python: 80-240 ms for 161 parameters), and every
    rank reads every rank's file."""
    order = sorted(pieces)
    packed = {"index": order, "start": [pieces[i]["start"] for i in order],
              "end": [pieces[i]["end"] for i in order], "slices": {}, "values": {}}
    keys = {kind: sorted({k for i in order for k in pieces[i][kind]})
            for kind in ("slices", "values")}
    for key in keys["slices"]:
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        filled: Dict[torch.dtype, int] = {}
        group, offset = [], []
        for i in order:
            value = pieces[i]["slices"].get(key)
            if value is None:
                group.append(-1)
                offset.append(0)
                continue
            if value.dtype not in groups:
                groups[value.dtype], filled[value.dtype] = [], 0
            group.append(list(groups).index(value.dtype))
            offset.append(filled[value.dtype])
            groups[value.dtype].append(value)
            filled[value.dtype] += value.numel()
        packed["slices"][key] = {"data": [_packed_copy(members, filled[dtype])
                                          for dtype, members in groups.items()],
                                 "group": group, "offset": offset}
    for key in keys["values"]:
        present = [key in pieces[i]["values"] for i in order]
        items = [pieces[i]["values"][key] for i in order if key in pieces[i]["values"]]
        stackable = all(isinstance(v, torch.Tensor) and v.dim() == 0 and
                        v.dtype == items[0].dtype for v in items)
        packed["values"][key] = {
            "present": present,
            "stacked": torch.stack([v.cpu() for v in items]) if stackable else None,
            "items": None if stackable else [_host_copy(v) if isinstance(v, torch.Tensor)
                                             else copy.deepcopy(v) for v in items]}
    return packed


def _packed_copy(members: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """``members`` (flat tensors of one dtype, on any devices, ``numel``
    elements in all) one after another in one new host tensor: a single
    copy of each element, with no device-side temporary."""
    out = torch.empty(numel, dtype=members[0].dtype)
    at = 0
    for t in members:
        out[at:at + t.numel()].copy_(t)
        at += t.numel()
    return out


def pieces_of(shard: dict) -> Dict[int, dict]:
    """One rank's pieces, per parameter index, from its packed ``state``
    (the slices are views of the packed tensors)."""
    packed = shard["state"]
    pieces = {}
    for j, (index, start, end) in enumerate(zip(packed["index"], packed["start"],
                                                packed["end"])):
        slices = {}
        for key, entry in packed["slices"].items():
            if entry["group"][j] >= 0:
                data = entry["data"][entry["group"][j]]
                slices[key] = data[entry["offset"][j]:entry["offset"][j] + end - start]
        pieces[index] = {"start": start, "end": end, "slices": slices, "values": {}}
    for key, entry in packed["values"].items():
        have = [index for index, present in zip(packed["index"], entry["present"]) if present]
        stacked, items = entry["stacked"], entry["items"]
        for n, index in enumerate(have):
            pieces[index]["values"][key] = stacked[n] if stacked is not None else items[n]
    return pieces


# ------------------------------------------------------------------ loading
def read_shards(shards: Sequence[ShardSource]) -> List[dict]:
    """Every saved rank's dict, in rank order: each item of ``shards`` a dict
    from ``sharded_state_dict()`` or the path of a file ``torch.save`` wrote
    it to (read with ``mmap=True``: only the elements a rank takes are read
    from disk).

    Raises:
        TypeError: ``shards`` is not a list or tuple, an item is neither a
            dict nor a path, or a file holds no dict.
        ValueError: an item is not a sharded optimizer state dict or lacks
            some of its keys (a truncated file), the items are of different
            saves (their ``save_id`` differs), or they are not one per saved
            rank (each rank once, all of the same save: world size, parameter
            shapes and groups).
    """
    if not isinstance(shards, (list, tuple)):
        raise TypeError(f"shards must be a list or tuple with every saved rank's "
                        f"sharded_state_dict() (or its file), got {type(shards).__name__}")
    if not shards:
        raise ValueError("shards is empty: pass every saved rank's sharded_state_dict() "
                         "(or its file)")
    loaded = []
    for i, item in enumerate(shards):
        if isinstance(item, (str, os.PathLike)):
            item = torch.load(os.fspath(item), map_location="cpu", mmap=True,
                              weights_only=True)
        elif not isinstance(item, dict):
            raise TypeError(f"shards[{i}] must be a dict from sharded_state_dict() or the "
                            f"path of a file it was saved to, got {type(item).__name__}")
        if not isinstance(item, dict):
            raise TypeError(f"shards[{i}] ({os.fspath(shards[i])}) holds a "
                            f"{type(item).__name__}, not a dict from sharded_state_dict()")
        if item.get("format") != FORMAT:
            hint = (": a whole state dict, for load_state_dict()"
                    if "state" in item and "param_groups" in item else "")
            raise ValueError(f"shards[{i}] is not a sharded optimizer state dict (from "
                             f"DistributedOptimizer.sharded_state_dict()){hint}")
        if item.get("version") != VERSION:
            raise ValueError(f"shards[{i}] has format version {item.get('version')!r}; "
                             f"this fusedreduce reads version {VERSION}")
        missing = [key for key in REQUIRED_KEYS if key not in item]
        if missing:
            raise ValueError(f"shards[{i}] is a truncated sharded state dict: it lacks "
                             f"{missing}")
        loaded.append(item)
    check_one_save(loaded)
    world_size = loaded[0]["world_size"]
    ranks = sorted(item["rank"] for item in loaded)
    if len(loaded) != world_size or ranks != list(range(world_size)):
        raise ValueError(f"shards must hold each of the {world_size} saved ranks once (the "
                         f"save's world size), got ranks {ranks}")
    first = loaded[0]
    for i, item in enumerate(loaded):
        if item["world_size"] != world_size or item["shapes"] != first["shapes"] or \
                [g["params"] for g in item["param_groups"]] != \
                [g["params"] for g in first["param_groups"]]:
            raise ValueError(f"shards[{i}] (rank {item['rank']}) is not of the same save as "
                             f"shards[0]: its world size, parameter shapes or groups differ")
    return sorted(loaded, key=lambda item: item["rank"])


def check_one_save(loaded: Sequence[dict]) -> None:
    """Every shard carries the same ``save_id``: files of two saves (a crash
    between two ranks' saves) are refused, naming each one's rank and id.
    Files written before the id existed are accepted with a warning: their
    mix cannot be told.

    Raises:
        ValueError: the ids differ.
    """
    ids = [item.get("save_id") for item in loaded]
    if None in ids:
        warnings.warn("some shards carry no save id (written by an older fusedreduce): "
                      "that they come from one save cannot be checked", UserWarning,
                      stacklevel=3)
    if len(set(ids)) > 1:
        listed = ", ".join(f"shards[{i}] (rank {item['rank']}): {item.get('save_id')}"
                           for i, item in enumerate(loaded))
        raise ValueError(f"the shards come from different saves (a save interrupted between "
                         f"ranks?): save ids {listed}; load the files of one save")


def check_shapes(shards: Sequence[dict], shapes: Sequence[torch.Size],
                 group_sizes: Sequence[int]) -> None:
    """The save's parameters are the optimizer's, group for group.

    Raises:
        ValueError: they differ (a checkpoint of another model).
    """
    saved = shards[0]
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != list(group_sizes):
        raise ValueError(f"the shards' parameter groups have {sizes} parameters, the "
                         f"optimizer's {list(group_sizes)}")
    for index, (got, want) in enumerate(zip(saved["shapes"], shapes)):
        if list(got) != list(want):
            raise ValueError(f"the shards' parameter {index} has shape {tuple(got)}, the "
                             f"optimizer's {tuple(want)}: a checkpoint of another model")


def pieces_by_index(shards: Sequence[dict]) -> Dict[int, List[dict]]:
    """Each parameter's pieces from every rank (``shards`` in rank order),
    in element order, checked to cover its elements exactly once with the
    same state keys.

    Raises:
        ValueError: they do not (shards of different saves, or edited).
    """
    return collect_pieces([item["state"] for item in shards], shards[0]["shapes"])


def collect_pieces(states: Sequence[dict],
                   shapes: Sequence[Sequence[int]]) -> Dict[int, List[dict]]:
    """``pieces_by_index`` of every rank's packed ``state`` (in rank order),
    for parameters of ``shapes``.

    Raises:
        ValueError: as ``pieces_by_index``.
    """
    by_index: Dict[int, List[dict]] = {}
    for rank, packed in enumerate(states):
        for index, piece in pieces_of({"state": packed}).items():
            if not isinstance(index, int) or not 0 <= index < len(shapes):
                raise ValueError(f"rank {rank}'s shard has state for parameter "
                                 f"{index!r}, which its groups do not list")
            by_index.setdefault(index, []).append(piece)
    for index, pieces in by_index.items():
        pieces.sort(key=lambda piece: piece["start"])
        numel = math.prod(shapes[index])
        if not _tiles(pieces, numel):
            covered = [(piece["start"], piece["end"]) for piece in pieces]
            raise ValueError(f"the shards' pieces of parameter {index}'s state cover elements "
                             f"{covered} of its {numel}, not each once: shards of different "
                             f"saves")
        for piece in pieces:
            if set(piece["slices"]) != set(pieces[0]["slices"]) or \
                    set(piece["values"]) != set(pieces[0]["values"]) or \
                    any(tuple(v.shape) != (piece["end"] - piece["start"],)
                        for v in piece["slices"].values()):
                raise ValueError(f"the shards disagree on parameter {index}'s state: its "
                                 f"pieces have different keys or lengths")
    return by_index


def _tiles(pieces: Sequence[dict], numel: int) -> bool:
    """``pieces`` (sorted by start) cover ``[0, numel)``, each element once."""
    at = 0
    for piece in pieces:
        if piece["start"] != at or piece["end"] < at:
            return False
        at = piece["end"]
    return at == numel


def state_over(pieces: Sequence[dict], start: int, end: int,
               shape: Optional[Sequence[int]] = None) -> dict:
    """One parameter's state over its elements ``[start, end)``, put together
    from ``pieces`` (fresh tensors; per-element values 1-D, or ``shape``).
    Keys come in the order torch's optimizers make them: the scalars
    (``step``) first, the master copy last."""
    entry = {}
    for key, value in pieces[0]["values"].items():
        entry[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    for key in sorted(pieces[0]["slices"], key=lambda k: k == "master_weight"):
        parts = [piece["slices"][key][max(start, piece["start"]) - piece["start"]:
                                      min(end, piece["end"]) - piece["start"]]
                 for piece in pieces if piece["start"] < end and piece["end"] > start]
        value = torch.cat(parts) if parts else pieces[0]["slices"][key][:0].clone()
        entry[key] = value.view(shape) if shape is not None else value
    return entry


def whole_state_dict(shards: Sequence[dict], by_index: Dict[int, List[dict]]) -> dict:
    """The torch-form state dict (``state`` keyed by the groups' parameter
    ids, per-element values shaped like their parameters) from ``shards``
    and their ``pieces_by_index``."""
    shapes = shards[0]["shapes"]
    groups = copy.deepcopy(shards[0]["param_groups"])
    ids = [i for g in groups for i in g["params"]]
    state = {ids[index]: state_over(pieces, 0, math.prod(shapes[index]), shapes[index])
             for index, pieces in sorted(by_index.items())}
    return {"state": state, "param_groups": groups}


def consolidate_sharded_state_dict(shards: Sequence[ShardSource]) -> dict:
    """Put every rank's ``sharded_state_dict()`` together into the whole
    state dict that ``DistributedOptimizer.state_dict()`` returns, in one
    process (no process group needed): for a plain torch optimizer, an
    unsharded run, or a tool that reads torch's form.

    Args:
        shards: every saved rank's dict, or the paths of the files
            ``torch.save`` wrote them to, in any order.

    Returns:
        ``{"state": ..., "param_groups": ...}`` with the keys and shapes of
        the wrapped optimizer's own ``state_dict()`` (16-bit parameters'
        fp32 masters under ``"master_weight"``, which torch optimizers keep
        as an unused entry and ``DistributedOptimizer`` reads).

    Raises:
        TypeError: ``shards`` or one of its items has the wrong type.
        ValueError: the items are not one complete save (a rank missing or
            twice, different saves, not sharded state dicts).

    Examples:
        >>> import fusedreduce, torch                              # doctest: +SKIP
        >>> files = [f"ckpt/optim.{r}.pt" for r in range(8)]      # doctest: +SKIP
        >>> whole = fusedreduce.consolidate_sharded_state_dict(files)  # doctest: +SKIP
        >>> torch.optim.AdamW(model.parameters()).load_state_dict(whole)  # doctest: +SKIP
    """
    loaded = read_shards(shards)
    return whole_state_dict(loaded, pieces_by_index(loaded))
