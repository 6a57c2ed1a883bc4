"""Drop-in use in torch-convention code: hook states as torch's hooks take them, a lazy
and picklable HookState, and DistributedOptimizer.step(closure).

The references are torch's own behaviour: DDP with ``state=None`` (and torch's
``allreduce_hook`` with a process group as state) for the hooks, and the same
optimizer stepped without a closure, or without an interruption, for the
optimizer. Comparisons are by bytes.
"""
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import TIMEOUT, run_ranks
from fusedreduce import DistributedOptimizer, hooks
from fusedreduce.hooks import HookState


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _ddp_grads(rank, state, hook, steps=2):
    model = DDP(_net())
    model.register_comm_hook(state, hook)
    for step in range(steps):  # the second step runs on DDP's rebuilt buckets
        model.zero_grad()
        x, y = _batch(rank, step)
        ((model(x) - y) ** 2).sum().backward()
    return [_bytes(p.grad) for p in model.parameters()]


# ------------------------------------------------------------------ hook states

def _states_as_torch_takes_them(rank, world_size, pickled_state):
    pair = dist.new_group([0, 1])  # collective: every rank makes it
    return {
        "none": _ddp_grads(rank, None, hooks.allreduce_hook),
        "world group": _ddp_grads(rank, dist.group.WORLD, hooks.allreduce_hook),
        "a group object": _ddp_grads(rank, pair, hooks.allreduce_hook),
        "made before init_process_group, pickled": _ddp_grads(
            rank, pickle.loads(pickled_state), hooks.allreduce_hook),
        "torch's hook, group state": _ddp_grads(rank, pair, default_hooks.allreduce_hook),
        "fp16, group state": _ddp_grads(rank, pair, hooks.fp16_compress_hook),
        "fp16, None": _ddp_grads(rank, None, hooks.fp16_compress_hook),
    }


@pytest.mark.timeout(TIMEOUT)
def test_hooks_take_none_a_process_group_or_a_hook_state_made_before_init():
    # built here, in a process with no process group, as Lightning builds it
    assert not dist.is_initialized()
    state = HookState(prescale=1.0)
    results = run_ranks(_states_as_torch_takes_them, 2, pickle.dumps(state))
    for outcome in results:
        reference = outcome["none"]
        for name in ("world group", "a group object", "made before init_process_group, pickled",
                     "torch's hook, group state"):
            assert all(torch.equal(a, b) for a, b in zip(reference, outcome[name])), name
        assert all(torch.equal(a, b) for a, b in zip(outcome["fp16, None"],
                                                     outcome["fp16, group state"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["none"], results[1]["none"]))


def test_a_hook_state_is_cheap_checks_what_it_can_and_pickles_without_a_process_group():
    assert not dist.is_initialized()
    state = HookState(prescale=0.25, local_size=2, backend="torch")
    again = pickle.loads(pickle.dumps(state))
    assert (again.prescale, again.local_size, again.backend, again.group) == \
        (0.25, 2, "torch", None)
    # what needs the group waits for it, and then says what is missing
    with pytest.raises(RuntimeError, match="init_process_group"):
        again.world_size
    for kwargs, error in (({"prescale": 0.0}, ValueError), ({"prescale": "1"}, TypeError),
                          ({"local_size": 0}, ValueError), ({"backend": "cuda"}, ValueError)):
        with pytest.raises(error):
            HookState(**kwargs)


def _pickled_with_a_subgroup(rank, world_size):
    solo = dist.new_group([0])
    if rank != 0:
        return None
    state = HookState(solo)
    again = pickle.loads(pickle.dumps(state))
    outcome = {"group after unpickling": again.group}
    try:
        again.world_size
        outcome["first use"] = None
    except RuntimeError as exc:
        outcome["first use"] = str(exc)
    again.group = solo
    outcome["after setting the group"] = again.world_size
    return outcome


@pytest.mark.timeout(TIMEOUT)
def test_a_state_pickled_with_a_subgroup_asks_for_its_group_instead_of_using_the_world():
    outcome = run_ranks(_pickled_with_a_subgroup, 2)[0]
    assert outcome["group after unpickling"] is None
    assert outcome["first use"] is not None and "state.group" in outcome["first use"] \
        and "[0]" in outcome["first use"]
    assert outcome["after setting the group"] == 1


# ------------------------------------------------------------------ step(closure)

def _train(rank, world_size, use_closure, passes, steps=4, resume_at=None, lbfgs=False):
    model = _net(1)

    def optimizer_for(net):
        inner = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=3) if lbfgs else \
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        opt = DistributedOptimizer(inner, backward_passes_per_step=passes)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    opt, sched = optimizer_for(model)
    losses = []
    for step in range(steps):
        if step == resume_at:  # a checkpoint, then a fresh process would load it
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved)
            model = _net(7)  # other weights: everything must come from the checkpoint
            model.load_state_dict(checkpoint["model"])
            opt, sched = optimizer_for(model)
            opt.load_state_dict(checkpoint["opt"])
            sched.load_state_dict(checkpoint["sched"])
        x, y = _batch(rank, step)

        def loss_of(micro):
            return ((model(x[micro::passes]) - y[micro::passes]) ** 2).sum()

        opt.zero_grad()
        for micro in range(passes - 1):  # the accumulating passes, outside the step
            loss_of(micro).backward()

        def closure():
            if lbfgs:
                opt.zero_grad()
            loss = loss_of(passes - 1)
            loss.backward()
            return loss

        if use_closure:
            losses.append(float(opt.step(closure)))
        else:
            losses.append(float(closure()))
            opt.step()
        sched.step()
    return [_bytes(p) for p in model.parameters()], losses


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("passes", [1, 2])
def test_step_with_a_closure_trains_exactly_as_backward_then_step(passes):
    plain = run_ranks(_train, 2, False, passes)
    closure = run_ranks(_train, 2, True, passes)
    for (weights, losses), (weights_c, losses_c) in zip(plain, closure):
        assert all(torch.equal(a, b) for a, b in zip(weights, weights_c))
        assert losses == losses_c  # the closure's loss is what step returns
    assert all(torch.equal(a, b) for a, b in zip(closure[0][0], closure[1][0]))


