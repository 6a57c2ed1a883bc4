"""The one check that every rank runs a reducer or a DDP hook alike.

Options that differ by rank would not fail by themselves: another prescale,
backend or clip limit gives each rank other gradients, and a collective
that some ranks start and others do not leaves them waiting. Both the
reducers' first reduction (``verify_reducer_agrees``) and a DDP hook's
first bucket (``verify_hook_agrees``) compare what they depend on in one
all-reduce of two int64s (``process_group.verify_same_on_all_ranks``), the
kernels' backend as each rank resolved it included, and raise on every
rank, before anything is written, if the ranks differ.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from .buckets import BucketPlan
from .process_group import backend_to_compare, value_checksums, verify_same_on_all_ranks

#: the fix that the first reduction's error gives for replicas that differ
REPLICAS_REMEDY = (
    "The replicas did not start equal (a different seed per rank?), and a reduced gradient "
    "applied to different parameters trains different models. Copy rank 0's parameters to "
    "every rank before training: fusedreduce.parameter_broadcast(model) or "
    "fusedreduce.broadcast_tensors(params, src=0), or pass initial_parameters='broadcast' "
    "(DDP's behaviour); initial_parameters='unchecked' if they are not replicas")


def _agree(backend: str, device, compare: Callable[[str], None]) -> None:
    """``compare(resolved_backend)``, then raise the backend's own error if it
    cannot run here (after the collective, so that every rank took part)."""
    resolved, unusable = backend_to_compare(backend, device) if device is not None \
        else (backend, None)
    compare(resolved)
    if unusable is not None:
        raise unusable


def verify_reducer_agrees(parameters: Sequence[torch.Tensor], order: Sequence[int],
                          plan: BucketPlan, group, backend: str, *, clipping: Tuple,
                          reduction: Tuple, values: bool) -> None:
    """A reducer's first reduction: the same parameters (compared in the
    caller's order, so the error names the first that differs), bucket
    layout, ``clipping`` and ``reduction`` options on every rank, and with
    ``values`` the same parameter values as group rank 0's."""
    signature = plan.signature()
    slot_of = {i: slot for slot, i in enumerate(order)}
    description = [signature[slot_of[i]] for i in range(len(parameters))]
    names = [f"parameters[{i}] {tuple(p.shape)} {p.dtype}" for i, p in enumerate(parameters)]

    def compare(resolved: str) -> None:
        # the backends sum the norm in rows of different lengths (other
        # bits, and a split's all-reduce of another size); the values last:
        # a layout that differs is named as such first
        checksums = value_checksums(parameters) if values else ()
        verify_same_on_all_ranks(description, names, group, what="parameter",
                                 values=checksums, values_remedy=REPLICAS_REMEDY,
                                 bucket_layout=plan.layout() + [clipping, ("backend", resolved),
                                                                reduction],
                                 bucket_layout_hint="pass the same bucket_cap_mb, fusion_type, "
                                                    "shard, max_grad_norm, norm_type, "
                                                    "split_norm, backend, mean (reduce_method), "
                                                    "degree, prescale, local_size, "
                                                    "wire_dtype, deterministic, "
                                                    "error_feedback, check_finite, passes per reduction and "
                                                    "find_unused_parameters on every rank")

    _agree(backend, parameters[0].device if parameters else None, compare)


def verify_hook_agrees(options: Callable[[str], Sequence[Tuple[str, object]]], backend: str,
                       device, group) -> None:
    """A DDP hook's first bucket: the same hook ``options(resolved_backend)``
    (name, value pairs) on every rank."""
    def compare(resolved: str) -> None:
        compared = options(resolved)
        verify_same_on_all_ranks([value for _, value in compared],
                                 [name for name, _ in compared], group, what="hook option",
                                 remedy="Every rank must register the same hook with the "
                                        "same HookState options")

    _agree(backend, device, compare)
