"""Compile the kernels ahead of time for a CUDA target and report what came out.

    python tests/compile_kernels.py {flatten,unflatten,adasum,norm,wire,unspecialized} CAPABILITY

Prints one JSON list, one entry per launch variant. Flatten kernels: the
constexprs, whether PTX came out, the global loads/stores of the PTX by width
in bits, and every value of the TTIR that carries a ``tt.divisibility`` hint.
AdaSum kernels (chunk statistics, their in-order reduction, the combine, per
buffer dtype): whether PTX came out and the count of each arithmetic, branch
and atomic instruction of interest; the norm kernels likewise, per norm and
buffer dtype. The wire kernels likewise, per wire dtype (and rank count and
output dtype for the sum). ``unspecialized`` (nothing compiled; CAPABILITY ignored): every
kernel's parameters and those Triton never specialises on. It needs no GPU, but
it must run without ``TRITON_INTERPRET``: under the interpreter ``@triton.jit``
makes functions that cannot be compiled (test_compile_aot.py runs it in a
subprocess for that reason).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
import time
from collections import Counter
from typing import Optional

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _reports_cache_key() -> str:
    """This checkout's ``kernels/``: its path and every source file's bytes.

    Triton 3.2's TTIR numbers its values, so the reports name them from the
    source line each value's location points to: the path of whichever
    checkout compiled the kernel first. A cache entry another checkout made
    points to files that may be gone (a CI clone, deleted) or say something
    else on that line (a later revision with the kernel moved), and its
    cache key holds neither."""
    kernels = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "kernels")
    digest = hashlib.sha256(kernels.encode())
    for directory, subdirectories, files in sorted(os.walk(kernels)):
        subdirectories.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, kernels).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()[:16]


# Its own on-disk cache, per checkout and kernel source (``_reports_cache_key``):
# the reports read the compiler's intermediates, and a kernel JIT-compiled
# elsewhere under the same key (the recording driver's launches in
# launch_fidelity.py) left Triton 3.2 a TTIR without value names
os.environ["TRITON_CACHE_DIR"] = os.path.join(
    os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton",
                                                       "cache"), "ahead-of-time-reports",
    _reports_cache_key())

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fusedreduce.kernels import (ADASUM_CHUNK, ADASUM_FP32_LIMIT, ADASUM_NORM_FLOOR,  # noqa: E402
                                 ALIGN_BYTES)
from fusedreduce.kernels.adasum import triton_backend as adasum  # noqa: E402
from fusedreduce.kernels.flatten import triton_backend as kernels  # noqa: E402
from fusedreduce.kernels.norm import triton_backend as norm  # noqa: E402
from fusedreduce.kernels.wire import triton_backend as wire  # noqa: E402

BUFFER_TYPES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
# what kinds_mask can return: one dtype code's bit, or ALL_KINDS for a mix
KINDS = sorted({1 << code for code in kernels.DTYPE_CODES.values()} | {kernels.ALL_KINDS})
# launched tensors get 16-byte divisibility when aligned, as every fresh allocation is
ALIGNED = [["tt.divisibility", 16]]

GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
# a named SSA value of the TTIR, e.g. `%numel_17 = tt.load %numel_16 {...} : !tt.ptr<i64>`
NAMED_VALUE = re.compile(r"^\s*%([A-Za-z_][A-Za-z_]*?)(?:_\d+)? = ([\w.]+)\b(.*)$")
DIVISIBILITY = re.compile(r"tt\.divisibility = dense<(\d+)>")


def variants(kernel: str):
    """(signature, constexprs, attrs) of every launch the Python launcher can make;
    a scale read from an fp32 tensor (``SCALE_TENSOR``) with the mixed-dtype
    ``KINDS`` and an fp32 buffer only: the one load it adds is the same in
    every variant, and each compile costs CI time."""
    for kinds in KINDS:
        for buffer, size in BUFFER_TYPES.items():
            for flag in (False, True):
                yield (buffer, *_variant(kernel, kinds, buffer, size, flag, False))
    for flag in (False, True):
        yield ("fp32", *_variant(kernel, kernels.ALL_KINDS, "fp32", BUFFER_TYPES["fp32"], flag,
                                 True))


def _variant(kernel: str, kinds: int, buffer: str, size: int, flag: bool, scale_tensor: bool):
    # a Python scale's launch passes the table as the scale pointer (never read)
    scale_ptr = "*fp32" if scale_tensor else "*i64"
    if kernel == "flatten":
        # without check_finite the launcher passes the table as the flag
        signature = {"table": "*i64", "work": "*i64", "base": "*u8", "out": f"*{buffer}",
                     "flag": "*u8" if flag else "*i64", "n_segments": "i32",
                     "scale_high": "i32", "scale_low": "i32", "scale_ptr": scale_ptr,
                     "KINDS": "constexpr", "CHECK_FINITE": "constexpr",
                     "BLOCK": "constexpr", "OUT_VEC": "constexpr", "SCALE_TENSOR": "constexpr"}
        constexprs = {"KINDS": kinds, "CHECK_FINITE": flag, "BLOCK": kernels.BLOCK,
                      "OUT_VEC": ALIGN_BYTES // size, "SCALE_TENSOR": scale_tensor}
        pointers = 5
    else:
        signature = {"table": "*i64", "work": "*i64", "base": "*u8", "flat": f"*{buffer}",
                     "n_segments": "i32", "scale_high": "i32", "scale_low": "i32",
                     "scale_ptr": scale_ptr, "KINDS": "constexpr", "ACCUMULATE": "constexpr",
                     "BLOCK": "constexpr", "FLAT_VEC": "constexpr", "SCALE_TENSOR": "constexpr"}
        constexprs = {"KINDS": kinds, "ACCUMULATE": flag, "BLOCK": kernels.BLOCK,
                      "FLAT_VEC": ALIGN_BYTES // size, "SCALE_TENSOR": scale_tensor}
        pointers = 4
    return signature, constexprs, {(i,): ALIGNED for i in range(pointers)}


def global_accesses(ptx: str) -> dict:
    """{"ld": {bits: count}, "st": {bits: count}} over the PTX's global loads and stores."""
    counts = {"ld": Counter(), "st": Counter()}
    for op, suffixes in GLOBAL_ACCESS.findall(ptx):
        lanes = re.search(r"\.v(\d+)", suffixes)
        width = re.search(r"\.[bfsu](\d+)\b", suffixes)
        bits = (int(lanes.group(1)) if lanes else 1) * (int(width.group(1)) if width else 0)
        counts[op][bits] += 1
    return {op: dict(c) for op, c in counts.items()}


