"""All-to-all gradient sums: compressed wire formats and the deterministic sum.

Never reduce in low precision inside the collective: each level of
``WireSum`` exchanges codes (``all_to_all_single``: chunk ``i`` of every rank
goes to the level's rank ``i``; a blockwise format's chunk carries its block
scales after its codes, so each level is one collective per direction, each
of which costs a latency on a network), and each rank dequantizes and sums the
chunks it received in fp32, in one fixed pairwise order
(``kernels.dequantize_sum``), into its own chunk of the bucket's buffer. The
sum is a pure function of the inputs: the same bits whatever the transport,
the bucket cap or the message sizes. Then the chunks travel back by
all-gathers, the innermost level first: in the wire format (each rank's
chunk re-quantized, its own included, so that every rank dequantizes the
same codes: the same bits everywhere), or in fp32 (``gather_wire=False``).

The levels (``node_collectives.node_collective`` builds them):

- one node, or ``local_size=1``: one level over the whole group, in the
  wire format (fp32 codes when only ``deterministic`` is asked, or on one
  node: nothing crosses a node there);
- two levels: inside the node in fp32 (the node's partial sums), then across
  nodes in the wire format, on the node's ``1/local_size`` chunk only. The
  pairwise order makes the node partial sums the subtrees of the flat
  order's tree when ``local_size`` is a power of two, so deterministic
  two-level results are bitwise the flat ones; with another ``local_size``
  they are deterministic too, but another order than the flat one.

The first level's codes of a wire format come straight from the gradients,
in the flatten pass (``kernels.quantize_flatten``, with error feedback's
residual added in the same pass); fp32 codes are the flatten itself, into
the buffer. The spare counts after the bucket (``check_finite``,
``find_unused_parameters``) are summed exactly by a small all-reduce of
their own (``node_collectives``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from .allreduce import PendingBucket, flatten_bucket
from .buckets import Bucket, BucketPlan
from .grad_collectives import AllReduce
from .sharded import start_all_gather


@dataclass(frozen=True)
class Level:
    """One exchange of ``WireSum``: ``group`` (``ranks`` ranks, this one at
    ``me``), its codes' ``dtype``."""

    group: Optional[dist.ProcessGroup]
    ranks: int
    me: int
    dtype: torch.dtype


@dataclass(frozen=True)
class LevelBuffers:
    """What level ``k`` of one bucket works on at every call, made at the
    bucket's first call and kept (``WireSum.level_buffers``): views that
    depend only on the bucket, the level and the buffer.

    ``whole`` is the region the level splits, ``mine`` this rank's chunk of
    it (the next level's region); ``codes``/``scales`` what its all-to-all
    sends (``whole`` itself for fp32 codes), ``received`` the ``(ranks,
    chunk)`` codes and scales that land (and where the all-gather lands);
    ``own``/``own_scales`` this rank's chunk of ``codes`` (what the
    all-gather sends). For the blockwise formats, the codes and scales are
    views of one byte buffer, each rank's chunk of codes followed by its
    scales: ``send``, ``land`` and ``own_send`` are those bytes, flat, as
    the collectives take them (one per level and direction), ``rows`` the
    received codes and scales as the gather's dequantize takes them."""

    whole: torch.Tensor
    mine: torch.Tensor
    codes: torch.Tensor
    scales: Optional[torch.Tensor]
    received: Tuple[torch.Tensor, Optional[torch.Tensor]]
    own: torch.Tensor
    own_scales: Optional[torch.Tensor]
    send: torch.Tensor
    land: torch.Tensor
    own_send: torch.Tensor
    rows: Tuple[torch.Tensor, Optional[torch.Tensor]]


class Phases:
    """A bucket's collectives in flight (``firsts``) and the phases after
    them (``later``, called in order), run by ``wait``: a
    ``PendingBucket.work``."""

    def __init__(self, firsts: Sequence, later: Sequence) -> None:
        self.firsts = list(firsts)
        self.later = [call for call in later if call is not None]

    def wait(self) -> None:
        while self.firsts:
            self.firsts.pop(0).wait()
        while self.later:
            self.later.pop(0)()


def spares_sum(bucket: Bucket, buffer: torch.Tensor, group):
    """The sum of ``buffer``'s spare elements over ``group``, started now (a
    call that waits for it), or None when it has none."""
    if buffer.numel() == bucket.size:
        return None
    return dist.all_reduce(buffer[bucket.size:], group=group, async_op=True).wait