@pytest.mark.timeout(TIMEOUT)
def test_checkpoint_and_resume_with_closures_gives_the_uninterrupted_run_bitwise():
    uninterrupted = run_ranks(_train, 2, True, 2, 5)
    resumed = run_ranks(_train, 2, True, 2, 5, 3)
    for (weights, losses), (weights_r, losses_r) in zip(uninterrupted, resumed):
        assert all(torch.equal(a, b) for a, b in zip(weights, weights_r))
        assert losses == losses_r


@pytest.mark.timeout(TIMEOUT)
def test_lbfgs_checkpoint_and_resume_gives_the_uninterrupted_run_bitwise():
    # LBFGS keeps flat state over every parameter (its directions, under the
    # first parameter): load_state_dict takes it as torch's own does
    uninterrupted = run_ranks(_train, 2, True, 1, 4, None, True)
    resumed = run_ranks(_train, 2, True, 1, 4, 2, True)
    for (weights, losses), (weights_r, losses_r) in zip(uninterrupted, resumed):
        assert all(torch.equal(a, b) for a, b in zip(weights, weights_r))
        assert losses == losses_r


@pytest.mark.timeout(TIMEOUT)
def test_an_optimizer_that_reevaluates_its_closure_works_and_ranks_agree():
    results = run_ranks(_train, 2, True, 1, 3, None, True)
    (weights0, losses0), (weights1, _) = results
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))
    assert all(loss == loss for loss in losses0)  # finite, not NaN


# ------------------------------------------------------------------ steady state

def _compress_hook_wires(rank, world_size):
    from fusedreduce.kernels import _prepared
    state = HookState()
    model = DDP(_net(), bucket_cap_mb=1 / 2 ** 12)  # a few buckets
    model.register_comm_hook(state, hooks.fp16_compress_hook)
    seen = []
    for step in range(4):
        model.zero_grad()
        x, y = _batch(rank, step)
        ((model(x) - y) ** 2).sum().backward()
        wires = sorted(map(id, state.wire_buffers))
        launches = {id(entry.launch) for entry in _prepared.LAUNCHES._entries.values()}
        seen.append((wires, launches))
    return seen


@pytest.mark.timeout(TIMEOUT)
def test_the_compress_hooks_cast_into_kept_buffers_with_kept_launches():
    for seen in run_ranks(_compress_hook_wires, 2):
        # DDP rebuilds its buckets after the first iteration; from then on the
        # same wire buffers and the same prepared launches serve every step,
        # and the first iteration's buffer is dropped one iteration later
        assert seen[2] == seen[3]
        assert seen[1][0] == sorted(set(seen[0][0]) | set(seen[2][0]))
        assert not set(seen[0][0]) & set(seen[3][0])


# ------------------------------------------------------------------ what DDP logs

def _logged_hook_names(rank, world_size):
    names = {}
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "adasum_hook"):
        model = DDP(_net())
        model.register_comm_hook(None, getattr(hooks, name))
        x, y = _batch(rank, 0)
        ((model(x) - y) ** 2).sum().backward()
        names[name] = model._get_ddp_logging_data().get("comm_hook")
    return names


