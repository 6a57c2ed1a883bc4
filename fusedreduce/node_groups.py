"""The process groups of a node-aware reduction, made once and reused.

``local_size`` ranks per node, contiguous in the group's rank order (as
torchrun numbers them: ``LOCAL_WORLD_SIZE`` ranks per host): the *intra*
group is this rank's node, the *cross* group the ranks of every node with
this rank's local rank. Every reducer, optimizer and hook of the same ranks
shares them: ``dist.new_group`` costs a store round and a connection per
pair, so each set of ranks is made once per process (``node_groups``).

Each group is made with ``use_local_synchronization=True``: only its members
enter ``new_group``, so a sub-group's ranks make theirs without the rest of
the world, and the world's named counter of groups (which plain
``new_group`` calls share) is left alone. Every rank makes its intra group
first, then its cross group: the intra groups are disjoint, so no rank waits
in one while a peer waits in another (torch's note on overlapping groups).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from .process_group import verify_same_on_all_ranks

# held weakly, by the world's group object (as process_group.consecutive_block
# keeps its blocks): a kept gloo group's threads outlive destroy_process_group
# and can abort the interpreter's exit, and a world made again gets groups of
# its own. Per world: the groups made, by (backend, global ranks), and the
# NodeGroups, by (parent's global ranks, local_size)
_made: "weakref.WeakKeyDictionary[Any, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_nodes: "weakref.WeakKeyDictionary[Any, Dict[tuple, NodeGroups]]" = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node-aware groups (see the module).

    Attributes:
        local_size: ranks per node.
        nodes: the number of nodes (the group's size / ``local_size``).
        local_rank: this rank's position in its node.
        node: this rank's node index.
        intra: the node's group (``local_size`` ranks); None with one node
            (the parent group is the node).
        cross: the group of the ranks with this local rank (``nodes``
            ranks); None with one node (nothing crosses).
    """

    local_size: int
    nodes: int
    local_rank: int
    node: int
    intra: Optional[dist.ProcessGroup]
    cross: Optional[dist.ProcessGroup]


def check_local_size(local_size, world_size: int) -> int:
    """``local_size`` if it is a positive int dividing ``world_size``: the
    ranks per node of the node-aware sums, AdaSum's blocks averaged first.

    A non-int (a bool included) is a ValueError like a bad int, as
    ``_checks.check_int``'s: one message says what ``local_size`` must be.

    Raises:
        ValueError: anything else, naming ``local_size``, the group's size and
            where torchrun gives the value.

    Examples:
        >>> check_local_size(2, 8)
        2
    """
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or world_size % local_size:
        raise ValueError(f"local_size must be a positive int dividing the group's size "
                         f"({world_size}): the ranks per node, e.g. "
                         f"int(os.environ['LOCAL_WORLD_SIZE']) under torchrun; got "
                         f"{local_size!r}")
    return local_size


def node_groups(group, local_size: int) -> NodeGroups:
    """This rank's intra-node and cross-node groups of ``group`` (None: the
    world) with ``local_size`` ranks per node, made at the first call for
    these ranks (by this rank's node and cross peers only) and reused.

    The first call for these ranks and ``local_size`` checks, in one small
    all-reduce over ``group``, that every rank passed the same
    ``local_size``: ranks that disagree would otherwise wait in groups the
    others never make.

    Raises:
        ValueError: ``local_size`` does not divide the group's size.
        RuntimeError: (on every rank) the ranks passed different ``local_size``.
    """
    world_size = dist.get_world_size(group)
    check_local_size(local_size, world_size)
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None
                  else range(world_size))
    known = _nodes.setdefault(dist.group.WORLD, {})
    made = known.get((ranks, local_size))
    if made is not None:
        return made
    verify_same_on_all_ranks([], [], group, what="option",
                             options=[("local_size", local_size)])
    node, local_rank = divmod(dist.get_rank(group), local_size)
    nodes = world_size // local_size
    backend = str(dist.get_backend(group))
    intra = None if nodes == 1 else _group(
        backend, ranks[node * local_size:(node + 1) * local_size])
    cross = None if nodes == 1 else _group(backend, ranks[local_rank::local_size])
    made = known[(ranks, local_size)] = NodeGroups(local_size, nodes, local_rank, node,
                                                   intra, cross)
    return made


def _group(backend: str, ranks: Tuple[int, ...]) -> dist.ProcessGroup:
    """The group of ``ranks``, made by its members at the first call."""
    groups = _made.setdefault(dist.group.WORLD, {})
    made = groups.get((backend, ranks))
    if made is None:
        made = groups[(backend, ranks)] = dist.new_group(list(ranks), backend=backend,
                                                         use_local_synchronization=True)
    return made
