"""Which of the torch fallback's strategies a kept launch runs, chosen once.

A kept launch of the flatten family on torch can compute its result several
ways (``STRATEGIES``), each offered only where it writes exactly the
kernels' bits; which one is fastest depends on the layout and the machine.
``Choice`` times them on the launch's real tensors at its second call of a
kind and keeps the fastest for every later call of that kind;
``FUSEDREDUCE_TORCH_STRATEGY`` forces one (``forced_strategy``).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional

#: the environment variable that forces one strategy of the torch fallback's
#: kept launches (read when a layout is prepared): ``auto`` (unset) times them
STRATEGY_VARIABLE = "FUSEDREDUCE_TORCH_STRATEGY"
#: the strategies: ``routes`` (``CopyPlan``, always offered), ``foreach`` (one
#: ``_foreach_copy_``, then one ``mul_`` of the whole buffer or one
#: ``_foreach_mul_`` of the outputs; a scaled unflatten into 16 bits: one
#: ``mul`` of the whole buffer into a kept scratch, then the copy), ``concat`` (``torch.cat(out=)`` /
#: ``torch.split_with_sizes_copy(out=)``, packed contiguous layouts),
#: ``per_tensor`` (one ``copy_`` per tensor, then the same scaling),
#: ``scratch`` (a scaled unflatten into the buffer's own dtype, or a scaled
#: flatten into a 16-bit buffer: each run of segments multiplied in a kept
#: fp32/fp64 scratch while in cache, where the others scale every tensor
#: apart)
STRATEGIES = ("routes", "foreach", "concat", "per_tensor", "scratch")
#: a trial runs every candidate, round-robin, at least the first and at most
#: the second number of rounds, and starts no new round once it has taken
#: ``TRIAL_BUDGET_S``: the minimum of several runs, so that one run slowed by
#: another process does not decide, and a bounded cost (ResNet-50's 161
#: gradients on a 2-core CPU: 4 candidates, ~0.1 ms a run at 250K elements,
#: ~10 ms at 25.6M, so 10 rounds in ~4 ms, or 2 rounds in ~80 ms)
TRIAL_ROUNDS = (2, 10)
TRIAL_BUDGET_S = 0.02
#: another strategy replaces ``routes`` only when its shortest run is shorter
#: by more than this fraction: on a busy CPU one candidate's runs vary by
#: more than the few percent that separate close candidates, and a choice
#: made on noise would be kept for good
TRIAL_MARGIN = 0.05


def forced_strategy() -> Optional[str]:
    """The strategy ``FUSEDREDUCE_TORCH_STRATEGY`` forces, or None (unset or ``auto``).

    Raises:
        ValueError: the variable holds anything else.

    Examples:
        >>> forced_strategy() in (None,) + STRATEGIES
        True
    """
    value = os.environ.get(STRATEGY_VARIABLE, "auto").strip().lower()
    if value == "auto":
        return None
    if value not in STRATEGIES:
        raise ValueError(f"{STRATEGY_VARIABLE} must be 'auto' or one of {STRATEGIES}, got "
                         f"{os.environ[STRATEGY_VARIABLE]!r}")
    return value


class Choice:
    """A kept launch's strategies for each kind of call, and the one kept for each.

    ``candidates``: ``{kind: {name: fn}}``, ``routes`` first in each; every
    ``fn(tensors, scale)`` writes the same bits. A kind with one candidate
    takes it; a forced strategy is taken where it is offered (``routes``
    elsewhere); with ``trial`` false (not on the CPU: on accelerators the
    Triton kernels are the fast path, and a timed trial there would need a
    synchronisation and could not be captured in a CUDA graph) ``routes``
    is kept. Otherwise the first call of a kind runs ``routes`` and the
    second times every candidate, round-robin (``TRIAL_ROUNDS``,
    ``TRIAL_BUDGET_S``; the candidates' runs write that call's result), and
    keeps the one of the shortest run (``routes`` unless another beats it by
    ``TRIAL_MARGIN``) for every later call; a candidate not kept that holds
    memory of its own (``fn.release``) gives it back.
    Waiting for the second call means a launch made for one call (a
    flatten with ``out=None``) never pays for a trial, and the trial runs
    on warm caches. ``chosen``: ``{kind: name}``; ``trial_s``: ``{kind:
    seconds}`` a trial took.
    """

    def __init__(self, candidates: Dict[object, Dict[str, Callable]], forced: Optional[str],
                 trial: bool):
        self.candidates = candidates
        self.chosen: Dict[object, str] = {}
        self.trial_s: Dict[object, float] = {}
        self._kept: Dict[object, Callable] = {}
        self._called = set()
        for kind, fns in candidates.items():
            if forced in fns:
                self._keep(kind, forced)
            elif len(fns) == 1 or forced is not None or not trial:
                self._keep(kind, "routes")

    def _keep(self, kind, name: str) -> None:
        self.chosen[kind] = name
        self._kept[kind] = self.candidates[kind][name]

    def run(self, kind, tensors, scale: float) -> None:
        """Write this call's result with the strategy kept for ``kind``, choosing it if due."""
        kept = self._kept.get(kind)
        if kept is not None:
            kept(tensors, scale)
        elif kind not in self._called:
            self._called.add(kind)
            self.candidates[kind]["routes"](tensors, scale)
        else:
            self._trial(kind, tensors, scale)

    def _trial(self, kind, tensors, scale: float) -> None:
        fns = self.candidates[kind]
        best = dict.fromkeys(fns, float("inf"))
        clock = time.perf_counter
        started = clock()
        fewest, most = TRIAL_ROUNDS
        for rounds in range(1, most + 1):
            for name, fn in fns.items():
                begin = clock()
                fn(tensors, scale)
                best[name] = min(best[name], clock() - begin)
            if rounds >= fewest and clock() - started > TRIAL_BUDGET_S:
                break
        self.trial_s[kind] = clock() - started
        fastest = min(best, key=best.get)
        if best[fastest] >= best["routes"] * (1 - TRIAL_MARGIN):
            fastest = "routes"
        self._keep(kind, fastest)
        # a candidate that holds memory of its own (a scratch) gives it back
        # when another is kept; it takes it again if it ever runs
        for name, fn in fns.items():
            if name != fastest and hasattr(fn, "release"):
                fn.release()