@pytest.mark.timeout(TIMEOUT)
def test_ddp_logs_name_the_fusedreduce_hooks_and_they_pickle():
    names = run_ranks(_logged_hook_names, 2)[0]
    assert names == {name: f"fusedreduce_{name}" for name in names}
    for name in names:  # spawn-started workers receive the hook by pickle
        hook = getattr(hooks, name)
        assert pickle.loads(pickle.dumps(hook)) is hook


# ------------------------------------------- activation checkpointing and torch.compile

class _Blocks(nn.Module):
    """Three blocks; ``variant`` says which are recomputed in backward:
    ``"plain"`` checkpoints the middle one (recomputed inside the one backward),
    the reentrant kinds run a backward of their own inside the outer one:
    ``"reentrant"`` around the middle block (hooks fire in the outer backward,
    then the inner one, then the outer again), ``"reentrant_last"`` around the
    last block (the inner backward fires first), ``"reentrant_shared"`` around
    the middle block, which is applied again outside it (its gradients are
    accumulated twice in one pass)."""

    def __init__(self, variant):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.variant = variant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        middle = lambda t: torch.tanh(self.middle(t))  # noqa: E731
        reentrant = self.variant.startswith("reentrant")
        x = torch.tanh(self.first(x))
        if self.variant in ("plain", "reentrant", "reentrant_shared"):
            x = checkpoint(middle, x, use_reentrant=reentrant)
        else:
            x = middle(x)
        if self.variant == "reentrant_shared":
            x = middle(x)
        if self.variant == "reentrant_last":
            return checkpoint(self.last, x, use_reentrant=True)
        return self.last(x)


def _variant_model(variant):
    model = _Blocks(variant)
    # aot_eager traces forward and backward into graphs without generating
    # code: the reference model compiled the same way computes the same bits
    return model, (torch.compile(model, backend="aot_eager") if variant == "compiled" else model)


def _reduce_in_training_code(rank, world_size, api, passes):
    from harness import record_collectives
    events = []
    record_collectives(events)
    return {variant: _train_variant(rank, world_size, variant, api, passes, events)
            for variant in VARIANTS}


def _train_variant(rank, world_size, variant, api, passes, events):
    from fusedreduce import DistributedGradReducer
    model, run = _variant_model(variant)
    reference, run_reference = _variant_model(variant)
    params = list(model.parameters())
    if api == "distributed_optimizer":
        opt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1), param_pack_thd=64,
                                   backward_passes_per_step=passes)
    else:
        DistributedGradReducer(params, bucket_cap_mb=1 / 2 ** 14).register_hooks(
            passes, gradient_as_bucket_view=api == "reducer_bucket_view")
        opt = torch.optim.SGD(params, lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    mismatches, all_reduces = [], []
    for step in range(3):
        opt.zero_grad()
        reference_opt.zero_grad()
        for micro in range(passes):
            x, y = _batch(rank, 10 * step + micro)
            x.requires_grad_()  # reentrant checkpointing needs an input that requires grad
            events.clear()
            ((run(x) - y) ** 2).sum().backward()
            all_reduces.append(events.count("all_reduce"))
            ((run_reference(x) - y) ** 2).sum().backward()
        for p in reference.parameters():  # the reference: all_reduce, then the mean
            dist.all_reduce(p.grad)
            p.grad /= world_size  # a power of two: the same bits as the reducer's postscale
        mismatches += [(step, i) for i, (p, q) in enumerate(zip(params, reference.parameters()))
                       if not torch.equal(_bytes(p.grad), _bytes(q.grad))]
        opt.step()
        reference_opt.step()
    return mismatches, all_reduces, [_bytes(p) for p in params]


VARIANTS = ("plain", "reentrant", "reentrant_last", "reentrant_shared", "compiled")


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("api,passes", [("reducer", 1), ("reducer", 2),
                                        ("reducer_bucket_view", 1),
                                        ("distributed_optimizer", 1)])
def test_activation_checkpointing_and_torch_compile_reduce_as_an_all_reduce(api, passes):
    # the hooks fire inside checkpointing's recomputation (for the reentrant
    # kind, inside a backward that ends before the outer one) and in a
    # compiled backward; every gradient must be reduced exactly once a step,
    # with one all_reduce per bucket, and accumulation passes stay local
    buckets = 6  # one per parameter at these caps
    by_rank = run_ranks(_reduce_in_training_code, 2, api, passes, timeout=2 * TIMEOUT)
    for variant in VARIANTS:
        results = [ranks_results[variant] for ranks_results in by_rank]
        for mismatches, all_reduces, _ in results:
            assert mismatches == [], (variant, mismatches)
            # the optimizer adds none: its check for gradients no rank had
            # rides in the buckets' own all-reduces
            expected = ([0] * (passes - 1) + [buckets]) * 3
            expected[passes - 1] += 1  # the first reduction checks the ranks' plans
            if variant == "reentrant_shared" and api != "reducer_bucket_view":
                # the first pass finds the middle block's two accumulations
                # after their buckets started, and starts those again
                expected[passes - 1] += 2
            assert all_reduces == expected, (variant, all_reduces)
        assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2])), variant


