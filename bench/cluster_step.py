"""Whole training steps timed on gloo ranks: torch DDP against the library.

A step pattern has ``cluster_patterns``' shape (built once per rank from the
process groups and the flat gradient buffer, which it ignores; a call returns
its phase seconds), so ``run_patterns`` times it round-robin with the others
and counts the bytes each node's link sent. It trains ``CharTransformer``
(``WIDTH`` = 384, ``LAYERS`` = 4: 7.3M parameters, a 29 MB fp32 gradient) on
``BATCH`` random windows of ``SEQUENCE`` tokens per rank, every rank its own:
forward, backward, AdamW's step, ``zero_grad``, one phase timed from a
barrier. Every pattern starts from the same weights.

- ``step_ddp``: ``torch.nn.parallel.DistributedDataParallel`` (its default
  25 MiB buckets, overlapped with backward).
- ``step_fp32``, ``step_bfloat16``, ``step_int8_ef``: the library's
  ``DistributedOptimizer`` around the same AdamW, ``local_size`` the
  cluster's ranks per node, with no wire option, ``wire_dtype=torch.bfloat16``,
  and ``wire_dtype=torch.int8, error_feedback=True``.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fusedreduce import DistributedOptimizer

#: the model's shape: a character transformer a few times examples/train_wire.py's
#: width, so that its gradient (29 MB fp32) takes a link time of the order of its compute
VOCAB = 256
WIDTH = 384
LAYERS = 4
SEQUENCE = 64
BATCH = 2


class CharTransformer(nn.Module):
    """Embedding, ``layers`` causal pre-norm encoder blocks (a head per 64 of
    ``width``), a linear head."""

    def __init__(self, width: int = WIDTH, layers: int = LAYERS, vocab: int = VOCAB) -> None:
        super().__init__()
        heads = max(1, width // 64)
        self.embedding = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embedding(tokens), mask=mask, is_causal=True))


def parameter_count(width: int = WIDTH, layers: int = LAYERS) -> int:
    """The elements of ``CharTransformer(width, layers)``'s gradient."""
    return sum(p.numel() for p in CharTransformer(width, layers).parameters())


def training_step(groups, grads: torch.Tensor, kind: str = "library", width: int = WIDTH,
                  layers: int = LAYERS, **options) -> Callable[[], Tuple[Dict[str, float], None]]:
    """One rank's training step, with DDP (``kind="ddp"``) or the library's
    ``DistributedOptimizer(local_size=groups.local_size, **options)``; the
    returned step's ``model`` attribute is the model it trains.

    Raises:
        ValueError: ``kind`` neither "ddp" nor "library".
    """
    if kind not in ("ddp", "library"):
        raise ValueError(f"kind must be 'ddp' or 'library', got {kind!r}")
    torch.manual_seed(0)
    model = CharTransformer(width, layers)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "ddp":
        net: nn.Module = nn.parallel.DistributedDataParallel(model)
        optimizer: torch.optim.Optimizer = adamw
    else:
        net = model
        optimizer = DistributedOptimizer(adamw, local_size=groups.local_size, **options)
    generator = torch.Generator().manual_seed(2000 + groups.rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=generator)

    def step() -> Tuple[Dict[str, float], Optional[torch.Tensor]]:
        dist.barrier()
        started = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"step": time.perf_counter() - started}, None
    step.model = model  # type: ignore[attr-defined]  # what it trains, for a test to read
    return step


#: pattern name -> builder(groups, grads) -> step; a step returns (its seconds, None)
STEP_PATTERNS = {
    "step_ddp": functools.partial(training_step, kind="ddp"),
    "step_fp32": training_step,
    "step_bfloat16": functools.partial(training_step, wire_dtype=torch.bfloat16),
    "step_int8_ef": functools.partial(training_step, wire_dtype=torch.int8, error_feedback=True),
}
