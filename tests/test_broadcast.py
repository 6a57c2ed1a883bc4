"""parameter_broadcast and broadcast_optimizer_state on local gloo ranks.

Every rank starts from its own values (special bit patterns included: NaN
payloads, -0.0, subnormals, infinities); afterwards each tensor must hold the
source rank's exact bits, compared as integers so that NaN == NaN and
-0.0 != +0.0.

Rank functions never assert (a rank that raised would leave the others waiting
in a collective): they return what they saw and the parent judges it. A little
over 300 lines: each behaviour's rank function sits beside its test.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import (ONE_BYTE_MB, TIMEOUT, assert_raised_before_any_collective,
                     outcomes_and_collectives, record_collectives, run_ranks)
from fusedreduce import (DistributedOptimizer, broadcast_optimizer_state, broadcast_tensors,
                         parameter_broadcast)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float32: torch.int32, torch.float64: torch.int64, torch.bool: torch.uint8}

# per dtype: quiet NaN with a payload, signalling NaN, -0.0, the smallest
# subnormal, -inf (as raw bits of the dtype's width)
_SPECIAL = {
    torch.float16: [0x7E01, 0x7C01, -0x8000, 0x0001, -0x0400],
    torch.bfloat16: [0x7FC1, 0x7F81, -0x8000, 0x0001, -0x0080],
    torch.float32: [0x7FC00001, 0x7F800001, -0x80000000, 0x00000001, -0x00800000],
    torch.float64: [0x7FF8000000000001, 0x7FF0000000000001, -0x8000000000000000, 1,
                    -0x0010000000000000],
}


class _EveryDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.fp16 = nn.Parameter(torch.empty(7, dtype=torch.float16))
        self.bf16 = nn.Parameter(torch.empty(3, 5, dtype=torch.bfloat16))
        self.fp32 = nn.Linear(4, 3)
        self.fp64 = nn.Parameter(torch.empty(2, 3, dtype=torch.float64))
        self.transposed = nn.Parameter(torch.empty(4, 3).t())  # not contiguous
        self.frozen = nn.Parameter(torch.empty(6), requires_grad=False)
        self.norm = nn.BatchNorm1d(3)  # fp32 statistics and an int64 num_batches_tracked
        self.register_buffer("mask", torch.empty(9, dtype=torch.bool))
        self.register_buffer("counts", torch.empty(4, dtype=torch.int32))


def _module(seed):
    """An _EveryDtype whose every tensor holds values (and special bit
    patterns, shifted by ``seed``) of its own."""
    module = _EveryDtype()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, generator=gen) < 0.5)
            elif not t.is_floating_point():
                t.copy_(torch.randint(-1000, 1000, t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64))
                if not t.is_contiguous():
                    continue
                special = [b + (seed if b > 0 and b != 1 else 0) for b in _SPECIAL[t.dtype]]
                special = special[:t.numel()]
                t.view(-1).view(_BITS[t.dtype])[:len(special)] = torch.tensor(
                    special, dtype=_BITS[t.dtype])
    return module


def _bits(module):
    """Every parameter and buffer as raw integer bits, by name."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return {name: t.detach().clone().view(_BITS.get(t.dtype, t.dtype))
            for name, t in tensors.items()}


def _broadcasts(rank, world_size, calls):
    """For each call: (bits before, bits after) of a fresh module seeded by rank.
    ``"group": [ranks]`` makes a subgroup, and only its members call."""
    seen = []
    for kwargs in calls:
        module = _module(seed=rank)
        before = _bits(module)
        kwargs = dict(kwargs)
        if kwargs.get("cur_rank") == "this rank":
            kwargs["cur_rank"] = dist.get_rank()
        members = kwargs.get("group")
        if members is not None:
            kwargs["group"] = dist.new_group(members)
        if members is None or rank in members:
            parameter_broadcast(module, **kwargs)
        seen.append((before, _bits(module)))
    return seen


def _source(kwargs):
    """The source's global rank."""
    source = kwargs.get("src", kwargs.get("initial_rank", 0))
    return kwargs["group"][source] if "group" in kwargs else source


def _assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), what


