"""A step captured in a CUDA graph: what is refused during capture, and what
replays.

Inside ``torch.cuda.graph`` nothing may read the device from the host, and
nothing may upload to it from pageable host memory: the first fails deep
inside CUDA, the second is recorded with values that go stale on replay.
fusedreduce keeps its steady state free of both (prepared launches, device-side
clip coefficients, postscale vectors uploaded once), and refuses, with a
``RuntimeError`` that names the step and the remedy, each thing that still
needs one: a layout no eager call prepared, the torch backend's read of a
tensor scale, ``find_unused_parameters=True``, ``error_if_nonfinite=True``,
``shard=True``'s backward, the one-shot functions that check the ranks at
every call (``adasum_allreduce``, the broadcasts) and a DDP hook state's first
bucket (it checks the ranks' hook options). It also refuses what the
host decides step by step and a replay would freeze: ``bcast_period`` > 0 and
``backward_passes_per_step`` > 1; and ``buffers=``'s broadcast after each step.

On the CPU, capture is simulated: ``kernels._checks.capturing`` is patched to
say "capturing", tensors made from host data (``torch.tensor``,
``torch.as_tensor``: on a GPU, an upload from pageable memory) are patched to
fail, and so are the host reads a capture forbids (``Tensor.item``,
``tolist``, ``__bool__``, ``__float__``, ``__int__``), so a steady-state step
that passes here issues none of them from Python and takes none of the
refused paths. The ``cuda_only`` tests capture a whole
``DistributedOptimizer`` and ``register_hooks`` step on one GPU (NCCL, one
rank: the collective is then skipped) and check that replays are bitwise the
eager steps; their procedure also runs on the CPU, with the capture
simulated, so that a GPU session does not find a bug in the test itself.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fusedreduce.kernels import _checks as kernel_checks
from fusedreduce.kernels import flatten_cast_scale, unflatten_cast_scale
from fusedreduce.local_ranks import run_on_local_ranks
from harness import run_ranks

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
#: torch functions that make a tensor from host data: on a GPU, inside a
#: capture, an upload from pageable memory, which CUDA refuses
HOST_UPLOADS = ("tensor", "as_tensor")


@contextlib.contextmanager
def simulated_capture(forbid_host_reads: bool = True):
    """While inside: fusedreduce sees a capturing stream, a tensor made from
    host data raises, and (with ``forbid_host_reads``) so does a tensor read
    on the host."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    saved_uploads = {name: getattr(torch, name) for name in HOST_UPLOADS}
    saved_capturing = kernel_checks.capturing

    def forbidden(name, what):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} ({what}) during the simulated capture")
        return call

    kernel_checks.capturing = lambda device: True
    for name in HOST_UPLOADS:
        setattr(torch, name, forbidden(f"torch.{name}", "an upload on a GPU"))
    if forbid_host_reads:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbidden(f"Tensor.{name}", "a host read"))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        for name, function in saved_uploads.items():
            setattr(torch, name, function)
        kernel_checks.capturing = saved_capturing


# ---------------------------------------------------------------- the kernels

def _grads():
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(5, dtype=torch.float16)]


def test_a_prepared_layout_runs_in_capture_and_a_new_one_is_refused_before_writing(backend):
    grads = _grads()
    flat = torch.empty(11, dtype=torch.float32)
    flatten_cast_scale(grads, out=flat, scale=0.5, backend=backend)  # the eager warm-up
    want = flat.clone()
    flat.fill_(7.0)
    with simulated_capture(forbid_host_reads=False):
        flatten_cast_scale(grads, out=flat, scale=0.5, backend=backend)
        assert torch.equal(flat, want)
        flat.fill_(7.0)
        # the same shapes at other addresses (gradients set to None and
        # allocated again) and a buffer never seen: both need a new launch
        for tensors, out in (([g.clone() for g in grads], flat),
                             (grads, torch.full((11,), 7.0))):
            with pytest.raises(RuntimeError, match="CUDA graph capture.*set_to_none=False"):
                flatten_cast_scale(tensors, out=out, scale=0.5, backend=backend)
            assert torch.all(out == 7.0)


