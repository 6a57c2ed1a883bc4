"""Where the host time of one steady-state fused call goes, part by part.

    python -m fusedreduce.bench.host_parts [--device cuda] [--size 25.6M] [--calls 300]

A steady-state ``flatten_cast_scale`` or ``unflatten_cast_scale`` call over
ResNet-50's 161 gradients (fp16 ↔ an fp32 buffer, scale 1/8) on the Triton
path does four things on the host: it recognises the layout
(``_prepared.LAUNCHES.lookup``), runs the kept launch (the closure that
picks the base tensor and the scale's words), which calls Triton's compiled
launcher (``_launcher.CompiledLaunch``), which calls the driver. Each part is
timed alone, with the arguments of a real call, beside the whole call and one
tiny torch op for scale: the whole call minus its parts is the façade's own
work (the scale's check, the lookup's wrapper).

On a GPU the launches are real: each block of calls is followed by a
synchronisation outside the timing, so a block never waits for a full launch
queue. On the CPU (``--device cpu``) the kernels are compiled for sm_90 by a
stand-in driver whose launcher does nothing (``recording_driver``), so every
host-side step runs except the C launcher and the kernel.

Each part is timed in blocks of ``--calls`` consecutive calls, the blocks of
the parts alternating (``--blocks`` rounds); the figure is the median µs per
call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable, Dict, List

from . import host_cost, output_files

#: the parts, in the order a call runs them (the whole call first)
PARTS = ("whole call", "recognising the layout", "the kept launch", "the compiled launcher",
         "one tiny torch op")


def part_calls(direction: str, grads, out, dsts, scale: float) -> Dict[str, Callable]:
    """``{part: a function doing that part once}`` for one steady-state call."""
    import torch

    from fusedreduce import kernels

    if direction == "flatten":
        tensors, buffer = grads, out

        def whole():
            kernels.flatten_cast_scale(grads, out, scale=scale, backend="triton")
    else:
        tensors, buffer = dsts, out

        def whole():
            kernels.unflatten_cast_scale(out, dsts, scale=scale, backend="triton")
    whole()  # prepares the launch
    whole()
    launch = kernels.kept_launch(direction, buffer, tensors, backend="triton")
    if launch is None or not hasattr(launch, "kernel"):
        raise RuntimeError(f"{direction}: no kept Triton launch after two calls")
    args = kernels.compiled_launch_arguments(whole)
    kernel = launch.kernel
    tiny = torch.zeros(1, device=out.device)
    if direction == "flatten":
        def kept():
            launch(grads, out, scale, False)
    else:
        def kept():
            launch(out, dsts, scale, False)
    return {
        "whole call": whole,
        "recognising the layout": lambda: kernels.kept_launch(direction, buffer, tensors,
                                                              backend="triton"),
        "the kept launch": kept,
        "the compiled launcher": lambda: kernel(*args),
        "one tiny torch op": lambda: tiny.add_(1),
    }


def time_parts(parts: Dict[str, Callable], calls: int, blocks: int,
               sync: Callable[[], None]) -> Dict[str, float]:
    """Median µs per call of each part, timed in alternating blocks (each
    block after ``host_cost``'s few warm-up calls)."""
    samples: Dict[str, List[float]] = {name: [] for name in parts}
    for _ in range(blocks):
        for name, fn in parts.items():
            samples[name].extend(ms * 1e3 for ms in host_cost._time_calls(fn, calls))
            sync()
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedreduce.bench.host_parts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: real launches; cpu (default): compiled for sm_90, a "
                             "launcher that does nothing")
    parser.add_argument("--size", default="25.6M",
                        help="elements of the ResNet-50 list (default 25.6M)")
    parser.add_argument("--calls", type=int, default=300, help="calls per block")
    parser.add_argument("--blocks", type=int, default=6, help="rounds of blocks")
    parser.add_argument("--json", type=output_files.output_file, metavar="PATH", help="write the figures")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.pop("TRITON_INTERPRET", None)  # before any import of triton
    import torch

    from . import common
    from .models import TENSOR_LISTS
    if args.device == "cpu":
        from . import recording_driver
        recording_driver.install(record=False)
        from fusedreduce.kernels import allow_cpu_launches
        allow_cpu_launches()  # the stand-in driver takes CPU tensors
        sync = lambda: None  # noqa: E731
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available here")
        sync = torch.cuda.synchronize
    device = torch.device(args.device)
    size = common.parse_sizes(args.size)[0]
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator).half().to(device)
             for s in TENSOR_LISTS["resnet50"](size)]
    out = torch.zeros(sum(g.numel() for g in grads), device=device)
    dsts = [torch.zeros_like(g) for g in grads]
    how = ("real launches on " + torch.cuda.get_device_name(device) if device.type == "cuda"
           else "compiled for sm_90, a launcher that does nothing")
    print(f"# {common.machine_summary(common.machine_info(device, 'triton', None))}")
    print(f"# host µs per steady-state call, resnet50 list ({len(grads)} tensors, "
          f"{out.numel():,} elements), fp16 <-> fp32, scale 1/8, {how}; median of "
          f"{args.blocks} alternating blocks of {args.calls} calls")
    figures = {}
    for direction in ("flatten", "unflatten"):
        parts = part_calls(direction, grads, out, dsts, 0.125)
        figures[direction] = time_parts(parts, args.calls, args.blocks, sync)
    print(f"{'part':26s} {'flatten':>9s} {'unflatten':>9s}")
    for part in PARTS:
        print(f"{part:26s} {figures['flatten'][part]:9.1f} {figures['unflatten'][part]:9.1f}")
    for direction in ("flatten", "unflatten"):
        f = figures[direction]
        rest = f["whole call"] - f["recognising the layout"] - f["the kept launch"]
        print(f"# {direction}: the façade around the lookup and the kept launch: {rest:.1f} µs; "
              f"the kept launch around the compiled launcher: "
              f"{f['the kept launch'] - f['the compiled launcher']:.1f} µs")
    if args.json:
        with output_files.open_output(args.json) as handle:
            json.dump({"device": str(device), "size": out.numel(), "tensors": len(grads),
                       "calls": args.calls, "blocks": args.blocks, "us": figures}, handle,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
