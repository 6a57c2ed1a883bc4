"""The clipping norm's reading, whole and as one rank's share, beside the write-back it precedes.

    python -m fusedreduce.bench.norm_share [--sizes 4M,25.6M] [--shares 2,4,8,16]
        [--dtype float16,bfloat16,float32] [--reduce-dtype float32] [--repeats 30]
        [--device auto|cuda|cpu] [--json PATH]

Issue 26's clipping aim is that clipping adds at most a tenth of one unflatten
pass to the reduction. Fused clipping has no multiply pass of its own (the clip
coefficient rides in the unflatten's scale), so what it adds is the norm: a
read of every reduced element, then a finish of a few launches. With
``split_norm`` each of W ranks reads only its ``1 / W`` of the rows and one
all-reduce of the row partials shares them (docs/guides/clipping.md). The
collective needs W devices; the reading does not, and it is what this times
on one device, with the kernels the reducer calls:

- ``write_back`` (reference): the unflatten of every bucket with the mean's
  postscale, the pass the reduction ends with anyway;
- ``torch_clip`` (baseline): ``torch.nn.utils.clip_grad_norm_(foreach=True)``
  over the written gradients: what a training loop adds after it;
- ``fused_norm`` (ours): the whole norm of the reduced buffers and the clip
  coefficients (the backend's ``norm_partials`` of every row, then
  ``clip_partials``), what one rank, or every rank without the split, adds;
- ``fused_norm_share_W`` (ours): rank 0's share of the same rows out of W
  (``norm_partials(buffers, 2, (0, W))``, the shares differ by one row at
  most), then the same finish: what each of W ranks adds, the partials'
  all-reduce (``allreduce_bytes``) excepted.

The gradients are a model's list (ResNet-50's 161 tensors and a 12-block
transformer's 147, ``bench/models.py``, scaled to each ``--sizes`` entry) in
each ``--dtype``, laid out in 25 MiB buckets of the communication dtype as
``DistributedGradReducer`` lays them out. ``of_write_back`` is a method's
median over ``write_back``'s (the aim: 0.10 or less); ``ratio`` is
``torch_clip``'s median over the method's. On a GPU each call's device time
is measured (``timing.time_on_device``: the host's launch cost excluded, the
L2 cache flushed); on the CPU wall time, round-robin.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from fusedreduce import BucketPlan, communication_dtype
from fusedreduce.kernels import NORM_ROW, clip_partials, norm_partials, resolve_backend

from . import common, output_files, timing
from .models import TENSOR_LISTS, gradients

NAME = "norm_share"
BUCKET_CAP_MB = 25.0
MAX_NORM = 1.0
NORM_TYPE = 2.0
MODELS = ("resnet50", "transformer")
#: the mean's postscale is 1 / WORLD_SIZE (a power of two: the scaling is exact)
WORLD_SIZE = 8
REFERENCE = "write_back"
BASELINE = "torch_clip"
DEFAULT_SIZES = (4_000_000, 25_600_000)
DEFAULT_SHARES = (2, 4, 8, 16)
#: the fused norm's relative error bound against float64 (``check_norm``)
NORM_RTOL = 4 * math.log2(NORM_ROW) * torch.finfo(torch.float32).eps
#: the clipping aim: the norm's cost over one unflatten pass
AIM_OF_WRITE_BACK = 0.10


def share_method(ranks: int) -> str:
    return f"fused_norm_share_{ranks}"


def reduced_buffers(grads: List[torch.Tensor],
                    reduce_dtype: torch.dtype) -> Tuple[BucketPlan, List[torch.Tensor]]:
    """The reducer's layout of ``grads`` and its flat buffers, filled (each
    rank's reduced buffers stand in: what the norm reads)."""
    plan = BucketPlan(grads, bucket_cap_mb=BUCKET_CAP_MB,
                      comm_dtype=lambda dtype: communication_dtype(dtype, reduce_dtype))
    return plan, [plan.flatten(bucket, grads) for bucket in plan.buckets]


def methods(grads: List[torch.Tensor], plan: BucketPlan, buffers: List[torch.Tensor],
            shares: Sequence[int]) -> Dict[str, Callable[[], object]]:
    """The timed calls over ``reduced_buffers``' ``plan`` and ``buffers`` of
    ``grads`` (the outputs allocated once), by method name; the postscale is a
    ``WORLD_SIZE`` ranks' mean's."""
    outputs = [torch.empty_like(g) for g in grads]
    holders = [torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape).requires_grad_()
               for g in grads]
    for holder, output in zip(holders, outputs):
        holder.grad = output
    postscales = [1.0 / WORLD_SIZE] * len(buffers)

    def write_back():
        for bucket, buffer in zip(plan.buckets, buffers):
            plan.unflatten(bucket, buffer, outputs, scale=postscales[0])

    def torch_clip():
        return torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, NORM_TYPE, foreach=True)

    def fused_norm(share=(0, 1)):
        partials = norm_partials(buffers, NORM_TYPE, share)
        return clip_partials(partials, buffers, postscales, MAX_NORM, NORM_TYPE)

    fns: Dict[str, Callable[[], object]] = {REFERENCE: write_back, BASELINE: torch_clip,
                                            "fused_norm": fused_norm}
    for ranks in shares:
        fns[share_method(ranks)] = lambda ranks=ranks: fused_norm((0, ranks))
    write_back()  # torch_clip reads the written gradients
    return fns


