"""A GPT training loop as users write it, changed only for fusedreduce, trains as its own DDP run.

examples/train_gpt.py has the loop most GPT training scripts share (per-rank
seeds, tied embeddings, AdamW with two groups, a cosine learning rate,
gradient accumulation, GradScaler.unscale_ then torch's clip_grad_norm_, a
checkpoint written by the master rank) and runs it once per way of
reducing, from the same start on the same batches, on 2 spawned gloo ranks.
nanoGPT's train.py resumes by loading the torch optimizer's state before it
wraps anything; the same order with a DistributedOptimizer continues DDP's run.
"""
import copy
import json
import subprocess
import sys

import pytest
import torch

import fusedreduce
from harness import ROOT, run_ranks

GPT = "examples/train_gpt.py"
#: how far a way whose clipping norm is summed in another order may drift from
#: DDP over the run: each step's norm differs from DDP's in its last fp32 bits
#: (eps 1.2e-7 relative: the norm summed over the ranks' parts, or from the
#: flat buffers, in another order), which 20 AdamW steps carried to 3.6e-7 on
#: the losses (~2.7 each) and 6e-6 on the weights in our runs. A rank clipping
#: by the norm of its own part (torch's clip on a sharded .grad) moves them
#: by 7.5e-2 and 2.1e-2 within the same steps
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-4


def _train(tmp_path, name, *options, iterations=20):
    out = tmp_path / f"{name}.json"
    process = subprocess.run([sys.executable, GPT, "--world-size", "2", "--iterations",
                              str(iterations), "--json", str(out), *options],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout + process.stderr[-4000:]
    return {r["way"]: r for r in json.loads(out.read_text())["results"]}, process.stdout


def _gaps(run, reference):
    """The largest loss and weight differences between two runs."""
    return tuple(max(abs(a - b) for a, b in zip(run[key], reference[key], strict=True))
                 for key in ("losses", "weights"))


def _assert_trains_as(run, reference, table):
    losses, weights = _gaps(run, reference)
    assert losses < LOSS_TOLERANCE and weights < WEIGHT_TOLERANCE, (run["way"], table)


@pytest.mark.slow
def test_the_gpt_loop_with_torchs_clip_left_in_trains_as_ddp_with_every_way(tmp_path):
    runs, table = _train(tmp_path, "torch_clip")
    ddp = runs["ddp"]
    assert all(run["ranks_equal"] for run in runs.values()), table
    # the hook and the unsharded optimizer reduce as DDP does: bitwise its model
    assert runs["hook"]["digest"] == ddp["digest"], table
    assert runs["optimizer"]["digest"] == ddp["digest"], table
    # sharded, torch's clip sees each rank's part: it must still clip by the
    # whole gradient's norm
    for way in ("sharded", "zero2"):
        _assert_trains_as(runs[way], ddp, table)


@pytest.mark.slow
def test_the_gpt_loop_with_the_fused_clip_trains_as_ddp(tmp_path):
    runs, table = _train(tmp_path, "fused_clip", "--clip", "fused",
                         "--way", "ddp,optimizer,sharded,zero2")
    assert all(run["ranks_equal"] for run in runs.values()), table
    for way in ("optimizer", "sharded", "zero2"):
        assert runs[way]["clip"] == "fused"
        _assert_trains_as(runs[way], runs["ddp"], table)


@pytest.mark.slow
def test_the_gpt_loop_on_uneven_shards_under_join_trains_as_ddps_join(tmp_path):
    # per-rank shards: rank 1 runs out of data five iterations and one
    # micro-step early, in the middle of an accumulation window; DDP's way
    # under model.join(), the DistributedOptimizer ways under Join([optimizer])
    runs, table = _train(tmp_path, "uneven", "--uneven", "--way", "ddp,hook,optimizer")
    assert all(run["ranks_equal"] for run in runs.values()), table
    assert runs["hook"]["digest"] == runs["ddp"]["digest"], table
    assert runs["optimizer"]["digest"] == runs["ddp"]["digest"], table
    # sharded under Join: the reduction's own clip, under the script's
    # GradScaler; a rank that ran out steps its part at the learning rate the
    # others' schedule set (at its own stale one the weights drift 3e-3 from
    # DDP's), unscaled by their scaler's scale and clipped at it
    runs, table = _train(tmp_path, "uneven_sharded", "--uneven", "--clip", "fused",
                         "--way", "ddp,sharded,zero2")
    assert all(run["ranks_equal"] for run in runs.values()), table
    for way in ("sharded", "zero2"):
        _assert_trains_as(runs[way], runs["ddp"], table)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["sharded", "zero2"])
