"""Prepared launches: the work of a fused call that depends only on its layout, done once.

A training loop calls the flatten kernels thousands of times with the same
tensors into the same buffer. Everything that depends only on the layout —
the argument checks, each segment's place in the buffer, the torch fallback's
views of the buffer and copy routes, the Triton launch table on the device —
is worked out by the first call and kept in a ``Prepared`` entry.

A later call is recognised by its *signature*: for every tensor its address,
element count (its shape, for the torch fallback), dtype and whether it is
contiguous (and a non-contiguous one's shape and strides), plus the buffer
(the same Python object, still at the same address, size and dtype; see
"A moved buffer" below) and the offsets. That is exactly what the results
and the checks depend on, so a call whose signature equals the kept one runs
the kept launch without re-validating, and any other call — a tensor moved, resized, re-typed or made
non-contiguous, another buffer — is validated and prepared afresh. Reading
the signature is the only per-tensor Python work of a steady-state call: one
C-level ``map`` pass for the addresses and, for the rest, one call of a
metadata guard (``_checks.metadata_guard``: torch's C++ tensor check, the one
TorchDynamo's guards are built on, which compares every tensor's type,
dtype, device, shape and strides in one loop, at half the cost of three more
``map`` passes over 161 tensors). The guard is a fast path only: where it is
missing (another torch) or says no, the passes decide, so the signature
means the same with it and without it.

New tensor objects at the old addresses are the same layout: gradients that
``optimizer.zero_grad()`` set to None come back at the same addresses on CUDA
(the caching allocator reuses them), and the kept launch serves them.

**Moved tensors.** A training loop that sets gradients to None (torch's
default ``zero_grad``) gets new gradients every step, and the caching
allocator hands their blocks out in another order, so same-shaped gradients
swap addresses between steps. A call whose signature differs from the kept
one *only in addresses* is the same layout at other places: when every
tensor is contiguous and the launch can be re-pointed (``launch.rebind``),
the new addresses are checked against the buffer (and, for outputs, against
each other) with one sorted pass over their byte spans (``spans_clear``;
the same rule as the full validation, for contiguous tensors), and the kept
launch is re-pointed instead of prepared again. Anything else is validated and
prepared afresh, and an overlap is refused by the full validation, naming
the tensor.

**A moved buffer.** A buffer whose memory is given back between steps and
allocated again (the same tensor object, its storage resized to nothing and
back: ZeRO-2's buffers and parts) comes back at another address as often as
not. A launch that can follow it (``launch.accepts_buffer_at(address)``: the
Triton kernels, whose table holds every tensor's offset from the buffer,
when the new address keeps the buffer's alignment) is re-pointed as for
moved tensors, with the spans checked against the buffer's new bytes; any
other launch is prepared afresh.

**Address sets seen before.** Where the allocator's order repeats itself
(gradients that swap addresses swap back at the next step) a moved call is
often at addresses the launch had before. An entry keeps the last
``RECENT`` address lists it was pointed at, each with the launch's binding
for it (``launch.binding()``, ``launch.bind(binding)``:
for Triton, the table already on the device). A call at one of them — the
same layout, as ``matches`` established, at exactly those addresses, so the
same byte spans, already found clear — is served by switching to that
binding: no span check, no table, no upload.

Entries are kept per buffer object and die with it (a weak reference with a
callback), and at most ``KEPT`` are kept in all, least recently used first out.
A torch entry holds views of its buffer; they are made from a detached alias,
so they keep the memory but not the caller's tensor object alive.
"""
from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ._checks import metadata_guard, refuse_in_capture

#: prepared layouts kept at most (per process)
KEPT = 64
#: what ``Prepared.matches`` finds: another layout, the same one, or the same one moved
MISS, SAME, MOVED = 0, 1, 2
#: address lists (and the launch's binding for each) an entry keeps for moved calls
RECENT = 4
#: up to this many tensors ``spans_clear`` sorts Python tuples: numpy's few
#: microseconds per call cost more than the whole check of a small bucket
#: (a 4-tensor check: about 25 us in numpy, 3 us in Python on the 2-core VM)
SMALL_SPANS = 32

