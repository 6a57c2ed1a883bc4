"""fusedreduce: fewer, larger, cheaper collectives for data-parallel PyTorch.

Gradients are gathered from many tensors into a few flat buffers by fused
kernels (``fusedreduce.kernels``), reduced with one ``torch.distributed``
collective per buffer, and scattered back, cast and scaled in the same pass.
"""
from . import hooks, kernels
from .broadcast import broadcast_optimizer_state, parameter_broadcast
from .buckets import Bucket, BucketPlan, TensorSpec
from .collectives import adasum_allreduce, all_reduce_plan, broadcast_tensors
from .optimizer import AdaSumByDeltaWeight, DistributedOptimizer
from .reducer import DistributedGradReducer

__all__ = [
    "AdaSumByDeltaWeight",
    "Bucket",
    "BucketPlan",
    "TensorSpec",
    "adasum_allreduce",
    "DistributedGradReducer",
    "DistributedOptimizer",
    "all_reduce_plan",
    "broadcast_optimizer_state",
    "broadcast_tensors",
    "hooks",
    "kernels",
    "parameter_broadcast",
]
__version__ = "0.1.0"
