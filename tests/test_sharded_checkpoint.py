"""The sharded checkpoint's pieces as a property, in one process: a
parameter's state cut into pieces at random element boundaries (0-element
pieces, 1-element and odd sizes, 0-d and non-contiguous state, all four
float dtypes) and put back together, whole or over any range, equals the
state it was cut from bit for bit (nothing is computed, only copied, so
there is no tolerance). The save and load across ranks, world sizes and
bucket layouts are test_sharded_optimizer.py's ``_sharded_checkpoints``."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusedreduce import consolidate_sharded_state_dict
from fusedreduce.sharded_checkpoint import (make_piece, pieces_by_index, read_shards,
                                            sharded_state, state_over)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def cut_states(draw):
    """A parameter shape, its state (two per-element tensors, one of them
    non-contiguous, a 0-d step) and the cut points of its pieces."""
    shape = draw(st.sampled_from([(0,), (1,), (7,), (3, 5), (2, 3, 4), ()]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    numel = int(torch.Size(shape).numel())
    param = torch.randn(shape, generator=gen).to(dtype)
    transposed = torch.randn(tuple(reversed(shape)), generator=gen).to(dtype)
    state = {"exp_avg": torch.randn(shape, generator=gen).to(dtype),
             "momentum": transposed.permute(tuple(reversed(range(len(shape))))),  # non-contiguous
             "step": torch.tensor(float(draw(st.integers(0, 100))))}
    cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=4)))
    bounds = [0, *cuts, numel]
    return param, state, list(zip(bounds[:-1], bounds[1:]))


def _cut(param, state, ranges):
    """The pieces each of ``len(ranges)`` ranks would save: a rank that
    holds part of the parameter holds 1-D slices of its per-element state."""
    pieces = []
    for start, end in ranges:
        whole = start == 0 and end == param.numel()
        entry = {k: (v if whole or v.dim() == 0 else v.reshape(-1)[start:end])
                 for k, v in state.items()}
        master = param.double().reshape(-1)[start:end]
        pieces.append(make_piece(param, start, end, entry, master))
    return pieces


@given(cut_states())
def test_pieces_put_back_together_are_the_state(case):
    param, state, ranges = case
    shards = [sharded_state(rank, len(ranges), [param.shape], [{"params": [0], "lr": 0.1}],
                            {0: piece}) for rank, piece in enumerate(_cut(param, state, ranges))]
    # the save is a copy: the live state, stepped in place later, leaves it as it was
    saved_state = {key: value.clone() for key, value in state.items()}
    for value in state.values():
        value.add_(1)
    state = saved_state
    whole = consolidate_sharded_state_dict(list(reversed(shards)))
    assert whole["param_groups"] == [{"params": [0], "lr": 0.1}]
    entry = whole["state"][0]
    # torch's order (a 0-d parameter's state is all 0-d values, kept by name)
    assert list(entry)[-1] == "master_weight"
    if param.dim():
        assert list(entry) == ["step", "exp_avg", "momentum", "master_weight"]
    for key, value in state.items():
        assert entry[key].dtype == value.dtype and torch.equal(entry[key], value), key
    assert torch.equal(entry["master_weight"], param.double())
    # any range another world size would own, from the same pieces
    by_index = pieces_by_index(read_shards(shards))
    numel = param.numel()
    for start in range(0, numel + 1, max(1, numel // 3)):
        for end in (start, min(numel, start + 1), numel):
            got = state_over(by_index[0], start, end)
            want = state["exp_avg"].reshape(-1)[start:end]
            if param.dim() == 0:
                assert torch.equal(got["exp_avg"], state["exp_avg"])
            else:
                assert torch.equal(got["exp_avg"], want)
                assert torch.equal(got["momentum"], state["momentum"].reshape(-1)[start:end])
            assert torch.equal(got["step"], state["step"])


def test_pieces_that_do_not_cover_the_parameter_once_are_refused():
    param = torch.zeros(10)
    state = {"exp_avg": torch.arange(10.0)}
    for ranges, what in [([(0, 4), (5, 10)], "a gap"), ([(0, 6), (4, 10)], "an overlap"),
                         ([(0, 4)], "a missing end")]:
        shards = [sharded_state(rank, len(ranges), [param.shape], [{"params": [0]}],
                                {0: piece})
                  for rank, piece in enumerate(_cut(param, state, ranges))]
        with pytest.raises(ValueError, match="not each once"):
            consolidate_sharded_state_dict(shards)
    # one piece without a key the others have
    pieces = _cut(param, state, [(0, 4), (4, 10)])
    del pieces[1]["slices"]["exp_avg"]
    shards = [sharded_state(rank, 2, [param.shape], [{"params": [0]}], {0: piece})
              for rank, piece in enumerate(pieces)]
    with pytest.raises(ValueError, match="different keys"):
        consolidate_sharded_state_dict(shards)


def test_a_rank_s_pieces_of_several_dtypes_keys_and_values_pack_and_come_back():
    # per key one flat tensor per dtype; a key some parameters lack; 0-d
    # tensor values stacked, other values (a Python int) kept as they are
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(5, generator=gen).half(), torch.randn(2, 3, generator=gen),
              torch.randn(4, generator=gen).double()]
    states = [{"exp_avg": torch.randn(5, generator=gen).half(), "step": torch.tensor(2.0)},
              {"exp_avg": torch.randn(2, 3, generator=gen), "extra": torch.randn(2, 3),
               "step": torch.tensor(2.0)},
              {"exp_avg": torch.randn(4, generator=gen).double(), "step": 7}]
    cuts = [[(0, 2), (2, 5)], [(0, 6), (6, 6)], [(0, 1), (1, 4)]]
    shards = []
    for rank in range(2):
        pieces = {}
        for index, (param, state, ranges) in enumerate(zip(params, states, cuts)):
            start, end = ranges[rank]
            whole = (start, end) == (0, param.numel())
            entry = {k: v if whole or not isinstance(v, torch.Tensor) or v.dim() == 0
                     else v.reshape(-1)[start:end] for k, v in state.items()}
            pieces[index] = make_piece(param, start, end, entry)
        shards.append(sharded_state(rank, 2, [p.shape for p in params],
                                    [{"params": [0, 1, 2]}], pieces))
    packed = shards[0]["state"]
    assert [t.dtype for t in packed["slices"]["exp_avg"]["data"]] == \
        [torch.float16, torch.float32, torch.float64]
    assert packed["values"]["step"]["stacked"] is None  # a 0-d tensor beside an int
    whole = consolidate_sharded_state_dict(shards)
    for index, state in enumerate(states):
        assert set(whole["state"][index]) == set(state)
        for key, value in state.items():
            got = whole["state"][index][key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
