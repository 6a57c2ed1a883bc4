"""fusedreduce: fewer, larger, cheaper collectives for data-parallel PyTorch.

Gradients are gathered from many tensors into a few flat buffers by fused
kernels (``fusedreduce.kernels``), reduced with one ``torch.distributed``
collective per buffer, and scattered back, cast and scaled in the same pass.
"""
from .buckets import Bucket, BucketPlan
from .collectives import all_reduce_plan
from . import kernels

__all__ = ["Bucket", "BucketPlan", "all_reduce_plan", "kernels"]
__version__ = "0.1.0"
