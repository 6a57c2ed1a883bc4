"""Launching a Triton kernel straight through the launcher Triton compiled for it.

``JITFunction.run`` works out on every call what the call's arguments make of
the kernel: it binds them, specializes each one (a pointer's dtype and 16-byte
alignment, an int's value), builds a cache key from that, looks the compiled
kernel up and only then calls the compiled kernel's launcher. A fused call
launches one kernel with arguments of the same kind thousands of times, so
:class:`CompiledLaunch` keeps, per kind of call, the compiled kernel's own
entry (``CompiledKernel[grid]``, what Triton's ahead-of-time users call) and
sends each later call of that kind straight to it.

What selects the compiled kernel is recomputed on every call, as a superset of
every Triton version's key from 3.2 on: the device, the dtype of every tensor
argument, the value of every int Triton may specialize on (type and 32-bit
range of those it may not), and every constexpr. Only calls whose tensor
arguments are all 16-byte aligned take the direct path; any other call goes
through ``JITFunction.run`` (which then specializes on the missing alignment),
as does a call while a ``pre_run_hooks`` entry is registered on the kernel.
The launcher gets the same arguments ``JITFunction.run`` would give it; which
ones differs by version (3.2: the non-constexpr arguments; 3.3 on: all of
them), and is read from the compiled kernel's signature. A kernel whose
signature matches neither is always launched through ``JITFunction.run``.

``FUSEDREDUCE_TRITON_LAUNCH=jit`` in the environment (read at import) sends
every launch through ``JITFunction.run``. Triton's run-time debug switches
are read when a kind of call is first seen, not on every call.
"""
from __future__ import annotations

import functools
from operator import itemgetter
from typing import Any, Callable, Dict, Optional, Tuple

from triton.runtime import driver

from ._common import triton_launch_mode

try:
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    JITFunction = None

#: ``jit`` turns the direct path off (read once, at import)
LAUNCH_MODE = triton_launch_mode()

_I32 = (-(1 << 31), (1 << 31) - 1)


