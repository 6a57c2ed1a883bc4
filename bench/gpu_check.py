"""``fusedreduce-bench gpu-check``: is this GPU install right, and is it fast?

One command for a new GPU machine. In order:

1. **Correctness, per kernel and dtype**, on CUDA with both backends (the
   compiled Triton kernels and the torch fallback): ``flatten``,
   ``unflatten``, ``unflatten`` with ``accumulate``, ``adasum_stats`` and
   ``adasum_combine``, for fp16, bf16, fp32 and fp64 gradients, on ResNet-50's
   tensor list plus the awkward cases (0 and 1 elements, an odd length, a
   transposed and a misaligned view). Each result is compared with a reference
   computed on the CPU that does exactly the documented roundings: flatten and
   unflatten (with a Python scale, and with the scale held in a device
   tensor: ``unflatten_device_scale``) must match it bit for bit, and the two backends each other (the
   docs' promise); accumulate and AdaSum within bounds derived from the
   dtypes' eps (see ``_bound``); the clipping norm (``clip_norm``: 2-norm
   and max norm of the flattened gradients) within its rows' rounding of
   float64, and the same bits from call to call.
2. **The kernel benchmark on the GPU** (``kernels_bench``: each call's device
   time alone, from CUDA events with the call queued behind a spin kernel, L2
   flushed): GB/s, × a device-to-device copy of the same bytes, and
   torch's strongest ways to do the same job (``_foreach_copy_`` +
   ``_foreach_mul_``, ``cat(out=)``, ``_chunk_cat(out=)``,
   ``split_with_sizes_copy(out=)``), plus the host µs of one steady-state call.
3. **The test suite in CUDA mode** (``pytest --device cuda``), when the
   checkout's ``tests/`` is found (an editable install), unless ``--no-tests``.

It prints one verdict table (correct or not per kernel and dtype, bandwidth
against the copy and against torch's best, host µs) with the Triton, torch,
CUDA and driver versions, and writes ``--json``/``--plot`` like the other
commands. Exit status: 0 when everything checked is correct (or when there is
no GPU: nothing to check, said on stdout), 1 when anything is wrong.

``--device cpu`` runs the same steps on the CPU (Triton only under
``TRITON_INTERPRET=1``, and only the correctness part at small sizes makes
sense there): a dry run, for the tests and for reading the output.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from fusedreduce import communication_dtype, kernels
from fusedreduce.kernels import (ADASUM_NORM_FLOOR, adasum_combine, adasum_stats,
                                 flatten_cast_scale, unflatten_cast_scale)

from . import common, kernels_bench, output_files, plot

KERNELS = ("flatten", "unflatten", "unflatten_device_scale", "unflatten_accumulate",
           "clip_norm", "adasum_stats", "adasum_combine")
CHECK_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: kernels whose two backends must agree bit for bit (docs/concepts/how-it-works.md, "Numerics")
BITWISE = ("flatten", "unflatten", "unflatten_device_scale")
#: the scale of the checks: 1/3 is not exact in fp32, so a scale used unrounded shows
CHECK_SCALE = 1 / 3
CHECK_SIZE, QUICK_CHECK_SIZE = 1_000_000, 100_000
BENCH_SIZES, QUICK_BENCH_SIZES = [4_000_000, 25_600_000], [4_000_000]
BENCH_DTYPES = ["float16", "bfloat16", "float32"]
#: the benchmark case each verdict row quotes: the mean's scale, ResNet-50's list
VERDICT_LIST, VERDICT_SCALE = "resnet50", 1 / 8
TESTS_TIMEOUT_S = 1800
#: pytest's closing line, e.g. "3 failed, 120 passed, 4 skipped in 61.2s"
SUMMARY_LINE = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


# ------------------------------------------------------------------ environment

def _driver_version() -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
        else None


def environment(device: torch.device) -> dict:
    """The machine record of the other commands, plus what a GPU install depends on."""
    try:
        backend = kernels.resolve_backend("auto", device)
    except RuntimeError:  # CUDA without a usable Triton: reported below, and checked
        backend = "triton (unavailable)"
    machine = common.machine_info(device, backend, None)
    machine.update(
        cuda=torch.version.cuda,
        driver=_driver_version() if device.type == "cuda" else None,
        compute_capability=(".".join(map(str, torch.cuda.get_device_capability(device)))
                            if device.type == "cuda" else None),
        triton_problem=kernels.triton_unavailable_reason())
    return machine


def versions_line(machine: dict) -> str:
    return (f"torch {machine['torch']} (CUDA {machine.get('cuda')}), Triton "
            f"{machine['triton']}, driver {machine.get('driver')}, fusedreduce "
            f"{machine['fusedreduce']}; {machine['gpu'] or 'no GPU'}"
            + (f" (sm_{machine['compute_capability'].replace('.', '')})"
               if machine.get("compute_capability") else ""))


# ------------------------------------------------------------------ correctness

def check_tensors(dtype: torch.dtype, size: int, device: torch.device, seed: int = 0,
                  shapes: Optional[Sequence[tuple]] = None) -> List[torch.Tensor]:
    """ResNet-50's tensor list scaled to ``size`` elements (or ``shapes``), then the
    awkward cases: empty, one element, an odd length, a transposed view and a view
    one element into its storage (misaligned). Values ~ N(0, 4), with zeros of
    both signs."""
    from .models import TENSOR_LISTS

    generator = torch.Generator().manual_seed(seed)

    def values(shape):
        x = torch.randn(shape, generator=generator, dtype=torch.float64) * 4
        x.view(-1)[::97] = 0.0
        x.view(-1)[1::89] = -0.0
        return x.to(dtype)

    if shapes is None:
        shapes = TENSOR_LISTS["resnet50"](size)
    tensors = [values(shape).to(device) for shape in shapes]
    tensors += [values((0,)).to(device), values((1,)).to(device), values((1023,)).to(device),
                values((41, 37)).to(device).t(), values((2050,)).to(device)[1:]]
    return tensors


def _compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def reference_cast_scale(x: torch.Tensor, dst: torch.dtype, scale: float) -> torch.Tensor:
    """``cast_to(dst)(x * scale)`` on the CPU, rounding as documented: the product
    in the compute dtype (the scale rounded to it first), 16-bit results from an
    fp32 value."""
    compute = _compute_dtype(x.dtype, dst)
    product = x.cpu().reshape(-1).to(compute) * torch.tensor(scale, dtype=compute)
    if dst in (torch.float16, torch.bfloat16):
        product = product.to(torch.float32)
    return product.to(dst)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().reshape(-1), b.cpu().reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(ints), b.view(ints)))


def _bound(magnitude: torch.Tensor, expected: torch.Tensor, compute: torch.dtype,
           dst: torch.dtype, roundings: int) -> torch.Tensor:
    """How far a correct result may sit from the float64 value: ``roundings``
    half-ulps of the compute dtype on the terms' ``magnitude``, then one ulp of
    the destination (its rounding, and a possible FMA) on the result, and the
    destination's subnormal spacing near zero."""
    info = torch.finfo(dst)
    return (roundings * torch.finfo(compute).eps * magnitude
            + 2 * info.eps * expected.abs() + 2 * info.tiny * info.eps)


