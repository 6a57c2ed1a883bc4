"""The flatten family on torch: the fallback of the Triton kernels, plain torch ops.

Used on the CPU and wherever Triton is not wanted; ``prepare_flatten`` and
``prepare_unflatten`` take the same arguments as the Triton backend's
(``kernels/_backends.py``) and return launches that are kept per layout.
The element math follows the kernels' rule (fp32, or fp64 when either side is fp64; 16-bit results rounded
from fp32). Python overhead per tensor matters as much as bandwidth here (a
ResNet-50 has 161 gradients), so the work is done by a few ``torch._foreach_*``
calls over all segments at once wherever the dtypes allow (the routes are
listed in ``CopyPlan``): a copy that rounds as the kernels do is one
``_foreach_copy_`` for every such pair; a scale on an fp32/fp64 destination
adds one ``_foreach_mul_`` (or, filling a flat buffer, one ``mul_`` per run of
segments); a scaled 16-bit destination takes one ``torch.mul(src, scale,
out=dst)`` per pair (from an fp32 buffer: ``ScratchRuns``); only fp64
into 16 bits and fp16<->bf16 with a scale go piece by piece.

Those routes are one *strategy*; torch's own multi-tensor ops are others
(``STRATEGIES``: one ``_foreach_copy_`` and one ``mul_`` of the whole buffer,
``torch.cat(out=)``, ``torch.split_with_sizes_copy(out=)``, a loop of
``copy_``), each offered only for the layouts and kinds of call (scale 1 or
not) where it computes exactly the element rule above. Which one is fastest
depends on the layout and the machine, so a kept launch on the CPU times the
candidates on its real tensors at its second call of a kind (``Choice``) and
keeps the fastest for every later call of that kind; the results are the
same bits whichever runs. ``FUSEDREDUCE_TORCH_STRATEGY`` forces one.

The launches run their ops under ``torch.inference_mode()``, not
``torch.no_grad()``: ``_foreach_copy_`` on the CPU is one ``copy_`` per tensor
through the dispatcher, and inference mode takes the autograd layer out of
each (ResNet-50's 161 gradients at 250K elements: a flatten 5-10% faster on
the 2-core VM). Nothing the caller sees changes: in-place writes to ordinary
tensors still bump their version counters (autograd still catches a saved
tensor overwritten), the bits are the same, and the only tensors made inside
are temporaries; the non-finite flag handed back is made outside it. The
mode is entered through its C++ guard where torch has it
(``torch.inference_mode()`` wraps the same guard in a Python object built at
each call, about 1 us more on the 2-core VM, 2-4% of a 250K-element call).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .._common import SIXTEEN_BIT_DTYPES, compute_dtype, packed_boundaries, round_into
from .._checks import refuse_in_capture
# STRATEGIES, STRATEGY_VARIABLE and TRIAL_ROUNDS are re-exported: this backend's
# docstrings and its users name them here
from .strategy_choice import (STRATEGIES, STRATEGY_VARIABLE, TRIAL_ROUNDS,  # noqa: F401
                              Choice, forced_strategy)
# SCALE_GROUP is re-exported: the tests read the run size here
from .scratch_runs import SCALE_GROUP, ScratchRuns, WholeScratch, segment_views  # noqa: F401

# elements per piece: 256 KiB of fp32, so the second pass over a piece hits L2
CACHE_PIECE = 1 << 16

_INFERENCE_GUARD = getattr(torch._C, "_InferenceMode", None)


def _inference_mode():
    """``torch.inference_mode()``, entered through its C++ guard where torch has it."""
    return _INFERENCE_GUARD(True) if _INFERENCE_GUARD is not None else torch.inference_mode()

_WIDENS_TO = {
    torch.float16: {torch.float32, torch.float64},
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
    torch.float64: set(),
}


def _write_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(src * scale)``; both the same shape, either may be strided."""
    # only the pairs ``_route`` leaves to it come here: an fp64 source into a
    # 16-bit destination, or fp16<->bf16 with a scale
    if scale == 1.0:
        round_into(dst, src)
    else:
        round_into(dst, torch.mul(src.to(compute_dtype(src.dtype, dst.dtype)), scale))


