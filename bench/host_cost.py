"""Host cost of a steady-state fused call on the Triton path, the kernel's execution excluded.

A training loop calls the kernels with the same tensors into the same buffer
every step; what the host spends per call (recognising the layout, the launch
itself) decides whether a GPU runs at the speed of the bytes or waits for
Python. This module times that cost, call by call, with ``perf_counter``:

- on CUDA, in the benchmark's own process: each call returns once its kernel
  is queued, so the wall time of an unsynchronised call is its host cost
  (Triton's launcher included);
- on the CPU, in a child process that sets ``TRITON_INTERPRET=1`` before
  importing Triton and replaces the interpreter's kernel runner with a no-op:
  every host-side step of the Triton path runs for real (the layout check, the
  kept launch table, the launch arguments) and only the kernel's execution is
  left out. Triton's compiled launcher does not exist on a CPU, so its cost
  (a GPU-only figure) is not in the CPU row.

Three steady states are timed. In the first the call gets the same tensors
every time (``zero_grad(set_to_none=False)``, bucket views). In the second,
*moved*, every call gets tensors of the same layout at other addresses: what
torch's default ``zero_grad(set_to_none=True)`` gives when the caching
allocator hands the new gradients out in another order. The call alternates
between two sets of tensors, as gradients that swap addresses do, so each
call moves the kept launch back to the addresses it had before (a kept
binding, ``kernels/_prepared.py``). In the third, *new*, the calls cycle
through ``NEW_SETS`` sets, more than a launch keeps, so every call re-points
it from scratch: the span check and, on Triton, a new table and its upload.
A fourth, *buffer moved* (``versus_revision``'s rows only), keeps the tensors
and gives the buffer other memory at every call, cycling through
``NEW_SETS`` allocations: the same tensor object, as ZeRO-2's buffers, whose
memory is released after each step and allocated again (the move, one
``Tensor.set_``, is inside the timed call).

A fifth, *prepared* (``PREPARED_SUFFIX``), times a prepared handle's call
(``prepare_flatten`` / ``prepare_unflatten``, made once) on the same
tensors: what a loop that declares its tensors fixed spends per call, with
no layout check.

``python -m fusedreduce.bench.host_cost CASES_JSON`` is the child's entry
point: it prints ``{case key: [ms, ...]}`` as JSON (a moved case's key ends
in ``MOVED_SUFFIX``, a new-addresses case's in ``NEW_SUFFIX``).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

CALLS = 200
WARMUP = 5
FLAT_DTYPE_NAME = "float32"
#: what ends a moved case's key (two address sets in turn)
MOVED_SUFFIX = "|moved"
#: what ends a key of calls at addresses the launch does not keep
NEW_SUFFIX = "|new"
#: the address sets such calls cycle through: more than a launch keeps
#: (``kernels/_prepared.RECENT``)
NEW_SETS = 8
#: each key's suffix and how many address sets its calls cycle through
ADDRESS_SETS = {"": 1, MOVED_SUFFIX: 2, NEW_SUFFIX: NEW_SETS}
#: what ends a key of calls through a prepared handle (the same tensors)
PREPARED_SUFFIX = "|prepared"
#: the same cases as a reader names them (``versus_revision``'s rows)
ADDRESS_LABELS = {"": "", MOVED_SUFFIX: ", moved", NEW_SUFFIX: ", new addresses"}
#: ``versus_revision``'s row of calls whose buffer has other memory every call
BUFFER_MOVED_LABEL = ", buffer moved"


def case_key(list_name: str, size: int, dtype: str, direction: str, scale: float) -> str:
    return f"{list_name}|{size}|{dtype}|{direction}|{scale!r}"


def _time_calls(fn, calls: int) -> List[float]:
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def time_host(tensors: Sequence, out, dsts: Sequence, direction: str, scale: float,
              calls: int = CALLS, kernels=None, address_sets: int = 1,
              buffer_sets: int = 1, prepared: bool = False) -> List[float]:
    """Per-call host times in ms of the Triton path on these buffers (see the module
    docstring). ``kernels``: the kernel package to time (default ``fusedreduce.kernels``;
    ``versus_revision`` passes another revision's). ``address_sets``: how many
    sets of tensors (the given ones and copies elsewhere) the calls cycle
    through; 1: the same tensors every call. ``buffer_sets``: how many
    allocations ``out`` cycles through, moved before each call (``out`` is
    back in its own memory after). ``prepared``: call a handle made once
    (the same tensors every call; not with the two above)."""
    if kernels is None:
        from fusedreduce import kernels

    mine = tensors if direction == "flatten" else dsts
    sides = itertools.cycle([mine] + [[t.clone() for t in mine]
                                      for _ in range(address_sets - 1)])
    own = out.untyped_storage()
    storages = itertools.cycle([own] + [out.clone().untyped_storage()
                                        for _ in range(buffer_sets - 1)])

    def place():
        if buffer_sets > 1:
            out.set_(next(storages), 0, out.shape, out.stride())

    if prepared:
        if address_sets > 1 or buffer_sets > 1:
            raise ValueError("a prepared handle keeps its tensors and buffer: "
                             "address_sets and buffer_sets must be 1")
        handle = (kernels.prepare_flatten(mine, out, backend="triton") if direction == "flatten"
                  else kernels.prepare_unflatten(out, mine, backend="triton"))

        def call():
            handle(scale)
    elif direction == "flatten":
        def call():
            place()
            kernels.flatten_cast_scale(next(sides), out, scale=scale, backend="triton")
    else:
        def call():
            place()
            kernels.unflatten_cast_scale(out, next(sides), scale=scale, backend="triton")
    samples = _time_calls(call, calls)
    if out.is_cuda:
        import torch
        torch.cuda.synchronize(out.device)
    out.set_(own, 0, out.shape, out.stride())
    return samples


def host_samples_on_cpu(cases: Sequence[dict], calls: int = CALLS) -> Dict[str, List[float]]:
    """The host times of ``cases`` (dicts of list, size, dtype, directions, scales),
    measured in a child process under the interpreter; ``{}`` if Triton cannot be
    imported there (the reason goes to stderr)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "fusedreduce.bench.host_cost",
                            json.dumps({"cases": list(cases), "calls": calls})],
                           capture_output=True, text=True, env=env, timeout=600)
    if child.returncode != 0:
        sys.stderr.write(f"host cost not measured: the child process failed:\n{child.stderr}")
        return {}
    return json.loads(child.stdout)


def _child(spec: dict) -> Dict[str, List[float]]:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from fusedreduce import kernels

    from .common import DTYPES
    from .models import TENSOR_LISTS

    # every host-side step runs; the kernel's execution is what is left out
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    results = {}
    for case in spec["cases"]:
        shapes = TENSOR_LISTS[case["list"]](case["size"])
        dtype = DTYPES[case["dtype"]]
        tensors = [torch.zeros(shape, dtype=dtype) for shape in shapes]
        out = torch.zeros(sum(t.numel() for t in tensors), dtype=DTYPES[FLAT_DTYPE_NAME])
        dsts = [torch.zeros_like(t) for t in tensors]
        for direction in case["directions"]:
            for scale in case["scales"]:
                key = case_key(case["list"], case["size"], case["dtype"], direction, scale)
                for suffix, sets in ADDRESS_SETS.items():
                    results[key + suffix] = time_host(tensors, out, dsts, direction, scale,
                                                      spec["calls"], address_sets=sets)
                if hasattr(kernels, "prepare_flatten"):  # not in libraries before the handles
                    results[key + PREPARED_SUFFIX] = time_host(
                        tensors, out, dsts, direction, scale, spec["calls"], prepared=True)
    return results


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