class WireSum(AllReduce):
    """The all-to-all sum of a bucket over ``levels`` (see the module).

    Attributes:
        gather_wire: the all-gathers back in the wire format (default) or in
            fp32; a class attribute for measuring both ways (set on the
            class, it applies to every ``WireSum`` of the process; fp32
            sends 4 bytes per element back instead of 1 or 2, and skips a
            re-quantization).
        residuals: with ``error_feedback``, per bucket, the fp32
            quantization error of the compressing level, added to the next
            step's values (4 bytes per element of the chunk quantized:
            the whole bucket flat, ``1/local_size`` of it on two levels).
    """

    gather_wire = True
    #: whether the summed chunks travel back to every rank (False: each rank
    #: keeps its own chunk of the sum, a reduce-scatter; ``owned_chunk``)
    gathers_back = True

    def __init__(self, plan: BucketPlan, group, world_size: int, backend: str,
                 levels: Sequence[Level], error_feedback: bool) -> None:
        super().__init__(plan, group, world_size, backend)
        self.levels = list(levels)
        self.error_feedback = error_feedback
        self.signature = ("all-to-all", tuple((lv.ranks, str(lv.dtype)) for lv in levels))
        self.blocking = dist.get_backend(group) == dist.Backend.GLOO
        self.residuals: Dict[int, torch.Tensor] = {}
        self._kept: Dict[Tuple, torch.Tensor] = {}
        # per bucket: the address of the buffer its level buffers view, and them
        self._views: Dict[int, Tuple[int, List[LevelBuffers]]] = {}

    def held(self) -> List[torch.Tensor]:
        """The codes, received chunks, scales and residuals kept."""
        return [*self._kept.values(), *self.residuals.values()]

    def level_buffers(self, bucket: Bucket, flat: torch.Tensor) -> List[LevelBuffers]:
        """Every level's buffers for ``bucket`` whose buffer (or region) is
        ``flat``, outermost first: made at the first call, and again only
        where ``flat`` is at another address (another buffer, or one whose
        memory was given back and taken again)."""
        kept = self._views.get(bucket.index)
        if kept is not None and kept[0] == flat.data_ptr():
            return kept[1]
        made, region = [], flat[:bucket.size]
        for k, (whole, mine) in enumerate(level_regions(self.levels, region)):
            made.append(self._level_buffers(bucket, k, whole, mine))
        self._views[bucket.index] = (flat.data_ptr(), made)
        return made

    def _level_buffers(self, bucket: Bucket, k: int, whole: torch.Tensor,
                       mine: torch.Tensor) -> LevelBuffers:
        level, numel = self.levels[k], whole.numel()
        if level.dtype == torch.float32:
            codes, scales = whole, None
        else:
            codes, scales = self._codes(bucket, k, numel)
        got, got_scales = self._received(bucket, k, numel)
        if scales is None:
            sent, landed = codes, got
            width = mine.numel()
            own, own_scales = codes[level.me * width:(level.me + 1) * width], None
            own_sent, rows = own, (got.view(1, -1), None)
        else:  # chunk by chunk: each rank's codes, then their scales
            sent = self._wire_buffer(bucket, k, numel, "codes")
            landed = self._wire_buffer(bucket, k, numel, "received")
            own, own_scales, own_sent = codes[level.me], scales[level.me], sent[level.me]
            rows = (got.unsqueeze(0), got_scales.unsqueeze(0))
        return LevelBuffers(whole, mine, codes, scales, (got, got_scales), own, own_scales,
                            send=_bytes(sent), land=_bytes(landed),
                            own_send=_bytes(own_sent), rows=rows)

    def _level(self, bucket: Bucket, k: int) -> LevelBuffers:
        """Level ``k``'s buffers of ``bucket``, made by the bucket's start."""
        return self._views[bucket.index][1][k]

    # ------------------------------------------------------------ the start
    def start(self, bucket: Bucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor,
              part: Optional[torch.Tensor] = None, prescale: float = 1.0, *,
              count_nonfinite: bool = False, mark_spare: Optional[int] = None) -> PendingBucket:
        if self.levels[0].dtype == torch.float32:
            spare = flatten_bucket(self.plan, bucket, tensors, buffer, prescale=prescale,
                                   backend=self.backend, count_nonfinite=count_nonfinite,
                                   mark_spare=mark_spare)
            return self.communicate(bucket, buffer, spare)
        # the codes straight from the gradients, in the flatten pass
        first = self.level_buffers(bucket, buffer)[0]
        flag = kernels.quantize_flatten(
            [tensors[i] for i in bucket.tensor_indices], first.codes, first.scales,
            scale=prescale, offsets=bucket.offsets,
            residual=self._residual(bucket, 0, bucket.size),
            check_finite=count_nonfinite, backend=self.backend)
        spare = None
        if buffer.numel() > bucket.size:
            buffer[bucket.size:].zero_()
            if count_nonfinite:
                spare = buffer[bucket.size]
                spare.copy_(flag)
            if mark_spare is not None:
                buffer[bucket.size + mark_spare] = 1
        return self._exchange(bucket, buffer, first.codes, first.scales, spare)

    def communicate(self, bucket: Bucket, buffer: torch.Tensor,
                    spare: Optional[torch.Tensor]) -> PendingBucket:
        """Start the sum of ``bucket``'s already filled fp32 ``buffer``."""
        first = self.level_buffers(bucket, buffer)[0]
        codes, scales = self._encode(bucket, 0, first.whole)
        return self._exchange(bucket, buffer, codes, scales, spare)

    def _exchange(self, bucket: Bucket, buffer: torch.Tensor, codes: torch.Tensor,
                  scales: Optional[torch.Tensor], spare) -> PendingBucket:
        """The first level's all-to-all started; the rest in ``wait`` on gloo
        (whose waits block the host), issued now elsewhere."""
        received, works = self._all_to_all(bucket, 0, codes, scales)
        region = self.level_buffers(bucket, buffer)[0].whole
        phases = Phases(works, [lambda: self._levels(bucket, region, received),
                                spares_sum(bucket, buffer, self.group)])
        if not self.blocking:
            phases.wait()  # NCCL's waits only order the streams
        return PendingBucket(bucket, buffer, phases, spare)

    # ----------------------------------------------------------- the levels
    def _levels(self, bucket: Bucket, region: torch.Tensor, received) -> None:
        """Every level's dequantize-and-sum, outermost first, each into this
        rank's chunk of the last; then the all-gathers back, innermost first."""
        views = self.level_buffers(bucket, region)
        for k, level in enumerate(views):
            if k:
                codes, scales = self._encode(bucket, k, level.whole)
                received, works = self._all_to_all(bucket, k, codes, scales)
                Phases(works, ()).wait()
            kernels.dequantize_sum(*received, level.mine, backend=self.backend)
        if not self.gathers_back:
            return
        for k in reversed(range(len(views))):
            self._gather(bucket, k, views[k].whole, views[k].mine)

    def _gather(self, bucket: Bucket, k: int, whole: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's chunk of level ``k`` into ``whole``."""
        level = self.levels[k]
        if level.dtype == torch.float32 or not self.gather_wire:
            start_all_gather(whole, mine, level.group).wait()
            return
        kept = self._level(bucket, k)
        # this rank's chunk re-quantized like every other rank's: the same codes everywhere
        kernels.quantize_flatten([mine], kept.own, kept.own_scales, backend=self.backend)
        start_all_gather(kept.land, kept.own_send, level.group).wait()
        kernels.dequantize_sum(*kept.rows, whole, backend=self.backend)

    # ------------------------------------------------- codes and exchanges
    def _encode(self, bucket: Bucket, k: int, values: torch.Tensor):
        """Level ``k``'s codes of ``values`` (fp32 codes: ``values`` themselves)."""
        if self.levels[k].dtype == torch.float32:
            return values, None
        kept = self._level(bucket, k)
        kernels.quantize_flatten([values], kept.codes, kept.scales,
                                 residual=self._residual(bucket, k, values.numel()),
                                 backend=self.backend)
        return kept.codes, kept.scales

    def _all_to_all(self, bucket: Bucket, k: int, codes: torch.Tensor,
                    scales: Optional[torch.Tensor]):
        """Level ``k``'s all-to-all of ``codes`` and their block scales, one
        collective, started: ``((received codes, received scales), works)``,
        each received ``(ranks, chunk)``. ``codes``: the level's kept ones
        (``_encode``), or codes of a format without scales."""
        kept = self._level(bucket, k)
        sent = kept.send if codes is kept.codes else _bytes(codes)
        return kept.received, [dist.all_to_all_single(kept.land, sent,
                                                      group=self.levels[k].group, async_op=True)]

    def _codes(self, bucket: Bucket, k: int, numel: int):
        """Level ``k``'s kept codes (and block scales) for ``numel`` values:
        1-D, or for the blockwise formats ``(ranks, chunk)`` codes and their
        scales, views of one byte buffer (``_wire_buffer``)."""
        return self._buffer(bucket, k, numel, "codes")

    def _received(self, bucket: Bucket, k: int, numel: int):
        """Level ``k``'s kept buffers for the chunks it receives, ``(ranks,
        chunk)`` codes and scales (also where its all-gather lands)."""
        codes, scales = self._buffer(bucket, k, numel, "received")
        return codes.view(self.levels[k].ranks, -1), scales

    def _buffer(self, bucket: Bucket, k: int, numel: int, name: str):
        """The codes and block scales of ``_wire_buffer``, as views."""
        level, buffer = self.levels[k], self._wire_buffer(bucket, k, numel, name)
        if buffer.dim() == 1:
            return buffer, None
        code_bytes = numel // level.ranks * level.dtype.itemsize
        return (buffer[:, :code_bytes].view(level.dtype),
                buffer[:, code_bytes:].view(torch.float32))

    def _wire_buffer(self, bucket: Bucket, k: int, numel: int, name: str) -> torch.Tensor:
        """A kept buffer for level ``k``'s codes of ``numel`` values: 1-D
        codes for the formats without scales; for the blockwise ones each
        rank's chunk of codes followed by its block scales, one ``(ranks,
        bytes)`` buffer, so that one collective carries both (each one costs
        a latency on a network)."""
        level = self.levels[k]
        chunk = numel // level.ranks
        count = kernels.wire_scale_count(chunk, level.dtype)
        if not count:
            return self._keep((bucket.index, k, name), (numel,), level.dtype)
        return self._keep((bucket.index, k, name),
                          (level.ranks, chunk * level.dtype.itemsize + 4 * count), torch.uint8)

    def _keep(self, key, shape, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept from step to step (a fresh one costs page faults,
        and the kernels find their prepared launch by the buffer)."""
        kept = self._kept.get(key)
        if kept is None:
            device = self.plan.buckets[key[0]].device
            kept = self._kept[key] = torch.empty(shape, dtype=dtype, device=device)
        return kept

    def residual_sizes(self) -> Optional[List[int]]:
        """Per bucket, the size of error feedback's residual: the region of the
        compressing level (``level_regions``' widths), or None without one."""
        compressing = next((k for k, level in enumerate(self.levels)
                            if level.dtype != torch.float32), None)
        if not self.error_feedback or compressing is None:
            return None
        sizes = []
        for bucket in self.plan.buckets:
            size = bucket.size
            for level in self.levels[:compressing]:
                size //= level.ranks
            sizes.append(size)
        return sizes

    def _residual(self, bucket: Bucket, k: int, numel: int) -> Optional[torch.Tensor]:
        """Error feedback's residual of the compressing level (zeros at first)."""
        if not self.error_feedback or self.levels[k].dtype == torch.float32:
            return None
        residual = self.residuals.get(bucket.index)
        if residual is None:
            residual = self.residuals[bucket.index] = torch.zeros(
                numel, dtype=torch.float32, device=bucket.device)
        return residual


def owned_chunk(levels: Sequence[Level], size: int) -> Tuple[int, int]:
    """``(start, end)`` of the chunk of a ``size``-element buffer that this
    rank holds the sum of after ``levels``' all-to-alls: each level keeps
    its rank's chunk of the region the level before kept."""
    start = 0
    for level in levels:
        size //= level.ranks
        start += level.me * size
    return start, start + size


def level_regions(levels: Sequence[Level], region: torch.Tensor
                  ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per level, outermost first: ``(whole, mine)``, the region the level
    splits and this rank's chunk of it (the next level's region)."""
    regions = []
    for level in levels:
        width = region.numel() // level.ranks
        mine = region[level.me * width:(level.me + 1) * width]
        regions.append((region, mine))
        region = mine
    return regions


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as flat bytes: gloo exchanges float8 only as bytes,
    and a collective splits a flat buffer into equal chunks whatever the dtype."""
    return t.reshape(-1).view(torch.uint8)