def hinted_values(ttir: str) -> list:
    """[name, op, divisibility or None] for every named scalar load, and every named
    value that carries a divisibility hint, of the TTIR.

    Triton 3.3 on names SSA values after the Python variables; 3.2 numbers them
    (``%10 = tt.load ... loc(#loc92)``), so there the name is the variable
    assigned on the source line the value's location points to."""
    locations = _locations(ttir)
    found = []
    for line in ttir.splitlines():
        match = NAMED_VALUE.match(line)
        if match:
            name, op, rest = match.groups()
        else:
            numbered = NUMBERED_VALUE.match(line)
            name = numbered and _assigned_name(locations, numbered.group(3))
            if not name:
                continue
            op, rest = numbered.group(1), numbered.group(2)
        hint = DIVISIBILITY.search(rest)
        scalar_load = op == "tt.load" and "tensor<" not in rest
        if scalar_load or hint:
            found.append([name, op, int(hint.group(1)) if hint else None])
    return found


# `%10 = tt.load %9 {...} : !tt.ptr<i64> loc(#loc92)`
NUMBERED_VALUE = re.compile(r"^\s*%\d+ = ([\w.]+)\b(.*) loc\((#loc\d+)\)\s*$")
# `#loc92 = loc(callsite(#loc13 at #loc2))` or `#loc13 = loc("file.py":108:41)`
LOCATION = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=[^=]")


def _locations(ttir: str) -> dict:
    return {m.group(1): m.group(2) for m in map(LOCATION.match, ttir.splitlines()) if m}


