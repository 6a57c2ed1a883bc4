"""Train a small character-level GPT as GPT training scripts do, changed only for fusedreduce.

    python examples/train_gpt.py --world-size 2                 # every way, 2 local gloo workers
    torchrun --nproc_per_node=2 examples/train_gpt.py --way ddp,sharded

The loop is the one most GPT training scripts share (nanoGPT's ``train.py`` is
the best known of them): a seed per rank (so the replicas start apart and the
data-parallel wrapper makes them equal), a decoder with tied input and output
embeddings, AdamW with a decayed and a non-decayed parameter group, a learning
rate warmed up and cosine-decayed, set on every group at each iteration,
gradient accumulation over micro-steps, ``GradScaler.unscale_`` then
``torch.nn.utils.clip_grad_norm_``, and a checkpoint of the model and the
optimizer that the master rank writes. The text is the Zen of Python (shipped
with Python: nothing is downloaded).

Each ``--way`` is the smallest change a user makes to such a script:

- ``ddp``: the script as written, DistributedDataParallel (the reference);
- ``hook``: ``ddp.register_comm_hook(None, fusedreduce.hooks.allreduce_hook)``;
- ``optimizer``: no DDP; the optimizer wrapped in
  ``fusedreduce.DistributedOptimizer(opt, backward_passes_per_step=k)``;
- ``sharded``: the same with ``shard=True`` (ZeRO-1);
- ``zero2``: the same with ``shard=True, shard_gradients=True`` (ZeRO-2).

``--clip torch`` (default) leaves the script's ``clip_grad_norm_`` in the
loop; ``--clip fused`` removes it and passes ``max_grad_norm=`` to the
``DistributedOptimizer`` ways instead, setting ``optimizer.loss_scale`` to
the GradScaler's scale at each iteration (DDP's ways keep torch's). With a
``DistributedOptimizer`` the checkpoint takes the optimizer's state with
``optimizer.state_dict(to=0)`` on every rank, rank 0 saving it: with
``shard=True`` the call is collective. ``--checkpoint-as-written`` keeps the
script's ``optimizer.state_dict()`` inside ``if master_process:``, to show
what that does: with ``shard=True`` rank 0 raises a RuntimeError naming the
call and the fix after ``--checkpoint-timeout`` seconds.

``--uneven`` gives the ranks different amounts of data, as per-rank shards
of a corpus do: rank r runs out r quarters of the iterations and one
micro-step early (in the middle of an accumulation window), and the loop runs inside DDP's
``model.join()`` or, for the ``DistributedOptimizer`` ways, torch's
``Join([optimizer], grad_scaler=scaler)``; the checkpoint is then written
once after it. The sharded ways under ``Join`` need ``--clip fused``: a rank
that ran out steps its part of the parameters at every pass of the others,
and torch's clip over the shares is a collective it cannot know of.

Rank 0 prints, per way, the final loss, how far its losses came from DDP's,
a digest of the final weights and whether the ranks' weights are bitwise
equal; ``--json`` writes every loss too.
"""
from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import fusedreduce
from fusedreduce import hooks
from fusedreduce.local_ranks import run_on_local_ranks

WAYS = ("ddp", "hook", "optimizer", "sharded", "zero2")
FUSED = ("optimizer", "sharded", "zero2")


