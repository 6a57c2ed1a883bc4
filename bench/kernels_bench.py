"""Kernel benchmark: ``flatten_cast_scale`` / ``unflatten_cast_scale`` against plain torch.

For each tensor list (``resnet50``, ``transformer``: ``bench/models.py``,
scaled to each ``--sizes`` entry), input dtype and scale there are two cases:

``flatten``: the gradients (``--dtype``) into one flat fp32 buffer, scaled.

- ``copy`` (reference): one ``dst.copy_(src)`` of a single tensor holding every
  element, the same input and output dtypes, into a preallocated ``dst``: the
  bandwidth of one big cast-copy, measured in the same run. Every row's
  ``ratio`` is ``copy`` time / its time, so 1.0 means "as fast as that copy".
- ``naive`` (baseline): ``torch._utils._flatten_dense_tensors(ts).float().mul_(scale)``.
- ``views_then_scale`` (baseline): a preallocated flat buffer, one ``copy_``
  per tensor into its slice, then one ``mul_`` (skipped at scale 1: nobody
  writes a multiply by one, and a baseline should be the best a hand-written
  loop does).
- ``torch_foreach`` (baseline): ``torch._foreach_copy_`` into the slices,
  then one ``mul_`` of the buffer (skipped at scale 1). The slices are kept
  in the tensors' own shapes: on the 2-core CPU that copy took about 0.9x
  the time of the same copy between 1-D views, so it is the stronger form.
- ``torch_cat`` (baseline): ``torch.cat(inputs, out=buffer)``, which casts
  while it concatenates (one op; on CUDA one batched kernel), then one
  ``mul_`` (skipped at scale 1).
- ``torch_chunk_cat`` (baseline): ``torch._chunk_cat(inputs, 0, 1,
  out=buffer)``, FSDP2's copy-in (one kernel on CUDA that also casts), then
  one ``mul_`` (skipped at scale 1).
- ``fusedreduce`` (ours): ``flatten_cast_scale(ts, out, scale=s)`` into a
  preallocated buffer reused every call, the way the library calls it: each
  call recognises its layout (every tensor's address and metadata read).
- ``fusedreduce_prepared`` (ours): ``prepare_flatten(ts, out)`` made once,
  then ``handle(scale=s)`` each call: the same launch with no per-tensor
  work, the contract of the baselines above, which keep their views.
- ``fusedreduce_fresh_out`` (ours): the same with ``out=None``, so the cost
  of a new buffer (allocation, page faults, freeing it) shows.
- ``fusedreduce_int8`` and ``fusedreduce_float8`` (ours): the same gradients
  quantized in the flatten pass for the wire, ``quantize_flatten`` into kept
  int8 / float8_e4m3fn codes and fp32 block scales (``WIRE_BLOCK``): beside
  ``fusedreduce``, what quantizing adds to the plain flatten (their time over
  ``fusedreduce``'s is the ratio the docs quote).

``unflatten``: an fp32 flat buffer back into tensors of the input dtype, scaled:
``copy`` (the fp32 -> dtype copy), ``naive``
(``_unflatten_dense_tensors(flat * s, ts)`` then one ``copy_`` per tensor),
``scale_then_views`` (one ``mul`` unless s is 1, then one ``copy_`` per
tensor), ``torch_foreach`` (``_foreach_copy_`` out of the views, in the
outputs' shapes as above, then
``_foreach_mul_`` of the outputs unless s is 1: what a loop over
``_foreach_*`` ops writes, though into 16 bits it rounds twice),
``torch_scale_then_foreach`` (only where s is not 1: one ``torch.mul(flat, s,
out=scratch)`` into a kept fp32 buffer, then ``_foreach_copy_`` out of its
views: one rounding, and on the CPU much faster than a 16-bit
``_foreach_mul_``), ``torch_split_copy`` (only where the
outputs have the buffer's dtype: ``torch.split_with_sizes_copy(flat, sizes,
out=views)``, what FSDP2 copies out with, then ``_foreach_mul_`` unless s is
1), ``fusedreduce`` (``unflatten_cast_scale(flat, ts, scale=s)``) and
``fusedreduce_prepared`` (``prepare_unflatten(flat, ts)`` once, then
``handle(scale=s)``).

``fusedreduce_host`` (host cost, flatten and unflatten): what the host spends
per steady-state call on the Triton path, the kernel's execution excluded
(``host_cost.py``: on CUDA an unsynchronised call, on the CPU a child process
under Triton's interpreter with the kernel's run made a no-op);
``fusedreduce_host_moved``: the same when every call's tensors sit at other
addresses (gradients set to None and allocated again), alternating between
two address sets, which the kept launch keeps a binding for;
``fusedreduce_host_new``: the same at addresses it has not kept, re-pointing
it from scratch; ``fusedreduce_host_prepared``: a prepared handle's call
(``prepare_flatten`` / ``prepare_unflatten`` made once), which checks no
layout. Their ``ms`` is host time; they have no bandwidth or ratio,
and the summary leaves them out.

Every method counts the same bytes: each element read once in one dtype and
written once in the other (``n * (in_size + out_size)``), so ``gbps`` is the
effective bandwidth, not the traffic a method really causes (``naive`` moves
the data three times).

Before timing, each method runs once as the warm-up and its result is checked
against the reference, so a number is never reported for a wrong answer. On
the CPU each method is then timed ``--repeats`` times with ``perf_counter``,
round-robin across methods; on CUDA ``timing.time_on_device`` times each
one's GPU work alone, round-robin, L2 flushed between calls, each call queued
behind a spin kernel so that the host's launch cost never shows in the device
figure (it is the ``fusedreduce_host`` row's; a loop of calls runs at the
larger of the two).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fusedreduce.kernels import (WIRE_BLOCK, dequantize_sum, flatten_cast_scale, quantize_flatten,
                                 triton_available, unflatten_cast_scale, wire_scale_count)

try:
    from fusedreduce.kernels import prepare_flatten, prepare_unflatten
except ImportError:  # a library revision from before the handles: the versus tools run
    prepare_flatten = prepare_unflatten = None  # this bench code on older libraries

from . import common, host_cost, timing
from .models import TENSOR_LISTS, Shape

FLAT_DTYPE = torch.float32
SCALES = (1 / 8, 1.0)
QUICK_SCALES = (1 / 8,)
DIRECTIONS = ("flatten", "unflatten")
DTYPE_CHOICES = ("float16", "bfloat16", "float32")
DEFAULT_DTYPES = ["float16", "bfloat16"]
QUICK_DTYPES = ["float16"]
DEFAULT_SIZES = [1_000_000, 4_000_000, 25_600_000]
QUICK_SIZES = [250_000, 1_000_000]
ROLES = {"copy": "reference", "naive": "baseline", "views_then_scale": "baseline",
         "scale_then_views": "baseline", "torch_foreach": "baseline", "torch_cat": "baseline",
         "torch_scale_then_foreach": "baseline",
         "torch_chunk_cat": "baseline",
         "torch_split_copy": "baseline", "fusedreduce": "ours",
         "fusedreduce_prepared": "ours",
         "fusedreduce_fresh_out": "ours", "fusedreduce_int8": "ours",
         "fusedreduce_float8": "ours", "fusedreduce_host": "host",
         "fusedreduce_host_moved": "host", "fusedreduce_host_new": "host",
         "fusedreduce_host_prepared": "host"}
HOST_METHOD = "fusedreduce_host"
HOST_MOVED_METHOD = "fusedreduce_host_moved"
HOST_NEW_METHOD = "fusedreduce_host_new"
HOST_PREPARED_METHOD = "fusedreduce_host_prepared"
#: each host row's method by the suffix of its ``host_cost`` key
HOST_METHODS = {"": HOST_METHOD, host_cost.MOVED_SUFFIX: HOST_MOVED_METHOD,
                host_cost.NEW_SUFFIX: HOST_NEW_METHOD,
                host_cost.PREPARED_SUFFIX: HOST_PREPARED_METHOD}
#: what the ``timer`` of a CUDA run's config says
DEVICE_TIMER = "device time alone (CUDA events, call queued behind a spin kernel, L2 flushed)"
BASELINE = "copy"
#: the wire methods' code dtypes, and the largest error of a dequantized
#: element as a fraction of the largest magnitude (int8: half a step of
#: absmax / 127; e4m3: 2^-4 of the value, 3 mantissa bits)
WIRE_METHODS = {"fusedreduce_int8": (torch.int8, 1 / 254),
                "fusedreduce_float8": (torch.float8_e4m3fn, 1 / 16)}


class Workload:
    """One tensor list in one dtype on one device, with every buffer the methods
    read or write allocated once, outside the timed calls."""

    def __init__(self, name: str, shapes: Sequence[Shape], dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.dtype, self.device = name, dtype, device
        self.tensors = [torch.randn(shape, device=device).to(dtype) for shape in shapes]
        self.numels = [t.numel() for t in self.tensors]
        self.n_elements = sum(self.numels)
        self.bytes = self.n_elements * (dtype.itemsize + FLAT_DTYPE.itemsize)
        self.inputs = [t.view(-1) for t in self.tensors]
        # flatten: the copy reference's single tensor, and the flat buffer with its slices
        self.src = torch.cat(self.inputs)
        self.copy_dst = torch.empty(self.n_elements, dtype=FLAT_DTYPE, device=device)
        self.out = torch.empty(self.n_elements, dtype=FLAT_DTYPE, device=device)
        self.slices = list(torch.split(self.out, self.numels))
        # the same slices in the tensors' shapes: torch_foreach's stronger form
        self.shaped_slices = [s.view(t.shape) for s, t in zip(self.slices, self.tensors)]
        # the wire methods: codes of whole blocks, the tensors packed from 0
        padded = -(-self.n_elements // WIRE_BLOCK) * WIRE_BLOCK
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.codes = {dtype: torch.empty(padded, dtype=dtype, device=device)
                      for dtype, _ in WIRE_METHODS.values()}
        self.block_scales = torch.empty(wire_scale_count(padded, torch.int8), device=device)
        # unflatten: an fp32 flat buffer into tensors of the input dtype
        self.flat = torch.randn(self.n_elements, device=device)
        self.flat_views = list(torch.split(self.flat, self.numels))
        self.scratch = torch.empty_like(self.flat)
        self.scratch_views = list(torch.split(self.scratch, self.numels))
        self.shaped_flat_views = [v.view(t.shape) for v, t in zip(self.flat_views, self.tensors)]
        self.shaped_scratch_views = [v.view(t.shape)
                                     for v, t in zip(self.scratch_views, self.tensors)]
        self.back_dst = torch.empty(self.n_elements, dtype=dtype, device=device)
        self.dsts = [torch.empty_like(t) for t in self.tensors]
        self.dst_views = [t.view(-1) for t in self.dsts]


def flatten_methods(w: Workload, scale: float) -> Dict[str, Callable[[], object]]:
    """The flatten methods as zero-argument calls, each returning what it wrote."""

    def copy():
        return w.copy_dst.copy_(w.src)

    def naive():
        return _flatten_dense_tensors(w.tensors).to(FLAT_DTYPE).mul_(scale)

    def views_then_scale():
        for view, t in zip(w.slices, w.inputs):
            view.copy_(t)
        return w.out.mul_(scale) if scale != 1.0 else w.out

    def torch_foreach():
        torch._foreach_copy_(w.shaped_slices, w.tensors)
        return w.out.mul_(scale) if scale != 1.0 else w.out

    def torch_cat():
        torch.cat(w.inputs, out=w.out)
        return w.out.mul_(scale) if scale != 1.0 else w.out

    def torch_chunk_cat():
        torch._chunk_cat(w.inputs, 0, 1, out=w.out.view(1, -1))
        return w.out.mul_(scale) if scale != 1.0 else w.out

    def fusedreduce():
        return flatten_cast_scale(w.tensors, w.out, scale=scale)

    prepared = prepare_flatten(w.tensors, w.out) if prepare_flatten else None

    def fusedreduce_prepared():
        return prepared(scale=scale)

    def fusedreduce_fresh_out():
        return flatten_cast_scale(w.tensors, dtype=FLAT_DTYPE, scale=scale)

    def wire(dtype):
        def quantized():
            quantize_flatten(w.tensors, w.codes[dtype], w.block_scales, scale=scale,
                             offsets=w.offsets)
            return w.codes[dtype], w.block_scales
        return quantized

    return {"copy": copy, "naive": naive, "views_then_scale": views_then_scale,
            "torch_foreach": torch_foreach, "torch_cat": torch_cat,
            "torch_chunk_cat": torch_chunk_cat, "fusedreduce": fusedreduce,
            **({"fusedreduce_prepared": fusedreduce_prepared} if prepared else {}),
            "fusedreduce_fresh_out": fusedreduce_fresh_out,
            **{name: wire(dtype) for name, (dtype, _) in WIRE_METHODS.items()}}


def unflatten_methods(w: Workload, scale: float) -> Dict[str, Callable[[], object]]:
    """The unflatten methods as zero-argument calls, each returning what it wrote."""

    def copy():
        return w.back_dst.copy_(w.flat)

    def naive():
        for dst, view in zip(w.dsts, _unflatten_dense_tensors(w.flat * scale, w.dsts)):
            dst.copy_(view)
        return w.dsts

    def scale_then_views():
        flat = w.flat * scale if scale != 1.0 else w.flat
        for dst, view in zip(w.dst_views, torch.split(flat, w.numels)):
            dst.copy_(view)
        return w.dsts

    def torch_foreach():
        torch._foreach_copy_(w.dsts, w.shaped_flat_views)
        if scale != 1.0:
            torch._foreach_mul_(w.dsts, scale)
        return w.dsts

    def torch_scale_then_foreach():
        torch.mul(w.flat, scale, out=w.scratch)
        torch._foreach_copy_(w.dsts, w.shaped_scratch_views)
        return w.dsts

    def torch_split_copy():
        torch.split_with_sizes_copy(w.flat, w.numels, out=w.dst_views)
        if scale != 1.0:
            torch._foreach_mul_(w.dst_views, scale)
        return w.dsts

    def fusedreduce():
        unflatten_cast_scale(w.flat, w.dsts, scale=scale)
        return w.dsts

    prepared = prepare_unflatten(w.flat, w.dsts) if prepare_unflatten else None

    def fusedreduce_prepared():
        prepared(scale=scale)
        return w.dsts

    fns = {"copy": copy, "naive": naive, "scale_then_views": scale_then_views,
           "torch_foreach": torch_foreach, "torch_scale_then_foreach": torch_scale_then_foreach,
           "torch_split_copy": torch_split_copy, "fusedreduce": fusedreduce,
           **({"fusedreduce_prepared": fusedreduce_prepared} if prepared else {})}
    if scale == 1.0:  # torch_foreach without its multiply
        del fns["torch_scale_then_foreach"]
    if w.dtype != FLAT_DTYPE:  # split_with_sizes_copy cannot cast
        del fns["torch_split_copy"]
    return fns


METHODS = {"flatten": flatten_methods, "unflatten": unflatten_methods}


def check(w: Workload, scale: float, direction: str, name: str, result) -> None:
    """Raise unless ``result`` (what method ``name`` returned) is the right answer."""
    if direction == "flatten":
        expected = w.src.to(FLAT_DTYPE) * (1.0 if name == "copy" else scale)
        if name in WIRE_METHODS:
            codes, block_scales = result
            result = torch.empty(codes.numel(), device=codes.device)
            dequantize_sum(codes.view(1, -1), block_scales.view(1, -1), result)
            result = result[:w.n_elements]
            bound = WIRE_METHODS[name][1] * float(expected.abs().max()) * (1 + 2 ** -10)
            if not bool(((result - expected).abs() <= bound).all()):
                raise AssertionError(f"method {name} gave a dequantized flatten more than "
                                     f"{bound:.3g} away on {w.name}")
            return
    else:
        result = result if name == "copy" else torch.cat([t.view(-1) for t in result])
        expected = (w.flat * (1.0 if name == "copy" else scale)).to(w.dtype)
    try:
        torch.testing.assert_close(result, expected)
    except AssertionError as error:
        raise AssertionError(f"method {name} gave a wrong {direction} result on {w.name} "
                             f"{common.dtype_name(w.dtype)} scale={scale}: {error}") from None


def case_name(w: Workload, direction: str, scale: float) -> str:
    dtypes = [common.dtype_name(w.dtype), common.dtype_name(FLAT_DTYPE)]
    if direction == "unflatten":
        dtypes.reverse()
    return f"{w.name} {direction} {'->'.join(dtypes)} x{scale:g}"


def measure(w: Workload, size: int, scale: float, direction: str, repeats: int,
            host_ms: Optional[Dict[str, Sequence[float]]] = None) -> List[dict]:
    """Check and time every method of ``direction`` on ``w`` at ``scale``; one record
    each, and one of each host row in ``host_ms`` ({method: samples in ms},
    the methods of ``HOST_METHODS``)."""
    fns = METHODS[direction](w, scale)
    for name, fn in fns.items():
        check(w, scale, direction, name, fn())  # doubles as the warm-up
    timing.synchronize(w.device)
    if w.device.type == "cuda":
        samples = timing.time_on_device(fns, repeats, w.device)
    else:
        samples = timing.time_interleaved(fns, repeats, w.device)
    dtype_in, dtype_out = ((w.dtype, FLAT_DTYPE) if direction == "flatten"
                           else (FLAT_DTYPE, w.dtype))
    extra = dict(list=w.name, direction=direction, dtype=common.dtype_name(w.dtype),
                 dtype_in=common.dtype_name(dtype_in), dtype_out=common.dtype_name(dtype_out),
                 scale=scale)
    records = [common.result(
        "kernels", case_name(w, direction, scale), size, name, ROLES[name], BASELINE, 1,
        len(w.tensors), w.n_elements, w.bytes, samples, **extra) for name in fns]
    for method, host_samples in (host_ms or {}).items():
        if not host_samples:
            continue
        record = common.result("kernels", case_name(w, direction, scale), size, method,
                               ROLES[method], BASELINE, 1, len(w.tensors), w.n_elements,
                               w.bytes, {method: host_samples, BASELINE: samples[BASELINE]},
                               **extra)
        # host time is no bandwidth, and no match for the copy's time
        record.update(gbps=None, ratio=None, host_us=record["time_ms"] * 1e3)
        records.append(record)
    return records


def n_steps(config: dict) -> int:
    """How many progress steps ``run`` takes."""
    return (len(config["lists"]) * len(config["sizes"]) * len(config["dtypes"])
            * len(config["scales"]) * len(DIRECTIONS))


def run(config: dict, device: torch.device, progress: common.Progress) -> List[dict]:
    """Every case of ``config`` (``lists``, ``sizes``, ``dtypes``, ``scales``,
    ``repeats``) on ``device``: the result records."""
    results: List[dict] = []
    host = _host_samples_on_cpu(config) if device.type == "cpu" else {}
    for list_name in config["lists"]:
        for size in config["sizes"]:
            shapes = TENSOR_LISTS[list_name](size)
            for dtype in config["dtypes"]:
                workload = Workload(list_name, shapes, common.DTYPES[dtype], device)
                for scale in config["scales"]:
                    for direction in DIRECTIONS:
                        key = host_cost.case_key(list_name, size, dtype, direction, scale)
                        if device.type == "cuda":
                            for suffix, sets in host_cost.ADDRESS_SETS.items():
                                host[key + suffix] = host_cost.time_host(
                                    workload.tensors, workload.out, workload.dsts, direction,
                                    scale, address_sets=sets)
                            if prepare_flatten:
                                host[key + host_cost.PREPARED_SUFFIX] = host_cost.time_host(
                                    workload.tensors, workload.out, workload.dsts, direction,
                                    scale, prepared=True)
                        with progress.step(f"kernels: {case_name(workload, direction, scale)}, "
                                           f"{workload.n_elements:,} elements"):
                            results += measure(
                                workload, size, scale, direction, config["repeats"],
                                {method: host.get(key + suffix)
                                 for suffix, method in HOST_METHODS.items()})
                del workload  # freed before the next one is built
    return results


def _host_samples_on_cpu(config: dict) -> dict:
    """Every case's host cost, from one child process under Triton's interpreter
    (``host_cost.py``); ``{}`` without Triton."""
    if not triton_available():
        common.log("kernels: Triton cannot be imported here, so the fusedreduce_host rows "
                   "(the Triton path's host cost) are left out")
        return {}
    cases = [{"list": list_name, "size": size, "dtype": dtype, "directions": list(DIRECTIONS),
              "scales": list(config["scales"])}
             for list_name in config["lists"] for size in config["sizes"]
             for dtype in config["dtypes"]]
    return host_cost.host_samples_on_cpu(cases)
