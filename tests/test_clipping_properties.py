"""Fused clipping as a property: random gradient lists on 1-4 local gloo ranks
against torch's ``clip_grad_norm_`` semantics in float64 (``reference_clip``).

Each hypothesis example is one launch of the ranks running a batch of random
cases: tensor lists with 0-element, 1-element and odd sizes, non-contiguous
gradients, all four float dtypes; random gradient scales, limits (``math.inf``
included: measured, not clipped), norm orders (1, 2, 3.5 and the max norm),
bucket caps; the reducer's call and hooks paths, the sharded optimizer and
DDP with ``allreduce_hook``; the mean or the sum; both kernel backends; the norm split across the ranks or
not. test_clipping.py holds the fixed scenarios (accumulation, bucket views,
an inf on one rank, GradScaler, DDP's hooks, AdaSum); this file draws the
inputs those scenarios fix. Under ``--device cuda`` the same cases run on
the GPU (one NCCL rank) with the compiled kernels.

Tolerances, from the precision each step computes in (``eps`` is a dtype's
machine epsilon, ``comm`` the dtype the reduction adds in: fp32 for 16-bit
gradients):

- the reduced gradient: the prescaled addends and each of the
  ``world_size - 1`` additions round once in ``comm``, relative to the sum of
  magnitudes ``m``: ``(world_size + 1) * eps_comm * m``;
- the norm: ``NORM_RTOL`` relative (rows summed in fp32, then in fp64; see
  test_clipping.py), plus the reduced gradient's error, whose ``p``-norm is at
  most ``(world_size + 1) * eps_comm * ||m||_p``;
- the coefficient carries the norm's relative error; the clipped value rounds
  once to the gradient's dtype (``eps_dtype`` relative, or one subnormal
  spacing near zero).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import device_mode
from fusedreduce import DistributedGradReducer, DistributedOptimizer, communication_dtype
from fusedreduce.local_ranks import run_on_local_ranks
from harness import ONE_BYTE_MB
from reference import reference_clip, subnormal_spacing
from test_clipping import NORM_RTOL, norm_bits
from test_sharded_pipelines import tensor_lists

# under --device cuda the same cases run on the GPU with the compiled kernels:
# one rank on NCCL (more ranks would need more GPUs)
pytestmark = pytest.mark.device_aware
MODES = ("call", "hooks", "sharded", "ddp")
TIMEOUT = 300.0


def _ranks(world_size, cases):
    """``_clip_cases`` on ``world_size`` local ranks: gloo on the CPU, NCCL on
    the GPU (rank r on GPU r)."""
    backend = "nccl" if device_mode.cuda_mode() else "gloo"
    return run_on_local_ranks(_clip_cases, world_size, cases, backend=backend, timeout=TIMEOUT)


WORLD_SIZES = [1] if device_mode.cuda_mode() else [1, 2, 3, 4]


class _Given(torch.nn.Module):
    """Parameters whose gradients are exactly the tensors ``forward`` is given."""

    def __init__(self, params):
        super().__init__()
        self.weights = torch.nn.ParameterList(params)

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.weights, grads))


def _gradients(specs, seed, rank, magnitude, device=torch.device("cpu")):
    """This rank's gradients of a case on ``device``: float64 normals times
    ``magnitude``, cast once to each dtype; transposed specs are
    non-contiguous views."""
    gen = torch.Generator().manual_seed(10_000 * seed + rank)
    grads = []
    for shape, dtype, transposed in specs:
        drawn = (torch.randn(shape[::-1] if transposed else shape, generator=gen,
                             dtype=torch.float64) * magnitude).to(dtype).to(device)
        grads.append(drawn.t() if transposed else drawn)
    return grads


def _params(specs, device):
    return [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
            for shape, dtype, _ in specs]


def _clip_cases(rank, world_size, cases):
    """Per case: the clipped gradients this rank ends with and ``grad_norm``."""
    seen = []
    device = torch.device("cuda", torch.cuda.current_device()) if device_mode.cuda_mode() \
        else torch.device("cpu")
    for case in cases:
        specs, cap_mb, max_norm, norm_type, magnitude, mode, mean, backend, split, seed = case
        grads = _gradients(specs, seed, rank, magnitude, device)
        params = _params(specs, device)
        clipping = dict(max_grad_norm=max_norm, norm_type=norm_type, split_norm=split)
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            from fusedreduce import hooks
            model = DistributedDataParallel(_Given(params), bucket_cap_mb=cap_mb)
            state = hooks.HookState(backend=backend, **clipping)
            model.register_comm_hook(state, hooks.allreduce_hook)
            model(grads).backward()  # DDP averages: the case's mean is ignored
            # ParameterList made parameters of its own from the tensors
            out = [p.grad.clone() for p in model.module.weights]
            norm = state.grad_norm
        elif mode == "sharded":
            opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), shard=True,
                                       param_pack_thd=max(1, int(cap_mb * 2 ** 20)),
                                       reduce_method="mean" if mean else "sum",
                                       backend=backend, **clipping)
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            opt.step()  # SGD(lr=1) from zeros: each parameter is minus its gradient
            out = [-p.detach().clone() for p in params]
            norm = opt.grad_norm
        else:
            reducer = DistributedGradReducer(params, bucket_cap_mb=cap_mb, mean=mean,
                                             backend=backend, **clipping)
            if mode == "call":
                out = list(reducer(grads))
            else:
                reducer.register_hooks()
                sum((p * g).sum() for p, g in zip(params, grads)).backward()
                out = [p.grad.clone() for p in params]
            norm = reducer.grad_norm
        seen.append(([g.cpu() for g in out], None if norm is None else norm.cpu()))
    return seen


def _judge(results, world_size, cases):
    for c, case in enumerate(cases):
        specs, cap_mb, max_norm, norm_type, magnitude, mode, mean, backend, split, seed = case
        what = f"case {c} ({mode}, {backend}, p={norm_type}, limit={max_norm}, split={split})"
        inputs = [_gradients(specs, seed, r, magnitude) for r in range(world_size)]
        divisor = world_size if mean or mode == "ddp" else 1
        reduced = [sum(x[i].double() for x in inputs) / divisor for i in range(len(specs))]
        magnitudes = [sum(x[i].double().abs() for x in inputs) / divisor
                      for i in range(len(specs))]
        want_norm, want = reference_clip(reduced, max_norm, norm_type)
        coefficient = min(1.0, max_norm / (want_norm + 1e-6))
        comm_eps = [torch.finfo(communication_dtype(dtype)).eps for _, dtype, _ in specs]
        reduction = [(world_size + 1) * eps * m for eps, m in zip(comm_eps, magnitudes)]
        reduction_norm = reference_clip(reduction, math.inf, norm_type)[0]
        grads, norm = results[0][c]
        assert norm is not None, what
        # torch's dtype: its per-dtype norms stacked promote to fp64 beside
        # fp64 gradients; 16-bit ones alone get fp32 here (fp16 in torch)
        want_dtype = torch.float64 if any(d == torch.float64 for _, d, _ in specs) \
            else torch.float32
        assert norm.dtype == want_dtype, f"{what}: norm dtype {norm.dtype}"
        assert abs(float(norm) - want_norm) <= NORM_RTOL * want_norm + reduction_norm, \
            f"{what}: norm {float(norm)} vs {want_norm}"
        for i, (got, exact, error) in enumerate(zip(grads, want, reduction)):
            dtype = specs[i][1]
            assert got.dtype == dtype and got.shape == exact.shape, f"{what}: tensor {i}"
            bound = coefficient * error + (NORM_RTOL + torch.finfo(dtype).eps) * exact.abs() \
                + subnormal_spacing(dtype)
            assert torch.all((got.double() - exact).abs() <= bound), \
                f"{what}: tensor {i} ({dtype}, {tuple(got.shape)})"
        for rank in range(1, world_size):
            other, other_norm = results[rank][c]
            # every rank reads the same reduced buffers in the same order
            assert norm_bits(other_norm) == norm_bits(norm), f"{what}: rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(other, grads)), f"{what}: rank {rank}"


CASE = st.tuples(
    tensor_lists(max_tensors=8),
    st.sampled_from([ONE_BYTE_MB, 0.004, 25.0]),               # bucket caps
    st.sampled_from([1e-3, 0.1, 1.0, 10.0, 1e3, math.inf]),   # limits
    st.sampled_from([1.0, 2.0, 3.5, math.inf]),               # norm orders
    st.sampled_from([1e-4, 1e-2, 1.0, 30.0]),                 # gradient scales
    st.sampled_from(MODES),
    st.booleans(),                                            # the mean, or the sum
    st.sampled_from(["torch", "triton"]),
    st.sampled_from([None, True, False]),                     # split_norm
    st.integers(0, 1000),                                     # the gradients' seed
)


@settings(max_examples=4, deadline=None)
@given(cases=st.lists(CASE, min_size=4, max_size=6), world_size=st.sampled_from(WORLD_SIZES))
def test_fused_clipping_is_torchs_clipping_of_the_reduced_gradients(cases, world_size):
    results = _ranks(world_size, cases)
    _judge(results, world_size, cases)


def _fixed(specs, mode, backend="torch", norm_type=2.0, split=None):
    return (specs, 25.0, 0.1, norm_type, 1.0, mode, True, backend, split, 7)


#: what a random draw reaches rarely: nothing but empty tensors (torch's norm
#: of no elements is 0, so nothing is clipped), one element, an empty tensor
#: between others, every mode on both backends
EDGE_CASES = [
    *[_fixed([((0,), torch.float32, False), ((0, 3), torch.float16, False)], mode, backend)
      for mode in MODES for backend in ("torch", "triton")],
    *[_fixed([((1,), torch.bfloat16, False)], mode, norm_type=p)
      for mode in MODES for p in (2.0, math.inf)],
    _fixed([((5, 3), torch.float16, True), ((0,), torch.float64, False),
            ((2049,), torch.float32, False)], "hooks", "triton", 3.5, True),
]


@pytest.mark.parametrize("world_size", WORLD_SIZES[:2])
def test_empty_and_one_element_gradients_clip_as_torch_does(world_size):
    results = _ranks(world_size, EDGE_CASES)
    _judge(results, world_size, EDGE_CASES)