def zen_of_python() -> str:
    """The Zen of Python's text, read from the ``this`` module's source
    (importing it would print the text)."""
    source = open(importlib.util.find_spec("this").origin, encoding="utf-8").read()
    encoded = next(node.value.value for node in ast.parse(source).body
                   if isinstance(node, ast.Assign) and node.targets[0].id == "s")
    return codecs.decode(encoded, "rot13")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention, self.projection = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.attention(self.norm1(x)).split(width, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocabulary: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.token.weight  # tied embeddings
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def learning_rate(iteration: int, args) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if iteration < args.warmup:
        return args.lr * (iteration + 1) / args.warmup
    progress = (iteration - args.warmup) / max(1, args.iterations - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(way: str, args, text: torch.Tensor, vocabulary: int, directory: str) -> dict:
    """One training run the way ``way`` changes the script; rank 0's record of it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    master_process = rank == 0
    torch.manual_seed(1337 + rank)  # as the scripts do: the replicas start apart
    model = GPT(vocabulary, args.context, args.width, args.layers, args.heads)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    fused_clip = args.clip == "fused" and way in FUSED
    if way in ("ddp", "hook"):
        module = DistributedDataParallel(model)
        if way == "hook":
            module.register_comm_hook(None, hooks.allreduce_hook)
    else:
        module = model
        optimizer = fusedreduce.DistributedOptimizer(
            optimizer, backward_passes_per_step=args.accumulation,
            shard=way in ("sharded", "zero2"), shard_gradients=way == "zero2",
            max_grad_norm=args.grad_clip if fused_clip else None,
            checkpoint_timeout=args.checkpoint_timeout if way in ("sharded", "zero2") else None)
    scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)
    losses = []
    micro_steps = args.iterations * args.accumulation  # this rank's data
    if args.uneven:  # per-rank shards: rank r runs out in the middle of a window
        early = rank * (args.iterations // 4 * args.accumulation + 1)
        micro_steps = max(0, micro_steps - early)
    uneven = contextlib.nullcontext()
    if args.uneven:
        uneven = module.join() if way in ("ddp", "hook") else \
            Join([optimizer], grad_scaler=scaler)
    with uneven:
        for iteration in range(args.iterations):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(iteration, args)
            if args.checkpoint_every and iteration and iteration % args.checkpoint_every == 0 \
                    and not args.uneven:
                save_checkpoint(way, args, model, optimizer, master_process, directory)
            if fused_clip:  # the limit is for the unscaled norm: tell the clip the scale
                optimizer.loss_scale = scaler.scale(torch.ones(()))
            total, ran_out = 0.0, False
            for micro_step in range(args.accumulation):
                if iteration * args.accumulation + micro_step == micro_steps:
                    ran_out = True
                    break
                if way in ("ddp", "hook"):
                    module.require_backward_grad_sync = micro_step == args.accumulation - 1
                start = torch.randint(len(text) - args.context - 1, (args.batch,))
                window = torch.stack([text[s:s + args.context + 1] for s in start.tolist()])
                loss = module(window[:, :-1], window[:, 1:]) / args.accumulation
                total += loss.item()
                scaler.scale(loss).backward()
            if ran_out:
                break
            if not fused_clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
    if args.uneven and args.checkpoint_every:  # every rank is here: the calls may be collective
        save_checkpoint(way, args, model, optimizer, master_process, directory)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, digest)
    return {"way": way, "clip": "fused" if fused_clip else "torch", "losses": losses,
            "weights": weights.tolist(), "digest": digest,
            "ranks_equal": len(set(everyone)) == 1}


def save_checkpoint(way: str, args, model: nn.Module, optimizer, master_process: bool,
                    directory: str) -> None:
    if way in FUSED and not args.checkpoint_as_written:
        state = optimizer.state_dict(to=0)  # on every rank: collective with shard=True
        if master_process:
            torch.save({"model": model.state_dict(), "optimizer": state},
                       os.path.join(directory, f"{way}.pt"))
        return
    if master_process:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(directory, f"{way}.pt"))


def run(rank: int, world_size: int, args) -> list:
    torch.set_num_threads(1)  # a tiny model: threads only spin on a shared host
    characters = zen_of_python()
    alphabet = sorted(set(characters))
    text = torch.tensor([alphabet.index(c) for c in characters])
    with tempfile.TemporaryDirectory() as directory:
        return [train(way, args, text, len(alphabet), directory) for way in args.way]


def report(results: list, args, world_size: int) -> None:
    print(f"gpt: {world_size} ranks x {args.accumulation} micro-steps x {args.batch} windows "
          f"of {args.context}, {args.iterations} iterations, clip {args.grad_clip} ({args.clip}), "
          f"GradScaler {'on' if args.scaler else 'off'}")
    reference = next((r for r in results if r["way"] == "ddp"), None)
    print(f"{'way':>10}  {'clip':>5}  {'final loss':>10}  {'vs ddp':>8}  {'weights vs ddp':>14}  "
          f"{'digest':>16}  ranks equal")
    for r in results:
        if reference is None:
            losses = weights = "-"
        else:
            losses = f"{max(abs(a - b) for a, b in zip(r['losses'], reference['losses'])):.1e}"
            weights = f"{max(abs(a - b) for a, b in zip(r['weights'], reference['weights'])):.1e}"
        print(f"{r['way']:>10}  {r['clip']:>5}  {r['losses'][-1]:10.4f}  {losses:>8}  "
              f"{weights:>14}  {r['digest']:>16}  {r['ranks_equal']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"world_size": world_size, "results": results}, handle)
        print(f"wrote {args.json}", file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="local gloo workers to spawn (ignored under torchrun)")
    parser.add_argument("--way", default=",".join(WAYS),
                        help=f"comma-separated, any of {','.join(WAYS)}")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-steps per iteration")
    parser.add_argument("--batch", type=int, default=8, help="windows per micro-step and rank")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--grad-clip", type=float, default=0.5)
    parser.add_argument("--clip", choices=("torch", "fused"), default="torch")
    parser.add_argument("--scaler", action=argparse.BooleanOptionalAction, default=True,
                        help="a GradScaler (unscale_ before the clip) as fp16 scripts have")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="iterations between checkpoints (0: none)")
    parser.add_argument("--checkpoint-as-written", action="store_true",
                        help="keep optimizer.state_dict() inside 'if master_process:'")
    parser.add_argument("--checkpoint-timeout", type=float, default=None, metavar="SECONDS",
                        help="the sharded ways' checkpoint_timeout (default: the library's)")
    parser.add_argument("--uneven", action="store_true",
                        help="rank r runs out of data r quarters of the iterations and one "
                             "micro-step early; "
                             "the loop runs under model.join() / Join([optimizer])")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    args.way = [w.strip() for w in args.way.split(",") if w.strip()]
    unknown = sorted(set(args.way) - set(WAYS))
    if unknown or not args.way:
        parser.error(f"--way: unknown {unknown}; choose from {','.join(WAYS)}")
    sharded = sorted(set(args.way) & {"sharded", "zero2"})
    if args.uneven and sharded and args.clip != "fused":
        parser.error(f"--uneven with {','.join(sharded)} needs --clip fused: under Join a rank "
                     f"that ran out steps its part of the parameters at every pass of the "
                     f"others, and torch's clip over the shares is a collective it cannot "
                     f"know of")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        results = run(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank() == 0:
            report(results, args, dist.get_world_size())
        dist.destroy_process_group()
    else:
        results = run_on_local_ranks(run, args.world_size, args)[0]
        report(results, args, args.world_size)


if __name__ == "__main__":
    main()