def test_the_unflatten_s_prepared_layout_runs_in_capture_too(backend):
    outputs = [torch.empty(2, 3), torch.empty(5, dtype=torch.float16)]
    flat = torch.arange(11, dtype=torch.float32)
    unflatten_cast_scale(flat, outputs, scale=2.0, backend=backend)
    want = [o.clone() for o in outputs]
    for o in outputs:
        o.zero_()
    with simulated_capture(forbid_host_reads=False):
        unflatten_cast_scale(flat, outputs, scale=2.0, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(outputs, want))


def test_the_torch_backend_s_tensor_scale_is_refused_in_capture():
    grads = _grads()
    flat = torch.empty(11)
    scale = torch.tensor(0.5)
    flatten_cast_scale(grads, out=flat, scale=scale, backend="torch")
    flat.fill_(7.0)
    with simulated_capture(forbid_host_reads=False):
        with pytest.raises(RuntimeError, match="CUDA graph capture.*Triton backend"):
            flatten_cast_scale(grads, out=flat, scale=scale, backend="torch")
    assert torch.all(flat == 7.0)


def test_outside_a_capture_nothing_is_refused():
    # the real check: a CPU tensor is never captured
    assert not kernel_checks.capturing(torch.device("cpu"))
    kernel_checks.refuse_in_capture(torch.device("cpu"), "anything", "nothing")


# --------------------------------------------------------- a whole step, gloo

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 7), torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def _batch(rank, step):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _train(model, optimizer, rank, steps, first=0, capture_from=None):
    """``steps`` steps; from step ``capture_from`` on, inside a simulated capture."""
    for step in range(first, first + steps):
        captured = capture_from is not None and step >= capture_from
        with simulated_capture() if captured else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=False)
            model(_batch(rank, step)).backward()
            optimizer.step()


def _message_in_capture(call):
    """The ``RuntimeError`` message ``call()`` raises in a simulated capture,
    or None if it runs."""
    try:
        with simulated_capture():
            call()
    except RuntimeError as exc:
        return str(exc)
    return None


def _refusal(rank, make, steps=2):
    """The message a simulated capture of the step after ``steps`` eager
    ones raises, or None."""
    model = _Net()
    optimizer = make(model)
    _train(model, optimizer, rank, steps)
    return _message_in_capture(lambda: _train(model, optimizer, rank, 1, first=steps))


def capture_on_rank(rank, world_size):
    from fusedreduce import DistributedOptimizer

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    results = {}
    for name, options in (("plain", {}), ("clipped", {"max_grad_norm": 0.05}),
                          ("bucket_views", {"gradient_as_bucket_view": True}),
                          ("clipped_inf_norm", {"max_grad_norm": 0.05,
                                                "norm_type": float("inf")}),
                          # the norm's reading shared: one more all-reduce
                          ("clipped_split", {"max_grad_norm": 0.05, "split_norm": True}),
                          # AdaSum's tree: point-to-point messages and
                          # coefficients computed on the device
                          ("adasum_clipped", {"reduce_method": "adasum",
                                              "max_grad_norm": 0.05})):
        runs = []
        for capture_from in (None, 2):
            model = _Net()
            # the default options otherwise: their steady state reads nothing
            # the GPU's kernels (under Triton's interpreter): the torch
            # fallback reads a tensor scale on the host, which is refused
            optimizer = DistributedOptimizer(sgd(model), param_pack_thd=150, backend="triton",
                                             **options)
            _train(model, optimizer, rank, 4, capture_from=capture_from)
            runs.append([p.detach().clone() for p in model.parameters()])
        results[name] = runs
    results["refused"] = {
        "find_unused": _refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=True)),
        "error_if_nonfinite": _refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=False, max_grad_norm=1.0, error_if_nonfinite=True)),
        "shard": _refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=False, shard=True)),
        # the host counts which steps broadcast, and which passes reduce: a
        # replay would repeat the captured step's choice
        "bcast_period": _refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=False, bcast_period=3)),
        # buffers= broadcasts after every step (a replay would not); on one
        # rank there is nothing to broadcast, and the step captures
        "buffers": _refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=False, buffers=[torch.zeros(2)])),
        "accumulation": _accumulation_refusal(rank, lambda m: DistributedOptimizer(
            sgd(m), find_unused_parameters=False, backward_passes_per_step=2)),
        "reducer_call": _reducer_call_refusal(rank),
        "adasum_allreduce": _one_shot_refusal(rank, world_size, "adasum_allreduce"),
        "broadcast_tensors": _one_shot_refusal(rank, world_size, "broadcast_tensors"),
    }
    return results