_data_ptr = torch.Tensor.data_ptr
# ``Tensor.size`` builds the same torch.Size as ``.shape`` at half its cost
_shape = torch.Tensor.size
_numel = torch.Tensor.numel
_dtype = operator.attrgetter("dtype")
_is_contiguous = torch.Tensor.is_contiguous


class Prepared:
    """One prepared layout: the signature it was prepared for and its launch.

    ``by_shape``: whether the launch depends on the tensors' shapes (the torch
    fallback's views have them) or only on their element counts (the Triton
    kernels read a contiguous tensor in memory order, whatever its shape;
    comparing counts costs half as much as comparing shapes). The
    shapes and strides of non-contiguous tensors are always compared.
    """

    __slots__ = ("buffer_ref", "buffer_ptr", "buffer_numel", "buffer_dtype", "buffer_stride",
                 "offsets", "offsets_source", "ptrs", "sizes", "size_of", "dtypes",
                 "contiguous", "strided", "guard", "launch", "nbytes", "live", "outputs",
                 "recent", "__weakref__")

    def __init__(self, buffer: torch.Tensor, offsets, starts: Sequence[int],
                 tensors: Sequence[torch.Tensor], launch: Callable, by_shape: bool,
                 outputs: bool = False):
        self.buffer_ref = None  # set by ``store``
        self.buffer_ptr, self.buffer_numel = buffer.data_ptr(), buffer.numel()
        self.buffer_dtype, self.buffer_stride = buffer.dtype, buffer.stride()
        # the checked starts, as ints: the caller's offsets may be a tensor or a
        # list changed in place later. A tuple of ints cannot change, so the
        # same tuple passed again is known equal without comparing it.
        self.offsets = None if offsets is None else tuple(starts)
        self.offsets_source = offsets if type(offsets) is tuple and \
            all(type(o) is int for o in offsets) else None
        self.size_of = _shape if by_shape else _numel
        self.ptrs = list(map(_data_ptr, tensors))
        self.sizes = list(map(self.size_of, tensors))
        self.dtypes = list(map(_dtype, tensors))
        self.contiguous = list(map(_is_contiguous, tensors))
        self.strided = [(i, t.shape, t.stride()) for i, t in enumerate(tensors)
                        if not t.is_contiguous()]
        self.guard = metadata_guard(tensors)
        self.launch = launch
        # moved tensors can be served when all are contiguous (their bytes are
        # one span each) and the launch can be re-pointed
        self.nbytes = (np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
                       if not self.strided and hasattr(launch, "rebind") else None)
        # the tensors that occupy bytes (None: all of them, the usual case)
        self.live = None if self.nbytes is None or self.nbytes.all() else self.nbytes > 0
        self.outputs = outputs  # the tensors are written: they must not overlap each other
        # [(addresses, the launch's binding for them)], the current ones first,
        # filled from the first move on; None: the launch cannot switch bindings
        self.recent: Optional[list] = [] if hasattr(launch, "bind") else None

    def matches(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets):
        """``(SAME, None)`` when a call with these arguments has exactly the
        prepared layout, ``(MOVED, addresses)`` when only addresses differ
        (the tensors', or the buffer's where the launch can follow it), else
        ``(MISS, None)``."""
        if self.buffer_ref() is not buffer \
                or buffer.numel() != self.buffer_numel or buffer.dtype != self.buffer_dtype \
                or buffer.stride() != self.buffer_stride:
            return MISS, None
        buffer_moved = buffer.data_ptr() != self.buffer_ptr
        if buffer_moved and (self.nbytes is None
                             or not hasattr(self.launch, "accepts_buffer_at")):
            return MISS, None
        try:
            if offsets is None or self.offsets is None:
                if offsets is not self.offsets:
                    return MISS, None
            elif offsets is not self.offsets_source and tuple(offsets) != self.offsets:
                return MISS, None
            ptrs = list(map(_data_ptr, tensors))
            guard = self.guard
            if (guard is None or len(ptrs) != len(self.ptrs) or not guard.check(*tensors)) \
                    and not (list(map(self.size_of, tensors)) == self.sizes
                             and list(map(_dtype, tensors)) == self.dtypes
                             and list(map(_is_contiguous, tensors)) == self.contiguous
                             and all(tensors[i].shape == shape and tensors[i].stride() == stride
                                     for i, shape, stride in self.strided)):
                return MISS, None
        except (TypeError, RuntimeError, AttributeError):
            return MISS, None  # not a list of dense tensors: validation names the problem
        return (SAME, None) if ptrs == self.ptrs and not buffer_moved else (MOVED, ptrs)

    def rebind(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
               ptrs: Sequence[int]) -> bool:
        """Re-point the launch at moved tensors (``ptrs``, their addresses) and
        ``buffer`` where it is now, if the layout allows it and the tensors'
        bytes are clear of the buffer's (and, for outputs, of each other);
        whether it did. ``ptrs`` is a list the caller hands over (``matches``
        makes it): it is kept. The launch's ``rebind(tensors, addresses,
        buffer_address)`` gets the addresses as an int64 array. Addresses
        among the ``RECENT`` kept ones switch back to their binding."""
        if self.nbytes is None or len(ptrs) != len(self.nbytes):
            return False
        launch, recent = self.launch, self.recent
        buffer_ptr = buffer.data_ptr()
        if buffer_ptr != self.buffer_ptr and not launch.accepts_buffer_at(buffer_ptr):
            return False
        if recent is not None:
            for i, (seen_buffer, seen, binding) in enumerate(recent):
                if seen_buffer == buffer_ptr and seen == ptrs:
                    launch.bind(binding)
                    self.ptrs, self.buffer_ptr = seen, buffer_ptr
                    if i:
                        recent.insert(0, recent.pop(i))
                    return True
        buffer_end = buffer_ptr + self.buffer_numel * self.buffer_dtype.itemsize
        if not spans_clear(ptrs, self.nbytes, (buffer_ptr, buffer_end), self.outputs,
                           self.live):
            return False
        addresses = np.fromiter(ptrs, dtype=np.int64, count=len(ptrs))
        if recent == []:
            recent.append((self.buffer_ptr, self.ptrs, launch.binding()))
        launch.rebind(tensors, addresses, buffer_ptr)
        self.ptrs, self.buffer_ptr = ptrs, buffer_ptr
        if recent is not None:
            recent.insert(0, (buffer_ptr, ptrs, launch.binding()))
            del recent[RECENT:]
        return True