def _shared_from_the_second_step(rank, world_size, bucket_view):
    """The middle block is also used outside its reentrant checkpoint from the
    second step on: a gradient accumulated twice that the first pass did not see."""
    from harness import outcomes, record_collectives
    from fusedreduce import DistributedGradReducer
    model, reference = _Blocks("reentrant"), _Blocks("reentrant")
    params = list(model.parameters())
    DistributedGradReducer(params, bucket_cap_mb=1 / 2 ** 14).register_hooks(
        gradient_as_bucket_view=bucket_view)
    events, steps = [], []
    record_collectives(events)
    for step in range(3):
        model.variant = reference.variant = "reentrant" if step == 0 else "reentrant_shared"
        for m in (model, reference):
            m.zero_grad()
        x, y = _batch(rank, step)
        x.requires_grad_()
        events.clear()
        raised = outcomes({"backward": lambda: ((model(x) - y) ** 2).sum().backward()})
        all_reduces = events.count("all_reduce")
        ((reference(x) - y) ** 2).sum().backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        same = [torch.equal(_bytes(p.grad), _bytes(q.grad))
                for p, q in zip(params, reference.parameters())]
        steps.append((raised["backward"], all_reduces, same))
    return steps


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_gradient_accumulated_twice_only_from_a_later_step_on(bucket_view):
    for steps in run_ranks(_shared_from_the_second_step, 2, bucket_view):
        (error0, count0, same0), (error1, count1, same1), (error2, count2, same2) = steps
        assert error0 is None and all(same0) and count0 == 6 + 1  # + the plan check
        if bucket_view:
            # the middle block's buckets were on the wire when the second
            # accumulation landed in them: refused, saying why
            assert error1 is not None and error1[0] == "RuntimeError", error1
            assert "accumulated twice" in error1[1] and "gradient_as_bucket_view" in error1[1]
        else:  # started again at the end: exact, two all-reduces more
            assert error1 is None and all(same1) and count1 == 6 + 2, steps[1]
        # from then on those buckets wait for the end of backward
        assert error2 is None and all(same2) and count2 == 6, steps[2]


def _sharded_gradients_under_checkpoints(rank, world_size):
    """DistributedOptimizer(shard=True, shard_gradients=True) against
    shard=True alone under each checkpointing variant (3 steps, bitwise), and
    a gradient accumulated twice only from the second step on."""
    from harness import outcomes
    from fusedreduce import DistributedOptimizer

    def optimizer(model, shard_gradients):
        return DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), shard=True,
                                    shard_gradients=shard_gradients, param_pack_thd=64)
    seen = {}
    for variant in ("plain", "reentrant", "reentrant_last", "reentrant_shared", "later_shared"):
        first = "reentrant" if variant == "later_shared" else variant
        models = [_Blocks(first), _Blocks(first)]
        optimizers = [optimizer(m, sharded) for m, sharded in zip(models, (False, True))]
        steps = []
        for step in range(3):
            if variant == "later_shared" and step > 0:
                for m in models:
                    m.variant = "reentrant_shared"
            x, y = _batch(rank, step)
            raised = {}
            for i, (m, opt) in enumerate(zip(models, optimizers)):
                raised[i] = outcomes({"backward": lambda m=m: ((m(x) - y) ** 2).sum().backward()})
                if raised[i]["backward"] is None:
                    opt.step()
                opt.zero_grad()
            steps.append((raised[1]["backward"],
                          all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                                models[1].parameters()))))
        seen[variant] = steps
    return seen


@pytest.mark.timeout(TIMEOUT)
def test_sharded_gradients_under_activation_checkpointing():
    for seen in run_ranks(_sharded_gradients_under_checkpoints, 2):
        for variant in ("plain", "reentrant", "reentrant_last", "reentrant_shared"):
            # a gradient accumulated twice from the first pass on is found by
            # that pass, which holds every bucket to its end
            assert seen[variant] == [(None, True)] * 3, (variant, seen[variant])
        (error0, same0), (error1, _), (error2, same2) = seen["later_shared"]
        assert error0 is None and same0
        # released gradients cannot be read again: refused, saying why
        assert error1 is not None and error1[0] == "RuntimeError", error1
        assert "accumulated twice" in error1[1] and "shard_gradients=True" in error1[1]
        assert error2 is None