@pytest.mark.parametrize("world_size, calls", [
    (2, [{}, {"bucket_cap_mb": ONE_BYTE_MB, "cur_rank": "this rank"}]),
    (3, [{"initial_rank": 1}, {"src": 2, "cur_rank": "this rank"},
         {"group": [0, 2], "src": 1}]),
], ids=["2ranks-from-rank-0", "3ranks-from-ranks-1-and-2-and-a-subgroup"])
def test_every_parameter_and_buffer_becomes_bitwise_equal_to_the_source(world_size, calls):
    results = run_ranks(_broadcasts, world_size, calls, timeout=TIMEOUT)
    names = set(_bits(_module(0)))
    for c, kwargs in enumerate(calls):
        source = _source(kwargs)
        want = results[source][c][0]
        assert set(want) == names
        for rank in range(world_size):
            before, after = results[rank][c]
            if rank not in kwargs.get("group", range(world_size)):
                assert all(torch.equal(before[n], after[n]) for n in names), \
                    f"call {kwargs}: rank {rank} is not in the group but changed"
                continue
            for name in names:
                _assert_bitwise(after[name], want[name],
                                f"call {kwargs}: rank {rank}'s {name} differs from rank {source}'s")
                if rank != source:  # it really changed
                    assert not torch.equal(before[name], after[name]), name


def test_a_layout_or_buffers_false_limits_what_is_broadcast():
    calls = [{"layout": {"fp16": None, "fp32.weight": "any value"}}, {"buffers": False}]
    results = run_ranks(_broadcasts, 2, calls, timeout=TIMEOUT)
    param_names = set(dict(_EveryDtype().named_parameters()))
    broadcast = [{"fp16", "fp32.weight"}, param_names]
    for c, (kwargs, names) in enumerate(zip(calls, broadcast)):
        source_bits = results[0][c][0]
        before, after = results[1][c]
        for name in after:
            want = source_bits[name] if name in names else before[name]
            _assert_bitwise(after[name], want, f"{kwargs}: rank 1's {name}")


def test_without_a_process_group_the_errors_say_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        parameter_broadcast(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        broadcast_optimizer_state(optimizer)


def test_what_is_not_a_module_or_an_optimizer_is_a_type_error_before_any_communication():
    # the type checks come first: no process group needed, none started, and
    # nothing passed in is touched
    assert not dist.is_initialized()
    module = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    params = list(module.parameters())
    before = [p.detach().clone() for p in params]
    not_modules = {"a list of tensors": params, "model.parameters()": module.parameters(),
                   "a state_dict": module.state_dict(), "None": None, "a tensor": params[0]}
    for what, value in not_modules.items():
        with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module.*"
                                            r"broadcast_tensors") as raised:
            parameter_broadcast(value)
        assert type(value).__name__ in str(raised.value), what
    for layout in ("weight", 3, params[0]):  # a string, an int, a tensor
        with pytest.raises(TypeError, match="layout must be a dict keyed by parameter name"):
            parameter_broadcast(module, layout=layout)
    not_optimizers = {"a list of parameters": params, "param_groups": optimizer.param_groups,
                      "a state_dict": optimizer.state_dict(), "None": None, "a module": module}
    for value in not_optimizers.values():
        with pytest.raises(TypeError, match=f"optimizer must be a torch.optim.Optimizer, got "
                                            f"{type(value).__name__}"):
            broadcast_optimizer_state(value)
    assert not dist.is_initialized()
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert not optimizer.state


def _bad_arguments(rank, world_size):
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    broadcast = lambda **kwargs: lambda: parameter_broadcast(module, **kwargs)  # noqa: E731
    cases = {
        "cur_rank of another rank": broadcast(cur_rank=(rank + 1) % world_size),
        "initial_rank=-1": broadcast(initial_rank=-1),
        "initial_rank=world_size": broadcast(initial_rank=world_size),
        "src=world_size": broadcast(src=world_size),
        "src=-1": broadcast(src=-1),
        "src=1.0": broadcast(src=1.0),
        "a layout name not in named_parameters": broadcast(layout={"0.weight": 0, "nope": 0}),
        "a buffer name in the layout": broadcast(layout={"1.running_mean": 0}),
        "optimizer state from src=world_size": lambda: broadcast_optimizer_state(
            optimizer, src=world_size),
        "optimizer state from src=-1": lambda: broadcast_optimizer_state(optimizer, src=-1),
    }
    tensors = [p.detach() for p in module.parameters()]
    for name, kwargs in BAD_BROADCAST_TENSORS.items():
        cases[name] = lambda kw=dict(kwargs): broadcast_tensors(kw.pop("tensors", tensors), 0,
                                                                 **kw)
    return outcomes_and_collectives(cases)


