"""BucketPlan: which tensors fuse into which flat buffer, and where each one sits.

A plan is computed from shapes, dtypes and devices only, in a fixed order, so
every rank that passes the same tensor list gets the same plan. It is the one
description of a fused layout: flatten/unflatten, the collectives and AdaSum's
per-tensor segments all read their offsets from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import kernels

DtypeRule = Union[None, torch.dtype, Callable[[torch.dtype], torch.dtype]]


@dataclass(frozen=True)
class TensorSpec:
    """What a plan needs to know of a tensor: no reference to its data is kept."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a plan.

    Attributes:
        index: position in ``BucketPlan.buckets``.
        device: where the buffer lives.
        dtype: the communication dtype (the buffer's dtype).
        fusion_id: the fusion group all its tensors belong to.
        tensor_indices: which of the plan's tensors it holds, in order.
        offsets: each tensor's first element in the buffer (aligned).
        numels: each tensor's element count.
        size: the buffer's element count, padding included.
        shards: how many equal contiguous parts the buffer splits into (the
            plan's ``shards``); ``size`` is a multiple of it.
    """

    index: int
    device: torch.device
    dtype: torch.dtype
    fusion_id: int
    tensor_indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numels: Tuple[int, ...]
    size: int
    shards: int = 1

    @property
    def nbytes(self) -> int:
        return self.size * _itemsize(self.dtype)

    @property
    def part_size(self) -> int:
        """The element count of each of the ``shards`` parts."""
        return self.size // self.shards

    def segments(self) -> List[Tuple[int, int]]:
        """``(start, end)`` of each tensor's elements in the buffer."""
        return [(o, o + n) for o, n in zip(self.offsets, self.numels)]


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the memory under ``tensors``, each storage counted once (a
    view or a reinterpretation of another tensor's memory adds nothing).

    Examples:
        >>> flat = torch.zeros(1000)
        >>> storage_bytes([flat, flat[10:20], flat.view(torch.bfloat16)])
        4000
        >>> storage_bytes([flat, torch.zeros(10, dtype=torch.float16)])
        4020
    """
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class FlatBuffers:
    """The flat buffers a reducer or a ``DistributedOptimizer`` holds, per
    bucket, as tensor objects, by role: what ``buffer_bytes`` counts (beside
    the zeros a sharded reducer keeps for frozen parameters). For
    memory accounting, tests and benchmarks: read them, never write them
    (the next backward or step overwrites them, and a kept launch is found
    by the buffer's identity). A buffer whose memory was given back
    (``shard_gradients=True`` between its uses) stays the same tensor with
    a storage of 0 bytes.

    Attributes:
        gradients: per bucket, the flat buffer its gradients are reduced in
            (in the bucket's communication dtype; the hooks' path); None
            until made.
        calls: per bucket, the call path's (``reducer(grads)``), likewise.
        views: with ``gradient_as_bucket_view``, the buffers the ``.grad``
            tensors of other dtypes than their bucket's are views of.
        parts: with ``shard=True``, per bucket, this rank's part of the
            reduced gradient (a slot of its ``gradients`` buffer, or with
            ``shard_gradients`` a tensor of its own); None until made.
        gathers: with ``shard=True``, per bucket, the buffer the parameters
            are all-gathered into (most reuse the ``gradients`` buffer's
            memory); None until made (a bucket gathered straight into the
            parameters, with ``shard_gradients``, needs none).

    Examples:
        >>> reducer = DistributedGradReducer([torch.zeros(10)])  # doctest: +SKIP
        >>> _ = reducer([torch.ones(10)])                        # doctest: +SKIP
        >>> len(reducer.flat_buffers.calls)   # one bucket         # doctest: +SKIP
        1
    """

    gradients: Tuple[Optional[torch.Tensor], ...] = ()
    calls: Tuple[Optional[torch.Tensor], ...] = ()
    views: Tuple[torch.Tensor, ...] = ()
    parts: Tuple[Optional[torch.Tensor], ...] = ()
    gathers: Tuple[Optional[torch.Tensor], ...] = ()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _resolve_dtype(rule: DtypeRule, dtype: torch.dtype) -> torch.dtype:
    if rule is None:
        return dtype
    if isinstance(rule, torch.dtype):
        return rule
    return rule(dtype)


class BucketPlan:
    """Split a list of tensors into fused buckets.

    Tensors are grouped by (device, communication dtype, fusion id); within a
    group they fill buckets in list order up to ``bucket_cap_mb`` (a tensor
    larger than the cap gets a bucket of its own). Buckets are ordered by
    their first tensor. Tensors with different fusion ids never share a
    bucket (MindSpore's ``fusion_type``).

    Args:
        tensors: the tensors (or ``TensorSpec``s) to plan for; only shapes,
            dtypes and devices are read.
        bucket_cap_mb: the byte cap of a bucket in MiB (2**20 bytes); any
            positive number: ``1 / 2**20`` (one byte) gives one bucket per tensor.
        comm_dtype: the communication dtype: None keeps each tensor's dtype, a
            dtype applies to all, a callable maps each tensor's dtype.
        fusion_ids: one int per tensor; default: all in group 0.
        shards: split every bucket into this many equal contiguous parts (the
            group's world size, for ``reduce_scatter_plan``): each bucket is
            padded at its end only, to a multiple of ``shards`` times the
            16-byte alignment, so every part starts aligned.
        part_multiple: each part's element count is also a multiple of
            this (``kernels.WIRE_BLOCK`` for the blockwise wire formats, whose
            rank chunks must hold whole blocks).

    Raises:
        TypeError: a non-tensor, sparse or non-floating entry, or a bad
            ``comm_dtype`` (the index is named).
        ValueError: a non-positive ``bucket_cap_mb``, ``shards`` or
            ``part_multiple``, or ``fusion_ids`` of the wrong length.

    Examples:
        >>> ts = [torch.zeros(1000), torch.zeros(10, dtype=torch.float16), torch.zeros(3)]
        >>> plan = BucketPlan(ts, comm_dtype=torch.float32)
        >>> [(b.tensor_indices, b.offsets, b.size) for b in plan.buckets]
        [((0, 1, 2), (0, 1000, 1012), 1016)]
        >>> [(b.size, b.part_size) for b in BucketPlan(ts, comm_dtype=torch.float32,
        ...                                            shards=3).buckets]
        [(1020, 340)]
    """

    def __init__(
        self,
        tensors: Sequence[Union[torch.Tensor, TensorSpec]],
        *,
        bucket_cap_mb: float = 25.0,
        comm_dtype: DtypeRule = None,
        fusion_ids: Optional[Sequence[int]] = None,
        shards: int = 1,
        part_multiple: int = 1,
    ) -> None:
        for name, value in (("shards", shards), ("part_multiple", part_multiple)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.shards, self.part_multiple = shards, part_multiple
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0 or not math.isfinite(bucket_cap_mb):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.specs: Tuple[TensorSpec, ...] = tuple(_spec(t, i) for i, t in enumerate(tensors))
        if fusion_ids is None:
            fusion_ids = [0] * len(self.specs)
        fusion_ids = [_fusion_id(f, i) for i, f in enumerate(fusion_ids)]
        if len(fusion_ids) != len(self.specs):
            raise ValueError(f"fusion_ids has {len(fusion_ids)} entries for {len(self.specs)} "
                             f"tensors")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.fusion_ids: Tuple[int, ...] = tuple(fusion_ids)
        self.comm_dtypes: Tuple[torch.dtype, ...] = tuple(
            _comm_dtype(comm_dtype, s.dtype, i) for i, s in enumerate(self.specs))
        self.buckets: Tuple[Bucket, ...] = self._split(int(bucket_cap_mb * 2 ** 20))
        self.location: Tuple[Tuple[int, int], ...] = self._locate()

    def _split(self, cap_bytes: int) -> Tuple[Bucket, ...]:
        open_buckets: Dict[tuple, List[int]] = {}
        closed: List[List[int]] = []
        used: Dict[tuple, int] = {}
        for i, spec in enumerate(self.specs):
            key = (str(spec.device), self.comm_dtypes[i], self.fusion_ids[i])
            nbytes = spec.numel * _itemsize(self.comm_dtypes[i])
            members = open_buckets.get(key)
            if members and used[key] + nbytes > cap_bytes:
                closed.append(members)
                members = None
            if not members:
                members = open_buckets[key] = []
                used[key] = 0
            members.append(i)
            used[key] += nbytes
        closed.extend(m for m in open_buckets.values() if m)
        closed.sort(key=lambda members: members[0])
        return tuple(self._bucket(k, members) for k, members in enumerate(closed))

    def _bucket(self, index: int, members: List[int]) -> Bucket:
        dtype = self.comm_dtypes[members[0]]
        # aligned segment starts: the kernels' 128-bit fast path then applies to
        # every full block of every segment
        align = kernels.ALIGN_BYTES // _itemsize(dtype)
        offsets, position = [], 0
        for i in members:
            offsets.append(position)
            position += -(-self.specs[i].numel // align) * align
        # sharded: padding at the end only, so that each part starts aligned
        stride = math.lcm(align, self.part_multiple) * self.shards
        size = -(-position // stride) * stride
        return Bucket(index=index, device=self.specs[members[0]].device, dtype=dtype,
                      fusion_id=self.fusion_ids[members[0]], tensor_indices=tuple(members),
                      offsets=tuple(offsets),
                      numels=tuple(self.specs[i].numel for i in members), size=size,
                      shards=self.shards)

    def _locate(self) -> Tuple[Tuple[int, int], ...]:
        where = [None] * len(self.specs)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.tensor_indices):
                where[i] = (bucket.index, slot)
        return tuple(where)

    def __len__(self) -> int:
        return len(self.buckets)

    def __repr__(self) -> str:
        total = sum(b.nbytes for b in self.buckets)
        return (f"BucketPlan({len(self.specs)} tensors in {len(self.buckets)} buckets, "
                f"{total / 2 ** 20:.2f} MiB, cap {self.bucket_cap_mb} MiB)")

    def signature(self) -> List[tuple]:
        """A picklable description to compare across ranks: per tensor, its
        shape, dtype, communication dtype and fusion id, in plan order."""
        return [(s.shape, str(s.dtype), str(c), f)
                for s, c, f in zip(self.specs, self.comm_dtypes, self.fusion_ids)]

    def layout(self) -> List[tuple]:
        """A picklable description of the buckets to compare across ranks: per
        bucket, its communication dtype, fusion id, member tensors and size.
        Two ranks whose ``signature()`` agree still disagree here when they
        were planned with different ``bucket_cap_mb``."""
        return [(str(b.dtype), b.fusion_id, b.tensor_indices, b.size) for b in self.buckets]

    def check(self, tensors: Sequence[torch.Tensor], name: str = "tensors") -> None:
        """Raise unless ``tensors`` match the plan's specs one by one.

        Raises:
            TypeError: an entry is not a dense tensor.
            ValueError: the count, or a shape, dtype or device differs (the
                first offending index is named).
        """
        if len(tensors) != len(self.specs):
            raise ValueError(f"{name} has {len(tensors)} entries but the plan has "
                             f"{len(self.specs)} tensors")
        for i, (t, spec) in enumerate(zip(tensors, self.specs)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise TypeError(f"{name}[{i}] is a {t.layout} tensor; only dense tensors fuse")
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype or t.device != spec.device:
                raise ValueError(
                    f"{name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} but the plan "
                    f"expects {spec.shape} {spec.dtype} on {spec.device}")

    def new_buffer(self, bucket: Bucket, spare: int = 0) -> torch.Tensor:
        """An uninitialised flat buffer for ``bucket``, with ``spare`` elements
        after the bucket's for whatever travels with it."""
        return torch.empty(bucket.size + spare, dtype=bucket.dtype, device=bucket.device)

    def flatten(self, bucket: Bucket, tensors: Sequence[torch.Tensor], *,
                out: Optional[torch.Tensor] = None, scale: float = 1.0,
                check_finite: bool = False, backend: str = "auto"):
        """Gather ``bucket``'s tensors (picked from the full list ``tensors``)
        into its flat buffer; see ``kernels.flatten_cast_scale``."""
        members = [tensors[i] for i in bucket.tensor_indices]
        if out is None:
            out = self.new_buffer(bucket)
        return kernels.flatten_cast_scale(members, out, scale=scale, check_finite=check_finite,
                                          offsets=bucket.offsets, backend=backend)

    def unflatten(self, bucket: Bucket, flat: torch.Tensor, tensors: Sequence[torch.Tensor], *,
                  scale: float = 1.0, accumulate: bool = False, backend: str = "auto") -> None:
        """Scatter ``flat`` into ``bucket``'s tensors (picked from the full list
        ``tensors``); see ``kernels.unflatten_cast_scale``."""
        members = [tensors[i] for i in bucket.tensor_indices]
        kernels.unflatten_cast_scale(flat, members, scale=scale, accumulate=accumulate,
                                     offsets=bucket.offsets, backend=backend)


def _spec(t, index: int) -> TensorSpec:
    if isinstance(t, TensorSpec):
        spec = t
    elif isinstance(t, torch.Tensor):
        if t.layout != torch.strided:
            raise TypeError(f"tensors[{index}] is a {t.layout} tensor; only dense tensors fuse")
        spec = TensorSpec.of(t)
    else:
        raise TypeError(f"tensors[{index}] must be a torch.Tensor, got {type(t).__name__}")
    if spec.dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"tensors[{index}] has dtype {spec.dtype}; only float16, bfloat16, "
                        f"float32 and float64 tensors can be fused")
    return spec


def _fusion_id(value, index: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fusion_ids[{index}] must be an int, got {type(value).__name__}")
    return value


def _comm_dtype(rule: DtypeRule, dtype: torch.dtype, index: int) -> torch.dtype:
    chosen = _resolve_dtype(rule, dtype)
    if chosen not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"the communication dtype for tensors[{index}] is {chosen}; it must "
                        f"be float16, bfloat16, float32 or float64")
    return chosen