def test_the_scripts_own_checkpoint_on_the_master_rank_raises_a_named_error_not_an_abort(way):
    # `if master_process: torch.save({..., "optimizer": optimizer.state_dict()})`
    # with shard=True: rank 0 alone in a collective call, rank 1 training on
    process = subprocess.run([sys.executable, GPT, "--world-size", "2", "--way", way,
                              "--iterations", "12", "--checkpoint-every", "5",
                              "--checkpoint-as-written", "--checkpoint-timeout", "3"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = process.stdout + process.stderr
    assert process.returncode != 0, output
    assert "DistributedOptimizer.state_dict() with shard=True is collective" in output, output
    assert "state_dict(to=0)" in output and "sharded_state_dict()" in output, output
    assert "EnforceNotMet" not in output and "SIGABRT" not in output, output


def _scaled_clipped_step(rank, world_size, tell_loss_scale, max_grad_norm):
    """One GradScaler step of a clipped DistributedOptimizer; what happened."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = fusedreduce.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 max_grad_norm=max_grad_norm)
    scaler = torch.amp.GradScaler("cpu")
    if tell_loss_scale:
        optimizer.loss_scale = scaler.scale(torch.ones(()))
    scaler.scale(model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)))
                 .sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        scaler.step(optimizer)
    except RuntimeError as exc:
        return "raised", str(exc), all(map(torch.equal, before, model.parameters()))
    return "stepped", "", all(map(torch.equal, before, model.parameters()))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_fused_clip_under_a_gradscaler_without_loss_scale_is_refused_at_the_first_step(
        world_size):
    # the scripts' smallest change: torch's clip line replaced by max_grad_norm=,
    # the GradScaler kept; the clip saw the scaled norm, so the step would be
    # 65536 times too small
    for outcome, message, unchanged in run_ranks(_scaled_clipped_step, world_size, False, 0.5):
        assert outcome == "raised" and unchanged, (outcome, message)
        assert "loss_scale is not set" in message and "scale 65536" in message
        assert "optimizer.loss_scale = scaler.scale(" in message


@pytest.mark.parametrize("tell_loss_scale, max_grad_norm", [(True, 0.5), (False, None),
                                                            (False, float("inf"))])
def test_a_gradscaler_step_goes_on_with_loss_scale_set_or_without_a_finite_clip(
        tell_loss_scale, max_grad_norm):
    for outcome, message, unchanged in run_ranks(_scaled_clipped_step, 2, tell_loss_scale,
                                                 max_grad_norm):
        assert outcome == "stepped" and not unchanged, message


def _resume_in_nanogpts_order(rank, world_size, options):
    """DDP trains 3 steps, saves as nanoGPT does (rank 0's optimizer.state_dict()),
    trains 3 more; a restarted job loads that state into a fresh torch AdamW
    *before* wrapping it (nanoGPT loads, then wraps the model in DDP) and trains
    the same 3 steps. The restarted parameters, the state, and its size."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 8))
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return model, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                         {"params": rest, "weight_decay": 0.0}], lr=1e-2)

    def train(model, optimizer, steps):
        for step in steps:
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    model, optimizer = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    train(ddp, optimizer, range(3))
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "optimizer": copy.deepcopy(optimizer.state_dict())}
    train(ddp, optimizer, range(3, 6))

    resumed, inner = build()
    resumed.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["optimizer"])
    wrapped = fusedreduce.DistributedOptimizer(inner, **options)
    held = sum(t.numel() for s in wrapped.state.values() for t in s.values() if t.dim() > 0)
    train(resumed, wrapped, range(3, 6))
    state = wrapped.state_dict(to=0) if options.get("shard") else wrapped.state_dict()
    return ([p.detach() for p in model.parameters()], [p.detach() for p in resumed.parameters()],
            optimizer.state_dict(), state, held)


@pytest.mark.parametrize("options", [{}, {"shard": True},
                                     {"shard": True, "shard_gradients": True}],
                         ids=["replicated", "zero1", "zero2"])
def test_an_optimizer_loaded_before_it_is_wrapped_resumes_ddps_run(options):
    world_size = 2
    whole = 2 * sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(16, 32),
                                                           torch.nn.Linear(32, 8)).parameters())
    results = run_ranks(_resume_in_nanogpts_order, world_size, options)
    held = [result[-1] for result in results]
    # sharded, the whole state loaded on every rank was cut to each rank's part
    assert held == [whole] * world_size if not options else sum(held) == whole, held
    for rank, (ddp, resumed, ddp_state, state, _) in enumerate(results):
        # no clipping, 2 ranks: the reduced gradients are DDP's bits
        assert all(map(torch.equal, ddp, resumed)), rank
        if rank == 0:
            assert ddp_state["param_groups"] == state["param_groups"]
            for i, entry in ddp_state["state"].items():
                assert all(torch.equal(v, state["state"][i][k]) for k, v in entry.items()), i
