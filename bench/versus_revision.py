"""This checkout's flatten kernels against another git revision's, timed in one process.

    python -m fusedreduce.bench.versus_revision REV [--sizes 250K,1M,4M,25.6M] [--repeats 30]

Before/after figures are only comparable when they come from one run on one
machine (a shared VM drifts by tens of percent between runs). Two versions of
one package cannot be imported side by side, but ``kernels/`` imports nothing
outside itself, so the revision's copy (``git archive REV kernels``) is
imported under another name and both run round-robin in one process, beside
torch's fastest baselines:

- per case (``resnet50`` list, fp16 gradients, fp32 buffer, scale 1/8):
  ``flatten_cast_scale`` into a kept buffer and ``unflatten_cast_scale`` out
  of it, for both revisions, against ``_foreach_copy_`` (+ one ``mul_``) and
  ``torch.cat(out=)`` (+ one ``mul_``) for flatten and ``_foreach_copy_``
  (+ ``_foreach_mul_``) for unflatten, on the torch fallback (the CPU path);
- the host cost per steady-state call of each revision's Triton path, the
  kernel's execution excluded (``TRITON_INTERPRET=1`` and the interpreter's
  kernel runner replaced by a no-op, as in ``host_cost.py``), with the same
  tensors at every call, with tensors that moved between two address sets,
  with tensors at new addresses every call, and with the buffer given other
  memory at every call (``host_cost.py``).

With ``--launch compiled`` (CPU) the host cost is measured without the
interpreter: a stand-in driver (``recording_driver``) compiles the kernels for
sm_90 and its launcher does nothing, so each call takes Triton's real launch
path (``JITFunction.run``, or the kept compiled launcher of
``kernels/_launcher.py``) and only the C launcher and the kernel are left out.

With ``--device cuda`` only the host cost is measured, on the GPU: each
revision's compiled kernels really launch (fp16 gradients of the ResNet-50
list at the largest ``--sizes`` entry), and a call's host time is from the
call until it returns, as ``gpu-check``'s ``host us`` column. On a machine
without git (a lent GPU machine), ``--from-dir PATH`` takes the revision's
``kernels/`` from a directory made beforehand with
``git archive REV kernels | tar -x -C PATH``.

Prints one table; run it from the repository (it needs git, or ``--from-dir``).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

from . import common, host_cost, timing  # noqa: E402
from .models import TENSOR_LISTS  # noqa: E402


def load_revision_kernels(revision: str, into: Path, from_dir: Optional[Path] = None):
    """The ``kernels`` package of ``revision``, imported as ``kernels_<revision>``
    (from ``from_dir/kernels`` when given, else from ``git archive``)."""
    name = "kernels_" + "".join(c if c.isalnum() else "_" for c in revision)
    if from_dir is not None:
        shutil.copytree(from_dir / "kernels", into / name)
    else:
        archive = subprocess.run(["git", "archive", revision, "kernels"], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
        (into / "kernels").rename(into / name)
    spec = importlib.util.spec_from_file_location(name, into / name / "__init__.py",
                                                  submodule_search_locations=[str(into / name)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _interleaved(fns, repeats):
    """Median ms of each function, warmed up, then timed round-robin."""
    for fn in fns.values():
        fn()
    samples = timing.time_interleaved(fns, repeats, torch.device("cpu"))
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(versions, size, repeats, scale=0.125):
    """Median ms of every method on the resnet50 list at ``size``."""
    shapes = TENSOR_LISTS["resnet50"](size)
    torch.manual_seed(0)
    grads = [torch.randn(s).half() for s in shapes]
    numels = [g.numel() for g in grads]
    out = torch.empty(sum(numels))
    slices = list(torch.split(out, numels))
    inputs = [g.view(-1) for g in grads]
    dsts = [torch.empty_like(g) for g in grads]
    dst_views = [d.view(-1) for d in dsts]
    flat = torch.randn(sum(numels))
    flat_views = list(torch.split(flat, numels))
    flatten = {"torch_foreach": lambda: (torch._foreach_copy_(slices, inputs), out.mul_(scale)),
               "torch_cat": lambda: (torch.cat(inputs, out=out), out.mul_(scale))}
    unflatten = {"torch_foreach": lambda: (torch._foreach_copy_(dst_views, flat_views),
                                           torch._foreach_mul_(dst_views, scale))}
    for label, kernels in versions.items():
        flatten[label] = lambda k=kernels: k.flatten_cast_scale(grads, out, scale=scale,
                                                               backend="torch")
        unflatten[label] = lambda k=kernels: k.unflatten_cast_scale(flat, dsts, scale=scale,
                                                                   backend="torch")
    return _interleaved(flatten, repeats), _interleaved(unflatten, repeats), len(grads), \
        sum(numels)


def host_cost_us(versions, size, calls=300, blocks=4, scale=0.125,
                 device: torch.device = torch.device("cpu"), interpreted: bool = True):
    """Median host µs per steady-state Triton call of each version (on the
    CPU the kernel's execution excluded; on a GPU the launch is real).

    Each function is timed in blocks of ``calls`` consecutive calls, the
    blocks alternating between functions: a steady state is one call after
    another of the same thing, and interleaving single calls of two versions
    would charge each with the other's effect on caches and the allocator.
    """
    if device.type == "cpu" and interpreted:
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = lambda self, *args, **kwargs: None
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator).half().to(device)
             for s in TENSOR_LISTS["resnet50"](size)]
    out = torch.zeros(sum(g.numel() for g in grads), device=device)
    dsts = [torch.zeros_like(g) for g in grads]
    samples = {}
    for _ in range(blocks):
        for label, kernels in versions.items():
            for direction in ("flatten", "unflatten"):
                for suffix, sets in host_cost.ADDRESS_SETS.items():
                    what = host_cost.ADDRESS_LABELS[suffix]
                    samples.setdefault(f"{label} {direction}{what}", []).extend(
                        host_cost.time_host(grads, out, dsts, direction, scale, calls, kernels,
                                            address_sets=sets))
                samples.setdefault(f"{label} {direction}{host_cost.BUFFER_MOVED_LABEL}",
                                   []).extend(host_cost.time_host(
                                       grads, out, dsts, direction, scale, calls, kernels,
                                       buffer_sets=host_cost.NEW_SETS))
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.versus_revision",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="the git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--sizes", type=common.parse_sizes,
                        default=[250_000, 1_000_000, 4_000_000, 25_600_000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default): the torch fallback's times and the host cost "
                             "under the interpreter; cuda: the host cost of real launches")
    parser.add_argument("--launch", choices=("interpreter", "compiled"), default="interpreter",
                        help="on the CPU, how the host cost's kernels are launched: under "
                             "the interpreter with a no-op runner (default), or compiled for "
                             "sm_90 with a no-op launcher (Triton's real launch path)")
    parser.add_argument("--from-dir", type=Path, metavar="PATH",
                        help="the revision's kernels/ from PATH/kernels instead of git")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    compiled = device.type == "cpu" and args.launch == "compiled"
    if compiled:
        os.environ.pop("TRITON_INTERPRET", None)
        from . import recording_driver
        recording_driver.install(record=False)
    elif device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton
    from fusedreduce import kernels as current
    with tempfile.TemporaryDirectory() as tmp:
        old = load_revision_kernels(args.revision, Path(tmp), args.from_dir)
        versions = {args.revision: old, "this checkout": current}
        if compiled:
            # the stand-in driver takes CPU tensors, which the façades keep for
            # the interpreter: lifted here, in this process only
            for kernels in versions.values():
                kernels._backends._interpreting = lambda: True
        # the CPU table's kernels are the torch fallback's; on a GPU only Triton's are timed
        kernels_timed = "triton" if device.type == "cuda" else "torch"
        print(f"# {common.machine_summary(common.machine_info(device, kernels_timed, None))}")
        if device.type == "cuda":
            size = max(args.sizes)
            print(f"# host µs per steady-state call, compiled kernels launched on "
                  f"{torch.cuda.get_device_name(device)}, resnet50 list at {size:,} elements, "
                  f"fp16 <-> fp32, scale 1/8; alternating blocks of 300 calls:")
            for name, us in host_cost_us(versions, size, blocks=6, device=device).items():
                print(f"  {name}: {us:.1f} µs")
            return 0
        print("# resnet50 list, fp16 gradients <-> fp32 buffer, scale 1/8, torch fallback; "
              "median ms of round-robin calls in this one process")
        for size in args.sizes:
            flat_ms, unflat_ms, n, elements = measure(versions, size, args.repeats)
            for direction, times in (("flatten", flat_ms), ("unflatten", unflat_ms)):
                best = min(v for k, v in times.items() if k.startswith("torch"))
                cells = "  ".join(f"{k} {v:.3f} ms ({best / v:.2f}x)" for k, v in times.items())
                print(f"{elements:>11,} elements, {n} tensors, {direction:9s}: {cells}")
        how = ("compiled for sm_90, a no-op launcher" if compiled
               else "the interpreter, a no-op kernel runner")
        print(f"# host µs per steady-state call on the Triton path ({how}), kernel "
              f"execution excluded:")
        for name, us in host_cost_us(versions, min(args.sizes), interpreted=not compiled).items():
            print(f"  {name}: {us:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