def _assigned_name(locations: dict, ref: str):
    """The variable assigned on the source line of location ``ref`` (a call site's
    callee side), or None."""
    for _ in range(16):
        body = locations.get(ref, "")
        callsite = re.match(r"callsite\((#loc\d*) at", body)
        if not callsite:
            break
        ref = callsite.group(1)
    place = re.match(r'"(.*)":(\d+):\d+$', locations.get(ref, ""))
    if not place or not os.path.isfile(place.group(1)):
        return None
    with open(place.group(1)) as source:
        lines = source.read().splitlines()
    assigned = ASSIGNED.match(lines[int(place.group(2)) - 1])
    return assigned.group(1) if assigned else None


#: PTX instructions the AdaSum, norm and wire tests count: arithmetic by type,
#: branches, atomics, and any conversion to or from fp8
INSTRUCTION = re.compile(r"\b((?:fma|mul|add|sub|div)(?:\.rn|\.full|\.approx)?(?:\.ftz)?"
                         r"\.f(?:32|64)|"
                         r"bra(?:\.uni)?|atom|red|cvt[.\w]*e4m3[.\w]*)\b")


def ast_source(fn, signature: dict, constexprs: dict, attrs: Optional[dict] = None):
    """``triton.compiler.ASTSource`` in the form this Triton takes.

    3.3 on: every parameter in ``signature`` (constexprs typed "constexpr"),
    their values in ``constexprs``, hints as ``{(index,): [[name, value]]}``.
    3.2: only runtime parameters in ``signature``, the values in ``constants``,
    and divisibility hints in an ``AttrsDescriptor``.
    """
    source = triton.compiler.ASTSource
    if "constexprs" in inspect.signature(source.__init__).parameters:
        return source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    from triton.backends.compiler import AttrsDescriptor

    hints = {index[0]: value for index, properties in (attrs or {}).items()
             for name, value in properties if name == "tt.divisibility"}
    return source(fn=fn, signature={k: v for k, v in signature.items() if v != "constexpr"},
                  constants=constexprs, attrs=AttrsDescriptor.from_hints(hints))


def adasum_variants():
    """(name, buffer, kernel, signature, constexprs, num_warps) of every AdaSum launch."""
    for buffer in BUFFER_TYPES:
        yield ("chunk_stats", buffer, adasum._chunk_stats_kernel,
               {"a": f"*{buffer}", "b": f"*{buffer}", "table": "*i64", "partials": "*fp64",
                "n_segments": "i32", "CHUNK": "constexpr", "BLOCK": "constexpr"},
               {"CHUNK": ADASUM_CHUNK, "BLOCK": adasum.BLOCK}, adasum.NUM_WARPS)
        yield ("combine", buffer, adasum._combine_kernel,
               {"a": f"*{buffer}", "b": f"*{buffer}", "out": f"*{buffer}", "table": "*i64",
                "stats": "*fp64", "n_segments": "i32", "FLOOR": "constexpr",
                "LIMIT": "constexpr", "BLOCK": "constexpr"},
               {"FLOOR": ADASUM_NORM_FLOOR, "LIMIT": ADASUM_FP32_LIMIT, "BLOCK": adasum.BLOCK},
               adasum.NUM_WARPS)
    yield ("reduce_chunks", None, adasum._reduce_chunks_kernel,
           {"partials": "*fp64", "first_chunk": "*i64", "stats": "*fp64"}, {}, 1)