def _getter(positions) -> Callable[[tuple], tuple]:
    """``args -> tuple of args[p] for p in positions``, always a tuple."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda args: (args[only],)
    return itemgetter(*positions)


class CompiledLaunch:
    """``fn[grid](*args, **options)``, served from the compiled kernel's launcher
    once a call of the same kind has gone through ``JITFunction.run``.

    ``args`` are all of ``fn``'s parameters, in order, constexprs included,
    and every call passes the same kind of value at each position (a tensor,
    an int, a constexpr); ``grid`` and ``options`` are fixed per object.
    Under Triton's interpreter, or with ``FUSEDREDUCE_TRITON_LAUNCH=jit``,
    every call is ``fn[grid](*args, **options)``.

    Example (a kept launch of one layout)::

        launch = CompiledLaunch(_flatten_kernel, (programs,), num_warps=4)
        launch(table, work, base, out, flag, n, high, low, scale, KINDS, ...)

    Attributes:
        direct_calls, jit_calls: how many calls took each path (for tests and
            the benchmarks' launch counts).
    """

    def __init__(self, fn: Any, grid: Tuple[int, ...], **options: Any) -> None:
        self.fn, self.options = fn, options
        self.grid = tuple(grid)
        self.grid3 = (tuple(grid) + (1, 1))[:3]
        self.enabled = (LAUNCH_MODE == "compiled" and JITFunction is not None
                        and isinstance(fn, JITFunction))
        self.direct_calls = self.jit_calls = 0
        self._launches: Dict[tuple, Callable] = {}  # call kind -> CompiledKernel[grid]
        self._pick: Optional[Callable] = None
        self._kinds: Optional[tuple] = None  # getters: tensors, values, unspecialized values
        if self.enabled:
            params = fn.params
            self._constexprs = _getter([p.num for p in params if p.is_constexpr])
            self._runtime = _getter([p.num for p in params if not p.is_constexpr])
            self._all_args = len(params)
            self._runtime_args = sum(not p.is_constexpr for p in params)

    def _first_call(self, args: tuple) -> None:
        """Learn the argument kinds and the driver's device and stream lookups
        (the driver is only asked once a kernel has really been launched)."""
        self._classify(args)
        self._get_device = driver.active.get_current_device
        self._get_stream = driver.active.get_current_stream

    def _classify(self, args: tuple) -> None:
        """Which runtime positions hold tensors, ints Triton may specialize on,
        and values it does not specialize (floats, ``do_not_specialize`` ints),
        from a first call."""
        tensors, values, unspecialized = [], [], []
        for p in self.fn.params:
            if p.is_constexpr:
                continue
            value = args[p.num]
            if hasattr(value, "data_ptr"):
                tensors.append(p.num)
            elif isinstance(value, float) or (p.do_not_specialize and type(value) is int):
                unspecialized.append(p.num)
            else:
                values.append(p.num)
        self._kinds = (_getter(tensors), _getter(values), _getter(unspecialized))

    def _key(self, device: Any, args: tuple) -> Optional[tuple]:
        """The call's kind, or None when a tensor argument is not 16-byte aligned.

        An int's value is in the key (3.2 specializes ints equal to 1, every
        version those divisible by 16); an unspecialized value's type and
        32-bit range are (Triton types an int by its range).
        """
        tensors_of, values_of, unspecialized_of = self._kinds
        tensors = tensors_of(args)
        address = 0
        for t in tensors:
            address |= t.data_ptr()
        if address & 15:
            return None
        low, high = _I32
        return (device, tuple([t.dtype for t in tensors]),
                tuple([(type(v), v) for v in values_of(args)]),
                tuple([(type(v), low <= v <= high) for v in unspecialized_of(args)]),
                self._constexprs(args))

    def __call__(self, *args: Any) -> None:
        if self.enabled and not self.fn.pre_run_hooks:
            launch = key = None
            if self._kinds is not None:
                device = self._get_device()
                try:
                    key = self._key(device, args)
                except (AttributeError, TypeError):
                    key = None  # a position changed kind: Triton decides
                launch = self._launches.get(key) if key is not None else None
            if launch is not None:
                self.direct_calls += 1
                stream = self._get_stream(device)
                if self._pick is None:
                    launch(*args, stream=stream)
                else:
                    launch(*self._pick(args), stream=stream)
                return
            self.jit_calls += 1
            kernel = self.fn[self.grid](*args, **self.options)
            if self._kinds is None:
                self._first_call(args)
                key = self._key(self._get_device(), args)
            if key is not None and kernel is not None and self._knows_protocol(kernel):
                self._launches[key] = kernel[self.grid3]
            return
        self.jit_calls += 1
        self.fn[self.grid](*args, **self.options)

    def _knows_protocol(self, kernel: Any) -> bool:
        """Whether ``kernel``'s launcher takes every argument (Triton 3.3 on) or
        the runtime ones (3.2), as its signature says; sets ``_pick``. Another
        protocol leaves every call to ``JITFunction.run``."""
        signature = len(kernel.src.signature)
        if signature == self._all_args:
            self._pick = None
        elif signature == self._runtime_args:
            self._pick = self._runtime
        else:
            return False
        return True


@functools.lru_cache(maxsize=256)
def launch_for(fn: Any, grid: Tuple[int, ...], num_warps: int) -> CompiledLaunch:
    """A kept :class:`CompiledLaunch` of ``fn`` over ``grid`` (a tuple) with
    ``num_warps`` (the last 256 kept), for call sites whose grid follows a kept
    table rather than a kept layout.

    Example::

        launch_for(_finish_kernel, (1,), num_warps=4)(partials, ..., 1024)
    """
    return CompiledLaunch(fn, grid, num_warps=num_warps)
