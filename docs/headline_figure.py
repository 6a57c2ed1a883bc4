"""Draw docs/headline_h100.png, the README's headline figure.

The figures are the `gpu-check` verdict table of one run on an NVIDIA H100
80GB HBM3 (torch 2.11.0+cu130, Triton 3.6.0, 2026-11-24):
`fusedreduce-bench gpu-check --json gpu-check.json --plot gpu-check.png`,
ResNet-50's 161 gradient tensors (25,557,032 elements), device time of one
call. "single copy" is one cast-copy of a single tensor with every element,
"torch's best" the fastest of `_foreach_copy_` (+ `mul_`), `cat(out=)`,
`_chunk_cat(out=)` and `split_with_sizes_copy(out=)` in the same run.

    python docs/headline_figure.py
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (case, fusedreduce GB/s, its ratio to the single copy, torch's best ratio to the copy)
CASES = [
    ("flatten\nfp16 → fp32", 2685, 1.43, 0.52),
    ("flatten\nfp32 → fp32", 2793, 1.02, 0.44),
    ("unflatten\nfp32 → fp16", 2657, 0.97, 0.36),
]

fig, ax = plt.subplots(figsize=(6.4, 2.9))
width = 0.27
for i, (case, ours, ours_x_copy, torch_x_copy) in enumerate(CASES):
    copy = ours / ours_x_copy
    bars = [("fusedreduce (one launch)", ours, "#2a7ab0"),
            ("torch's best multi-tensor op", copy * torch_x_copy, "#bbbbbb"),
            ("single-tensor copy", copy, "#777777")]
    for j, (label, gbps, color) in enumerate(bars):
        ax.bar(i + (j - 1) * width, gbps, width, color=color, label=label if i == 0 else None)
        ax.text(i + (j - 1) * width, gbps + 40, f"{gbps:,.0f}", ha="center", fontsize=7)
ax.set_xticks(range(len(CASES)), [c[0] for c in CASES], fontsize=8)
ax.set_ylabel("GB/s (device time)", fontsize=8)
ax.set_ylim(0, 3700)
ax.tick_params(axis="y", labelsize=7)
ax.set_title("ResNet-50's 161 gradients, 25.6M elements, H100", fontsize=9)
ax.legend(fontsize=7, loc="upper right", ncols=3, frameon=False, bbox_to_anchor=(1.0, 1.0))
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
fig.savefig(__file__.replace("headline_figure.py", "headline_h100.png"), dpi=120)