def norm_variants():
    """(name, buffer, kernel, signature, constexprs, num_warps) of every norm launch."""
    codes = {"max": norm.NORM_MAX, "one": norm.NORM_ONE, "two": norm.NORM_TWO, "p": norm.NORM_P}
    for label, code in codes.items():
        for buffer in BUFFER_TYPES:
            compute = "fp64" if buffer == "fp64" else "fp32"
            yield (f"row_powers {label}", buffer, norm._row_powers_kernel,
                   {"base": f"*{buffer}", "table": "*i64", "work": "*i64", "partials": "*fp64",
                    "n_buffers": "i32", "p_high": "i32", "p_low": "i32",
                    "NORM": "constexpr", "COMPUTE": "constexpr",
                    "ROW": "constexpr", "ROWS": "constexpr"},
                   {"NORM": code, "COMPUTE": getattr(triton.language, {"fp64": "float64",
                                                                       "fp32": "float32"}[compute]),
                    "ROW": norm.NORM_ROW, "ROWS": norm.ROWS_PER_PROGRAM}, norm.NUM_WARPS)
        for sum_partials, finish, loss, loss_tensor, norm64 in (
                (True, True, False, False, False), (True, True, True, True, False),
                (True, False, False, False, False), (False, True, True, False, False),
                (True, True, False, False, True)):  # the last: fp64 gradients' norm
            yield (f"finish {label} partials={int(sum_partials)} finish={int(finish)} "
                   f"loss={int(loss)}{'t' if loss_tensor else ''} norm64={int(norm64)}", None,
                   norm._finish_kernel,
                   {"partials": "*fp64", "ranges": "*i64", "powers": "*fp64", "post": "*fp64",
                    "total_out": "*fp64" if norm64 else "*fp32", "scales_out": "*fp64",
                    "n_buffers": "i32", "p_high": "i32", "p_low": "i32", "max_high": "i32", "max_low": "i32",
                    "loss_ptr": "*fp32", "loss_high": "i32", "loss_low": "i32",
                    "NORM": "constexpr", "SUM_PARTIALS": "constexpr", "FINISH": "constexpr",
                    "LOSS": "constexpr", "LOSS_TENSOR": "constexpr", "NORM64": "constexpr",
                    "BLOCK": "constexpr"},
                   {"NORM": code, "SUM_PARTIALS": sum_partials, "FINISH": finish, "LOSS": loss,
                    "LOSS_TENSOR": loss_tensor, "NORM64": norm64, "BLOCK": norm.FINISH_BLOCK},
                   norm.NUM_WARPS)


WIRE_TYPES = {"float32": "fp32", "bfloat16": "bf16", "int8": "i8", "float8_e4m3fn": "u8"}


