"""The CUDA test mode's own tests: what only a GPU can show.

Run on a machine with a GPU (one is enough)::

    pytest --device cuda tests/test_cuda.py

The default CPU mode runs the same checks where they take seconds: the
kernel checks at small sizes on CPU tensors with the torch fallback
(``test_the_kernel_checks_hold_on_cpu_tensors_with_the_torch_fallback``), and
the ranks' checks (``device_aware``) on CPU gloo ranks; the kernel checks at
their full sizes, the DDP hooks and AdaSum's tree (``CUDA_ONLY_JOBS``,
``CUDA_ONLY_RUNS``) are skipped there ("CUDA test mode only"). Covered:

- the kernels, both backends (the ``backend`` fixture), at sizes Triton's
  interpreter cannot reach: one tensor of 2**25 + 3 elements, 3000 tensors of
  odd sizes and mixed dtypes, unaligned storage offsets and odd segment
  starts, non-contiguous inputs and destinations, the non-finite flag, the
  steady state's kept launch; and AdaSum's statistics and combine;
- the collectives on one GPU: NCCL with one rank (every reduction is then the
  identity times its scale) and two gloo ranks sharing the GPU (gloo takes
  CUDA tensors for all_reduce and broadcast): ``DistributedGradReducer``,
  ``DistributedOptimizer``, ``broadcast_tensors``, ``adasum_allreduce``;
- ``fusedreduce.hooks`` on DDP over both, against DDP's own all-reduce and
  torch's ``allreduce_hook``;
- AdaSum's tree on two gloo ranks with CUDA tensors (gloo cannot send or
  receive CUDA tensors; the tree stages its messages through host memory);
- uneven inputs under ``Join([optimizer])``, unsharded and sharded (``Join``'s
  own all-reduces on the GPU under NCCL).

Expected values come from the float64 references of reference.py, computed on
the CPU. The flatten kernels are compared bit for bit (flatten_cases.py says
why no freedom is left), and Triton's results also bit for bit with the torch
fallback's on the same CUDA data, as the docs promise; ``accumulate`` and
AdaSum within bounds derived from the dtypes' eps (see each). Every check is
a module-level function of the device (and backend, and for the large cases
the size), so its logic also runs on CPU tensors with small sizes; the rank
functions are in cuda_runs.py. The ranks start once per session, all three
runs at once.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cuda_runs import (ADASUM_BACKENDS, ADASUM_CAPS, BF16, F16, F32, F64, MIXED, STEPS,
                       REDUCER_CONFIGS, Net, adasum_gradients, broadcast_values, gradients,
                       hook_runs, one_rank_jobs, run_each, tree_jobs, two_rank_jobs)
from adasum_cases import assert_within as assert_adasum_within
from adasum_cases import reference_adasum
from device_mode import on_cpu
from flatten_cases import (Spec, accumulate_bound, assert_same_bits, assert_within, make_values,
                           safe_bound)
from fusedreduce.kernels import (ADASUM_CHUNK, _prepared, adasum_combine, adasum_stats,
                                 flatten_cast_scale, unflatten_cast_scale)
from fusedreduce.local_ranks import RankFailure, run_on_local_ranks
from harness import TIMEOUT, once_per_session
from reference import (adasum_of_blocks, adasum_stats as reference_stats, communication_dtype,
                       reference_flatten, reference_unflatten, subnormal_spacing)

# numpy under Triton's interpreter (the CPU check of this logic) warns about
# the overflows some cases cause on purpose
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

#: the sizes of the CUDA run (the CPU check passes smaller ones)
LARGE = 2 ** 25 + 3
MANY = 3000
MAX_NUMEL = 5000
UNALIGNED_BIG = 2 ** 20 + 5
TRANSPOSED_SIDE = 1531
NONFINITE_BIG = 2 ** 22 + 1
STEADY_COUNT = 300
ADASUM_BIG = 257 * 1024 + 77
#: sizes that end exactly at, or one element around, Triton's 2048-element blocks
EDGE_SIZES = (1, 2, 3, 7, 8, 9, 2047, 2048, 2049, 4095, 4096, 4097)
EPS64 = torch.finfo(F64).eps
#: what gloo says when it refuses a tensor's device or an operation for it
#: (a TCP write from a CUDA pointer fails with EFAULT, "Bad address")
GLOO_REFUSALS = ("not supported", "unsupported", "does not support", "bad address",
                 "not implemented", "only supports")


# ================================================================== helpers


def wide_values(n, dtype, seed, bound):
    """``n`` values of ``dtype`` spread over 36 binary orders of magnitude (from
    fp16's subnormals up), with exact zeros of both signs, ``|x| <= bound``."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen, dtype=F64)
    values *= torch.exp2(torch.randint(-24, 12, (n,), generator=gen).to(F64))
    values[seed % 7::7] = 0.0
    values[seed % 11::11] = -0.0
    return values.clamp(-bound, bound).to(dtype)


def on_device(tensors, device):
    return [t.to(device) for t in tensors]


def both_ways(backend, run):
    """``run(backend)``: a list of CPU tensors. For Triton, also ``run("torch")``
    on the same device data: the docs promise the two backends' flatten and
    unflatten bit for bit."""
    got = run(backend)
    if backend != "torch":
        for i, (a, b) in enumerate(zip(got, run("torch"))):
            assert_same_bits(a, b, f"{backend} vs the torch fallback, result {i}")
    return got


def cpu_layout(values, shape, layout):
    """(CPU storage, view function) of a tensor of ``shape`` holding ``values``
    in row-major order, stored as ``layout`` (flatten_cases.lay_out's, NaN
    padding included; kept here on the CPU whatever the test device, each
    check moving the storage to its own): ``offset``, one element into its
    storage; ``transposed``, the last two dims swapped in memory; ``strided``,
    every other element of a padded last dim."""
    if layout == "offset":
        owner = torch.full((values.numel() + 1,), math.nan, dtype=values.dtype)
        owner[1:] = values
        return owner, lambda o: o[1:].view(shape)
    if layout == "transposed":
        return values.reshape(shape).transpose(-1, -2).contiguous(), \
            lambda o: o.transpose(-1, -2)
    assert layout == "strided", layout
    owner = torch.full(tuple(shape[:-1]) + (2 * shape[-1] + 1,), math.nan, dtype=values.dtype)
    owner[..., 1::2] = values.reshape(shape)
    return owner, lambda o: o[..., 1::2]


def mixed_sizes(count, max_numel, seed):
    """``count`` sizes in 1..max_numel, spread among them the block edges that fit."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_numel + 1, (count,), generator=gen).tolist()
    edges = [s for s in EDGE_SIZES if s <= max_numel][:count]
    for k, size in enumerate(edges):
        sizes[k * (count // len(edges))] = size
    return sizes


def aligned_starts(sizes, element_size, gaps=(0, 3, 2048)):
    """Segment starts aligned to 16 bytes, as BucketPlan lays them out, after
    gaps of 0, a few, or a block of elements; and the end of the last one."""
    align = 16 // element_size
    starts, end = [], 0
    for i, n in enumerate(sizes):
        start = end + gaps[i % len(gaps)]
        start = -(-start // align) * align
        starts.append(start)
        end = start + n
    return starts, end


def odd_starts(sizes, gaps=(1, 2, 5, 2047, 2050)):
    """Segment starts that are all odd (never 16-byte aligned for any dtype)."""
    starts, end = [], 0
    for i, n in enumerate(sizes):
        start = end + gaps[i % len(gaps)]
        start += 1 - start % 2
        starts.append(start)
        end = start + n
    return starts, end


# ================================================================== the kernels


#: the large case's flatten scale (full mantissa: rounded to fp32 first) and its
#: unflattens' (destination dtype, scale): 1 and a power of two keep every tie a tie
LARGE_SCALE = 1 / 3
LARGE_UNFLATTEN = ((F16, 1.0), (BF16, 2.0 ** -3))


@functools.lru_cache(maxsize=1)
def large_case(n):
    """The large case's inputs and float64 references (CPU), built once for
    both backends (and kept, under 0.5 GiB): (fp16 input, its flatten, fp32
    buffer, its unflattens)."""
    src = wide_values(n, F16, 1, safe_bound(F16, F32, LARGE_SCALE))
    flat = make_values(Spec((n,), F32, seed=2, ties=True), safe_bound(F32, F16, 1.0), "")
    unflattened = {dtype: reference_unflatten(flat, [torch.empty(n, dtype=dtype)], scale,
                                              False)[0]
                   for dtype, scale in LARGE_UNFLATTEN}
    return src, reference_flatten([src], F32, LARGE_SCALE), flat, unflattened


def check_one_large_tensor(device, backend, n=LARGE):
    """One fp16 tensor of ``n`` elements flattened to fp32 times a full-mantissa
    scale; an fp32 buffer holding many exact fp16 and bf16 ties unflattened
    into fp16 and bf16 (round to nearest even decides each of them)."""
    src, flattened, flat_cpu, unflattened = large_case(n)
    x = src.to(device)

    def flatten(b):
        out = torch.full((n,), math.nan, dtype=F32, device=device)
        assert flatten_cast_scale([x], out, scale=LARGE_SCALE, backend=b) is out
        return [on_cpu(out)]

    assert_same_bits(both_ways(backend, flatten)[0], flattened, f"flatten of {n} fp16")

    flat = flat_cpu.to(device)
    for dtype, scale in LARGE_UNFLATTEN:
        def unflatten(b):
            dest = torch.full((n,), math.nan, dtype=dtype, device=device)
            unflatten_cast_scale(flat, [dest], scale=scale, backend=b)
            return [on_cpu(dest)]

        assert_same_bits(both_ways(backend, unflatten)[0], unflattened[dtype],
                         f"unflatten of {n} into {dtype}")


def many_tensors(count, max_numel, seed, bound):
    """``count`` tensors of odd sizes, fp16/bf16/fp32 mixed; some 2-D."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [(F16, BF16, F32)[k] for k in torch.randint(0, 3, (count,), generator=gen).tolist()]
    tensors = []
    for i, (n, dtype) in enumerate(zip(mixed_sizes(count, max_numel, seed), dtypes)):
        t = wide_values(n, dtype, seed * 100_003 + i, bound(dtype))
        tensors.append(t.view(3, n // 3) if n % 3 == 0 else t)
    return tensors


def check_many_tensors(device, backend, count=MANY, max_numel=MAX_NUMEL):
    """Thousands of tensors in one call each way: packed into fp32 and into bf16
    at aligned offsets with gaps, then back, plainly and accumulating."""
    scales = {"to_fp32": 0.1, "to_bf16": -3.0, "back": 4.0, "accumulate": -0.5}

    def bound(dtype):
        return min(safe_bound(dtype, F32, 0.1 * 4.0), safe_bound(dtype, BF16, 3.0))

    cpu = many_tensors(count, max_numel, 3, bound)
    tensors = on_device(cpu, device)
    total = sum(t.numel() for t in cpu)

    def packed(b):
        out = torch.full((total,), math.nan, dtype=F32, device=device)
        flatten_cast_scale(tensors, out, scale=scales["to_fp32"], backend=b)
        return [on_cpu(out)]

    flat_cpu = both_ways(backend, packed)[0]
    assert_same_bits(flat_cpu, reference_flatten(cpu, F32, scales["to_fp32"]),
                     f"{count} tensors packed into fp32")

    starts, end = aligned_starts([t.numel() for t in cpu], 2)
    size = end + 5

    def placed(b):
        out = torch.full((size,), math.nan, dtype=BF16, device=device)
        flatten_cast_scale(tensors, out, scale=scales["to_bf16"], offsets=starts, backend=b)
        return [on_cpu(out)]

    # the whole buffer: gaps and tail must be +0.0
    assert_same_bits(both_ways(backend, placed)[0],
                     reference_flatten(cpu, BF16, scales["to_bf16"], starts, size),
                     f"{count} tensors into bf16 at aligned offsets")

    flat = flat_cpu.to(device)

    def back(b):
        dests = [torch.full_like(t, math.nan) for t in tensors]
        unflatten_cast_scale(flat, dests, scale=scales["back"], backend=b)
        return [on_cpu(d) for d in dests]

    wanted = reference_unflatten(flat_cpu, cpu, scales["back"], False)
    for i, (got, want) in enumerate(zip(both_ways(backend, back), wanted)):
        assert_same_bits(got, want, f"unflatten, tensors[{i}] {want.dtype}")

    # accumulate: t + x * scale may be one FMA on the GPU, so it is compared
    # within accumulate_bound (and not between backends)
    dests = [t.clone() for t in tensors]
    unflatten_cast_scale(flat, dests, scale=scales["accumulate"], accumulate=True, backend=backend)
    wanted = reference_unflatten(flat_cpu, cpu, scales["accumulate"], True)
    products = reference_unflatten(flat_cpu, [torch.zeros(t.shape, dtype=F64) for t in cpu],
                                   scales["accumulate"], False)
    for i, (d, want, p) in enumerate(zip(dests, wanted, products)):
        assert_within(on_cpu(d), want, accumulate_bound(p, want, F32, d.dtype),
                      f"accumulate, tensors[{i}] {d.dtype}")


def check_unaligned(device, backend, big=UNALIGNED_BIG, count=40):
    """Inputs one element into their storage, segments at odd starts, ``out``
    1 (fp32) or 3 (fp16) elements into its storage and ``flat`` 3 into its own;
    every float dtype, fp64 -> fp16 (via fp32, as documented) included."""
    sizes = [big] + list(EDGE_SIZES) + mixed_sizes(count, 5000, 5)
    dtypes = [(F16, BF16, F32, F64)[i % 4] for i in range(len(sizes))]
    scale = 0.7  # full mantissa: rounded to fp32 except where fp64 is involved
    layouts = [cpu_layout(wide_values(n, d, 40 + i, safe_bound(d, F16, scale)), (n,), "offset")
               for i, (n, d) in enumerate(zip(sizes, dtypes))]
    cpu = [view(owner) for owner, view in layouts]
    tensors = [view(owner.to(device)) for owner, view in layouts]
    assert all(t.storage_offset() == 1 for t in tensors)
    starts, end = odd_starts(sizes)
    size = end + 3

    results = {}
    for dtype, shift in ((F32, 1), (F16, 3)):
        def flatten(b):
            storage = torch.full((shift + size + 8,), math.nan, dtype=dtype, device=device)
            out = storage[shift:shift + size]
            flatten_cast_scale(tensors, out, scale=scale, offsets=starts, backend=b)
            return [on_cpu(storage)]

        storage = both_ways(backend, flatten)[0]
        assert torch.isnan(storage[:shift]).all() and torch.isnan(storage[shift + size:]).all(), \
            "flatten wrote outside out"
        results[dtype] = storage[shift:shift + size]
        assert_same_bits(results[dtype], reference_flatten(cpu, dtype, scale, starts, size),
                         f"flatten into {dtype} at odd starts")

    flat_cpu = results[F32]
    flat = torch.cat([torch.full((3,), math.nan), flat_cpu]).to(device)[3:]
    assert flat.storage_offset() == 3

    def unflatten(b):
        owners = [torch.full((t.numel() + 1,), math.nan, dtype=t.dtype, device=device)
                  for t in cpu]
        unflatten_cast_scale(flat, [o[1:] for o in owners], scale=-2.5, offsets=starts,
                             backend=b)
        return [on_cpu(o) for o in owners]

    wanted = reference_unflatten(flat_cpu, cpu, -2.5, False, starts)
    for i, (owner, want) in enumerate(zip(both_ways(backend, unflatten), wanted)):
        assert torch.isnan(owner[0]), f"unflatten wrote before tensors[{i}]"
        assert_same_bits(owner[1:], want, f"unflatten from odd starts, tensors[{i}]")


def strided_layouts(side):
    """(CPU owner, view function) pairs of non-contiguous tensors: transposed,
    every other element, a permuted 3-D one, channels-last, and a
    ``side`` x ``side - 2`` transposed one of many blocks."""
    def channels_last(o):
        return o.permute(0, 3, 1, 2)  # an NHWC owner seen as NCHW

    layouts = []
    for i, (dtype, values_shape, layout) in enumerate([
            (F16, (37, 29), "transposed"), (BF16, (13, 5000), "strided"),
            (F32, (3, 2049), "strided"), (F64, (17, 3), "transposed"),
            (F32, (side, side - 2), "transposed")]):
        values = wide_values(math.prod(values_shape), dtype, 60 + i,
                             safe_bound(dtype, F32, 4.0))
        layouts.append(cpu_layout(values, values_shape, layout))
    owner = wide_values(4 * 6 * 9, BF16, 70, 1e4).view(6, 9, 4)
    layouts.append((owner, lambda o: o.permute(2, 0, 1)))
    owner = wide_values(2 * 7 * 5 * 3, F16, 71, 1e3).view(2, 5, 3, 7)
    layouts.append((owner, channels_last))
    return layouts


def check_noncontiguous(device, backend, side=TRANSPOSED_SIDE):
    """Non-contiguous inputs flattened, and non-contiguous destinations written
    without touching the memory between their elements."""
    layouts = strided_layouts(side)
    cpu = [view(owner) for owner, view in layouts]
    tensors = [view(owner.to(device)) for owner, view in layouts]
    assert not any(t.is_contiguous() for t in tensors), "the case needs non-contiguous tensors"
    total = sum(t.numel() for t in cpu)

    def flatten(b):
        return [on_cpu(flatten_cast_scale(tensors, dtype=F32, scale=-1.5, backend=b))]

    assert_same_bits(both_ways(backend, flatten)[0], reference_flatten(cpu, F32, -1.5),
                     "flatten of non-contiguous inputs")

    flat_cpu = wide_values(total, F32, 80, 1e4)
    flat = flat_cpu.to(device)

    def unflatten(b):
        owners = [torch.full_like(owner, math.nan).to(device) for owner, _ in layouts]
        unflatten_cast_scale(flat, [view(o) for o, (_, view) in zip(owners, layouts)],
                             scale=0.3, backend=b)
        return [on_cpu(o) for o in owners]

    wanted = reference_unflatten(flat_cpu, cpu, 0.3, False)
    for i, (owner, want, (template, view)) in enumerate(zip(both_ways(backend, unflatten),
                                                           wanted, layouts)):
        # the whole storage: the view's elements as the reference says, the
        # rest still the NaN it was filled with
        expected = torch.full_like(template, math.nan)
        view(expected).copy_(want)
        assert_same_bits(owner, expected, f"non-contiguous destination {i}")


def check_nonfinite_flag(device, backend, big=NONFINITE_BIG, count=200):
    """``check_finite`` on the device: true exactly when an input holds an inf
    or NaN, wherever it sits; an overflowing product of finite inputs is not one."""
    def cases():
        yield "finite", many_tensors(count, 3000, 9, lambda d: safe_bound(d, F16, 2.0)), F16
        big_inf = wide_values(big, F32, 10, 1e3)
        big_inf[-1] = math.inf
        yield "inf at the end of a large tensor", [big_inf], F32
        nan_last = many_tensors(count, 3000, 11, lambda d: 1e3)
        nan_last[-1].view(-1)[-1] = math.nan
        yield "NaN in the last element of the last tensor", nan_last, F32
        minus_inf = many_tensors(count, 3000, 12, lambda d: 1e3)
        minus_inf[count // 2].view(-1)[0] = -math.inf
        yield "-inf in a middle tensor", minus_inf, BF16
        huge = [torch.full((4099,), torch.finfo(F32).max), wide_values(77, F16, 13, 1.0)]
        yield "finite fp32 max overflowing fp16", huge, F16

    for name, cpu, dtype in cases():
        tensors = on_device(cpu, device)
        expected_flag = not all(bool(torch.isfinite(t).all()) for t in cpu)
        flat, found = flatten_cast_scale(tensors, dtype=dtype, scale=2.0, check_finite=True,
                                         backend=backend)
        assert found.dtype == torch.bool and found.shape == () and found.device == flat.device
        assert bool(found) == expected_flag, name
        assert_same_bits(on_cpu(flat), reference_flatten(cpu, dtype, 2.0), name)


def check_steady_state(device, backend, count=STEADY_COUNT):
    """The same flatten (and unflatten) called again with the same tensors runs
    the launch the first call kept, and follows new values and scales."""
    def bound(dtype):
        return safe_bound(dtype, F32, 8.0)

    cpu = many_tensors(count, 3000, 20, bound)
    strided = torch.full((64, 33), math.nan, dtype=F16)
    cpu.append(strided[:, 1::2])
    cpu[-1].copy_(wide_values(64 * 16, F16, 21, 1e3).view(64, 16))
    tensors = [cpu_t.to(device) for cpu_t in cpu[:-1]]
    tensors.append(strided.to(device)[:, 1::2])
    starts, end = aligned_starts([t.numel() for t in cpu], 4)
    out = torch.empty(end, dtype=F32, device=device)

    def kept(op, buffer):
        return _prepared.LAUNCHES._entries[(op, backend, id(buffer))]

    def counting(entry):
        launches = []
        real = entry.launch

        def counted(*args):
            launches.append(1)
            return real(*args)

        entry.launch = counted
        return launches

    flatten_cast_scale(tensors, out, scale=1.0, offsets=starts, backend=backend)
    entry = kept("flatten", out)
    launches = counting(entry)
    for step, scale in enumerate((0.5, -3.0, 1 / 7), start=1):
        for i, (c, t) in enumerate(zip(cpu, tensors)):
            c.copy_(wide_values(c.numel(), c.dtype, 1000 * step + i, bound(c.dtype)).view(c.shape))
            t.copy_(c)
        flatten_cast_scale(tensors, out, scale=scale, offsets=list(starts), backend=backend)
        assert_same_bits(on_cpu(out), reference_flatten(cpu, F32, scale, starts, end),
                         f"flatten, step {step}")
    assert len(launches) == 3 and kept("flatten", out) is entry, \
        "a steady-state flatten did not run the kept launch"

    flat = out.clone()
    unflatten_cast_scale(flat, tensors, scale=1.0, offsets=starts, backend=backend)
    entry = kept("unflatten", flat)
    launches = counting(entry)
    for step, scale in enumerate((2.0, -0.25, 1 / 3), start=1):
        flat_cpu = wide_values(end, F32, 2000 + step, 1e3)
        flat.copy_(flat_cpu)
        unflatten_cast_scale(flat, tensors, scale=scale, offsets=starts, backend=backend)
        wanted = reference_unflatten(flat_cpu, cpu, scale, False, starts)
        for i, (t, want) in enumerate(zip(tensors, wanted)):
            assert_same_bits(on_cpu(t), want, f"unflatten, step {step}, tensors[{i}]")
    assert len(launches) == 3 and kept("unflatten", flat) is entry, \
        "a steady-state unflatten did not run the kept launch"


def check_adasum_kernels(device, backend, big=ADASUM_BIG):
    """adasum_stats and adasum_combine on the device, every float dtype,
    segments of several AdaSum chunks and one of more than 256 1024-element
    blocks, against the float64 reference (adasum_cases.py's tolerance model);
    Triton's results within that tolerance of the torch fallback's (the
    backends' fp64 sums may differ in the last bits, docs/concepts/how-it-works.md)."""
    lengths = [5, 2 * ADASUM_CHUNK + 77, 0, big, 3, 1300]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    for k, dtype in enumerate((F16, BF16, F32, F64)):
        gen = torch.Generator().manual_seed(30 + k)
        a64 = torch.randn(bounds[-1], generator=gen, dtype=F64)
        # correlated: coefficients far from 1
        b64 = 1.5 * a64 + torch.randn(bounds[-1], generator=gen, dtype=F64)
        a, b = a64.to(dtype), b64.to(dtype)
        a_dev, b_dev = a.to(device), b.to(device)

        def run(chosen):
            stats = adasum_stats(a_dev, b_dev, bounds, backend=chosen)
            return stats, adasum_combine(a_dev, b_dev, bounds, stats, backend=chosen)

        stats, out = (on_cpu(t) for t in run(backend))
        expected_stats = reference_stats(a, b, bounds)
        x, y = a.double(), b.double()
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            # n fp64 additions (and fp64 products) each round by at most eps64
            budget = (hi - lo + 1) * EPS64
            sums = [(x[lo:hi] * y[lo:hi]).abs().sum(), (x[lo:hi] ** 2).sum(),
                    (y[lo:hi] ** 2).sum()]
            for j in range(3):
                assert abs(stats[i, j].item() - expected_stats[i, j].item()) \
                    <= budget * float(sums[j]), f"{dtype} segment {i} statistic {j}"
        expected, tolerance = reference_adasum(a, b, bounds)
        assert out.dtype == dtype
        assert_adasum_within(out, expected, tolerance, f"AdaSum of {dtype} on {device}")
        if backend != "torch":
            _, fallback = (on_cpu(t) for t in run("torch"))
            assert_adasum_within(out, fallback.double(), tolerance,
                                 f"{backend} vs the torch fallback, {dtype}")


@pytest.mark.cuda_only
@pytest.mark.timeout(TIMEOUT)
def test_one_tensor_of_2_25_plus_3_elements_each_way(device, backend):
    check_one_large_tensor(device, backend)


@pytest.mark.cuda_only
@pytest.mark.timeout(TIMEOUT)
def test_three_thousand_tensors_of_odd_sizes_and_mixed_dtypes(device, backend):
    check_many_tensors(device, backend)


@pytest.mark.cuda_only
def test_unaligned_storage_and_odd_segment_starts(device, backend):
    check_unaligned(device, backend)


@pytest.mark.cuda_only
def test_non_contiguous_inputs_and_destinations(device, backend):
    check_noncontiguous(device, backend)


@pytest.mark.cuda_only
def test_the_nonfinite_flag_on_the_device(device, backend):
    check_nonfinite_flag(device, backend)


@pytest.mark.cuda_only
def test_the_steady_state_runs_the_kept_launch_on_new_values(device, backend):
    check_steady_state(device, backend)


@pytest.mark.cuda_only
def test_adasum_kernels_on_the_device_match_the_float64_reference(device, backend):
    check_adasum_kernels(device, backend)


#: each kernel check at sizes the CPU suite runs in a few seconds in all
#: (each check's structure kept: edge sizes, gaps, strides, the non-finite
#: cases; the large ones a few Triton blocks long instead of thousands)
CPU_SIZES = {
    "one large tensor": (check_one_large_tensor, {"n": 2 ** 18 + 3}),
    "many tensors": (check_many_tensors, {"count": 300, "max_numel": 2000}),
    "unaligned": (check_unaligned, {"big": 2 ** 16 + 5}),
    "non-contiguous": (check_noncontiguous, {"side": 131}),
    "non-finite flag": (check_nonfinite_flag, {"big": 2 ** 16 + 1, "count": 50}),
    "steady state": (check_steady_state, {"count": 60}),
    "adasum kernels": (check_adasum_kernels, {"big": 2 * 1024 + 77}),
}


@pytest.mark.parametrize("name", list(CPU_SIZES))
def test_the_kernel_checks_hold_on_cpu_tensors_with_the_torch_fallback(name):
    check, sizes = CPU_SIZES[name]
    check(torch.device("cpu"), "torch", **sizes)


# ================================================================== the ranks


#: what the CPU suite leaves to the CUDA run: the DDP hooks' dozen training
#: runs on every rank, and the tree's run of two more ranks, would add about 20
#: CPU seconds there, and test_hooks.py and test_adasum.py cover both on CPU
#: gloo ranks
CUDA_ONLY_JOBS = ("hooks",)
CUDA_ONLY_RUNS = ("tree",)


def launch_ranks(kind):
    """The three runs of ranks, at once: ``one_rank`` (NCCL on the GPU, gloo on
    the CPU), ``two_ranks`` (gloo) and ``tree`` (gloo, AdaSum's tree); on the
    CPU without ``CUDA_ONLY_JOBS`` and ``CUDA_ONLY_RUNS``. A run that failed
    gives its error as text."""
    def spawn(fn, world_size, backend, *args, timeout=TIMEOUT, collective_timeout=60.0):
        try:
            return run_on_local_ranks(fn, world_size, *args, backend=backend, timeout=timeout,
                                      collective_timeout=collective_timeout)
        except (RankFailure, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    runs = {"one_rank": (1, "nccl" if kind == "cuda" else "gloo", one_rank_jobs()),
            "two_ranks": (2, "gloo", two_rank_jobs()), "tree": (2, "gloo", tree_jobs())}
    if kind != "cuda":
        runs = {name: (size, backend, {job: fn for job, fn in table.items()
                                       if job not in CUDA_ONLY_JOBS})
                for name, (size, backend, table) in runs.items() if name not in CUDA_ONLY_RUNS}
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {name: pool.submit(spawn, run_each, size, backend, kind, table)
                   for name, (size, backend, table) in runs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="session")
def rank_results(tmp_path_factory, device):
    return once_per_session(tmp_path_factory, "test_cuda-ranks",
                            lambda _: launch_ranks(device.type))


def gloo_refusal(text):
    """The line of ``text`` (a traceback) in which gloo refuses something, or None."""
    for line in text.splitlines():
        low = line.lower()
        if "gloo" in low and any(phrase in low for phrase in GLOO_REFUSALS):
            return line.strip()
    return None


def fail_or_skip(run, text):
    """Fail with ``text``; skip instead where gloo refused CUDA tensors for an
    operation (a limit of gloo, not of this library)."""
    refusal = gloo_refusal(text) if run != "one_rank" else None
    if refusal:
        pytest.skip(f"{run}: gloo refused an operation on these tensors: {refusal}")
    pytest.fail(text, pytrace=False)


def job_results(results, run, job):
    """Each rank's result of ``job`` in ``run``; fails with the ranks' tracebacks,
    or skips where gloo refused the CUDA tensors for an operation."""
    ranks = results[run]
    if isinstance(ranks, str):
        fail_or_skip(run, f"the {run} ranks failed:\n{ranks}")
    per_rank = [r[job] for r in ranks]
    for rank, result in enumerate(per_rank):
        if isinstance(result, str):
            fail_or_skip(run, f"{run}: {job} raised on rank {rank}:\n{result}")
    return per_rank


def assert_same_on_every_rank(per_rank, what):
    """Bitwise the same tensors (anywhere in nested lists/dicts) on every rank;
    what only rank 0 records (None elsewhere) is skipped."""
    def walk(a, b, where):
        if a is None or b is None:
            return
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), where
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{where}[{k!r}]")
        elif isinstance(a, (list, tuple)):
            for k, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{k}]")

    for rank in range(1, len(per_rank)):
        walk(per_rank[0], per_rank[rank], f"{what}: rank {rank} differs from rank 0 at")


# ---------------------------------------------------------------- float64 models


def mean_model(per_rank, wire, before, after, total):
    """The float64 reference of ``total * sum(per_rank)`` reduced by summing
    ``x * before`` in ``wire`` and multiplying by ``after``, its error bound,
    and — where the arithmetic leaves no freedom — the exact result.

    Bound: each addend rounds once to ``wire`` and each of the n - 1 additions
    once more, relative to the sum of magnitudes (or a subnormal step of
    ``wire``, scaled by ``after``); the product by ``after`` and the widening
    round in the compute dtype; the cast back rounds once to the gradient's
    dtype. eps, not eps / 2: a factor 2 of slack.

    Exact: one rank has no addition, and the sum of two ranks is one IEEE
    addition, which in fp32/fp64 is the float64 sum rounded once
    (reference.py); gloo's 16-bit sums are not specified that closely.
    """
    n, dtype = len(per_rank), per_rank[0].dtype
    values = [g.double() for g in per_rank]
    reference = sum(values) * total
    magnitude = sum(v.abs() for v in values) * abs(total)
    compute = F64 if F64 in (wire, dtype) else F32
    bound = (n * torch.finfo(wire).eps + 2 * torch.finfo(compute).eps) * magnitude \
        + n * subnormal_spacing(wire) * abs(after) \
        + torch.finfo(dtype).eps * reference.abs() + subnormal_spacing(dtype)
    exact = None
    if n == 1 or (n == 2 and wire in (F32, F64)):
        addends = [reference_flatten([g], wire, before) for g in per_rank]
        summed = addends[0] if n == 1 else (addends[0].double() + addends[1].double()).to(wire)
        exact = reference_unflatten(summed, [per_rank[0]], after, False)[0]
    return reference, bound, exact


def assert_mean(got, per_rank, wire, before, after, total, what):
    reference, bound, exact = mean_model(per_rank, wire, before, after, total)
    assert got.dtype == per_rank[0].dtype and got.shape == per_rank[0].shape, what
    excess = (got.double() - reference).abs() - bound
    assert not bool((excess > 0).any()), \
        f"{what}: |error| exceeds the bound by {float(excess.max()):.3g}"
    if exact is not None:
        assert_same_bits(got, exact, f"{what} (exact)")


def _tree_depth(n):
    return (n.bit_length() - 1) + (n & (n - 1) != 0)


def adasum_tolerance(expected, per_rank, local_size, dtype):
    """test_adasum.py's budget: each AdaSum rounds its coefficients, products
    and sum in fp32 (fp64 for fp64, where the fp64 statistics' own summation
    error, n·eps64 relative, is of the same order): <= 4 eps of the largest
    input per level, doubled for the block mean and the error carried through
    the next level's coefficients; then one rounding to the tensor's dtype,
    and an absolute subnormal step."""
    compute = F64 if dtype == F64 else F32
    eps_c = torch.finfo(compute).eps * (expected.numel() + 4 if dtype == F64 else 1)
    largest = sum(float(t.double().abs().max()) for t in per_rank if t.numel())
    levels = _tree_depth(len(per_rank) // local_size) + 1
    eps_d, tiny_d = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return 8 * levels * eps_c * largest + eps_d * expected.abs() + tiny_d * eps_d


# ---------------------------------------------------------------- the checks


def reducer_scales(dtype, world_size, kwargs):
    """(wire, before, after, total) of DistributedGradReducer with ``kwargs``,
    as the docs state them: 16-bit communication divides fully before the
    sum, wider communication after it."""
    wire = communication_dtype(dtype, kwargs.get("reduce_dtype", F32))
    degree = kwargs.get("degree", world_size)
    total = 1.0 / degree if kwargs.get("mean", True) else 1.0
    before = total if wire in (F16, BF16) else 1.0
    return wire, before, total / before, total


def check_reducer(results, run, kind):
    per_rank = job_results(results, run, "reducer")
    world_size = len(per_rank)
    assert_same_on_every_rank(per_rank, "reducer")
    locals_ = [gradients(r, "cpu") for r in range(world_size)]
    for name, kwargs, nonfinite in REDUCER_CONFIGS:
        for rank, result in enumerate(per_rank):
            got = result[name]
            assert got["inputs_unchanged"], f"{name}: rank {rank}'s inputs changed"
            assert got["devices"] == [kind], f"{name}: results on {got['devices']}"
            if kwargs.get("check_finite"):
                assert got["found_nonfinite"] is nonfinite, f"{name}: rank {rank}"
        if nonfinite:
            continue
        for i, got in enumerate(per_rank[0][name]["grads"]):
            addends = [grads[i] for grads in locals_]
            wire, before, after, total = reducer_scales(addends[0].dtype, world_size, kwargs)
            assert_mean(got, addends, wire, before, after, total, f"{name}: grads[{i}]")
    for i, (a, b) in enumerate(zip(per_rank[0]["mean"]["grads"],
                                   per_rank[0]["mean_torch"]["grads"])):
        assert_same_bits(a, b, f"reducer grads[{i}]: default backend vs torch")


def check_optimizer(results, run, kind):
    per_rank = job_results(results, run, "optimizer")
    world_size = len(per_rank)
    assert_same_on_every_rank(per_rank, "optimizer")
    start = [p.detach() for p in Net(**MIXED, seed=0).parameters()]
    for rank, result in enumerate(per_rank):
        assert result["device"] == kind
        for i, (got, want) in enumerate(zip(result["initial"], start)):
            assert_same_bits(got, want, f"rank {rank}'s weights[{i}] after the broadcast")
    for step, record in enumerate(per_rank[0]["steps"]):
        for i, got in enumerate(record["grads"]):
            addends = [record["local"][r][i] for r in range(world_size)]
            wire = communication_dtype(got.dtype, F32)
            assert_mean(got, addends, wire, 1.0, 1.0 / world_size, 1.0 / world_size,
                        f"step {step} grads[{i}]")


def check_broadcast(results, run):
    per_rank = job_results(results, run, "broadcast")
    for rank, result in enumerate(per_rank):
        for src, tensors in result.items():
            for i, (got, want) in enumerate(zip(tensors, broadcast_values(src, "cpu"))):
                what = f"rank {rank}, from {src}, tensors[{i}]"
                if want.is_floating_point():
                    assert_same_bits(got, want, what)
                else:
                    assert got.dtype == want.dtype and torch.equal(got, want), what


def hook_scales(hook_name, state_kwargs, dtype, world_size):
    """(wire, before) of a DDP run; None for AdaSum's tree (its own reference)."""
    if hook_name in (None, "torch_allreduce"):  # DDP's own: x / n in the bucket's dtype
        return dtype, 1.0 / world_size
    if hook_name == "allreduce":
        return communication_dtype(dtype, F32), 1.0 / world_size
    if hook_name in ("fp16", "bf16"):
        return {"fp16": F16, "bf16": BF16}[hook_name], 1.0 / world_size
    local_size = (state_kwargs or {}).get("local_size", 1)
    if local_size == world_size:  # the block mean is the whole AdaSum
        return communication_dtype(dtype, F32), 1.0 / local_size
    return None


def check_hook_runs(per_rank, runs, kind):
    assert_same_on_every_rank(per_rank, "DDP runs")
    world_size = len(per_rank)
    first = per_rank[0]
    for label, _, hook_name, state_kwargs in runs:
        assert first[label]["device"] == kind, label
        for step, record in enumerate(first[label]["steps"]):
            for i, got in enumerate(record["grads"]):
                addends = [record["local"][r][i] for r in range(world_size)]
                what = f"{label}: step {step} param {i} ({got.dtype})"
                scales = hook_scales(hook_name, state_kwargs, got.dtype, world_size)
                if scales is None:
                    expected = adasum_of_blocks(addends, 1).view(got.shape)
                    assert_adasum_within(got.reshape(-1), expected.reshape(-1), adasum_tolerance(
                        expected, addends, 1, got.dtype).reshape(-1), what)
                else:
                    wire, before = scales
                    assert_mean(got, addends, wire, before, 1.0, 1.0 / world_size, what)
            if hook_name == "adasum":
                for rank, result in enumerate(per_rank):
                    mine = result[label]["steps"][step]
                    for i, (a, b) in enumerate(zip(mine["grads"], mine["adasum_allreduce"])):
                        assert_same_bits(a, b, f"{label}: rank {rank} step {step} param {i}: "
                                               f"adasum_hook vs adasum_allreduce")


def assert_runs_equal(first, label_a, label_b):
    for step, (a, b) in enumerate(zip(first[label_a]["steps"], first[label_b]["steps"])):
        for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert_same_bits(ga, gb, f"{label_a} vs {label_b}: step {step} param {i}")
    for i, (pa, pb) in enumerate(zip(first[label_a]["params"], first[label_b]["params"])):
        assert_same_bits(pa, pb, f"{label_a} vs {label_b}: parameter {i} after training")


def check_hooks(results, run, kind):
    per_rank = job_results(results, run, "hooks")
    world_size = len(per_rank)
    runs = hook_runs(world_size)
    check_hook_runs(per_rank, runs, kind)
    first = per_rank[0]
    # allreduce_hook on an fp32 model: x * fp32(1/n) in the bucket, summed in
    # place, as DDP without a hook and torch's allreduce_hook: bitwise theirs,
    # every step and after training
    assert_runs_equal(first, "ddp", "allreduce")
    assert_runs_equal(first, "torch_allreduce", "allreduce")
    # the kernels' backends give bitwise the same casts
    assert_runs_equal(first, "allreduce_mixed", "allreduce_mixed_torch")
    assert_runs_equal(first, "fp16_mixed", "fp16_mixed_torch")
    dtypes = {g.dtype for g in first["allreduce_mixed"]["steps"][0]["grads"]}
    assert dtypes == {F16, BF16, F32, F64}


def check_adasum_collective(results, run, kind, local_size):
    """adasum_allreduce where the ranks' block mean is everything (one rank, or
    local_size = world size): bitwise the exact mean model, for both backends
    and bucket caps."""
    per_rank = job_results(results, run, "adasum")
    world_size = len(per_rank)
    assert local_size == world_size
    assert_same_on_every_rank(per_rank, "adasum_allreduce")
    locals_ = [adasum_gradients(r, "cpu") for r in range(world_size)]
    for rank, result in enumerate(per_rank):
        assert result["inputs_unchanged"] and result["devices"] == [kind], rank
    for backend in ADASUM_BACKENDS:
        for cap in ADASUM_CAPS:
            for i, got in enumerate(per_rank[0][backend, cap]):
                addends = [g[i] for g in locals_]
                wire = communication_dtype(got.dtype, F32)
                assert_mean(got, addends, wire, 1.0 / local_size, 1.0, 1.0 / local_size,
                            f"{backend}, cap {cap}: tensors[{i}]")


def kernel_tree_of_two(a, b, backend, device):
    """AdaSum of two ranks' whole tensors by the kernels on ``device``, in the
    communication dtype, cast back: what the tree computes, whatever the
    halving cut (docs/guides/adasum.md, "Canonical statistics")."""
    wide = F64 if a.dtype == F64 else F32
    x, y = a.reshape(-1).to(wide).to(device), b.reshape(-1).to(wide).to(device)
    n = x.numel()
    combined = adasum_combine(x, y, [0, n], adasum_stats(x, y, [0, n], backend=backend),
                              backend=backend)
    return on_cpu(combined.to(a.dtype)).view(a.shape)


def check_adasum_tree(results, device):
    per_rank = job_results(results, "tree", "adasum")
    assert_same_on_every_rank(per_rank, "adasum_allreduce")
    locals_ = [adasum_gradients(r, "cpu") for r in range(2)]
    for rank, result in enumerate(per_rank):
        assert result["inputs_unchanged"] and result["devices"] == [device.type], rank
    first = per_rank[0]
    for backend in ADASUM_BACKENDS:
        fused = first[backend, ADASUM_CAPS[0]]
        for cap in ADASUM_CAPS:
            for i, got in enumerate(first[backend, cap]):
                addends = [g[i] for g in locals_]
                what = f"{backend}, cap {cap}: tensors[{i}] {got.dtype}"
                expected = adasum_of_blocks(addends, 1)
                tolerance = adasum_tolerance(expected, addends, 1, got.dtype)
                assert got.dtype == addends[0].dtype and got.shape == addends[0].shape, what
                assert bool(((got.double() - expected).abs() <= tolerance).all()), what
                assert_same_bits(got, kernel_tree_of_two(*addends, backend, device),
                                 f"{what}: vs the kernels on the whole tensors")
                # the bucketing never changes a result, bitwise
                assert_same_bits(got, fused[i], f"{what}: vs one bucket")
    # the backends' statistics may differ in the last bits (docs, "Numerics"): Triton's
    # result within the float64 reference's tolerance of the fallback's
    for i, (a, b) in enumerate(zip(first["triton", ADASUM_CAPS[0]],
                                   first["torch", ADASUM_CAPS[0]])):
        addends = [g[i] for g in locals_]
        tolerance = adasum_tolerance(adasum_of_blocks(addends, 1), addends, 1, a.dtype)
        assert bool(((a.double() - b.double()).abs() <= tolerance).all()), \
            f"tensors[{i}]: triton vs torch"


def check_adasum_hook_tree(results, kind):
    per_rank = job_results(results, "tree", "hooks")
    check_hook_runs(per_rank, hook_runs(1, with_baselines=False), kind)


RUNS = ["one_rank", "two_ranks"]


@pytest.mark.device_aware
@pytest.mark.parametrize("run", RUNS)
def test_the_reducer_gives_the_float64_mean(rank_results, device, run):
    check_reducer(rank_results, run, device.type)


@pytest.mark.device_aware
@pytest.mark.parametrize("run", RUNS)
def test_the_distributed_optimizer_broadcasts_and_steps_on_the_float64_mean(rank_results,
                                                                             device, run):
    check_optimizer(rank_results, run, device.type)


@pytest.mark.device_aware
@pytest.mark.parametrize("run", RUNS)
def test_join_with_uneven_inputs_leaves_every_rank_the_same_weights(rank_results, device, run):
    """``Join([optimizer])`` where rank r runs STEPS - r steps, unsharded and
    sharded: every rank ends with the same weights, trained, on the device,
    and the last joiner's step count."""
    per_rank = job_results(rank_results, run, "join")
    untrained = [p.detach() for p in Net(**MIXED, seed=0).parameters()]
    for mode in ("replicated", "sharded"):
        results = [r[mode] for r in per_rank]
        assert_same_on_every_rank([r["params"] for r in results], f"join, {mode}")
        assert [r["steps"] for r in results] == [STEPS] * len(results), mode
        assert all(r["device"] == device.type for r in results), mode
        assert any(not torch.equal(p.cpu(), q) for p, q in zip(results[0]["params"], untrained))
        assert all(torch.isfinite(p).all() for p in results[0]["params"]), mode


@pytest.mark.device_aware
@pytest.mark.parametrize("run", RUNS)
def test_the_sharded_optimizer_steps_as_the_unsharded_one(rank_results, device, run):
    """shard=True (gloo: all-reduce and one broadcast per rank; NCCL: a
    reduce-scatter and an all-gather, in place) and shard_gradients=True on
    the device: fp32 weights bitwise the unsharded AdamW's (elementwise on
    slices; at 1 and 2 ranks the reduced gradient is the same sum), and
    shard_gradients bitwise shard=True for the mixed-dtype model too, with a
    .grad exactly on the parameters each rank owns elements of; one-file-per-rank
    checkpoints load back on the device, equal to the whole state; the whole
    state_dict()'s tensors sit where the unsharded optimizer's do (moments on
    the device, the non-capturable step on the host), and with
    cpu_offload=True all on the host, from where it loads back onto the
    device."""
    per_rank = job_results(rank_results, run, "sharded")
    assert_same_on_every_rank(per_rank, "sharded")
    for rank, result in enumerate(per_rank):
        for step in range(len(result["fp32_unsharded"]["params"])):
            for i, (a, b, c) in enumerate(zip(result["fp32_unsharded"]["params"][step],
                                              result["fp32_sharded"]["params"][step],
                                              result["fp32_grads_sharded"]["params"][step])):
                assert_same_bits(b, a, f"rank {rank} step {step} fp32 weights[{i}] sharded")
                assert_same_bits(c, a, f"rank {rank} step {step} fp32 weights[{i}] "
                                       f"grads sharded")
            for i, (b, c) in enumerate(zip(result["mixed_sharded"]["params"][step],
                                           result["mixed_grads_sharded"]["params"][step])):
                assert_same_bits(c, b, f"rank {rank} step {step} mixed weights[{i}]")
        for name in ("fp32_grads_sharded", "mixed_grads_sharded"):
            for seen in result[name]["held"]:
                assert seen["held"] == seen["owns"], (rank, name, seen)
        if len(per_rank) > 1:
            assert not all(result["fp32_grads_sharded"]["held"][0]["held"])
        # one file per rank: host copies loaded back into another layout on the device
        for model_name in ("fp32", "mixed"):
            checkpoint = dict(result[f"{model_name}_checkpoint"])
            placed = checkpoint.pop("placement")
            assert checkpoint == {"equal": True, "on_device": True, "offloaded": True,
                                  "host_dict_loads": True}, \
                (rank, model_name)
            unsharded = result[f"{model_name}_placement"]
            assert {k: v for k, v in placed.items() if k[1] != "master_weight"} == unsharded, \
                (rank, model_name, placed, unsharded)
            assert {v for k, v in placed.items() if k[1] == "master_weight"} <= {device.type}


@pytest.mark.device_aware
@pytest.mark.parametrize("run", RUNS)
def test_broadcast_tensors_copies_the_source_bitwise(rank_results, run):
    check_broadcast(rank_results, run)


@pytest.mark.cuda_only
@pytest.mark.parametrize("run", RUNS)
def test_ddp_hooks_match_ddp_torch_s_hook_and_the_float64_mean(rank_results, device, run):
    check_hooks(rank_results, run, device.type)


@pytest.mark.device_aware
@pytest.mark.parametrize("run,local_size", [("one_rank", 1), ("two_ranks", 2)])
def test_adasum_allreduce_of_one_block_is_its_exact_mean(rank_results, device, run, local_size):
    check_adasum_collective(rank_results, run, device.type, local_size)


@pytest.mark.cuda_only
def test_adasum_allreduce_on_two_ranks_matches_the_float64_tree_and_the_kernels(rank_results,
                                                                                 device):
    check_adasum_tree(rank_results, device)


@pytest.mark.cuda_only
def test_adasum_hook_on_two_ranks_is_adasum_allreduce_and_the_float64_tree(rank_results,
                                                                             device):
    check_adasum_hook_tree(rank_results, device.type)
