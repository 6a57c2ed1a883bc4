"""Every Triton launch variant compiles for sm_80 and sm_90, vectorized, with honest hints.

No GPU needed: tests/compile_kernels.py compiles each variant the launchers
can request (every KINDS mask x buffer dtype x CHECK_FINITE/ACCUMULATE) and
reports on its PTX and TTIR. It runs in a subprocess without TRITON_INTERPRET,
because under the interpreter (which conftest.py turns on) ``@triton.jit``
functions cannot be compiled. A cold compile of one kernel for one target
takes ~30 s on two cores, so each (kernel, target) is its own test and xdist
can spread them; Triton's on-disk cache makes repeat runs quick. The AdaSum
kernels (one variant per buffer dtype) are checked on their instructions: fp64
statistics, a sequential reduction of chunk partials, the combine's fp32 path
and its fp64 fallback, and no atomics.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedreduce.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")

HELPER = Path(__file__).with_name("compile_kernels.py")
TARGETS = [80, 90]
KERNELS = ["flatten", "unflatten"]
BUFFER_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
# bits of the KINDS mask and the element size of their dtype (kernels.flatten.DTYPE_CODES)
KIND_BYTES = {1: 2, 2: 2, 4: 4, 8: 8}


@functools.lru_cache(maxsize=None)
def compile_report(kernel: str, capability: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HELPER), kernel, str(capability)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = sum(v["seconds"] for v in report["variants"])
    print(f"{kernel} sm_{capability}: {len(report['variants'])} variants in {seconds:.1f} s")
    return report


def accesses_per_thread(report: dict, element_bytes: int) -> int:
    """128-bit accesses one thread makes to move one BLOCK of elements of this size."""
    threads = 32 * report["num_warps"]
    total = report["block"] * element_bytes
    assert total % (16 * threads) == 0, "a BLOCK must split into 16-byte pieces per thread"
    return total // (16 * threads)


def expected_128_bit(report: dict, variant: dict) -> tuple:
    """(loads, stores) of 128 bits the fast paths of all the variant's branches make:
    each branch moves a whole BLOCK of every array it touches in 16-byte pieces."""
    kinds = [bit for bit in KIND_BYTES if variant["constexprs"]["KINDS"] & bit]
    per = functools.partial(accesses_per_thread, report)
    buffer = per(BUFFER_BYTES[variant["buffer"]])
    tensors = sum(per(KIND_BYTES[bit]) for bit in kinds)
    if report["kernel"] == "flatten":
        return tensors, buffer * len(kinds)
    reread = tensors if variant["constexprs"]["ACCUMULATE"] else 0
    return buffer * len(kinds) + reread, tensors


@pytest.mark.parametrize("capability", TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_variant_compiles_to_ptx_whose_fast_path_is_all_128_bit(kernel, capability):
    report = compile_report(kernel, capability)
    # 5 KINDS x 4 buffers x the flag/accumulate constexpr, and the mixed KINDS
    # on an fp32 buffer again with the scale read from a tensor: its fast path
    # stays 128-bit too
    assert len(report["variants"]) == 5 * 4 * 2 + 2
    assert sum(v["constexprs"]["SCALE_TENSOR"] for v in report["variants"]) == 2
    for variant in report["variants"]:
        name = f"{kernel} sm_{capability} {variant['buffer']} {variant['constexprs']}"
        assert variant["has_ptx"], f"{name}: no PTX"
        loads, stores = expected_128_bit(report, variant)
        got = (variant["accesses"]["ld"].get("128", 0), variant["accesses"]["st"].get("128", 0))
        assert got == (loads, stores), (
            f"{name}: {got[0]} loads and {got[1]} stores of 128 bits, want {loads} and {stores}; "
            f"all accesses by width in bits: {variant['accesses']}")


@pytest.mark.parametrize("capability", TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_divisibility_hints_sit_only_on_values_that_honour_them(kernel, capability):
    """The table stores byte offsets, flat starts and block starts rounded to their
    alignment, so only those may carry hints. ``numel``, ``extent`` and ``kind``
    are arbitrary: a hint on them (as when ``tl.multiple_of`` on one result of a
    multi-result call marked them all) would let full blocks of odd-sized
    segments take the vectorized path and read or write out of bounds."""
    report = compile_report(kernel, capability)
    table_loads = {"numel", "kind"} | ({"extent"} if kernel == "flatten" else set())
    for variant in report["variants"]:
        name = f"{kernel} sm_{capability} {variant['buffer']} {variant['constexprs']}"
        hinted = {(n, op, d) for n, op, d in variant["hinted"]}
        for n, op, d in hinted:
            assert n not in table_loads | {"seg", "work", "code"} or d is None, (
                f"{name}: %{n} ({op}) carries tt.divisibility = {d}")
        loaded = {n for n, op, d in hinted if op == "tt.load"}
        assert table_loads <= loaded, f"{name}: no scalar loads named {table_loads - loaded}"
        vec = 16 // BUFFER_BYTES[variant["buffer"]]
        for honest in [("src_bytes", "tt.load", 16), ("flat_start", "tt.load", vec),
                       ("start", "arith.muli", report["block"])]:
            assert honest in hinted, (
                f"{name}: hint {honest} missing; found {sorted(hinted, key=str)}")


# ------------------------------------------------------------------ AdaSum

ADASUM_BUFFERS = ["fp16", "bf16", "fp32", "fp64"]


def _instructions(variant: dict, *names: str) -> int:
    return sum(variant["instructions"].get(name, 0) for name in names)


@pytest.mark.parametrize("capability", TARGETS)
def test_every_adasum_kernel_compiles_for_every_buffer_dtype_without_atomics(capability):
    report = compile_report("adasum", capability)
    names = sorted((v["name"], v["buffer"] or "") for v in report["variants"])
    assert names == sorted([("chunk_stats", b) for b in ADASUM_BUFFERS]
                           + [("combine", b) for b in ADASUM_BUFFERS] + [("reduce_chunks", "")])
    for variant in report["variants"]:
        name = f"{variant['name']} {variant['buffer']} sm_{capability}"
        assert variant["has_ptx"], f"{name}: no PTX"
        # deterministic: every result has one writer, no atomic adds anywhere
        assert _instructions(variant, "atom", "red") == 0, f"{name}: {variant['instructions']}"


@pytest.mark.parametrize("capability", TARGETS)
def test_adasum_chunk_statistics_are_fp64_products_summed_in_fp64(capability):
    report = compile_report("adasum", capability)
    per_thread = report["elements_per_thread"]
    for variant in (v for v in report["variants"] if v["name"] == "chunk_stats"):
        name = f"chunk_stats {variant['buffer']} sm_{capability}"
        # each thread's elements: three fp64 products, each added to its lane's sum
        # (contracted into an fma), and no fp32 arithmetic at all
        assert _instructions(variant, "fma.rn.f64") == 3 * per_thread, \
            f"{name}: {variant['instructions']}"
        assert _instructions(variant, "fma.rn.f32", "mul.f32", "mul.rn.f32", "add.f32",
                             "add.rn.f32") == 0, f"{name}: {variant['instructions']}"


@pytest.mark.parametrize("capability", TARGETS)
def test_the_adasum_combine_branches_to_fp64_only_for_16_and_32_bit_buffers(capability):
    report = compile_report("adasum", capability)
    per_thread = report["elements_per_thread"]
    for variant in (v for v in report["variants"] if v["name"] == "combine"):
        name = f"combine {variant['buffer']} sm_{capability}"
        f32 = _instructions(variant, "fma.rn.f32", "mul.f32", "mul.rn.f32")
        f64 = _instructions(variant, "fma.rn.f64", "mul.f64", "mul.rn.f64")
        if variant["buffer"] == "fp64":
            # one path: ca·x + cb·y in fp64, no branch on the coefficients
            assert f32 == 0 and f64 == 2 * per_thread, f"{name}: {variant['instructions']}"
            assert _instructions(variant, "bra.uni") == 0, f"{name}: {variant['instructions']}"
        else:
            # both paths compiled (ca·x + cb·y per element in each), and a
            # uniform branch between them on the segment's coefficients
            assert f32 == 2 * per_thread and f64 == 2 * per_thread, \
                f"{name}: {variant['instructions']}"
            assert _instructions(variant, "bra.uni") >= 1, f"{name}: {variant['instructions']}"


@pytest.mark.parametrize("capability", TARGETS)
def test_adasum_chunk_partials_are_reduced_by_one_sequential_fp64_sum_from_minus_zero(capability):
    report = compile_report("adasum", capability)
    variant = next(v for v in report["variants"] if v["name"] == "reduce_chunks")
    # one add in a loop (not a tree), starting from -0.0 (which adds exactly)
    assert _instructions(variant, "add.f64", "add.rn.f64") == 1, variant["instructions"]
    assert variant["minus_zero"]


# ------------------------------------------------------------------ the clipping norm

@pytest.mark.parametrize("capability", TARGETS)
def test_every_norm_kernel_compiles_without_atomics(capability):
    report = compile_report("norm", capability)
    rows = [v for v in report["variants"] if v["name"].startswith("row_powers")]
    finishes = [v for v in report["variants"] if v["name"].startswith("finish")]
    # every norm (max, 1, 2, p) for every buffer dtype, and the finishing program's modes
    assert len(rows) == 4 * len(ADASUM_BUFFERS) and len(finishes) == 4 * 5
    for variant in report["variants"]:
        name = f"{variant['name']} {variant['buffer']} sm_{capability}"
        assert variant["has_ptx"], f"{name}: no PTX"
        # deterministic: every partial and every result has one writer
        assert _instructions(variant, "atom", "red") == 0, f"{name}: {variant['instructions']}"
    # the partials are summed in fp64 and the norm divided by the loss scale in fp64
    for variant in finishes:
        if "partials=1" in variant["name"] and not variant["name"].startswith("finish max"):
            assert _instructions(variant, "add.f64", "add.rn.f64") > 0, variant
        if "loss=1" in variant["name"]:
            assert _instructions(variant, "div.rn.f64") >= 1, variant
    # the 2-norm's finish divides in fp64 only for the coefficient of an fp64
    # norm (fp64 gradients, as torch): an fp32 norm's is an fp32 division
    for variant in finishes:
        if variant["name"].startswith("finish two partials=1 finish=1 loss=0"):
            fp64 = variant["name"].endswith("norm64=1")
            assert (_instructions(variant, "div.rn.f64") >= 1) == fp64, variant


def test_the_words_of_run_time_floats_are_never_specialised_on():
    # a scale (or loss scale) travels as the two 32-bit words of its float64
    # bits: were Triton to specialise on their values (== 1, divisible by 16), a
    # new scale could compile another variant mid-training and make a kept
    # launch's compiled kernel wrong for it
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HELPER), "unspecialized", "0"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    words = {name: [p for p in kernel["params"] if p.endswith(("_high", "_low"))]
             for name, kernel in report.items()}
    assert sum(map(len, words.values())) >= 4, words  # the flatten kernels' and the norm's
    for name, kernel in report.items():
        assert set(words[name]) <= set(kernel["unspecialized"]), (name, kernel)


# ------------------------------------------------------------------ the wire formats

@pytest.mark.parametrize("capability", TARGETS)
def test_every_wire_kernel_compiles_with_ieee_roundings_and_no_fp8_instructions(capability):
    report = compile_report("wire", capability)
    # a chunked quantize with residual and flag, and a flat one without, per
    # wire dtype; three sums each (the last of chunks side by side)
    assert len(report["variants"]) == 4 * 5
    for variant in report["variants"]:
        name = f"{variant['name']} sm_{capability}"
        assert variant["has_ptx"], f"{name}: no PTX"
        found = variant["instructions"]
        # bit-equal to the torch backend: no FMA contraction (enable_fp_fusion
        # off), no approximate division, no atomics (one writer per element)
        assert not [op for op in found if op.startswith("fma") or ".full" in op
                    or ".approx" in op or op in ("atom", "red")], f"{name}: {found}"
        # e4m3 is encoded on the integer bits: nothing that needs sm_89's fp8 cvt
        assert not [op for op in found if "e4m3" in op], f"{name}: {found}"
        # IEEE division (Triton 3.2's div_rn flushes subnormals: div.rn.ftz)
        if variant["name"].startswith(("quantize int8", "quantize float8")):
            assert _instructions(variant, "div.rn.f32", "div.rn.ftz.f32") > 0, f"{name}: {found}"