# broadcast_tensors' bad arguments: (case, kwargs, exception, fragment)
BAD_BROADCAST_TENSORS_ROWS = [
    ("tensors of ints", dict(tensors=[1, 2]), "TypeError", "tensors[0] must be a tensor"),
    ("a meta tensor", dict(tensors=[torch.zeros(2, device="meta")]), "ValueError",
     "tensors[0] is a meta tensor"),
    ("verify a string", dict(verify="False"), "TypeError", "verify must be a bool"),
    ("an unknown backend", dict(backend="x"), "ValueError", "backend must be one of"),
    ("names a string", dict(names="abcd"), "TypeError", "names must be a list of strings"),
    ("names too few", dict(names=["a"]), "ValueError", "names must hold one string per tensor"),
    ("names not strings", dict(names=[1, 2, 3, 4]), "ValueError",
     "names must hold one string per tensor"),
]
BAD_BROADCAST_TENSORS = {f"broadcast_tensors {case}": kwargs
                         for case, kwargs, _, _ in BAD_BROADCAST_TENSORS_ROWS}


def test_bad_ranks_and_unknown_layout_names_are_value_errors_on_every_rank():
    results = run_ranks(_bad_arguments, 2, timeout=TIMEOUT)
    fragments = {
        "cur_rank of another rank": "cur_rank", "initial_rank=-1": "initial_rank",
        "initial_rank=world_size": "initial_rank", "src=world_size": "src",
        "src=-1": "src", "src=1.0": "src",
        "a layout name not in named_parameters": "nope",
        "a buffer name in the layout": "1.running_mean",
        "optimizer state from src=world_size": "src", "optimizer state from src=-1": "src",
    }
    expected = {name: ("ValueError", fragment) for name, fragment in fragments.items()}
    expected.update({f"broadcast_tensors {case}": (kind, fragment)
                     for case, _, kind, fragment in BAD_BROADCAST_TENSORS_ROWS})
    assert_raised_before_any_collective(results, expected)


def _mismatched_modules(rank, world_size):
    seen = {}
    modules = {
        # rank 1's second layer is wider: the same names, a different shape
        "a differently shaped 1.weight": lambda r: nn.Sequential(
            nn.Linear(3, 2), nn.Linear(2, 4 if r == 1 else 2)),
        # rank 1 has an extra layer: its 2.weight is missing on rank 0
        "an extra layer on rank 1": lambda r: nn.Sequential(
            nn.Linear(3, 2), nn.Linear(2, 2), *([nn.Linear(2, 1)] if r == 1 else [])),
    }
    same = lambda r: nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))  # noqa: E731
    cases = {name: (make, {"buffers": False}) for name, make in modules.items()}
    # the same modules but different bucket caps: the buckets would not match
    cases["different bucket caps"] = (
        same, {"bucket_cap_mb": 25.0 if rank == 0 else ONE_BYTE_MB})
    # each rank naming itself the source: each would send and wait for the
    # others; named as such whether or not the tensor lists agree too
    cases["different source ranks"] = (same, {"src": rank})
    cases["different source ranks and tensor counts"] = (
        modules["an extra layer on rank 1"], {"src": rank})
    for name, (make, kwargs) in cases.items():
        module = make(rank)
        before = [p.detach().clone() for p in module.parameters()]
        try:
            parameter_broadcast(module, **kwargs)
            seen[name] = None
        except RuntimeError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
            seen[name] = (str(exc), unchanged)
    return seen


def test_mismatched_modules_are_a_runtime_error_naming_the_parameter_on_every_rank():
    # without the check (before it compared src, too: each rank naming itself
    # the source timed out in gloo's send) the broadcasts would have different sizes: gloo aborts
    # a process or, worse, the ranks copy garbage into each other's weights
    results = run_ranks(_mismatched_modules, 2, timeout=TIMEOUT)
    for rank, seen in enumerate(results):
        for name, fragment in {"a differently shaped 1.weight": "1.weight",
                               "an extra layer on rank 1": "2.weight",
                               "different bucket caps": "bucket_cap_mb",
                               "different source ranks": "disagree on src: rank 0: 0; rank 1: 1",
                               "different source ranks and tensor counts":
                                   "disagree on src: rank 0: 0; rank 1: 1"}.items():
            assert seen[name] is not None, f"rank {rank}: {name} did not raise"
            message, unchanged = seen[name]
            assert fragment in message, f"rank {rank}: {name}: {message}"
            assert unchanged, f"rank {rank}: {name}: parameters changed before the error"


# ---------------------------------------------------------- optimizer state
def _net():
    gen = torch.Generator().manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net


def _train_locally(net, optimizer, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        optimizer.step()


def _optimizer(name, net, is_source):
    """The source's hyperparameters differ from everyone else's."""
    lr = 0.1 if is_source else 0.5
    if name == "adam":
        return torch.optim.Adam(net.parameters(), lr=lr,
                                betas=(0.8, 0.95) if is_source else (0.9, 0.999))
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9 if is_source else 0.5)