def spans_clear(ptrs: Sequence[int], nbytes: np.ndarray, buffer_span, pairwise: bool,
                live: Optional[np.ndarray] = None) -> bool:
    """Whether the byte spans ``[ptrs[i], ptrs[i] + nbytes[i])`` of contiguous
    tensors miss ``buffer_span`` and, with ``pairwise``, each other (empty
    tensors occupy nothing). ``live``: ``nbytes > 0`` if the caller keeps it
    (None: computed here).

    Examples:
        >>> spans_clear([0, 8], np.array([8, 8]), (16, 32), pairwise=True)
        True
        >>> spans_clear([0, 4], np.array([8, 8]), (16, 32), pairwise=True)
        False
    """
    if len(ptrs) <= SMALL_SPANS:
        return _small_spans_clear(ptrs, nbytes.tolist(), buffer_span, pairwise)
    starts = np.asarray(ptrs, dtype=np.int64)
    if live is None:
        live = nbytes > 0
    if not live.all():
        starts, nbytes = starts[live], nbytes[live]
    ends = starts + nbytes
    lo, hi = buffer_span
    if hi > lo and bool(((starts < hi) & (ends > lo)).any()):
        return False
    if pairwise and starts.size > 1:
        order = starts.argsort()
        # the sort's order among equal starts is irrelevant: two live spans
        # that start together overlap whichever comes first
        if bool((ends[order[:-1]] > starts[order[1:]]).any()):
            return False
    return True


