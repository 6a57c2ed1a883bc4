"""What the library asks torch.distributed about the process group, in one place.

Who we are (``require_process_group``, ``global_rank``), where tensors must
live for the group's backend (``comm_device``), whether every rank holds the
same thing (``verify_same_on_all_ranks``), and the blocks of consecutive ranks
AdaSum's ``local_size`` averages within (``consecutive_block``).
"""
from __future__ import annotations

import hashlib
import pickle
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .kernels import refuse_in_capture, resolve_backend


def require_process_group(group=None) -> int:
    """The world size of ``group``; a clear error if torch.distributed is not up.

    Raises:
        RuntimeError: no default process group has been initialised, or this
            process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('nccl' or 'gloo') first (torchrun sets "
            "the environment it reads)")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """Where tensors must live to go through ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the same for the world)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def global_ranks(group) -> List[int]:
    """The global ranks of ``group``'s members, in group order."""
    return [global_rank(group, r) for r in range(dist.get_world_size(group))]


def check_rank(value, name: str, world_size: int) -> int:
    """``value`` if it is a rank of a group of ``world_size``.

    Raises:
        ValueError: anything else, naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
        raise ValueError(f"{name}={value!r} is not a rank of the group (0..{world_size - 1})")
    return value


#: what a refusal during capture advises for the functions that plan, check
#: and allocate at every call
ONE_SHOT_REMEDY = ("call it before or after the capture. Inside a captured step use "
                   "DistributedOptimizer or DistributedGradReducer(...).register_hooks(), "
                   "which check once, when built, and keep their buffers")


def refuse_one_shot_in_capture(tensors: Iterable[torch.Tensor], name: str) -> None:
    """Refuse ``name`` (a function that plans, checks across ranks and allocates
    at every call) during CUDA graph capture, before it does anything; the
    first of ``tensors`` says which device's stream to look at."""
    first = next(iter(tensors), None)
    if first is not None:
        refuse_in_capture(first.device, f"{name} (it plans, checks the ranks' tensors on "
                          f"the host and allocates its buffers at every call)", ONE_SHOT_REMEDY)


def backend_to_compare(backend: str, device: torch.device) -> Tuple[str, Optional[Exception]]:
    """``(name, error)``: the kernels' backend ``backend`` resolves to on
    ``device``, to compare across ranks, and None; or, where it cannot run
    here (no Triton on this rank), a name saying so and the error, for the
    caller to raise after the comparison, so that no rank is left waiting in
    it."""
    try:
        return resolve_backend(backend, device), None
    except RuntimeError as exc:
        return f"{backend} (cannot run here)", exc