def _state_bits(optimizer):
    state = optimizer.state_dict()
    tensors = {(k, name): v.clone().view(_BITS[v.dtype])
               for k, entry in state["state"].items() for name, v in entry.items()
               if isinstance(v, torch.Tensor)}
    others = {(k, name): v for k, entry in state["state"].items() for name, v in entry.items()
              if not isinstance(v, torch.Tensor)}
    groups = [{k: v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, others, groups


def _optimizer_states(rank, world_size, src, stepped):
    """Per optimizer: the state before and after broadcast_optimizer_state, and
    the parameters after one more identical step everywhere."""
    seen = {}
    for name in ("adam", "sgd"):
        net = _net()
        # the source (and ranks in ``stepped``) trained with their own data and
        # hyperparameters; the others never stepped
        optimizer = _optimizer(name, net, is_source=rank == src)
        if rank in stepped:
            _train_locally(net, optimizer, steps=3 + rank, seed=rank)
        before = _state_bits(optimizer)
        broadcast_optimizer_state(optimizer, src=src)
        after = _state_bits(optimizer)
        parameter_broadcast(net, src=src)
        _train_locally(net, optimizer, steps=1, seed=99)
        seen[name] = (before, after, [p.detach().clone() for p in net.parameters()])
    return seen


@pytest.mark.parametrize("world_size, src, stepped", [
    (2, 0, (0,)),
    (3, 2, (0, 1, 2)),
    (2, 1, (0,)),
], ids=["never-stepped-rank-gets-the-state", "every-rank-stepped-3ranks-from-2",
        "a-source-without-state-clears-the-others"])
def test_broadcast_optimizer_state_gives_every_rank_the_sources_state_and_hyperparameters(
        world_size, src, stepped):
    results = run_ranks(_optimizer_states, world_size, src, stepped, timeout=TIMEOUT)
    for name in ("adam", "sgd"):
        want_tensors, want_others, want_groups = results[src][name][0]
        if src in stepped:
            assert want_tensors, f"{name}: the source should have state to send"
        else:
            assert not want_tensors and not want_others
        for rank in range(world_size):
            _, (tensors, others, groups), params = results[rank][name]
            assert tensors.keys() == want_tensors.keys(), f"{name}: rank {rank}"
            for key in want_tensors:
                _assert_bitwise(tensors[key], want_tensors[key], f"{name}: rank {rank} {key}")
            assert others == want_others, f"{name}: rank {rank}"
            assert groups == want_groups, f"{name}: rank {rank}'s hyperparameters"
            # same parameters, same state, same gradients: the same next step
            for a, b in zip(params, results[src][name][2]):
                assert torch.equal(a, b), f"{name}: rank {rank}'s next step differs"


def _optimizer_state_from_different_sources(rank, world_size):
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_locally(net, optimizer, 1, seed=rank)
    before = _state_bits(optimizer)
    try:
        broadcast_optimizer_state(optimizer, src=rank)
        return None
    except ValueError as exc:
        (tensors, others, groups), (was_tensors, was_others, was_groups) = \
            _state_bits(optimizer), before
        unchanged = tensors.keys() == was_tensors.keys() and all(
            torch.equal(tensors[k], was_tensors[k]) for k in tensors) and \
            others == was_others and groups == was_groups
        return str(exc), unchanged


def test_optimizer_state_from_sources_that_differ_by_rank_is_a_value_error_on_every_rank():
    # each rank naming itself the source would wait in a broadcast the others
    # never join
    for rank, seen in enumerate(run_ranks(_optimizer_state_from_different_sources, 2,
                                          timeout=TIMEOUT)):
        assert seen is not None, f"rank {rank} did not raise"
        message, unchanged = seen
        assert "different src ranks (by rank: [0, 1])" in message, message
        assert unchanged, f"rank {rank}: the state changed before the error"


def _alone(rank, world_size):
    events = []
    record_collectives(events)
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    broadcast_tensors([p.data for p in model.parameters()], src=0)
    bad = None
    try:
        broadcast_tensors([p.data for p in model.parameters()], src=1)
    except ValueError as exc:
        bad = str(exc)
    return events, bad, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_one_rank_world_broadcasts_nothing_and_still_checks_src():
    [(events, bad, unchanged)] = run_ranks(_alone, 1)
    # the optimizer's initial broadcast and a direct call: each rank is the source
    assert "broadcast" not in events, events
    assert unchanged
    assert bad is not None and "src" in bad