def _add_scaled(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = cast(dst + src * scale)`` computed in the compute dtype."""
    compute = compute_dtype(src.dtype, dst.dtype)
    if dst.dtype == src.dtype == compute:
        dst.add_(src, alpha=scale)
    else:
        acc = torch.mul(src.to(compute), scale)
        acc += dst
        round_into(dst, acc)


def _apply(op, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``op(dst, src, scale)`` for same-numel tensors, one flat, cache-sized piece at
    a time when both are contiguous (whole and in their own shapes otherwise)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst, src = dst.view(-1), src.reshape(-1)
        for start in range(0, dst.numel(), CACHE_PIECE):
            op(dst[start:start + CACHE_PIECE], src[start:start + CACHE_PIECE], scale)
    else:
        op(dst.view(src.shape) if dst.dim() == 1 else dst,
           src.view(dst.shape) if src.dim() == 1 else src, scale)


def _exact(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    return dst_dtype == src_dtype or dst_dtype in _WIDENS_TO[src_dtype]


def _gap_views(flat: torch.Tensor, starts, numels, extents):
    """Views of every element of ``flat`` that no segment covers."""
    gaps, position = [], 0
    for off, n, ext in zip(starts, numels, extents):
        if off > position:
            gaps.append(flat.narrow(0, position, off - position))
        if ext > n:
            gaps.append(flat.narrow(0, off + n, ext - n))
        position = off + max(n, ext)
    if flat.numel() > position:
        gaps.append(flat.narrow(0, position, flat.numel() - position))
    return gaps


def _one_rounding_mul(dst_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    """Whether ``torch.mul(src, scale, out=dst)`` is ``cast(src * scale)`` computed in
    fp32 with one rounding into a 16-bit ``dst``: true when ``src`` is fp32 (the
    product is fp32, rounded once on the way out) or ``dst``'s own dtype (ATen
    computes 16-bit products in fp32 with an fp32 scalar, rounding once)."""
    return dst_dtype in SIXTEEN_BIT_DTYPES and src_dtype in (torch.float32, dst_dtype)


def _route(dst: torch.dtype, src: torch.dtype, scale: float) -> int:
    """Which of ``CopyPlan``'s four routes a pair of dtypes takes."""
    if scale == 1.0 and (_exact(dst, src) or (dst in SIXTEEN_BIT_DTYPES and src != torch.float64)):
        return 0  # one foreach copy
    if _exact(dst, src) and dst in (torch.float32, torch.float64):
        return 1  # foreach copy, then scale the destination
    if _one_rounding_mul(dst, src):
        return 2  # one torch.mul(out=) per pair
    return 3  # piece by piece


class CopyPlan:
    """``dst = cast(src * scale)`` (or ``dst = cast(dst + src * scale)``) for every
    pair of a layout, the routes decided once from the pairs' dtypes.

    The cheapest exact route per pair (measured on a 2-core CPU against one
    big ``copy_``; see the README's kernel figures):

    - scale 1 and no fp64 source into a 16-bit destination: everything
      ``copy_`` rounds exactly as the kernels do (one rounding from a value
      fp32 holds exactly) goes through one ``_foreach_copy_``;
    - exact pairs with an fp32/fp64 destination and a scale: ``_foreach_copy_``
      then ``_foreach_mul_`` (foreach ops round the scalar to the tensors'
      dtype, so only the compute dtype itself may take this path), or, when
      every pair of a flatten takes this route, per run of segments one
      ``_foreach_copy_`` and one ``mul_`` of the run's part of the buffer;
    - a 16-bit destination from fp32 or its own dtype with a scale: one
      ``torch.mul(src, scale, out=dst)`` per pair, one rounding;
    - anything else (fp64 into 16 bits, fp16<->bf16 with a scale): per
      segment, the product in the compute dtype on a cache-sized piece.
    """

    def __init__(self, dst_dtypes: Sequence[torch.dtype], src_dtypes: Sequence[torch.dtype]):
        self.pairs = list(zip(dst_dtypes, src_dtypes))
        self._routes = {}  # scale == 1 -> the four routes' index lists
        same = [d == s == compute_dtype(d, s) for d, s in self.pairs]
        self.accumulate_same = [i for i, x in enumerate(same) if x]
        self.accumulate_rest = [i for i, x in enumerate(same) if not x]

    def routes(self, unit_scale: bool):
        """The index lists of the four routes, for scale 1 or any other scale."""
        routes = self._routes.get(unit_scale)
        if routes is None:
            routes = ([], [], [], [])
            of_pair = {}
            for i, pair in enumerate(self.pairs):
                route = of_pair.get(pair)
                if route is None:
                    route = of_pair[pair] = _route(*pair, 1.0 if unit_scale else 2.0)
                routes[route].append(i)
            routes = self._routes[unit_scale] = tuple(routes)
        return routes

    def _pick(self, items, indices):
        # the common case, one route for every pair, passes the lists as they are
        return items if len(indices) == len(self.pairs) else [items[i] for i in indices]

    def run(self, dsts, srcs, scale: float, accumulate: bool = False,
            runs: Optional[Sequence[Tuple[int, int, torch.Tensor]]] = None,
            products: Optional[Callable] = None) -> None:
        """Copy (or add) every pair. ``runs``: ``(first, end, piece)`` covering
        the pairs in order, ``piece`` the part of a flat buffer holding
        ``dsts[first:end]`` whose other elements the caller overwrites
        afterwards; when every pair takes the second route, each run is copied
        and then its piece scaled. ``products``: a replacement for the third
        route, called as ``products(dsts, srcs, scale)``."""
        pick = self._pick
        if accumulate:
            if self.accumulate_same:
                torch._foreach_add_(pick(dsts, self.accumulate_same),
                                    pick(srcs, self.accumulate_same), alpha=scale)
            for i in self.accumulate_rest:
                if dsts[i].numel():
                    _apply(_add_scaled, dsts[i], srcs[i], scale)
            return
        copies, scaled, products_route, rest = self.routes(scale == 1.0)
        if copies:
            torch._foreach_copy_(pick(dsts, copies), pick(srcs, copies))
        if scaled and runs is not None and len(scaled) == len(self.pairs):
            for first, end, piece in runs:
                torch._foreach_copy_(dsts[first:end], srcs[first:end])
                piece.mul_(scale)  # one pass over the piece, still in cache
        elif scaled:
            torch._foreach_copy_(pick(dsts, scaled), pick(srcs, scaled))
            torch._foreach_mul_(pick(dsts, scaled), scale)
        if products_route and products is not None:
            products(dsts, srcs, scale)
        else:
            for i in products_route:
                torch.mul(srcs[i], scale, out=dsts[i])
        for i in rest:
            if dsts[i].numel():
                _apply(_write_scaled, dsts[i], srcs[i], scale)