def _small_spans_clear(ptrs: Sequence[int], nbytes: Sequence[int], buffer_span,
                       pairwise: bool) -> bool:
    """``spans_clear`` for a few spans, in Python (the same rule)."""
    spans = sorted((start, start + size) for start, size in zip(ptrs, nbytes) if size)
    lo, hi = buffer_span
    if hi > lo and any(start < hi and end > lo for start, end in spans):
        return False
    # sorted by start (then end): two live spans that start together overlap
    return not pairwise or all(end <= following[0]
                               for (_, end), following in zip(spans, spans[1:]))


class Cache:
    """Prepared entries by (operation, backend, buffer object), least recently used out."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._entries: "OrderedDict[tuple, Prepared]" = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, op: str, backend: str, buffer: torch.Tensor,
               tensors: Sequence[torch.Tensor], offsets) -> Optional[Callable]:
        """The kept launch for this call, or None if its layout is not the
        prepared one (or the same one moved where it cannot be re-pointed)."""
        key = (op, backend, id(buffer))
        entry = self._entries.get(key)
        found, ptrs = (MISS, None) if entry is None else entry.matches(buffer, tensors, offsets)
        if found != SAME and isinstance(buffer, torch.Tensor):
            # preparing or re-pointing a launch uploads its table (Triton) and
            # validates on the host: a capture would replay a stale table
            refuse_in_capture(
                buffer.device, f"a {op} call whose layout no eager call prepared (new tensors, "
                f"or the same ones at other addresses)",
                "run the step eagerly first, with the tensors the capture will use, and keep "
                "them where they are: optimizer.zero_grad(set_to_none=False), or "
                "gradient_as_bucket_view=True, keeps every gradient at its address")
        if entry is None:
            return None
        if found == MISS or (found == MOVED and not entry.rebind(buffer, tensors, ptrs)):
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # forgotten meanwhile by another thread; the entry is still valid
            pass
        return entry.launch

    def store(self, op: str, backend: str, buffer: torch.Tensor, entry: Prepared) -> None:
        """Keep ``entry`` for calls of ``op`` into ``buffer`` (replacing an older one)."""
        key = (op, backend, id(buffer))

        def forget(_ref, key=key, entry_ref=weakref.ref(entry)):
            with self._lock:
                if self._entries.get(key) is entry_ref():
                    del self._entries[key]

        entry.buffer_ref = weakref.ref(buffer, forget)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.kept:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


#: the kernels' prepared launches (``flatten_cast_scale`` and ``unflatten_cast_scale``)
LAUNCHES = Cache()


def lookup_launch(op: str, backend, buffer, tensors, offsets) -> Optional[Callable]:
    """The launch kept for exactly this call's layout, or None: a public
    function's first step (``buffer`` is the one it writes or reads whole)."""
    # anything but a list or tuple goes through validation, which names it
    if buffer is None or type(backend) is not str or type(tensors) not in (list, tuple):
        return None
    return LAUNCHES.lookup(op, backend, buffer, tensors, offsets)


def keep_launch(op: str, backend: str, backend_name: str, buffer: torch.Tensor, tensors,
                offsets, starts: Sequence[int], launch: Callable, outputs: bool = False) -> None:
    """Keep ``launch``, prepared by the backend ``backend_name`` for this call's
    layout, for ``lookup_launch``; ``outputs``: the tensors are written."""
    entry = Prepared(buffer, offsets, starts, tensors, launch,
                     by_shape=backend_name == "torch", outputs=outputs)
    LAUNCHES.store(op, backend, buffer, entry)
