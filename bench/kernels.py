"""Kernel benchmark: ``flatten_cast_scale`` / ``unflatten_cast_scale`` against plain torch.

For each tensor list, input dtype and scale, every method below moves the same
gradients into (or out of) one flat fp32 buffer:

- ``copy``: one ``dst.copy_(src)`` of a single tensor with every element, the
  same input and output dtypes, into a preallocated ``dst``: the bandwidth
  baseline. ``ratio_to_copy`` is ``copy`` time / method time from the same run,
  so 1.0 means "as fast as one big cast-copy".
- ``naive``: ``torch._utils._flatten_dense_tensors(ts).float().mul_(scale)``.
- ``views_then_scale``: a preallocated flat buffer, one ``copy_`` per tensor
  into its slice, then one ``mul_`` (skipped at scale 1: nobody writes a
  multiply by one, and the baseline should be the best a hand-written loop does).
- ``fusedreduce``: ``flatten_cast_scale(ts, out, scale=s)`` into a preallocated
  buffer reused every call, the way the library calls it.
- ``fusedreduce_fresh_out``: the same with ``out=None``, so the cost of a new
  buffer (allocation, page faults, freeing it) shows.
- ``fusedreduce_unflatten``: ``unflatten_cast_scale(flat, ts, scale=s)``, the
  inverse direction, fp32 flat buffer into tensors of the input dtype.
- ``torch_foreach`` (CUDA only): ``torch._foreach_copy_`` into the slices, then
  ``torch._foreach_mul_`` (skipped at scale 1), torch's own multi-tensor path.

Every method counts the same bytes: each element read once in one dtype and
written once in the other (``n * (in_size + out_size)``), so ``gbps`` is the
effective bandwidth, not the traffic a method really causes (``naive`` moves
the data three times).

Before timing, each method runs once as the warm-up and its result is checked
against the reference, so a number is never reported for a wrong answer. On
the CPU each method is then timed ``--repeats`` times with ``perf_counter``,
round-robin across methods; on CUDA ``triton.testing.do_bench`` times each
one (L2 flushed between calls). ``time_ms`` is the median call, the one every
derived number uses; ``time_ms_min`` the fastest, the least disturbed when
other work shares the machine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors

from fusedreduce.kernels import flatten_cast_scale, resolve_backend, unflatten_cast_scale

from . import common

Shape = Tuple[int, ...]

OUT_DTYPE = torch.float32
SCALES = (1 / 8, 1.0)
DTYPE_CHOICES = ("float16", "bfloat16", "float32")
METHODS = ("copy", "naive", "views_then_scale", "fusedreduce", "fusedreduce_fresh_out",
           "fusedreduce_unflatten")
CUDA_METHODS = METHODS + ("torch_foreach",)


def resnet50_shapes(width: int = 64, num_classes: int = 1000) -> List[Shape]:
    """The parameter shapes of torchvision's ResNet-50, in ``named_parameters`` order.

    161 tensors and 25,557,032 elements at the defaults. Bottleneck blocks
    (1x1, 3x3, 1x1 convolutions, each followed by batch-norm weight and bias)
    in four stages of 3, 4, 6 and 3 blocks; the first block of each stage has a
    1x1 downsample convolution and its batch norm. A smaller ``width`` keeps
    the 161 tensors and their proportions with fewer elements.
    """
    shapes: List[Shape] = [(width, 3, 7, 7), (width,), (width,)]
    inplanes = width
    for planes, blocks in ((width, 3), (2 * width, 4), (4 * width, 6), (8 * width, 3)):
        outplanes = 4 * planes
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (outplanes, planes, 1, 1), (outplanes,), (outplanes,)]
            if block == 0:
                shapes += [(outplanes, inplanes, 1, 1), (outplanes,), (outplanes,)]
            inplanes = outplanes
    return shapes + [(num_classes, inplanes), (num_classes,)]


def transformer_shapes(d_model: int = 384, n_layers: int = 12, vocab: int = 16384) -> List[Shape]:
    """A GPT-2-style decoder: token embedding, ``n_layers`` blocks, final layer norm.

    Each block has layer norm 1 (weight, bias), the fused QKV projection
    ``3d x d`` and bias, the output projection ``d x d`` and bias, layer norm 2,
    and the MLP ``4d x d`` + bias, ``d x 4d`` + bias: 12 tensors per block.

    GPT-2 small itself (d=768, 50257-token vocabulary) has 124M parameters,
    about 5 s per method and repeat on a 2-core CPU, so the default keeps its
    depth (12 blocks, 147 tensors) and its mix of a few large matrices and many
    small vectors at half the width and a 16384-token vocabulary: 27.6M
    elements, the size of ResNet-50, of which the embedding is 23%.
    """
    d = d_model
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
             (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d)] + block * n_layers + [(d,), (d,)]


# name -> (full shapes, --quick shapes); --quick keeps every tensor count at ~1.6M elements
TENSOR_LISTS: Dict[str, Tuple[Callable[[], List[Shape]], Callable[[], List[Shape]]]] = {
    "resnet50": (resnet50_shapes, lambda: resnet50_shapes(width=16, num_classes=250)),
    "transformer": (transformer_shapes,
                    lambda: transformer_shapes(d_model=96, n_layers=12, vocab=4096)),
}


class Workload:
    """One tensor list in one input dtype on one device, with every buffer the
    methods read or write allocated once, outside the timed calls."""

    def __init__(self, name: str, shapes: Sequence[Shape], dtype_in: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.dtype_in, self.dtype_out, self.device = name, dtype_in, OUT_DTYPE, device
        self.tensors = [torch.randn(shape, device=device).to(dtype_in) for shape in shapes]
        self.n_elements = sum(t.numel() for t in self.tensors)
        self.bytes = self.n_elements * (dtype_in.itemsize + OUT_DTYPE.itemsize)
        self.inputs = [t.view(-1) for t in self.tensors]
        # the copy baseline: the same elements as one tensor
        self.src = torch.cat(self.inputs)
        self.copy_dst = torch.empty(self.n_elements, dtype=OUT_DTYPE, device=device)
        self.out = torch.empty(self.n_elements, dtype=OUT_DTYPE, device=device)
        self.slices = list(torch.split(self.out, [t.numel() for t in self.tensors]))
        # the inverse direction: an fp32 flat buffer into tensors of the input dtype
        self.flat = torch.randn(self.n_elements, device=device)
        self.dsts = [torch.empty_like(t) for t in self.tensors]


def method_fns(w: Workload, scale: float, foreach: bool) -> Dict[str, Callable[[], object]]:
    """The methods as zero-argument calls, each returning what it wrote."""

    def copy():
        return w.copy_dst.copy_(w.src)

    def naive():
        return _flatten_dense_tensors(w.tensors).to(w.dtype_out).mul_(scale)

    def views_then_scale():
        for view, t in zip(w.slices, w.inputs):
            view.copy_(t)
        return w.out.mul_(scale) if scale != 1.0 else w.out

    def fusedreduce():
        return flatten_cast_scale(w.tensors, w.out, scale=scale)

    def fusedreduce_fresh_out():
        return flatten_cast_scale(w.tensors, dtype=w.dtype_out, scale=scale)

    def fusedreduce_unflatten():
        unflatten_cast_scale(w.flat, w.dsts, scale=scale)
        return w.dsts

    def torch_foreach():
        torch._foreach_copy_(w.slices, w.inputs)
        if scale != 1.0:
            torch._foreach_mul_(w.slices, scale)
        return w.out

    fns = {"copy": copy, "naive": naive, "views_then_scale": views_then_scale,
           "fusedreduce": fusedreduce, "fusedreduce_fresh_out": fusedreduce_fresh_out,
           "fusedreduce_unflatten": fusedreduce_unflatten}
    if foreach:
        fns["torch_foreach"] = torch_foreach
    return fns


def check(w: Workload, scale: float, name: str, result) -> None:
    """Raise unless ``result`` (what method ``name`` returned) is the right answer."""
    if name == "copy":
        expected = w.src.to(w.dtype_out)
    elif name == "fusedreduce_unflatten":
        result = torch.cat([t.view(-1) for t in result])
        expected = (w.flat * scale).to(w.dtype_in)
    else:
        expected = w.src.to(w.dtype_out) * scale
    try:
        torch.testing.assert_close(result, expected)
    except AssertionError as error:
        raise AssertionError(f"method {name} gave a wrong result on {w.name} "
                             f"{common.dtype_name(w.dtype_in)} scale={scale}: {error}") from None


def measure(w: Workload, scale: float, repeats: int) -> List[dict]:
    """Check and time every method on ``w`` at ``scale``; one result record each."""
    fns = method_fns(w, scale, foreach=w.device.type == "cuda")
    for name, fn in fns.items():
        check(w, scale, name, fn())  # doubles as the warm-up
    common.synchronize(w.device)
    if w.device.type == "cuda":
        samples = common.time_do_bench(fns)
    else:
        samples = common.time_interleaved(fns, repeats, w.device)
    times = {name: statistics.median(ms) for name, ms in samples.items()}
    return [{
        "list": w.name,
        "dtype_in": common.dtype_name(w.dtype_in),
        "dtype_out": common.dtype_name(w.dtype_out),
        "scale": scale,
        "method": name,
        "n_tensors": len(w.tensors),
        "n_elements": w.n_elements,
        "bytes": w.bytes,
        "time_ms": time_ms,
        # the fastest call: on a busy machine the least disturbed estimate
        "time_ms_min": min(samples[name]),
        "gbps": w.bytes / (time_ms * 1e6),
        "ratio_to_copy": times["copy"] / time_ms,
    } for name, time_ms in times.items()]


TABLE = [("list", "list", ""), ("dtype", "dtypes", ""), ("scale", "scale", "g"),
         ("method", "method", ""), ("ms", "time_ms", ".2f"),
         ("min ms", "time_ms_min", ".2f"), ("GB/s", "gbps", ".1f"),
         ("x copy", "ratio_to_copy", ".2f")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small tensor lists (~1.6M elements), a run of seconds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=common.default_device(),
                        help="default: cuda when available")
    parser.add_argument("--dtype", type=common.csv_choices(DTYPE_CHOICES),
                        default=["float16", "bfloat16"],
                        help="input dtypes, comma-separated (default float16,bfloat16); "
                             "the flat buffer is float32")
    parser.add_argument("--lists", type=common.csv_choices(tuple(TENSOR_LISTS)),
                        default=list(TENSOR_LISTS),
                        help="tensor lists, comma-separated (default resnet50,transformer)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed calls per method on the CPU, median kept (default 10); "
                             "on CUDA do_bench chooses its own count")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    machine = common.machine_info(device, resolve_backend("auto", device))
    common.warn_if_busy(machine)
    config = {"benchmark": "kernels", "quick": args.quick, "repeats": args.repeats,
              "lists": args.lists, "dtypes": args.dtype, "scales": list(SCALES),
              "timer": "do_bench" if device.type == "cuda" else "perf_counter, round-robin"}

    started = time.perf_counter()
    results: List[dict] = []
    for list_name in args.lists:
        shapes = TENSOR_LISTS[list_name][1 if args.quick else 0]()
        for dtype in args.dtype:
            workload = Workload(list_name, shapes, common.DTYPES[dtype], device)
            common.log(f"{list_name}: {len(shapes)} tensors, {workload.n_elements:,} elements, "
                       f"{dtype} -> {common.dtype_name(OUT_DTYPE)}")
            for scale in SCALES:
                results += measure(workload, scale, args.repeats)
            del workload  # freed before the next one is built
    elapsed = time.perf_counter() - started

    print(f"# {common.machine_summary(machine)}")
    for list_name in args.lists:
        first = next(r for r in results if r["list"] == list_name)
        print(f"# {list_name}: {first['n_tensors']} tensors, {first['n_elements']:,} elements")
    rows = [dict(r, dtypes=f"{r['dtype_in']}->{r['dtype_out']}") for r in results]
    print(common.format_table(rows, TABLE, group_by=("list", "dtypes", "scale")))
    print(f"# {elapsed:.1f} s in all")
    if args.json:
        common.write_json(args.json, machine, config, results)
        common.log(f"wrote {args.json}")
    return 0
