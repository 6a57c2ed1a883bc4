"""The machinery of ``DistributedOptimizer(..., shard=True)``: ZeRO on the fused buckets.

- ``ShardedGradReducer`` (``sharded_grads.py``): during backward each bucket
  is flattened (cast and prescaled in the same launch) and reduce-scattered as soon as it is ready;
  when backward ends, each ``.grad`` holds the reduced gradient on the
  elements this rank owns and zeros elsewhere (one write-back launch per
  bucket), and one small all-reduce settles, for every rank alike, which
  parameters got no gradient anywhere and whether any owned gradient is
  non-finite.
- ``ShardedParameters`` (``sharded_params.py``): this rank's part of every bucket as optimizer
  parameters: a parameter wholly owned is stepped as itself (or as its
  master copy), a parameter cut by a part boundary as a 1-D slice (a view,
  or a master copy); after the step the parts are all-gathered (one
  collective per bucket, in the parameters' own dtype) and written back into
  the parameters with one unflatten launch per bucket.

The layout is ``BucketPlan(..., shards=world_size)``: padding at bucket ends
only, part ``r`` of every bucket owned by group rank ``r``. With AdaSum a
rank owns instead the slice the tree's halving leaves it (``TreeShare``),
and the parameters come back through the tree's reverse swaps.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import kernels
from ._checks import check_choice
# re-exported: the sharded optimizer's pieces, by the names users and the
# sharded guide know them under
from .precision import master_dtype_of  # noqa: F401
from .shard_transport import GATHER_CHUNK_BYTES  # noqa: F401
from .sharded_grads import ShardedGradReducer  # noqa: F401
from .sharded_params import ShardedParameters  # noqa: F401

#: optimizers whose step updates every element from that element's gradient
#: and state alone (and per-parameter scalars such as a step count), so a
#: slice of a parameter steps exactly as the whole would
ELEMENTWISE_OPTIMIZERS: Tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
     "Rprop", "ASGD") if hasattr(torch.optim, name))


def check_shardable(optimizer: torch.optim.Optimizer, assume_elementwise: bool) -> None:
    """Refuse an optimizer whose step is not known to be elementwise.

    Raises:
        ValueError: ``optimizer``'s class is not one of
            ``ELEMENTWISE_OPTIMIZERS`` (exactly: a subclass may change the
            step) and ``assume_elementwise`` is false.
    """
    if assume_elementwise or type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"shard=True steps each rank's slice of a parameter on its own, which is exact only "
        f"for an optimizer whose step is elementwise; {type(optimizer).__name__} is not known "
        f"to be (known: {names}). An optimizer that needs whole tensors (LBFGS, Adafactor's "
        f"factored statistics, orthogonalising ones) would step wrongly. If its step is "
        f"elementwise, pass assume_elementwise=True")


def check_master_dtype(master_dtype) -> torch.dtype:
    """``master_dtype`` if it is a floating dtype the kernels handle.

    Raises:
        TypeError: not a ``torch.dtype``, or not floating.
    """
    if not isinstance(master_dtype, torch.dtype) or master_dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"master_dtype must be torch.float16, bfloat16, float32 or float64, "
                        f"got {master_dtype!r}")
    return master_dtype


#: ``gradient_collective=`` values: how the sharded reduction leaves each
#: rank its part of a bucket
GRADIENT_COLLECTIVES = ("reduce_scatter", "all_reduce", "exchange")
#: ``parameter_gather=`` values: how the stepped parts come back into the
#: parameters of every rank
PARAMETER_GATHERS = ("all_gather", "broadcast", "broadcast_direct")


def check_collectives(gradient_collective: Optional[str], parameter_gather: Optional[str], *,
                      shard: bool, adasum: bool) -> None:
    """Refuse a collective choice that is not one of the sharded step's.

    Raises:
        TypeError: ``gradient_collective`` or ``parameter_gather`` is neither
            None nor a string.
        ValueError: not one of ``GRADIENT_COLLECTIVES`` / ``PARAMETER_GATHERS``;
            given without ``shard``, or with AdaSum (whose tree is its own
            collective both ways).
    """
    for name, value, known in (("gradient_collective", gradient_collective,
                                GRADIENT_COLLECTIVES),
                               ("parameter_gather", parameter_gather, PARAMETER_GATHERS)):
        if check_choice(value, name, known, optional=True) is None:
            continue
        if not shard:
            raise ValueError(f"{name}={value!r} applies to shard=True only (unsharded, every "
                             f"bucket is all-reduced)")
        if adasum:
            raise ValueError(f"{name}={value!r} does not combine with reduce_method='adasum': "
                             f"AdaSum's tree reduces the gradients and gathers the parameters")


def check_node_collectives(node, gradient_collective: Optional[str],
                           parameter_gather: Optional[str], *, world_size: int) -> None:
    """Refuse a collective choice the node-aware sharded step cannot take
    (``node``: ``node_collectives.NodeOptions``).

    Raises:
        ValueError: ``gradient_collective`` "all_reduce" or "exchange" with
            ``local_size`` > 1, ``wire_dtype`` or ``deterministic``;
            "reduce_scatter" with ``wire_dtype`` or ``deterministic`` (their
            sum is the all-to-all one); ``parameter_gather`` "broadcast" or
            "broadcast_direct" with more than one node of ``local_size`` > 1
            ranks (the parts are not in rank order there: they are gathered
            back over the nodes' levels).
    """
    if node.flat:
        return
    if gradient_collective in ("all_reduce", "exchange"):
        raise ValueError(f"gradient_collective={gradient_collective!r} does not combine with "
                         f"local_size > 1, wire_dtype or deterministic: leave it None, or "
                         f"'reduce_scatter' for the backend's reduce-scatter on each level")
    if gradient_collective == "reduce_scatter" and node.exchanges:
        raise ValueError("gradient_collective='reduce_scatter' does not combine with wire_dtype "
                         "or deterministic: their sum is the all-to-all one (leave it None)")
    if parameter_gather in ("broadcast", "broadcast_direct") \
            and 1 < node.local_size < world_size:
        raise ValueError(f"parameter_gather={parameter_gather!r} does not combine with "
                         f"local_size={node.local_size} over {world_size // node.local_size} "
                         f"nodes: the parts are gathered back over the nodes' levels (leave "
                         f"it None, or 'all_gather')")
