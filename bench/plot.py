"""``--plot PATH.png``: GB/s against size, one panel per case, one line per method.

matplotlib is optional (the ``bench`` extra) and imported only here, only when
a plot is asked for.
"""
from __future__ import annotations

import importlib
import math
from typing import List, Sequence

from . import output_files

# fusedreduce is installed from a checkout, not by name from an index
INSTALL_HINT = 'pip install matplotlib (the "bench" extra: pip install -e ".[bench]" in a checkout)'
# ours solid, the baselines dashed, the copy reference dotted
LINE_STYLES = {"ours": "-", "baseline": "--", "reference": ":"}


def require_matplotlib() -> None:
    """Raise ``SystemExit`` with the install command unless matplotlib can be imported.

    The CLI calls this before measuring anything, so a missing extra costs
    nothing but the message.
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise SystemExit(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") \
            from None


def write_plot(path: str, results: Sequence[dict], title: str) -> None:
    """Write a PNG of ``gbps`` against ``n_elements`` for every (benchmark, case)."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels: List[tuple] = list(dict.fromkeys((r["benchmark"], r["case"]) for r in results))
    if not panels:
        raise ValueError("no results to plot")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (benchmark, case) in zip(axes.flat, panels):
        rows_ = [r for r in results if (r["benchmark"], r["case"]) == (benchmark, case)
                 and r["gbps"] is not None]
        for method in dict.fromkeys(r["method"] for r in rows_):
            points = sorted((r["n_elements"], r["gbps"]) for r in rows_ if r["method"] == method)
            role = next(r["role"] for r in rows_ if r["method"] == method)
            ax.plot([x for x, _ in points], [y for _, y in points], LINE_STYLES[role],
                    marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")  # copies, collectives and whole steps differ by decades
        ax.set_xlabel("gradient elements (total)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{benchmark}: {case}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(output_files.make_parents(path), format="png", dpi=110)
    plt.close(fig)