def _within(got: torch.Tensor, expected64: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest error over its bound (<= 1 passes); inf on a non-finite mismatch."""
    got = got.cpu().reshape(-1).to(torch.float64)
    if got.numel() == 0:
        return 0.0
    if not torch.equal(torch.isfinite(got), torch.isfinite(expected64)):
        return math.inf
    return float(((got - expected64).abs() / bound.clamp_min(1e-300)).max())


def _flat_dtype(dtype: torch.dtype) -> torch.dtype:
    # what the reducer's default fp32 reduce_dtype makes of these gradients
    return communication_dtype(dtype, torch.float32)


def _check_flatten(tensors, dtype, backend):
    flat = flatten_cast_scale(tensors, dtype=_flat_dtype(dtype), scale=CHECK_SCALE,
                              backend=backend)
    expected = torch.cat([reference_cast_scale(t, _flat_dtype(dtype), CHECK_SCALE)
                          for t in tensors])
    return flat, _bits_equal(flat, expected), None


def _flat_for(tensors, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    n = sum(t.numel() for t in tensors)
    return (torch.randn(n, generator=generator, dtype=torch.float64) * 4).to(
        _flat_dtype(dtype)).to(device)


def _check_unflatten(tensors, dtype, backend):
    flat = _flat_for(tensors, dtype, tensors[0].device, 1)
    outputs = [torch.empty_like(t) for t in tensors]
    outputs[-2] = torch.empty_like(tensors[-2].t()).t()  # a transposed destination
    unflatten_cast_scale(flat, outputs, scale=CHECK_SCALE, backend=backend)
    segments = torch.split(flat.cpu(), _segments(tensors))
    expected = [reference_cast_scale(s, dtype, CHECK_SCALE) for s in segments]
    got = torch.cat([o.cpu().reshape(-1) for o in outputs])
    return got, _bits_equal(got, torch.cat(expected)), None


def _check_unflatten_device_scale(tensors, dtype, backend):
    """``unflatten`` with the scale held in an fp32 tensor on the device (a
    loss scale's inverse, a clip coefficient): the value the tensor holds is
    the scale, and the result must be bitwise the documented rounding of it."""
    flat = _flat_for(tensors, dtype, tensors[0].device, 3)
    held = torch.tensor(CHECK_SCALE, dtype=torch.float32, device=flat.device)
    outputs = [torch.empty_like(t) for t in tensors]
    unflatten_cast_scale(flat, outputs, scale=held, backend=backend)
    value = float(held.cpu())
    segments = torch.split(flat.cpu(), _segments(tensors))
    expected = [reference_cast_scale(s, dtype, value) for s in segments]
    got = torch.cat([o.cpu().reshape(-1) for o in outputs])
    return got, _bits_equal(got, torch.cat(expected)), None


def _check_accumulate(tensors, dtype, backend):
    flat = _flat_for(tensors, dtype, tensors[0].device, 2)
    outputs = [t.clone() for t in tensors]
    unflatten_cast_scale(flat, outputs, scale=CHECK_SCALE, accumulate=True, backend=backend)
    compute = _compute_dtype(dtype, flat.dtype)
    scale = float(torch.tensor(CHECK_SCALE, dtype=compute))  # as the kernels round it
    worst = 0.0
    for t, segment, out in zip(tensors, torch.split(flat.cpu(), _segments(tensors)), outputs):
        product = segment.to(torch.float64) * scale
        before = t.cpu().reshape(-1).to(torch.float64)
        expected = before + product
        # two roundings in the compute dtype (product, sum), then the destination
        bound = _bound(product.abs() + before.abs(), expected, compute, dtype, 2)
        worst = max(worst, _within(out, expected, bound))
    return None, worst <= 1.0, worst


def _check_clip_norm(tensors, dtype, backend):
    """The clipping norm (``clipping.norm_powers`` on ``backend``: rows of
    ``NORM_ROW`` elements, each row's sum in the buffer's precision, fp32 at
    least, the rows added in fp64) of the flattened gradients, 2-norm and max
    norm, against float64 on the CPU; and the same bits from a second call
    (the value every rank computes must not vary)."""
    from fusedreduce.clipping import NORM_ROW, norm_powers
    flat = flatten_cast_scale(tensors, dtype=_flat_dtype(dtype), backend=backend)
    exact = flat.cpu().to(torch.float64)
    compute = torch.float64 if flat.dtype == torch.float64 else torch.float32
    worst, got = 0.0, []
    for norm_type in (2.0, math.inf):
        power = norm_powers([flat], norm_type, backend=backend)[0]
        again = norm_powers([flat], norm_type, backend=backend)[0]
        norm = float(power) if norm_type == math.inf else float(power) ** 0.5
        want = float(exact.abs().max()) if norm_type == math.inf else float(exact.norm())
        if not torch.equal(power, again):
            return None, False, math.inf
        # a row's sum of squares in `compute` is within (NORM_ROW - 1) roundings
        # of its exact value; the square root halves the relative error. The
        # max norm is exact
        bound = (NORM_ROW * torch.finfo(compute).eps * want if norm_type != math.inf
                 else 0.0) + 1e-300
        worst = max(worst, abs(norm - want) / bound)
        got.append(power.cpu())
    return torch.stack(got), worst <= 1.0, worst


def _segments(tensors) -> List[int]:
    return [t.numel() for t in tensors]


def _adasum_operands(tensors, dtype):
    """``a``, ``b`` on the device in ``dtype``, and their float64 copies on the CPU."""
    a = flatten_cast_scale(tensors, dtype=dtype, backend="torch")
    a64 = a.cpu().to(torch.float64)
    generator = torch.Generator().manual_seed(3)
    # b partly aligned with a, so the coefficients are not all ~1
    noise = torch.randn(a.numel(), generator=generator, dtype=torch.float64)
    b = (0.5 * a64 + noise).to(dtype)
    return a, b.to(a.device), a64, b.to(torch.float64)


def _reference_stats(a64, b64, segments) -> torch.Tensor:
    rows = [torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum()])
            for x, y in zip(torch.split(a64, segments), torch.split(b64, segments))]
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def _check_adasum_stats(tensors, dtype, backend):
    a, b, a64, b64 = _adasum_operands(tensors, dtype)
    segments = _segments(tensors)
    got = adasum_stats(a, b, kernels.packed_boundaries(segments), backend=backend).cpu()
    expected = _reference_stats(a64, b64, segments)
    worst = 0.0
    for column, (x, y) in enumerate(((a64, b64), (a64, a64), (b64, b64))):
        magnitude = torch.stack([(p * q).abs().sum() for p, q in zip(
            torch.split(x, segments), torch.split(y, segments))])
        # two float64 sums of the same products, in different orders: each is
        # within (n - 1) half-ulps of the exact sum of magnitudes
        n = torch.tensor(segments, dtype=torch.float64).clamp_min(1)
        bound = 2 * n * torch.finfo(torch.float64).eps * magnitude + 1e-300
        worst = max(worst, float(((got[:, column] - expected[:, column]).abs() / bound).max())
                    if len(segments) else 0.0)
    return got, worst <= 1.0, worst


def _check_adasum_combine(tensors, dtype, backend):
    a, b, a64, b64 = _adasum_operands(tensors, dtype)
    segments = _segments(tensors)
    stats = _reference_stats(a64, b64, segments)
    out = adasum_combine(a, b, kernels.packed_boundaries(segments), stats.to(a.device),
                         backend=backend)
    # the coefficients, both products and the sum in fp32 (fp64 for fp64 data,
    # or where the kernels widen): four roundings on |ca·a| + |cb·b|, then dst
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    worst = 0.0
    for x, y, got, (dot, a2, b2) in zip(torch.split(a64, segments), torch.split(b64, segments),
                                        torch.split(out.cpu(), segments), stats.tolist()):
        ca = 1.0 if a2 < ADASUM_NORM_FLOOR else 1.0 - dot / (2.0 * a2)
        cb = 1.0 if b2 < ADASUM_NORM_FLOOR else 1.0 - dot / (2.0 * b2)
        expected = ca * x + cb * y
        bound = _bound((ca * x).abs() + (cb * y).abs(), expected, compute, dtype, 4)
        worst = max(worst, _within(got, expected, bound))
    return out, worst <= 1.0, worst


CHECKS = {"flatten": _check_flatten, "unflatten": _check_unflatten,
          "unflatten_device_scale": _check_unflatten_device_scale,
          "unflatten_accumulate": _check_accumulate, "clip_norm": _check_clip_norm,
          "adasum_stats": _check_adasum_stats,
          "adasum_combine": _check_adasum_combine}


def check_kernels(device: torch.device, backends: Sequence[str], size: int,
                  progress: Optional[common.Progress] = None,
                  shapes: Optional[Sequence[tuple]] = None) -> List[dict]:
    """One record per (kernel, dtype, backend): ``correct``, ``max_error_over_bound``
    (bounded kernels) and, for the bitwise ones, ``same_as_torch``; a kernel that
    raises is recorded as incorrect with its error."""
    records = []
    for dtype_name in CHECK_DTYPES:
        dtype = common.DTYPES[dtype_name]
        tensors = check_tensors(dtype, size, device, shapes=shapes)
        for kernel in KERNELS:
            results = {}
            for backend in backends:
                label = f"check: {kernel} {dtype_name} {backend}"
                record = {"kernel": kernel, "dtype": dtype_name, "backend": backend,
                          "device": device.type, "n_elements": sum(_segments(tensors)),
                          "n_tensors": len(tensors)}
                with progress.step(label) if progress else contextlib.nullcontext():
                    try:
                        result, correct, worst = CHECKS[kernel](tensors, dtype, backend)
                    except Exception as exc:  # noqa: BLE001 (reported, not raised)
                        result, correct, worst = None, False, None
                        record["error"] = f"{type(exc).__name__}: {exc}"
                record.update(correct=bool(correct), max_error_over_bound=worst)
                results[backend] = result
                records.append(record)
            if kernel in BITWISE and {"triton", "torch"} <= set(results):
                same = (results["triton"] is not None and results["torch"] is not None
                        and _bits_equal(results["triton"], results["torch"]))
                for record in records[-len(backends):]:
                    record["same_as_torch"] = same
    return records


# ------------------------------------------------------------------ the test suite

def find_tests() -> Optional[Path]:
    """The checkout's ``tests/`` beside the installed package (editable installs)."""
    import fusedreduce

    tests = Path(fusedreduce.__file__).resolve().parent.parent / "tests"
    conftest = tests / "conftest.py"
    if conftest.is_file() and "--device" in conftest.read_text():
        return tests
    return None


def run_tests(tests: Path, log_path: Optional[str]) -> dict:
    """``pytest --device cuda tests`` in a fresh process; the counts from its summary."""
    command = [sys.executable, "-m", "pytest", "--device", "cuda", "-p", "no:cacheprovider",
               "-rfE", str(tests)]
    if importlib.util.find_spec("xdist") is not None:
        command[3:3] = ["-n", "4"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, env=env,
                             timeout=TESTS_TIMEOUT_S, cwd=tests.parent)
        text, returncode = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        text = f"{exc.stdout or ''}\ntimed out after {TESTS_TIMEOUT_S} s"
        returncode = None
    if log_path:
        Path(log_path).write_text(text)
    summaries = [line for line in text.splitlines() if SUMMARY_LINE.search(line)]
    counts = {word: int(n) for n, word in COUNT.findall(summaries[-1] if summaries else "")}
    failed_lines = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"command": " ".join(command), "returncode": returncode, "counts": counts,
            "seconds": time.perf_counter() - started, "failed": failed_lines[:50],
            "ok": returncode == 0, "log": log_path}


# ------------------------------------------------------------------ the verdict

def verdict_rows(checks: Sequence[dict], bench: Sequence[dict]) -> List[dict]:
    """One row per (kernel, dtype): correctness per backend and, for flatten and
    unflatten, the benchmark's figures at the largest size, scale 1/8, ResNet-50."""
    rows = []
    largest = max((r["size"] for r in bench), default=None)
    for kernel in KERNELS:
        for dtype in CHECK_DTYPES:
            mine = [c for c in checks if (c["kernel"], c["dtype"]) == (kernel, dtype)]
            if not mine:
                continue
            row = dict.fromkeys(key for _, key, _ in VERDICT_COLUMNS)
            row.update(kernel=kernel, dtype=dtype)
            for c in mine:
                row[c["backend"]] = "ok" if c["correct"] else "WRONG"
            same = {c.get("same_as_torch") for c in mine} - {None}
            row["triton_eq_torch"] = (None if not same else ("yes" if same == {True} else "NO"))
            group = [r for r in bench if r.get("direction") == kernel and r["dtype"] == dtype
                     and r["list"] == VERDICT_LIST and r["size"] == largest
                     and math.isclose(r["scale"], VERDICT_SCALE)]
            ours = next((r for r in group if r["method"] == "fusedreduce"), None)
            host = next((r for r in group if r["method"] == kernels_bench.HOST_METHOD), None)
            moved = next((r for r in group if r["method"] == kernels_bench.HOST_MOVED_METHOD),
                         None)
            new = next((r for r in group if r["method"] == kernels_bench.HOST_NEW_METHOD), None)
            prepared = next((r for r in group
                             if r["method"] == kernels_bench.HOST_PREPARED_METHOD), None)
            baselines = [r for r in group if r["role"] == "baseline"]
            if ours:
                best = min(baselines, key=lambda r: r["time_ms"])
                row.update(n_elements=ours["n_elements"], gbps=ours["gbps"],
                           x_copy=ours["ratio"], best_torch=best["method"],
                           best_torch_x_copy=best["ratio"],
                           x_best_torch=best["time_ms"] / ours["time_ms"],
                           host_us=host["host_us"] if host else None,
                           host_moved_us=moved["host_us"] if moved else None,
                           host_new_us=new["host_us"] if new else None,
                           host_prepared_us=prepared["host_us"] if prepared else None)
            rows.append(row)
    return rows


VERDICT_COLUMNS: List[common.Column] = [
    ("kernel", "kernel", ""), ("dtype", "dtype", ""), ("triton", "triton", ""),
    ("torch", "torch", ""), ("triton==torch", "triton_eq_torch", ""),
    ("elements", "n_elements", ",d"), ("GB/s", "gbps", ".4g"), ("x copy", "x_copy", ".2f"),
    ("best torch", "best_torch", ""), ("its x copy", "best_torch_x_copy", ".2f"),
    ("x best torch", "x_best_torch", ".2f"), ("host us", "host_us", ".1f"),
    ("host us, moved", "host_moved_us", ".1f"), ("host us, new", "host_new_us", ".1f"),
    ("host us, prepared", "host_prepared_us", ".1f")]


def all_correct(checks: Sequence[dict]) -> bool:
    return bool(checks) and all(c["correct"] and c.get("same_as_torch", True) for c in checks)


def print_verdict(machine: dict, checks, bench, tests: Optional[dict], elapsed: float) -> bool:
    """The verdict on stdout; whether everything checked was correct."""
    print(f"# gpu-check: {versions_line(machine)}")
    if machine.get("triton_problem"):
        print(f"# Triton backend unavailable: {machine['triton_problem']}")
    if bench:
        print("\n## kernels benchmark (GB/s: bytes read + written / time; x copy: a "
              "device-to-device copy of the same bytes over ours)")
        print(common.format_table([dict({"host_us": None}, **r) for r in bench], [
            ("case", "case", ""), ("elements", "n_elements", ",d"), ("method", "method", ""),
            ("ms", "time_ms", ".4g"), ("GB/s", "gbps", ".4g"), ("x copy", "ratio", ".2f"),
            ("host us", "host_us", ".1f")], group_by=("case", "size")))
    print(f"\n## verdict: correctness against a CPU reference of the documented roundings "
          f"(flatten/unflatten bitwise, the rest within eps-derived bounds); figures: "
          f"{VERDICT_LIST}, scale {VERDICT_SCALE:g}, the largest size")
    print(common.format_table(verdict_rows(checks, bench), VERDICT_COLUMNS))
    for c in checks:
        if not c["correct"] or c.get("same_as_torch") is False:
            detail = c.get("error") or (f"error/bound {c['max_error_over_bound']:.3g}"
                                        if c["max_error_over_bound"] is not None
                                        else "not bitwise the reference" if not c["correct"]
                                        else "differs from the torch backend")
            print(f"WRONG: {c['kernel']} {c['dtype']} {c['backend']}: {detail}")
    ok = all_correct(checks)
    if tests is not None:
        counts = ", ".join(f"{n} {word}" for word, n in tests["counts"].items()) or "no summary"
        print(f"\n## tests: {tests['command']}\n{counts} in {tests['seconds']:.0f} s "
              f"(exit {tests['returncode']})")
        for line in tests["failed"]:
            print(line)
        ok = ok and tests["ok"]
    print(f"\n# {'PASS' if ok else 'FAIL'}: {elapsed:.0f} s in all")
    return ok


def write_plot(path: str, rows: Sequence[dict], title: str) -> None:
    """Bars of x copy per kernel and dtype: ours beside torch's best."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("x_copy") is not None]
    if not rows:
        raise ValueError("no benchmark figures to plot")
    labels = [f"{r['kernel']}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    ax.bar([x - 0.2 for x in xs], [r["x_copy"] for r in rows], 0.4, label="fusedreduce")
    ax.bar([x + 0.2 for x in xs], [r["best_torch_x_copy"] for r in rows], 0.4,
           label="torch's best")
    ax.axhline(1.0, color="grey", linestyle=":", label="copy of the same bytes")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("x copy bandwidth")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_files.make_parents(path), dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ the command

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "gpu-check", help="on a new GPU machine: kernels correct per dtype, the test suite in "
                          "CUDA mode, kernel bandwidth vs a copy and vs torch; one verdict",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smaller checks (100K elements) and one benchmark size (4M)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto (default): cuda, or a clean skip without a GPU; cpu: a dry "
                             "run of the same steps on the CPU")
    parser.add_argument("--sizes", type=common.parse_sizes,
                        help="benchmark sizes in elements, comma-separated, suffixes K/M/G "
                             "(default 4M,25.6M; --quick 4M)")
    parser.add_argument("--no-tests", action="store_true",
                        help="leave out the test suite (pytest --device cuda)")
    parser.add_argument("--no-bench", action="store_true", help="leave out the benchmark")
    parser.add_argument("--tests-log", metavar="PATH", help="keep the test run's output here")
    parser.add_argument("--json", type=output_files.output_file,
                                  metavar="PATH", help="write machine, config and results here")
    parser.add_argument("--plot", type=output_files.output_file, metavar="PATH.png",
                        help="write a PNG of x copy per kernel and dtype (needs matplotlib: "
                             "pip install matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        plot.require_matplotlib()
    if args.device == "auto":
        if not torch.cuda.is_available():
            print(f"# gpu-check: no CUDA device here (torch {torch.__version__}, "
                  f"torch.cuda.is_available() is False): nothing checked. Run it on the GPU "
                  f"machine; `--device cpu` is a dry run on this one.")
            if args.json:
                common.write_json(args.json, environment(torch.device("cpu")),
                                  {"command": "gpu-check", "skipped": "no CUDA device"}, [])
            return 0
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check --device cuda: CUDA is not available here")
    device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
              else torch.device("cpu"))
    machine = environment(device)
    on_cpu = device.type == "cpu"
    # on CUDA the Triton backend is always checked: if it cannot run, its rows
    # say why and the verdict fails; on the CPU it runs only under the interpreter
    triton_runs = not on_cpu or (kernels.triton_available() and os.environ.get(
        "TRITON_INTERPRET", "0") not in ("", "0"))
    backends = ["triton", "torch"] if triton_runs else ["torch"]
    size = QUICK_CHECK_SIZE if (args.quick or on_cpu) else CHECK_SIZE
    bench_config = None
    if not args.no_bench:
        bench_config = {"lists": ["resnet50", "transformer"],
                        "sizes": args.sizes or (QUICK_BENCH_SIZES if args.quick
                                                else BENCH_SIZES),
                        "dtypes": BENCH_DTYPES, "scales": [VERDICT_SCALE, 1.0],
                        "repeats": 10 if args.quick else 20,
                        "flat_dtype": common.dtype_name(kernels_bench.FLAT_DTYPE),
                        "timer": (kernels_bench.DEVICE_TIMER if not on_cpu
                                  else "perf_counter, round-robin")}
    tests_dir = None if args.no_tests or on_cpu else find_tests()
    steps = len(KERNELS) * len(CHECK_DTYPES) * len(backends) + (
        kernels_bench.n_steps(bench_config) if bench_config else 0)
    progress = common.Progress(steps, enabled=not args.no_progress)

    started = time.perf_counter()
    checks = check_kernels(device, backends, size, progress)
    bench = kernels_bench.run(bench_config, device, progress) if bench_config else []
    tests = None
    if tests_dir is not None:
        common.log(f"gpu-check: running the test suite in CUDA mode ({tests_dir})")
        tests = run_tests(tests_dir, args.tests_log)
    elif not args.no_tests and not on_cpu:
        common.log("gpu-check: no tests/ beside the installed package (install the checkout "
                   "with `pip install -e .` to include them); the suite is left out")
    elapsed = time.perf_counter() - started

    ok = print_verdict(machine, checks, bench, tests, elapsed)
    rows = verdict_rows(checks, bench)
    if args.json:
        common.write_json(args.json, machine,
                          {"command": "gpu-check", "quick": args.quick, "backends": backends,
                           "check_size": size, "check_scale": CHECK_SCALE,
                           "kernels": bench_config, "tests": tests},
                          bench + [dict(r, benchmark="gpu-check") for r in checks])
        common.log(f"wrote {args.json}")
    if args.plot and rows and any(r.get("x_copy") is not None for r in rows):
        write_plot(args.plot, rows, versions_line(machine))
        common.log(f"wrote {args.plot}")
    return 0 if ok else 1
