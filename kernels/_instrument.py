"""The kept launches seen from outside, for the benchmarks: looked up,
counted, and taken apart into what a steady-state call runs.

What is wrapped here (``_prepared``'s cache and entries, ``_launcher``'s
compiled launches) is put back when the ``with`` block or the call ends;
nothing changes what a kernel call computes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from . import _backends, _prepared

__all__ = ["LAUNCH_OUTCOMES", "allow_cpu_launches", "compiled_launch_arguments",
           "count_launches", "kept_launch"]

#: what ``count_launches`` counts: the kept-launch lookups (``calls``) and how
#: each ended (the layout ``same`` as prepared, ``switched`` to another kept
#: one, its tensors ``re-pointed``, or a launch ``prepared`` anew), and the
#: compiled Triton launches that went ``direct`` to the launcher or ``via_jit``
LAUNCH_OUTCOMES = ("calls", "same", "switched", "re-pointed", "prepared", "direct", "via_jit")


def kept_launch(op: str, buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                backend: str = "auto", offsets: Optional[Sequence[int]] = None
                ) -> Optional[Callable]:
    """The launch ``flatten_cast_scale`` (``op="flatten"``, into ``buffer``) or
    ``unflatten_cast_scale`` (``op="unflatten"``, out of ``buffer``) keeps for
    this layout, or None when the call would prepare one: the lookup each
    steady-state call begins with (a moved layout is re-pointed, as the
    call would). A Triton launch has the compiled kernel launcher as its
    ``kernel`` attribute.

    Raises:
        RuntimeError: the layout needs preparing inside a CUDA graph capture.

    Examples:
        >>> from fusedreduce.kernels import flatten_cast_scale
        >>> grads, out = [torch.ones(3)], torch.empty(3)
        >>> _ = flatten_cast_scale(grads, out)
        >>> kept_launch("flatten", out, grads) is not None
        True
    """
    return _prepared.LAUNCHES.lookup(op, backend, buffer, tensors, offsets)


def compiled_launch_arguments(call: Callable[[], object]) -> tuple:
    """The arguments the one compiled Triton launch of ``call()`` hands the
    compiled kernel's launcher (``kept_launch(...).kernel(*arguments)``
    repeats the launch alone).

    Raises:
        RuntimeError: ``call()`` made no compiled launch, or more than one.
    """
    from ._launcher import CompiledLaunch  # imports Triton
    seen: List[tuple] = []
    original = CompiledLaunch.__call__

    def recording(self, *args):
        seen.append(args)
        original(self, *args)
    CompiledLaunch.__call__ = recording
    try:
        call()
    finally:
        CompiledLaunch.__call__ = original
    if len(seen) != 1:
        raise RuntimeError(f"expected one compiled launch per call, saw {len(seen)}")
    return seen[0]


@contextlib.contextmanager
def count_launches() -> Iterator[Dict[str, int]]:
    """Count what the kept launches do inside the block: ``{outcome: count}``
    for each of ``LAUNCH_OUTCOMES``, complete when the block ends. The
    cache's lookup, the re-pointing, the span check and the preparation are
    wrapped, so time nothing inside the block.

    Examples:
        >>> from fusedreduce.kernels import flatten_cast_scale
        >>> grads, out = [torch.ones(3)], torch.empty(3)
        >>> with count_launches() as counts:
        ...     for _ in range(2):
        ...         _ = flatten_cast_scale(grads, out)
        >>> counts["calls"], counts["prepared"], counts["same"]
        (2, 1, 1)
    """
    counts = dict.fromkeys(LAUNCH_OUTCOMES, 0)
    cache, entry = _prepared.LAUNCHES, _prepared.Prepared
    lookup, rebind, spans_clear, init = cache.lookup, entry.rebind, _prepared.spans_clear, \
        entry.__init__

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        from ._launcher import CompiledLaunch
    except Exception:  # noqa: BLE001 (no usable Triton: the torch fallback launches none)
        CompiledLaunch = None
    if CompiledLaunch is not None:
        launch = CompiledLaunch.__call__

        def counted_launch(self, *args):
            before = self.direct_calls
            launch(self, *args)
            counts["direct" if self.direct_calls > before else "via_jit"] += 1
        CompiledLaunch.__call__ = counted_launch

    counts["moved"] = 0  # re-pointed or switched: derived from below at the end
    cache.lookup = counted("calls", lookup)
    entry.rebind = counted("moved", rebind)
    _prepared.spans_clear = counted("re-pointed", spans_clear)
    entry.__init__ = counted("prepared", init)
    try:
        yield counts
    finally:
        del cache.lookup
        entry.rebind, _prepared.spans_clear, entry.__init__ = rebind, spans_clear, init
        if CompiledLaunch is not None:
            CompiledLaunch.__call__ = launch
        moved = counts.pop("moved")
        counts["switched"] += moved - counts["re-pointed"]
        counts["same"] += counts["calls"] - moved - counts["prepared"]


def allow_cpu_launches() -> None:
    """Let ``backend="triton"`` take CPU tensors without Triton's
    interpreter, in this process from now on: for a Triton driver standing
    in for a GPU's (one that compiles for a GPU and records the launches
    instead of running them, as the benchmarks' host-cost tools install)
    to time the host side of a compiled launch. Any other driver fails on
    the CPU tensors.
    """
    _backends.allow_cpu_launches()