def _accumulation_refusal(rank, make):
    """The message a simulated capture of a backward raises after two eager
    steps of two passes each (None if it ran)."""
    model = _Net()
    optimizer = make(model)
    for step in range(2):
        optimizer.zero_grad(set_to_none=False)
        for micro in range(2):
            model(_batch(rank, 2 * step + micro)).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return _message_in_capture(lambda: model(_batch(rank, 4)).backward())


def _reducer_call_refusal(rank):
    """The message a simulated capture of a reducer call (MindSpore's way:
    new tensors returned) raises after two eager calls (None if it ran)."""
    from fusedreduce import DistributedGradReducer
    model = _Net()
    reducer = DistributedGradReducer(list(model.parameters()), backend="triton")
    grads = [torch.full_like(p, rank + 1.0) for p in model.parameters()]
    for _ in range(2):
        reducer(grads)
    return _message_in_capture(lambda: reducer(grads))


def _one_shot_refusal(rank, world_size, name):
    """The message a simulated capture of the one-shot function ``name``
    raises (None if it ran), after checking it left its input untouched."""
    import fusedreduce
    tensors = [torch.full((3,), float(rank + 1)), torch.ones(2, dtype=torch.float16)]
    before = [t.clone() for t in tensors]
    call = {"adasum_allreduce": lambda: fusedreduce.adasum_allreduce(tensors),
            "broadcast_tensors": lambda: fusedreduce.broadcast_tensors(tensors, src=0)}[name]
    message = _message_in_capture(call)
    if message is not None:
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    return message


@pytest.fixture(scope="module", params=[1, 2])
def captured(request):
    return run_ranks(capture_on_rank, request.param)


@pytest.mark.parametrize("name", ["plain", "clipped", "bucket_views", "clipped_inf_norm",
                                  "clipped_split", "adasum_clipped"])
def test_a_steady_state_step_passes_a_simulated_capture_and_gives_the_eager_step(captured,
                                                                                  name):
    for rank, r in enumerate(captured):
        eager, in_capture = r[name]
        assert all(torch.equal(a, b) for a, b in zip(eager, in_capture)), f"rank {rank}"
        # and the steps did something
        assert not all(torch.equal(a, b) for a, b in zip(eager, _Net().parameters()))


@pytest.mark.parametrize("name, remedy", [
    ("find_unused", "find_unused_parameters=False"),
    ("error_if_nonfinite", "error_if_nonfinite=False"),
    ("shard", "shard=True runs eagerly"),
    ("bcast_period", "bcast_period=0 or -1"),
    ("accumulation", "passes_per_sync=1 (backward_passes_per_step=1)"),
    ("reducer_call", "register_hooks() reduces .grad in place"),
    ("adasum_allreduce", "DistributedOptimizer or DistributedGradReducer"),
    ("broadcast_tensors", "DistributedOptimizer or DistributedGradReducer")])