def wire_variants():
    """(name, codes, kernel, signature, constexprs, options) of the wire launches:
    the quantize kernel per wire dtype (mixed input dtypes, residual and flag
    on; and fp32 inputs with neither), the sum per wire dtype for 5 ranks
    into fp32, and for 3 ranks into fp64."""
    for dtype, codes in WIRE_TYPES.items():
        level = {"int8": 127.0, "float8_e4m3fn": 448.0}.get(dtype, 1.0)
        # all input kinds with every extra, chunked (codes and scales in one
        # buffer per rank chunk); fp32 inputs with none, flat
        for kinds, extras in ((kernels.ALL_KINDS, True), (1 << 2, False)):
            yield (f"quantize {dtype} kinds={kinds} residual={int(extras)}", codes,
                   wire._quantize_kernel,
                   {"table": "*i64", "tiles": "*i64", "base": "*u8", "codes": f"*{codes}",
                    "scales": "*fp32", "residual": "*fp32" if extras else "*i64",
                    "flag": "*u8" if extras else "*i64", "n_segments": "i32", "numel": "i32",
                    "row": "i32", "code_stride": "i32", "scale_stride": "i32",
                    "scale_high": "i32", "scale_low": "i32", "scale_ptr": "*i64",
                    "KINDS": "constexpr", "WIRE": "constexpr", "LEVEL": "constexpr",
                    "BLOCK": "constexpr", "GROUPS": "constexpr", "HAS_RESIDUAL": "constexpr",
                    "CHUNKED": "constexpr", "CHECK_FINITE": "constexpr",
                    "SCALE_TENSOR": "constexpr"},
                   {"KINDS": kinds, "WIRE": wire.WIRE_CODES[getattr(torch, dtype)],
                    "LEVEL": level, "BLOCK": 256, "GROUPS": wire.TILE // 256,
                    "HAS_RESIDUAL": extras, "CHUNKED": extras, "CHECK_FINITE": extras,
                    "SCALE_TENSOR": False},
                   wire.OPTIONS)
        # 5 ranks' rows into fp32, 3 into fp64; 1 rank's chunks side by side (a gather's)
        for ranks, out, chunked in ((5, "fp32", False), (3, "fp64", False), (1, "fp32", True)):
            padded = 1 << (ranks - 1).bit_length()
            yield (f"sum {dtype} R={ranks} out={out} chunked={int(chunked)}", codes,
                   wire._dequantize_sum_kernel,
                   {"codes": f"*{codes}", "scales": "*fp32", "out": f"*{out}", "n": "i32",
                    "n_blocks": "i32", "total": "i32", "total_blocks": "i32",
                    "code_rank": "i32", "code_chunk": "i32", "scale_rank": "i32",
                    "scale_chunk": "i32", "WIRE": "constexpr", "R": "constexpr",
                    "RANKS": "constexpr", "LEVELS": "constexpr", "BLOCK": "constexpr",
                    "GROUPS": "constexpr", "CHUNKED": "constexpr"},
                   {"WIRE": wire.WIRE_CODES[getattr(torch, dtype)], "R": ranks,
                    "RANKS": padded, "LEVELS": padded.bit_length() - 1, "BLOCK": 256,
                    "GROUPS": max(1, wire.TILE // (256 * padded)), "CHUNKED": chunked},
                   wire.OPTIONS)


def main_adasum(capability: int, kernel: str = "adasum") -> None:
    target = GPUTarget("cuda", capability, 32)
    report = []
    families = {"adasum": adasum_variants, "norm": norm_variants, "wire": wire_variants}
    for name, buffer, fn, signature, constexprs, options in families[kernel]():
        start = time.perf_counter()
        if isinstance(options, int):
            options = {"num_warps": options}
        compiled = triton.compile(ast_source(fn, signature, constexprs),
                                  target=target, options=options)
        ptx = compiled.asm.get("ptx", "")
        body = ptx[ptx.find(".entry"):]
        report.append({
            "name": name,
            "buffer": buffer,
            "seconds": round(time.perf_counter() - start, 3),
            "has_ptx": f".entry {fn.__name__}" in ptx,
            "instructions": dict(Counter(INSTRUCTION.findall(body))),
            # the bits of -0.0 as a PTX fp64 immediate
            "minus_zero": "0d8000000000000000" in body,
        })
    print(json.dumps({"kernel": kernel, "capability": capability,
                      "elements_per_thread": adasum.BLOCK // (32 * adasum.NUM_WARPS),
                      "variants": report}))


def main_unspecialized() -> None:
    """Every ``@triton.jit`` kernel's parameters and those it never specialises
    on (``do_not_specialize``)."""
    report = {}
    for module in (kernels, adasum, norm, wire):
        for name, fn in sorted(vars(module).items()):
            if isinstance(fn, triton.runtime.JITFunction) and name.endswith("_kernel"):
                report[f"{module.__name__}.{name}"] = {
                    "params": [p.name for p in fn.params],
                    "unspecialized": [p.name for p in fn.params if p.do_not_specialize]}
    print(json.dumps(report))


def main(kernel: str, capability: int) -> None:
    if kernel == "unspecialized":
        main_unspecialized()
        return
    if kernel in ("adasum", "norm", "wire"):
        main_adasum(capability, kernel)
        return
    fn = {"flatten": kernels._flatten_kernel, "unflatten": kernels._unflatten_kernel}[kernel]
    target = GPUTarget("cuda", capability, 32)
    report = []
    for buffer, signature, constexprs, attrs in variants(kernel):
        start = time.perf_counter()
        compiled = triton.compile(ast_source(fn, signature, constexprs, attrs),
                                  target=target, options={"num_warps": kernels.NUM_WARPS})
        ptx = compiled.asm.get("ptx", "")
        report.append({
            "buffer": buffer,
            "constexprs": constexprs,
            "seconds": round(time.perf_counter() - start, 3),
            "has_ptx": f".entry {fn.__name__}" in ptx,
            "accesses": global_accesses(ptx),
            "hinted": hinted_values(compiled.asm.get("ttir", "")),
        })
    print(json.dumps({"kernel": kernel, "capability": capability, "block": kernels.BLOCK,
                      "num_warps": kernels.NUM_WARPS, "variants": report}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