def partials_bytes(buffers: List[torch.Tensor]) -> int:
    """The bytes of the row partials the split all-reduces (fp64, one per row)."""
    return norm_partials(buffers, NORM_TYPE).numel() * 8


def check_norm(fns: Dict[str, Callable[[], object]], buffers: List[torch.Tensor]) -> None:
    """Refuse to time a wrong norm: ``fused_norm``'s total against the float64
    norm of the ``buffers`` it reads, times the postscale (the norm of what the
    write-back writes, before its rounding to the gradients' dtype)."""
    squares = sum(float(b.double().square().sum()) for b in buffers)
    reference = squares ** 0.5 / WORLD_SIZE
    ours = float(fns["fused_norm"]()[0])
    # rows of at most NORM_ROW fp32 terms (summed pairwise or in a tree: about
    # log2(NORM_ROW) roundings each), then fp64, then one rounding to fp32.
    # torch's clip_grad_norm_ is no reference here: its fp32 norm of one
    # 2.4M-element tensor was off by 4e-5 on the CPU
    if abs(ours - reference) > NORM_RTOL * reference:
        raise RuntimeError(f"fused_norm gave {ours!r}, float64 {reference!r}")


def measure(model: str, size: int, dtype: torch.dtype, reduce_dtype: torch.dtype,
            shares: Sequence[int], repeats: int, device: torch.device) -> List[dict]:
    """Time every method on one gradient list; one record each."""
    grads = gradients(model, size, dtype, device, seed=0)
    plan, buffers = reduced_buffers(grads, reduce_dtype)
    fns = methods(grads, plan, buffers, shares)
    for fn in fns.values():  # the warm-up: launches prepared, kernels compiled
        fn()
    check_norm(fns, buffers)
    timing.synchronize(device)
    if device.type == "cuda":
        samples = timing.time_on_device(fns, repeats, device)
    else:
        samples = timing.time_interleaved(fns, repeats, device)
    n_elements = sum(g.numel() for g in grads)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    reference_ms = common.summary_ms(samples[REFERENCE])["time_ms"]
    case = (f"{model} {common.dtype_name(dtype)} gradients, "
            f"{common.dtype_name(communication_dtype(dtype, reduce_dtype))} buffers")
    allreduce = partials_bytes(buffers)
    ranks_of = {share_method(ranks): ranks for ranks in shares}
    records = []
    for name in fns:
        role = {REFERENCE: "reference", BASELINE: "baseline"}.get(name, "ours")
        ranks = ranks_of.get(name, 1)
        record = common.result(NAME, case, size, name, role, BASELINE, ranks, len(grads),
                               n_elements, nbytes, samples, list=model,
                               dtype=common.dtype_name(dtype),
                               allreduce_bytes=allreduce if ranks > 1 else 0)
        record["of_write_back"] = record["time_ms"] / reference_ms
        records.append(record)
    return records


COLUMNS = [("case", "case", "s"), ("size", "size", common.format_count),
           ("method", "method", "s"), ("ranks", "world_size", "d"),
           ("ms", "time_ms", ".3f"), ("of write-back", "of_write_back", ".3f"),
           ("vs torch_clip", "ratio", ".2f"), ("all-reduce B", "allreduce_bytes", ",d")]


def _positive_ints(text: str) -> List[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"expected rank counts of 2 or more, got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.norm_share",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=common.parse_sizes, default=list(DEFAULT_SIZES),
                        help="gradient-set sizes in elements (default 4M,25.6M)")
    parser.add_argument("--shares", type=_positive_ints, default=list(DEFAULT_SHARES),
                        help="the rank counts W whose 1/W share is timed (default 2,4,8,16)")
    parser.add_argument("--dtype", type=common.csv_choices(list(common.DTYPES)),
                        default=["float16", "float32"], help="gradient dtypes")
    parser.add_argument("--reduce-dtype", choices=list(common.DTYPES), default="float32",
                        help="the reducer's reduce_dtype: the buffers' dtype for 16-bit "
                             "gradients (default float32)")
    parser.add_argument("--models", type=common.csv_choices(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--json", type=output_files.output_file,
                                  metavar="PATH", help="write machine, config and results here")
    args = parser.parse_args(argv)
    device = common.one_device(args.device)
    on_gpu = device.type == "cuda"
    machine = common.machine_info(device, resolve_backend("auto", device), None)
    common.warn_if_busy(machine)
    records = []
    for model in args.models:
        for size in args.sizes:
            for dtype in args.dtype:
                common.log(f"{model} {common.format_count(size)} {dtype}")
                records += measure(model, size, common.DTYPES[dtype],
                                   common.DTYPES[args.reduce_dtype], args.shares,
                                   args.repeats, device)
    timer = ("device time (CUDA events behind a spin kernel, L2 flushed)" if on_gpu
             else "wall time, round-robin")
    print(f"# {common.machine_summary(machine)}")
    print(f"# median ms of {args.repeats} calls, {timer}; clipping aim: the norm at most "
          f"{AIM_OF_WRITE_BACK:.2f} of the write-back")
    print(common.format_table(records, COLUMNS, group_by=("case", "size")))
    if args.json:
        config = {"sizes": args.sizes, "shares": args.shares, "dtypes": args.dtype,
                  "reduce_dtype": args.reduce_dtype, "models": args.models,
                  "repeats": args.repeats, "bucket_cap_mb": BUCKET_CAP_MB,
                  "norm_type": NORM_TYPE, "lists": {m: len(TENSOR_LISTS[m](args.sizes[0]))
                                                    for m in args.models}}
        common.write_json(args.json, machine, config, records)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
