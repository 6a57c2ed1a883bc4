"""What both op families and both backends share: dtypes, constants, the
element rule, AdaSum's chunking, and a kept CPU scratch buffer.

Torch only (no Triton import): the fallback and the façade read it on
machines without Triton. The Triton kernels' own element helpers live in
``_triton_common.py``.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import List, Sequence, Tuple

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIXTEEN_BIT_DTYPES = (torch.float16, torch.bfloat16)

#: flat buffers align segment starts to this many bytes: the widest (128-bit)
#: vector access the Triton kernels make
ALIGN_BYTES = 16
#: elements per row of the clipping norm's fixed summation order (``norm/``)
NORM_ROW = 2048

#: AdaSum statistics are sums over chunks of this many elements counted from a
#: segment's start (a power of two, a multiple of every vector width)
ADASUM_CHUNK = 1 << 14
#: fp32 and 16-bit buffers are combined in fp32 while both AdaSum coefficients
#: are at most this in magnitude, in fp64 otherwise (fp32 cannot hold them)
ADASUM_FP32_LIMIT = 2.0 ** 64
#: an AdaSum coefficient is 1 where its squared norm is below this: sqrt(fp64 tiny)
ADASUM_NORM_FLOOR = math.sqrt(2.2250738585072014e-308)


#: the dtypes a flat buffer can travel in (``quantize_flatten``'s codes)
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
#: the blockwise wire dtypes, each with the largest code magnitude a block's
#: absmax maps to: the block's fp32 scale is ``absmax / WIRE_LEVELS[dtype]``
WIRE_LEVELS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: elements per fp32 scale of a blockwise wire dtype. Measured on ResNet-50-
#: and transformer-shaped gradients (normal values, heavy-tailed row scales),
#: int8's relative L2 error grows with the block (5.4e-3 at 32, 6.7e-3 at 128,
#: 7.5e-3 at 256, 9.8e-3 at 1024) while the bytes per element fall as
#: (1 + 4 / block) / 4 of fp32's (0.281 at 32, 0.258 at 128, 0.254 at 256);
#: 128 is the smallest block under the 0.27 aim with room to spare, and e4m3's
#: error (2.6e-2, its 3 mantissa bits) hardly depends on it
WIRE_BLOCK = 128
#: the block sizes the wire kernels take: powers of two in this range
WIRE_BLOCK_RANGE = (8, 1 << 14)

#: the environment variable that picks how Triton kernels are launched
LAUNCH_VARIABLE = "FUSEDREDUCE_TRITON_LAUNCH"
#: its values: straight through the compiled kernel's launcher once a call of
#: the same kind went through ``JITFunction.run`` (the default), or always
#: through ``JITFunction.run``
LAUNCH_MODES = ("compiled", "jit")


def triton_launch_mode() -> str:
    """How Triton kernels are launched, from ``FUSEDREDUCE_TRITON_LAUNCH``
    (``kernels/_launcher.py``): ``"compiled"`` (unset) or ``"jit"``.

    Raises:
        ValueError: the variable holds another value.

    Examples:
        >>> triton_launch_mode() in LAUNCH_MODES
        True
    """
    mode = os.environ.get(LAUNCH_VARIABLE, LAUNCH_MODES[0]).strip().lower()
    if mode not in LAUNCH_MODES:
        raise ValueError(f"{LAUNCH_VARIABLE} must be one of {LAUNCH_MODES}, got "
                         f"{os.environ[LAUNCH_VARIABLE]!r}")
    return mode


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype a copy between ``a`` and ``b`` computes in: fp64 when either is
    fp64, else fp32 (16-bit values are widened, never computed in 16 bits)."""
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def round_into(dst: torch.Tensor, value: torch.Tensor) -> None:
    """``dst.copy_(value)`` with the kernels' rounding: fp64 reaches 16 bits via fp32."""
    if dst.element_size() == 2 and value.dtype == torch.float64:
        value = value.to(torch.float32)
    dst.copy_(value)


def packed_boundaries(numels: Sequence[int]) -> List[int]:
    """The ``n + 1`` boundaries of segments of these sizes packed densely:
    ``[0, n0, n0 + n1, ...]``.

    Examples:
        >>> packed_boundaries([3, 0, 2])
        [0, 3, 3, 5]
    """
    boundaries = [0]
    for n in numels:
        boundaries.append(boundaries[-1] + n)
    return boundaries


def adasum_chunk_counts(boundaries: Sequence[int]) -> List[int]:
    """How many AdaSum chunks each segment has: ``ceil(length / ADASUM_CHUNK)``."""
    return [-(-(hi - lo) // ADASUM_CHUNK) for lo, hi in zip(boundaries[:-1], boundaries[1:])]


_scratch = threading.local()


def scratch_buffer(name: str, shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A scratch tensor of ``shape`` kept between calls on the CPU; a new one elsewhere.

    On the CPU a fresh multi-MiB allocation costs page faults every time (a
    fresh 25 MiB buffer filled took 6x as long as a reused one), so one buffer
    per thread, ``name`` and dtype is kept and grows as needed; on GPUs the
    caching allocator already reuses memory. Two users of one ``name`` in the
    same thread share the memory, so a name belongs to one use at a time.

    Examples:
        >>> scratch_buffer("example", (2, 3), torch.float64, torch.device("cpu")).shape
        torch.Size([2, 3])
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    kept = getattr(_scratch, "buffers", None)
    if kept is None:
        kept = _scratch.buffers = {}
    numel = math.prod(shape)
    buffer = kept.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = kept[name, dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


@functools.lru_cache(maxsize=64)
def share_bounds(count: int, share: Tuple[int, int]) -> Tuple[int, int]:
    """``[lo, hi)``: share ``(index, of)`` of ``count`` items in order, the
    shares' sizes differing by at most one (the clipping norm's split)."""
    index, of = share
    return index * count // of, (index + 1) * count // of


@functools.lru_cache(maxsize=64)
def postscale_vectors(postscales: Tuple[float, ...],
                      device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Buffers' postscales, absolute and signed, as fp64 vectors on ``device``
    (the norm family's): the same every step, so uploaded once (a per-step
    upload would cost a host-to-device copy, and could not be captured in a
    CUDA graph). The vectors are shared between calls: read them, never
    write them."""
    signed = torch.tensor(postscales, dtype=torch.float64, device=device)
    return signed.abs(), signed
