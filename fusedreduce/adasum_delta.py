"""``AdaSumByDeltaWeight``: each rank steps locally, then the weight deltas
are combined with AdaSum. PyTorch counterpart of MindSpore's
``AdaSumByDeltaWeightWrapCell``, for any world size.

It returns an object that *is* an instance of the wrapped optimizer's class
(it takes over its parameter groups and state), so learning-rate schedulers,
``torch.amp.GradScaler`` and ``state_dict()``/``load_state_dict()`` work as
with the original. ``fusedreduce.optimizer`` and the package re-export it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._checks import refuse_join
from .adasum import adasum_allreduce
from .node_groups import check_local_size
from .param_swap import instance_of_both, params_of
from .process_group import require_process_group


class AdaSumByDeltaWeight(torch.optim.Optimizer):
    """Step locally, then combine the ranks' weight deltas with AdaSum.

    ``step()`` saves the weights, runs the wrapped optimizer on this rank's
    own gradients, takes the delta, AdaSum-reduces the deltas of all ranks
    (``adasum_allreduce``: one fused collective, per-parameter coefficients,
    any world size) and sets ``weights = saved + AdaSum(deltas)``. Gradients
    are not all-reduced: that is the point of the delta-weight formulation.

    Use it for large-batch training where averaging gradients stalls
    convergence: AdaSum adds orthogonal updates and averages parallel ones.
    Start from the learning rate tuned for one rank's batch (AdaSum of k
    identical deltas is the delta itself), and with ``local_size`` (ranks of a
    node averaged first) from the rate tuned for one node's batch.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        group: the process group; default: the world.
        local_size: average inside consecutive blocks of this many ranks first.
        bucket_cap_mb: the byte cap of a fused bucket.

    Raises:
        RuntimeError: torch.distributed is not initialised (AdaSum needs a
            distributed run, as MindSpore's does).
        ValueError: ``local_size`` does not divide the world size.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    Examples:
        >>> opt = AdaSumByDeltaWeight(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # doctest: +SKIP
        >>> loss.backward(); opt.step(); opt.zero_grad()   # doctest: +SKIP
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        return instance_of_both(cls, optimizer)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 group: Optional[dist.ProcessGroup] = None, *, local_size: int = 1,
                 bucket_cap_mb: float = 25.0) -> None:
        world_size = require_process_group(group)
        check_local_size(local_size, world_size)
        self.__dict__.update(optimizer.__dict__)
        self.group = group
        self.local_size = local_size
        self.bucket_cap_mb = bucket_cap_mb

    def step(self, closure=None):
        """Local step, then ``weights = saved + AdaSum(deltas)`` on every rank."""
        params = params_of(self)
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
        loss = super().step(closure)
        with torch.no_grad():
            deltas = torch._foreach_sub([p.detach() for p in params], saved)
            combined = adasum_allreduce(deltas, self.group, local_size=self.local_size,
                                        bucket_cap_mb=self.bucket_cap_mb)
            torch._foreach_add_(saved, combined)
            torch._foreach_copy_([p.detach() for p in params], saved)
        return loss

    def join_hook(self, **kwargs):
        """Refused: uneven inputs (``torch.distributed.algorithms.Join``) are
        not shadowed; every rank runs the same number of steps.

        Raises:
            TypeError: always.
        """
        refuse_join(type(self).__name__)
