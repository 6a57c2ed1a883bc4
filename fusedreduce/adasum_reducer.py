"""``AdaSumReducer``: a ``DistributedGradReducer`` whose buckets combine by AdaSum.

A user API over the AdaSum pipeline (``adasum.py``): it lives a layer above
it, with the reducer it subclasses, so that the pipeline imports nothing of
the user APIs (``docs/architecture.md``, ``tests/test_layers.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .adasum import check_adasum_reduce_dtype
from .node_groups import check_local_size
from .grad_collectives import AdaSumTree
from .reducer import DistributedGradReducer


class AdaSumReducer(DistributedGradReducer):
    """A ``DistributedGradReducer`` whose buckets combine by AdaSum, not by a sum.

    Each bucket, once its gradients are ready (or on a call), is flattened
    into an fp32/fp64 buffer times ``1/local_size`` and combined along
    AdaSum's tree (``adasum_allreduce_flat``), one coefficient pair per
    parameter: the result is bitwise ``adasum_allreduce`` of the gradients,
    whatever the bucketing. The tree is a chain of dependent point-to-point
    steps, run when the bucket starts (as ``adasum_hook`` runs it).

    Args:
        parameters: as ``DistributedGradReducer``'s.
        group: the process group; default: the world.
        local_size: average inside consecutive blocks of this many ranks
            first (a node's GPUs), then AdaSum across the blocks.
        bucket_cap_mb: the byte cap of a fused bucket, in MiB.
        reduce_dtype: float32 (16-bit gradients are combined in fp32) or
            float64.
        backend: the kernels' backend.
        clipping: ``max_grad_norm``, ``norm_type`` and ``error_if_nonfinite``
            as ``DistributedGradReducer`` takes them (the norm of the combined
            gradients).

    Raises:
        ValueError: ``reduce_dtype`` is 16-bit (AdaSum's statistics and
            combine need fp32 or fp64 buffers), or ``local_size`` does not
            divide the world size, or ``wire_dtype``, ``deterministic`` or
            ``error_feedback`` given; and ``DistributedGradReducer``'s errors.
    """

    def __init__(self, parameters, group: Optional[dist.ProcessGroup] = None, *,
                 local_size: int = 1, bucket_cap_mb: float = 25.0,
                 reduce_dtype: torch.dtype = torch.float32, backend: str = "auto",
                 **clipping) -> None:
        check_adasum_reduce_dtype(reduce_dtype)
        if any(clipping.get(name) not in (None, False)
               for name in ("wire_dtype", "deterministic", "error_feedback")):
            raise ValueError("wire_dtype, deterministic and error_feedback do not combine with "
                             "AdaSum (it combines the gradients, it does not sum them)")
        super().__init__(parameters, mean=False, group=group, bucket_cap_mb=bucket_cap_mb,
                         reduce_dtype=reduce_dtype, backend=backend, **clipping)
        self._engine.stacks_exactly = False  # a combine of combined gradients
        self.local_size = check_local_size(local_size, self.world_size)
        self._engine.combine_by(AdaSumTree(self.plan, group, local_size, backend))