def prepare_flatten(tensors: Sequence[torch.Tensor], starts: Sequence[int],
                    extents: Sequence[int], out: torch.Tensor) -> Callable:
    """The launch that fills ``out``: segment ``i`` at ``starts[i]``, ``extents[i]``
    elements long (the part past the tensor zeroed), every other element zeroed.

    The launch is ``(tensors, out, scale, check_finite) -> flag or None`` for
    tensors and a buffer of the prepared layout (the 0-d bool non-finite flag
    with ``check_finite``). The buffer's views are made here, once: on the
    CPU a view costs microseconds and a model has hundreds of gradients.
    ``launch.choice`` (a ``Choice``) holds its strategies and the one chosen
    for each kind of call.

    Raises:
        ValueError: ``FUSEDREDUCE_TORCH_STRATEGY`` holds an unknown strategy.
    """
    forced = forced_strategy()
    alias = out.detach()  # the views keep the memory, not the caller's tensor object
    numels = [t.numel() for t in tensors]
    segments = segment_views(alias, starts, tensors)
    gaps = _gap_views(alias, starts, numels, extents)
    runs = _scale_runs(alias, starts, numels)
    plan = CopyPlan([out.dtype] * len(tensors), [t.dtype for t in tensors])
    packed = not gaps and all(t.is_contiguous() for t in tensors)
    # the scratch strategy holds a scratch buffer: made only where it can run
    # (timed on the CPU, or forced), never for routes alone on an accelerator
    timed = out.device.type == "cpu"
    widening = None
    if (timed or forced == "scratch") and tensors and len(plan.routes(False)[2]) == len(tensors):
        # 16-bit results of a scale: the products in a kept fp32 scratch run by
        # run (the same fp32 products, rounded once), not one mul per tensor
        widening = ScratchRuns(alias, starts, tensors, range(len(tensors)),
                             scratch_dtype=torch.float32)
    choice = Choice(_flatten_candidates(plan, segments, runs, alias, packed, widening), forced,
                    trial=timed)

    def launch(tensors, out, scale, check_finite):
        scale = _host_scale(scale)
        with _inference_mode():  # see the module docstring
            # the gaps are zeroed after: whole pieces of the buffer may be scaled
            choice.run(scale == 1.0, tensors, scale)
            if gaps:
                torch._foreach_zero_(gaps)
        if not check_finite:
            return None
        with torch.no_grad():  # the flag is the caller's: an ordinary tensor
            return _found_nonfinite(tensors, out)
    launch.rebind = _reads_tensors_at_launch
    launch.binding, launch.bind = _no_binding, _bind_nothing
    launch.choice = choice
    return launch