def test_what_needs_the_host_is_refused_during_capture_on_every_rank(captured, name, remedy):
    for rank, r in enumerate(captured):
        message = r["refused"][name]
        assert message is not None and "CUDA graph capture" in message and remedy in message, \
            f"rank {rank}: {message}"


# --------------------------------------------- DDP with fusedreduce's hooks

#: hook name, HookState options: the fused all-reduce and the bf16 wire
#: clipped (each bucket's future completes when every bucket is reduced),
#: AdaSum's tree with and without clipping
DDP_CASES = {"allreduce_clipped": ("allreduce_hook", {"max_grad_norm": 0.05}),
             "bf16_clipped": ("bf16_compress_hook", {"max_grad_norm": 0.05}),
             "allreduce_clipped_split": ("allreduce_hook", {"max_grad_norm": 0.05,
                                                            "split_norm": True}),
             "adasum": ("adasum_hook", {}),
             "adasum_clipped": ("adasum_hook", {"max_grad_norm": 0.05})}


def _ddp(hook: str, options: dict):
    from fusedreduce import hooks
    model = _Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # the GPU's kernels, interpreted: the torch fallback reads a tensor scale
    ddp.register_comm_hook(hooks.HookState(backend="triton", **options), getattr(hooks, hook))
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def ddp_capture_on_rank(rank, world_size):
    results = {}
    for name, (hook, options) in DDP_CASES.items():
        runs = []
        for capture_from in (None, 2):
            model, ddp, optimizer = _ddp(hook, options)
            _train(ddp, optimizer, rank, 4, capture_from=capture_from)
            runs.append([p.detach().clone() for p in model.parameters()])
        results[name] = runs
    _, ddp, optimizer = _ddp("allreduce_hook", {"max_grad_norm": 1.0,
                                                "error_if_nonfinite": True})
    _train(ddp, optimizer, rank, 2)
    results["refused"] = _message_in_capture(lambda: _train(ddp, optimizer, rank, 1, first=2))
    # a state's first bucket compares the ranks' hook options on the host
    _, ddp, optimizer = _ddp("allreduce_hook", {})
    results["refused_unwarmed"] = _message_in_capture(lambda: _train(ddp, optimizer, rank, 1))
    return results


@pytest.fixture(scope="module", params=[1, 2])
def ddp_captured(request):
    return run_ranks(ddp_capture_on_rank, request.param)


@pytest.mark.parametrize("name", sorted(DDP_CASES))
def test_a_ddp_step_with_fusedreduce_hooks_passes_a_simulated_capture(ddp_captured, name):
    # DDP's own capture support is torch's; what is checked here is that the
    # hooks, after DDP's first iterations, read nothing on the host and
    # prepare nothing, and that the step is bitwise the eager one
    for rank, r in enumerate(ddp_captured):
        eager, in_capture = r[name]
        assert all(torch.equal(a, b) for a, b in zip(eager, in_capture)), f"rank {rank}"
        assert not all(torch.equal(a, b) for a, b in zip(eager, _Net().parameters()))


def test_a_ddp_hook_that_must_read_the_norm_is_refused_during_capture(ddp_captured):
    for rank, r in enumerate(ddp_captured):
        message = r["refused"]
        assert message is not None and "CUDA graph capture" in message and \
            "error_if_nonfinite=False" in message, f"rank {rank}: {message}"


def test_a_hook_state_s_first_bucket_is_refused_during_capture(ddp_captured):
    for rank, r in enumerate(ddp_captured):
        message = r["refused_unwarmed"]
        assert message is not None and "CUDA graph capture" in message and \
            "HookState" in message and "eager step" in message, f"rank {rank}: {message}"


# ------------------------------------------------------ a real capture, a GPU

