"""fusedreduce: fewer, larger, cheaper collectives for data-parallel PyTorch.

Gradients are gathered from many tensors into a few flat buffers by fused
kernels (``fusedreduce.kernels``), reduced with one ``torch.distributed``
collective per buffer, and scattered back, cast and scaled in the same pass.
docs/architecture.md maps the modules.
"""
import torch.distributed as _dist

if _dist.is_available():
    # torch.distributed.nn.functional binds the world process group into ten
    # default arguments when it is first imported, and torch.optim imports it
    # (through torch._dynamo) when the first optimizer is built. Imported after
    # init_process_group, those defaults keep gloo's group alive past
    # destroy_process_group(), and its worker threads then abort the
    # interpreter's exit ("terminate called without an active exception") in
    # about one run in four. Imported here, before the script's
    # init_process_group, the defaults bind None.
    import torch.distributed.nn.functional  # noqa: F401

from . import hooks, kernels
from .adasum import adasum_allreduce, adasum_allreduce_flat
from .allreduce import all_reduce_plan
from .broadcast import broadcast_optimizer_state, broadcast_tensors, parameter_broadcast
from .buckets import Bucket, BucketPlan, FlatBuffers, TensorSpec
from .optimizer import AdaSumByDeltaWeight, DistributedOptimizer
from .precision import communication_dtype
from .reducer import DistributedGradReducer
from .sharded import (OwnedRange, PartRange, ShardLayout, all_gather_plan, part_ranges,
                      reduce_scatter_plan)
from .sharded_checkpoint import consolidate_sharded_state_dict

__all__ = [
    "AdaSumByDeltaWeight",
    "Bucket",
    "BucketPlan",
    "TensorSpec",
    "adasum_allreduce",
    "adasum_allreduce_flat",
    "DistributedGradReducer",
    "DistributedOptimizer",
    "FlatBuffers",
    "OwnedRange",
    "PartRange",
    "ShardLayout",
    "all_gather_plan",
    "all_reduce_plan",
    "broadcast_optimizer_state",
    "broadcast_tensors",
    "communication_dtype",
    "consolidate_sharded_state_dict",
    "hooks",
    "kernels",
    "parameter_broadcast",
    "part_ranges",
    "reduce_scatter_plan",
]
# the one place the version is written: pyproject.toml reads it from here (a
# literal, so setuptools reads it from the source without importing the package)
__version__ = "0.1.0"
