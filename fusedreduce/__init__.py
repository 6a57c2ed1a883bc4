"""fusedreduce: fewer, larger, cheaper collectives for data-parallel PyTorch.

Gradients are gathered from many tensors into a few flat buffers by fused
kernels (``fusedreduce.kernels``), reduced with one ``torch.distributed``
collective per buffer, and scattered back, cast and scaled in the same pass.
docs/architecture.md maps the modules.
"""
from . import hooks, kernels
from .adasum import adasum_allreduce, adasum_allreduce_flat
from .allreduce import all_reduce_plan
from .broadcast import broadcast_optimizer_state, broadcast_tensors, parameter_broadcast
from .buckets import Bucket, BucketPlan, TensorSpec
from .optimizer import AdaSumByDeltaWeight, DistributedOptimizer
from .precision import communication_dtype
from .reducer import DistributedGradReducer
from .sharded import PartRange, all_gather_plan, part_ranges, reduce_scatter_plan

__all__ = [
    "AdaSumByDeltaWeight",
    "Bucket",
    "BucketPlan",
    "TensorSpec",
    "adasum_allreduce",
    "adasum_allreduce_flat",
    "DistributedGradReducer",
    "DistributedOptimizer",
    "PartRange",
    "all_gather_plan",
    "all_reduce_plan",
    "broadcast_optimizer_state",
    "broadcast_tensors",
    "communication_dtype",
    "hooks",
    "kernels",
    "parameter_broadcast",
    "part_ranges",
    "reduce_scatter_plan",
]
# the one place the version is written: pyproject.toml reads it from here (a
# literal, so setuptools reads it from the source without importing the package)
__version__ = "0.1.0"