def _flatten_candidates(plan: CopyPlan, segments, runs, flat: torch.Tensor, packed: bool,
                        widening=None):
    """``{unit scale: {name: fn(tensors, scale)}}``: the strategies that fill
    ``flat``'s segments exactly as ``routes`` does. torch's ops are offered
    where every pair takes one ``_foreach_copy_`` (scale 1) or a copy then a
    scale of the buffer (an exact widening into fp32/fp64, the buffer's dtype
    being the compute dtype, so ``mul_`` rounds the scale as the rule says)."""

    def routes(tensors, scale):
        plan.run(segments, tensors, scale, runs=runs)

    def scaled(copy):
        def fn(tensors, scale):
            copy(tensors)
            if scale != 1.0:
                flat.mul_(scale)  # the gaps too: the launch zeroes them after
        return fn

    copies = {
        "foreach": lambda tensors: torch._foreach_copy_(segments, tensors),
        "per_tensor": lambda tensors: [view.copy_(t) for view, t in zip(segments, tensors)],
    }
    if packed:
        copies["concat"] = lambda tensors: torch.cat(
            [t if t.dim() == 1 else t.view(-1) for t in tensors], out=flat)
    candidates = {}
    for unit, route in ((True, 0), (False, 1)):
        candidates[unit] = {"routes": routes}
        if segments and len(plan.routes(unit)[route]) == len(segments):
            candidates[unit].update((name, scaled(copy)) for name, copy in copies.items())
    if widening is not None:
        def scratch(tensors, scale):
            widening.fill(segments, tensors, scale)
        scratch.release = widening.release  # Choice calls it if another strategy is kept
        candidates[False]["scratch"] = scratch
    return candidates


def _host_scale(scale) -> float:
    """A tensor scale's value as a Python float (exact: fp32 and fp64 values
    are doubles): the routes below decide on it. On the CPU this is a plain
    memory read; on an accelerator it waits for the device, which the Triton
    backend never does."""
    if not isinstance(scale, torch.Tensor):
        return scale
    refuse_in_capture(scale.device, "the torch backend's read of a tensor scale",
                      "use the Triton backend, which reads the scale on the device")
    return scale.item()


def _reads_tensors_at_launch(tensors, addresses, buffer_address) -> None:
    """``rebind`` of this backend's launches (``_prepared.py``): they keep views
    of the buffer only and take the tensors at each launch, so moved tensors
    need nothing. (A moved buffer never comes here: its kept views would
    miss a buffer given other storage, so the launches do not offer
    ``accepts_buffer_at``.)"""


def _no_binding() -> None:
    """``binding`` of this backend's launches: nothing depends on addresses."""


def _bind_nothing(binding) -> None:
    """``bind`` of this backend's launches: nothing to switch."""


def _scale_runs(flat: torch.Tensor, starts: Sequence[int], numels: Sequence[int]):
    """``(first, end, piece)``: consecutive segments of about ``SCALE_GROUP``
    elements, and the part of ``flat`` from the first one's start to the next
    run's (the last run: to the buffer's end)."""
    bounds, total, first = [], 0, 0
    for i, n in enumerate(numels):
        total += n
        if total >= SCALE_GROUP or i == len(numels) - 1:
            bounds.append((first, i + 1))
            first, total = i + 1, 0
    runs = []
    for k, (first, end) in enumerate(bounds):
        lo = 0 if k == 0 else starts[first]
        hi = starts[bounds[k + 1][0]] if k + 1 < len(bounds) else flat.numel()
        runs.append((first, end, flat.narrow(0, lo, hi - lo)))
    return runs