def _capture_and_replay(rank, world_size, hooked: bool, clipped: bool):
    """Warm up on a side stream, capture one step in ``torch.cuda.graph``,
    replay it on new data copied into the static input; beside it, a twin
    stepped eagerly on the same data. Returns both parameter lists per step.

    On the CPU (a gloo rank) the same procedure runs with the capture
    simulated and each "replay" an eager step: the test's own plumbing,
    checked where it is cheap, before a GPU session spends time on it."""
    from fusedreduce import DistributedGradReducer, DistributedOptimizer
    on_gpu = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    clip = {"max_grad_norm": 0.05} if clipped else {}

    def make():
        model = _Net().to(device)
        # capturable Adam needs CUDA tensors
        adam = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=on_gpu)
        if hooked:
            reducer = DistributedGradReducer(list(model.parameters()), bucket_cap_mb=1e-4,
                                             backend="auto" if on_gpu else "triton",
                                             **clip).register_hooks()
            return model, adam, reducer
        # off the GPU, the GPU's kernels, interpreted
        optimizer = DistributedOptimizer(adam, param_pack_thd=150,
                                         find_unused_parameters=False,
                                         backend="auto" if on_gpu else "triton", **clip)
        return model, optimizer, None

    graphed, graphed_optimizer, graphed_reducer = make()
    twin, twin_optimizer, twin_reducer = make()
    static_x = _batch(rank, 0).to(device)

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=False)
        loss = model(static_x)
        loss.backward()
        optimizer.step()
        return loss

    if on_gpu:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        warm_up = torch.cuda.stream(side)
    else:
        warm_up = contextlib.nullcontext()
    with warm_up:
        for warm in range(3):
            static_x.copy_(_batch(rank, warm))
            step(graphed, graphed_optimizer)
            step(twin, twin_optimizer)
    if on_gpu:
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(graphed, graphed_optimizer)
        replay = graph.replay
    else:
        def replay():
            # Adam reads its step count on the host off the GPU: only the
            # refusals are simulated here
            with simulated_capture(forbid_host_reads=False):
                step(graphed, graphed_optimizer)
    seen = []
    for replayed in range(3, 7):
        static_x.copy_(_batch(rank, replayed))
        replay()
        step(twin, twin_optimizer)
        if on_gpu:
            torch.cuda.synchronize(device)
        seen.append(([p.detach().cpu().clone() for p in graphed.parameters()],
                     [p.detach().cpu().clone() for p in twin.parameters()]))
    del graphed_reducer, twin_reducer
    return seen


def _check_replays(seen):
    for replay, (graphed, eager) in enumerate(seen):
        assert all(torch.equal(a, b) for a, b in zip(graphed, eager)), f"replay {replay}"
    # the replays moved the parameters
    assert not all(torch.equal(a, b) for a, b in zip(seen[0][0], seen[-1][0]))


def _every_capture_case(rank, world_size):
    return {(hooked, clipped): _capture_and_replay(rank, world_size, hooked, clipped)
            for hooked in (False, True) for clipped in (False, True)}


def test_the_gpu_capture_test_s_procedure_runs_on_the_cpu():
    (cases,) = run_ranks(_every_capture_case, 1)
    for case, seen in cases.items():
        _check_replays(seen)


@pytest.mark.cuda_only
@pytest.mark.parametrize("hooked", [False, True], ids=["distributed_optimizer", "register_hooks"])
@pytest.mark.parametrize("clipped", [False, True], ids=["unclipped", "clipped"])
def test_a_captured_step_replays_bitwise_as_the_eager_step(hooked, clipped):
    (seen,) = run_on_local_ranks(_capture_and_replay, 1, hooked, clipped, backend="nccl")
    _check_replays(seen)


def test_buffers_broadcast_is_refused_during_capture_where_it_communicates(captured):
    for rank, r in enumerate(captured):
        message = r["refused"]["buffers"]
        if len(captured) == 1:
            assert message is None, message
        else:
            assert message is not None and "CUDA graph capture" in message and \
                "call broadcast_buffers() between replays" in message, f"rank {rank}: {message}"
