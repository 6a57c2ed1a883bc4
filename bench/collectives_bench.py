"""Collective benchmarks on N ranks, all in one launch of the ranks.

Three parts, each in its own module, each case timed inside the same process
group (spawned local workers, or the ranks of a ``torchrun`` launch):

- ``reduce`` (``bench/reduce_bench.py``): the fused reducer against per-tensor
  all_reduce and DDP-style buckets, gradient reduction alone.
- ``step`` (``bench/step_bench.py``): a ResNet-50 training step under DDP, against
  the fused reducer's backward hooks and fusedreduce's DDP communication hooks.
- ``adasum`` (``bench/adasum_bench.py``): ``adasum_allreduce`` against an
  all_reduce of the same bytes, with the bytes each rank sends.

A part module has ``NAME``, ``FIXED_DTYPE`` (None: the cases take
``--dtype``), ``rank_measure(rank, world_size, device, case, config)`` run on
every rank, and ``records(outcome, case, config)`` that turns every rank's
measurement into result records.
"""
from __future__ import annotations

from typing import List

from . import adasum_bench, clip_bench, common, ranks, reduce_bench, step_bench

PARTS = {module.NAME: module for module in (reduce_bench, step_bench, adasum_bench,
                                            clip_bench)}
DEFAULT_SIZES = [4_000_000, 25_600_000]
QUICK_SIZES = [1_000_000]
DEFAULT_DTYPES = ["float32"]


def cases(config: dict) -> List[dict]:
    """Every ``{"part", "size", "dtype"}`` that ``config`` asks for, in run order."""
    out = []
    for part in config["parts"]:
        fixed = PARTS[part].FIXED_DTYPE
        for size in config["sizes"]:
            for dtype in [fixed] if fixed else config["dtypes"]:
                out.append({"part": part, "size": size, "dtype": dtype})
    return out


def _rank_body(rank: int, world_size: int, config: dict) -> List[dict]:
    device = ranks.rank_device(config["backend"])
    # rank 0 carries on the parent's progress bar; the others keep quiet
    progress = common.Progress(**dict(config["progress"], enabled=rank == 0
                                      and config["progress"]["enabled"]))
    outputs = []
    for case in cases(config):
        label = (f"collectives: {case['part']}, resnet50 {common.format_count(case['size'])} "
                 f"{case['dtype']}, {world_size} ranks")
        with progress.step(label):
            outputs.append(PARTS[case["part"]].rank_measure(rank, world_size, device, case,
                                                            config))
    return outputs


def run(config: dict, progress: common.Progress, joined: bool) -> List[dict]:
    """Every case of ``config`` (``parts``, ``sizes``, ``dtypes``, ``repeats``,
    ``world_size``, ``backend``, ``batch``, ``image``) on the ranks: the result
    records. ``joined``: this process is a rank of a ``torchrun`` launch already."""
    config = dict(config, progress=progress.state())
    if joined:
        outcome = ranks.run_in_launch(_rank_body, config)
    else:
        outcome = ranks.run_on_ranks(_rank_body, config["world_size"], config)
    results: List[dict] = []
    for i, case in enumerate(cases(config)):
        progress.done += 1
        results += PARTS[case["part"]].records(
            {rank: outputs[i] for rank, outputs in outcome.items()}, case, config)
    return results