def prepare_unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                      starts: Sequence[int]) -> Callable:
    """The launch ``(flat, tensors, scale, accumulate) -> None`` that writes (or
    adds) each segment of ``flat`` into its tensor, in place; ``launch.choice``
    as ``prepare_flatten``'s.

    Raises:
        ValueError: ``FUSEDREDUCE_TORCH_STRATEGY`` holds an unknown strategy.
    """
    forced = forced_strategy()
    alias = flat.detach()
    segments = segment_views(alias, starts, tensors)
    plan = CopyPlan([t.dtype for t in tensors], [flat.dtype] * len(tensors))
    narrowing = scaled_copies = whole = None
    if flat.dtype == torch.float32 and plan.routes(False)[2]:
        narrowing = ScratchRuns(flat, starts, tensors, plan.routes(False)[2])
    timed = flat.device.type == "cpu"  # as in prepare_flatten: the scratch only where it runs
    if (timed or forced == "foreach") and narrowing is not None \
            and len(plan.routes(False)[2]) == len(tensors):
        # every destination 16-bit: the whole buffer's products in one mul
        whole = WholeScratch(flat, starts, tensors)
    if (timed or forced == "scratch") and tensors and all(t.dtype == flat.dtype for t in tensors) \
            and len(plan.routes(False)[1]) == len(tensors):
        # destinations in the buffer's (fp32/fp64) dtype: the products in a kept
        # scratch run by run, then copied (the same bits as a copy then a scale)
        scaled_copies = ScratchRuns(flat, starts, tensors, range(len(tensors)))
    numels = [t.numel() for t in tensors]
    packed = list(starts) == packed_boundaries(numels)[:-1] \
        and all(t.is_contiguous() and t.dtype == flat.dtype for t in tensors)
    choice = Choice(_unflatten_candidates(plan, segments, narrowing, scaled_copies,
                                          alias.narrow(0, 0, sum(numels)) if packed else None,
                                          numels, whole),
                    forced, trial=timed)

    def launch(flat, tensors, scale, accumulate):
        scale = _host_scale(scale)
        with _inference_mode():  # see the module docstring
            choice.run(ACCUMULATE if accumulate else scale == 1.0, tensors, scale)
    launch.rebind = _reads_tensors_at_launch
    launch.binding, launch.bind = _no_binding, _bind_nothing
    launch.choice = choice
    return launch


#: the kind of an unflatten call with ``accumulate`` (the others: whether the scale is 1)
ACCUMULATE = "accumulate"


def _unflatten_candidates(plan: CopyPlan, segments, narrowing, scaled_copies,
                          packed: Optional[torch.Tensor], numels: Sequence[int],
                          whole: Optional[WholeScratch] = None):
    """``{kind: {name: fn(tensors, scale)}}``: the strategies that write the
    segments into the tensors exactly as ``routes`` does. torch's ops are
    offered where every pair takes one ``_foreach_copy_`` (scale 1) or a copy
    then a scale of the destinations in their own dtype (the compute dtype:
    ``_foreach_mul_`` rounds the scale to it, as the rule says). A scaled
    16-bit destination is never copied then scaled (that would round twice):
    its ``foreach`` is ``whole``'s one ``mul`` of the buffer into a kept
    fp32 scratch and one ``_foreach_copy_`` out of it. Accumulating has
    ``routes`` alone: a trial would add more than once."""

    def routes(tensors, scale):
        plan.run(tensors, segments, scale, products=narrowing)

    def accumulate(tensors, scale):
        plan.run(tensors, segments, scale, True)

    def scaled(copy):
        def fn(tensors, scale):
            copy(tensors)
            if scale != 1.0:
                torch._foreach_mul_(tensors, scale)
        return fn

    copies = {
        "foreach": lambda tensors: torch._foreach_copy_(tensors, segments),
        "per_tensor": lambda tensors: [t.copy_(view) for t, view in zip(tensors, segments)],
    }
    if packed is not None:
        # split_with_sizes_copy resizes an out= of another shape: 1-D views
        copies["concat"] = lambda tensors: torch.split_with_sizes_copy(
            packed, numels, out=[t if t.dim() == 1 else t.view(-1) for t in tensors])
    candidates = {ACCUMULATE: {"routes": accumulate}}
    for unit, route in ((True, 0), (False, 1)):
        candidates[unit] = {"routes": routes}
        if segments and len(plan.routes(unit)[route]) == len(segments):
            candidates[unit].update((name, scaled(copy)) for name, copy in copies.items())
    if whole is not None:
        candidates[False]["foreach"] = whole  # Choice calls whole.release if another is kept
    if scaled_copies is not None:
        def scratch(tensors, scale):
            scaled_copies(tensors, segments, scale)
        scratch.release = scaled_copies.release  # Choice calls it if another is kept
        candidates[False]["scratch"] = scratch
    return candidates


def _found_nonfinite(tensors, out) -> torch.Tensor:
    """True if any *input* element is inf or NaN, as a 0-d bool tensor.

    A non-finite input always gives a non-finite output (inf*0 is NaN), so on
    the CPU one pass over ``out`` rules out the common all-finite case; only
    when it finds something (maybe an overflow of ``x * scale``) are the inputs
    checked. On an accelerator the inputs are checked without a host sync.
    """
    device = out.device
    if device.type == "cpu" and bool(torch.isfinite(out).all()):
        return torch.zeros((), dtype=torch.bool)
    flags = [~torch.isfinite(t).all() for t in tensors if t.numel() > 0]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()