def verify_same_on_all_ranks(description: Sequence[Any], names: Sequence[str], group=None,
                             what: str = "parameter", bucket_layout: Any = None,
                             bucket_layout_hint: str = "", remedy: str = "",
                             options: Sequence[Tuple[str, Any]] = (),
                             values: Sequence[int] = (), values_remedy: str = "") -> None:
    """Raise on every rank unless all ranks hold the same ``options``,
    ``description``, ``bucket_layout`` and ``values``.

    ``options`` are ``(name, value)`` pairs of single arguments (a broadcast's
    source, say), compared first: a differing one is named as such, whatever
    the tensors. ``description`` has one entry per tensor (``names[i]`` names
    entry ``i`` in the error); ``bucket_layout`` (``BucketPlan.layout()``) is
    compared after it, so a differing tensor is always reported as such, not
    as a layout change; ``remedy`` ends a tensor's error (default: every rank
    must pass the same ``what``s in the same order). ``values``
    (``value_checksums``, one per tensor named in ``names``) are compared
    last, so a differing value is reported only among tensors alike in
    everything else, ending with ``values_remedy``. Costs one all-reduce of
    two int64s when the ranks agree, whatever is compared; only on a
    mismatch are the descriptions gathered, to name the first entry that
    differs.

    Raises:
        RuntimeError: the ranks disagree; names the first differing option,
            or the first differing ``what`` (``names[i]``), and what each rank
            has there, or, when every entry agrees, says the bucket layouts
            differ (with ``bucket_layout_hint``), or, when that agrees too,
            names the ``what``s whose ``values`` differ from rank 0's and the
            ranks holding them; or called during CUDA graph capture (the
            check reads its all-reduce on the host).
    """
    refuse_in_capture(comm_device(group),
                      f"checking that every rank passes the same {what}s (the check's "
                      f"all-reduce is read on the host)", ONE_SHOT_REMEDY)
    options = [tuple(option) for option in options]
    mine = (options, list(description), bucket_layout, list(values))
    digest = hashlib.sha256(pickle.dumps(mine)).digest()
    value = int.from_bytes(digest[:7], "little")  # 56 bits: exact in int64 arithmetic
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):
        return
    everyone: List[Any] = [None] * dist.get_world_size(group)
    # (options, description, bucket layout, values, names) of every rank
    dist.all_gather_object(everyone, (*mine, list(names)), group=group)
    for i, (name, _) in enumerate(options):
        chosen = [theirs[i][1] if i < len(theirs) else "<missing>"
                  for theirs, _, _, _, _ in everyone]
        if any(v != chosen[0] for v in chosen):
            per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(chosen))
            raise RuntimeError(f"ranks disagree on {name}: {per_rank}. Every rank must pass "
                               f"the same {name}")
    longest = max(len(d) for _, d, _, _, _ in everyone)
    for i in range(longest):
        entries = [d[i] if i < len(d) else "<missing>" for _, d, _, _, _ in everyone]
        if any(e != entries[0] for e in entries):
            name = next(n[i] for _, d, _, _, n in everyone if i < len(n))
            per_rank = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            remedy = remedy or f"Every rank must pass the same {what}s in the same order"
            raise RuntimeError(f"ranks disagree on {what} {i} ({name}): {per_rank}. {remedy}")
    first = everyone[0][3]
    ranks = [r for r, (_, _, _, theirs, _) in enumerate(everyone) if theirs != first]
    if not ranks or any(lay != everyone[0][2] for _, _, lay, _, _ in everyone):
        per_rank = "; ".join(f"rank {r}: {lay}" for r, (_, _, lay, _, _) in enumerate(everyone))
        hint = f" ({bucket_layout_hint})" if bucket_layout_hint else ""
        raise RuntimeError(f"ranks agree on every {what} but not on the bucket layout{hint}: "
                           f"{per_rank}")
    differing = sorted({i for _, _, _, theirs, _ in everyone
                        for i, v in enumerate(theirs) if i >= len(first) or v != first[i]})
    shown = ", ".join(names[i] if i < len(names) else f"{what} {i}" for i in differing[:3])
    if len(differing) > 3:
        shown += ", ..."
    raise RuntimeError(f"ranks {ranks} hold other values than rank 0 in {len(differing)} of "
                       f"{len(first)} {what}s ({shown}). {values_remedy}")


#: an integer dtype of each element size, to read a tensor's bits as integers
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_checksums(tensors: Sequence[torch.Tensor]) -> List[int]:
    """One integer per tensor for ``verify_same_on_all_ranks``'s ``values``:
    the sum of its elements' bit patterns read as integers (int64
    arithmetic, which wraps). Integer sums do not depend on the summation
    order, so ranks holding the same bits get the same numbers on any
    device; replicas initialised from different seeds differ in every sum
    but with a chance of 2**-64. One pass over the tensors and one host read.
    """
    if not tensors:
        return []
    with torch.no_grad():
        device = tensors[0].device
        sums = [t.detach().view(_BITS_OF_SIZE[t.element_size()]).sum(dtype=torch.int64)
                for t in tensors]
        return torch.stack([s.to(device) for s in sums]).tolist()


# held weakly, by the parent group object: a kept gloo group's threads outlive
# destroy_process_group and can abort the interpreter's exit, and a world made
# again after destroy_process_group must get blocks of its own
_blocks: "weakref.WeakKeyDictionary[Any, Dict[int, list]]" = weakref.WeakKeyDictionary()


def consecutive_block(group, size: int):
    """This rank's block of ``size`` consecutive ranks of ``group``, as a process group.

    ``new_group`` is collective over the whole world, so every rank creates
    every block, once per (group, size), in the same order. The blocks live
    as long as ``group`` (the world's object for ``None``) does.
    """
    by_size = _blocks.setdefault(dist.group.WORLD if group is None else group, {})
    if size not in by_size:
        ranks = global_ranks(group)
        by_size[size] = [dist.new_group(ranks[i:i + size]) for i in range(0, len(ranks), size)]
    return by_size[size][dist.get_rank(group) // size]
