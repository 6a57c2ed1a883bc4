"""Bad input to the flatten kernels raises a clear error, naming the culprit, before writing.

Every case passes a valid ``out`` (or valid destinations) filled with a
sentinel next to the bad argument and checks afterwards that not a bit of it
changed: validation must finish before the first write.

Device-aware: the tensors are made on ``device_mode.DEVICE()`` (CUDA under
``pytest --device cuda``); "another device" is ``meta``. What Triton on CPU
tensors does without its interpreter is checked in the CPU mode only.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import device_mode
from device_mode import DEVICE
from fusedreduce.kernels import flatten_cast_scale, triton_available, unflatten_cast_scale

SENTINEL = 7.0

pytestmark = [pytest.mark.device_aware,
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]


def sentinel(n, dtype=torch.float32, **kwargs):
    kwargs.setdefault("device", DEVICE())
    return torch.full((n,), SENTINEL, dtype=dtype, **kwargs)


def ones(*size, dtype=None):
    return torch.ones(*size, dtype=dtype, device=DEVICE())


def meta(n):
    return torch.empty(n, device="meta")


def sparse(n=3):
    return torch.sparse_coo_tensor([[0]], [1.0], (n,), check_invariants=True, device=DEVICE())


def device_name() -> str:
    """The test device as error messages name it: a tensor's device, so ``cuda:0``
    rather than ``cuda``."""
    return str(torch.empty(0, device=DEVICE()).device)


# (id, exception, message pattern, make_args() -> positional args, keyword args)
FLATTEN_CASES = [
    ("tensor on another device", ValueError,
     r"tensors\[1\] is on meta but tensors\[0\] is on <device>",
     lambda: ([ones(2), torch.empty(3, device="meta")], sentinel(5)), {}),
    # meta tensors have no memory (every address is 0): named, not called overlapping
    ("every tensor on the meta device", ValueError, r"out is on the meta device: it holds no data",
     lambda: ([meta(2), meta(3)], meta(5)), {}),
    ("meta tensors, no out", ValueError, r"tensors\[0\] is on the meta device",
     lambda: ([meta(2), meta(3)],), {}),
    ("sparse coo tensor", TypeError, r"tensors\[1\] has layout torch\.sparse_coo",
     lambda: ([ones(2), sparse()], sentinel(5)), {}),
    ("sparse csr tensor", TypeError, r"tensors\[1\] has layout torch\.sparse_csr",
     lambda: ([ones(2), torch.eye(2, device=DEVICE()).to_sparse_csr()], sentinel(6)), {}),
    ("integer tensor", TypeError, r"tensors\[1\]\.dtype must be one of .* got torch\.int32",
     lambda: ([ones(2), ones(3, dtype=torch.int32)], sentinel(5)), {}),
    ("bool tensor", TypeError, r"tensors\[2\]\.dtype must be one of .* got torch\.bool",
     lambda: ([ones(2), ones(1), ones(2, dtype=torch.bool)], sentinel(5)), {}),
    ("complex tensor", TypeError, r"tensors\[0\]\.dtype .* got torch\.complex64",
     lambda: ([ones(2, dtype=torch.complex64)], sentinel(2)), {}),
    ("float entry", TypeError, r"tensors\[1\] must be a torch\.Tensor, got float",
     lambda: ([ones(2), 3.0], sentinel(3)), {}),
    ("None entry", TypeError, r"tensors\[0\] must be a torch\.Tensor, got NoneType",
     lambda: ([None, ones(2)], sentinel(3)), {}),
    ("bare tensor", TypeError, r"tensors must be a list or tuple of tensors, got Tensor",
     lambda: (ones(2), sentinel(2)), {}),
    ("generator", TypeError, r"tensors must be a list or tuple of tensors, got generator",
     lambda: ((t for t in [ones(2)]), sentinel(2)), {}),
    ("out too large", ValueError, r"out has 6 elements but the tensors need 5\b",
     lambda: ([ones(2), ones(3)], sentinel(6)), {}),
    ("out too small", ValueError, r"out has 4 elements but the tensors need 5\b",
     lambda: ([ones(2), ones(3)], sentinel(4)), {}),
    ("out too small for the offsets", ValueError, r"out has 6 elements .* need at least 7",
     lambda: ([ones(2), ones(3)], sentinel(6)), {"offsets": [0, 4]}),
    ("out of an integer dtype", TypeError, r"out\.dtype must be one of .* got torch\.int32",
     lambda: ([ones(2)], sentinel(2, torch.int32)), {}),
    ("out on another device", ValueError, r"out is on meta but the tensors are on <device>",
     lambda: ([ones(2)], torch.empty(2, device="meta")), {}),
    ("2-D out", ValueError, r"out must be a 1-D contiguous tensor, got shape \(1, 2\)",
     lambda: ([ones(2)], sentinel(2).view(1, 2)), {}),
    ("non-contiguous out", ValueError, r"out must be a 1-D contiguous tensor, .* strides \(2,\)",
     lambda: ([ones(2)], sentinel(4)[::2]), {}),
    ("out not a tensor", TypeError, r"out must be a torch\.Tensor, got list",
     lambda: ([ones(2)], [0.0, 0.0]), {}),
    ("integer dtype", TypeError, r"dtype must be one of .* got torch\.int8",
     lambda: ([ones(2)],), {"dtype": torch.int8}),
    ("infinite scale", ValueError, r"scale must be finite, got inf",
     lambda: ([ones(2)], sentinel(2)), {"scale": float("inf")}),
    ("NaN scale", ValueError, r"scale must be finite, got nan",
     lambda: ([ones(2)], sentinel(2)), {"scale": float("nan")}),
    ("string scale", TypeError, r"scale must be a Python int or float, got str",
     lambda: ([ones(2)], sentinel(2)), {"scale": "2"}),
    ("None scale", TypeError, r"scale must be a Python int or float, got NoneType",
     lambda: ([ones(2)], sentinel(2)), {"scale": None}),
    ("bool scale", TypeError, r"scale must be a Python int or float, got bool",
     lambda: ([ones(2)], sentinel(2)), {"scale": True}),
    ("integer tensor scale", TypeError, r"a tensor scale must be float32 or float64",
     lambda: ([ones(2)], sentinel(2)), {"scale": torch.tensor(2)}),
    ("two-element tensor scale", ValueError, r"a tensor scale must hold one element",
     lambda: ([ones(2)], sentinel(2)), {"scale": torch.ones(2)}),
    ("overlapping offsets", ValueError, r"offsets\[1\]=1 overlaps the previous segment",
     lambda: ([ones(2), ones(2)], sentinel(4)), {"offsets": [0, 1]}),
    ("decreasing offsets", ValueError, r"offsets\[1\]=0 overlaps",
     lambda: ([ones(2), ones(2)], sentinel(6)), {"offsets": [4, 0]}),
    ("negative offset", ValueError, r"offsets\[0\]=-1",
     lambda: ([ones(2)], sentinel(2)), {"offsets": [-1]}),
    ("too few offsets", ValueError, r"offsets has 1 entries but tensors has 2",
     lambda: ([ones(2), ones(2)], sentinel(4)), {"offsets": [0]}),
    ("too many offsets", ValueError, r"offsets has 3 entries but tensors has 2",
     lambda: ([ones(2), ones(2)], sentinel(4)), {"offsets": [0, 2, 4]}),
    # out may not share memory with an input (helpers at the end of the file)
    ("input is a view of out", ValueError, r"tensors\[1\] overlaps out",
     lambda: _tensors_over_out(5, lambda out: [ones(2), out[2:5]]), {}),
    ("out is an input", ValueError, r"tensors\[0\] overlaps out",
     lambda: _tensors_over_out(2, lambda out: [out]), {}),
    ("strided input over out", ValueError, r"tensors\[1\] overlaps out",
     lambda: _tensors_over_out(6, lambda out: [ones(3), out[1::2]]), {}),
    ("input over a gap of out", ValueError, r"tensors\[1\] overlaps out",
     lambda: _tensors_over_out(8, lambda out: [ones(2), out[2:4]]), {"offsets": [0, 5]}),
]

UNFLATTEN_CASES = [
    ("flat not a tensor", TypeError, r"flat must be a torch\.Tensor, got list",
     lambda: ([1.0, 2.0], [sentinel(2)]), {}),
    ("sparse flat", TypeError, r"flat has layout torch\.sparse_coo",
     lambda: (sparse(2), [sentinel(2)]), {}),
    ("integer flat", TypeError, r"flat\.dtype must be one of .* got torch\.int64",
     lambda: (ones(2, dtype=torch.int64), [sentinel(2)]), {}),
    ("2-D flat", ValueError, r"flat must be a 1-D contiguous tensor, got shape \(2, 1\)",
     lambda: (ones(2, 1), [sentinel(2)]), {}),
    ("non-contiguous flat", ValueError, r"flat must be a 1-D contiguous tensor",
     lambda: (ones(4)[::2], [sentinel(2)]), {}),
    ("flat too small", ValueError, r"flat has 4 elements but the segments need 5",
     lambda: (ones(4), [sentinel(2), sentinel(3)]), {}),
    ("flat too small for the offsets", ValueError, r"flat has 5 elements .* need 6",
     lambda: (ones(5), [sentinel(2), sentinel(3)]), {"offsets": [0, 3]}),
    ("every tensor on the meta device", ValueError, r"flat is on the meta device: it holds no data",
     lambda: (meta(5), [meta(2), meta(3)]), {}),
    ("destinations on another device", ValueError, r"tensors are on meta but flat is on <device>",
     lambda: (ones(2), [torch.empty(2, device="meta")]), {}),
    ("destination on another device", ValueError,
     r"tensors\[1\] is on meta but tensors\[0\] is on <device>",
     lambda: (ones(4), [sentinel(2), torch.empty(2, device="meta")]), {}),
    ("integer destination", TypeError, r"tensors\[1\]\.dtype must be one of .* got torch\.int32",
     lambda: (ones(4), [sentinel(2), sentinel(2, torch.int32)]), {}),
    ("sparse destination", TypeError, r"tensors\[1\] has layout torch\.sparse_coo",
     lambda: (ones(5), [sentinel(2), sparse()]), {}),
    ("non-tensor destination", TypeError, r"tensors\[1\] must be a torch\.Tensor, got int",
     lambda: (ones(4), [sentinel(2), 2]), {}),
    ("bare tensor destination", TypeError, r"tensors must be a list or tuple of tensors",
     lambda: (ones(2), sentinel(2)), {}),
    ("NaN scale", ValueError, r"scale must be finite, got nan",
     lambda: (ones(2), [sentinel(2)]), {"scale": float("nan")}),
    ("string scale", TypeError, r"scale must be a Python int or float, got str",
     lambda: (ones(2), [sentinel(2)]), {"scale": "0.5"}),
    ("overlapping offsets", ValueError, r"offsets\[1\]=1 overlaps",
     lambda: (ones(4), [sentinel(2), sentinel(2)]), {"offsets": [0, 1]}),
    ("too few offsets", ValueError, r"offsets has 1 entries but tensors has 2",
     lambda: (ones(4), [sentinel(2), sentinel(2)]), {"offsets": [0]}),
    # destinations may not share memory with flat, nor with each other
    ("flat overlaps a destination", ValueError, r"tensors\[1\] overlaps flat",
     lambda: _destinations_over_flat(5, lambda flat: [sentinel(2), flat[2:5]]), {}),
    ("strided destination over flat", ValueError, r"tensors\[0\] overlaps flat",
     lambda: _destinations_over_flat(6, lambda flat: [flat[1::2]]), {}),
    ("destinations share memory", ValueError, r"tensors\[0\] and tensors\[1\] share memory",
     lambda: (ones(5), _views_of(sentinel(4), lambda d: [d[0:3], d[2:4]])), {}),
    ("a destination passed twice", ValueError, r"tensors\[0\] and tensors\[2\] share memory",
     lambda: (ones(6), _views_of(sentinel(2), lambda d: [d, sentinel(2), d])), {}),
    ("strided destinations share an element", ValueError,
     r"tensors\[0\] and tensors\[1\] share memory",
     lambda: (ones(6), _views_of(sentinel(8).view(4, 2), lambda x: [x[:, 0], x[1]])), {}),
    ("expanded destination", ValueError, r"tensors\[1\] has elements that share memory",
     lambda: (ones(5), [sentinel(2), torch.zeros(1, device=DEVICE()).expand(3)]), {}),
]


def _tensors_in(args):
    """Every dense tensor an argument list holds on the test device (the ones that must
    stay untouched; meta tensors hold no data)."""
    found = []
    for a in args:
        items = a if isinstance(a, (list, tuple)) else [a]
        found += [t for t in items if isinstance(t, torch.Tensor) and t.layout == torch.strided
                  and t.device.type == DEVICE().type]
    return found


def _raises_before_writing(fn, make_args, kwargs, backend, error, pattern):
    """``pattern`` may name the test device as ``<device>``."""
    pattern = pattern.replace("<device>", re.escape(device_name()))
    args = make_args()
    watched = _tensors_in(args)
    before = [t.clone() for t in watched]
    with pytest.raises(error, match=pattern):
        fn(*args, **kwargs, backend=backend)
    for t, b in zip(watched, before):
        assert torch.equal(t, b), "an argument changed although the call raised"


@pytest.mark.parametrize("name, error, pattern, make_args, kwargs", FLATTEN_CASES,
                         ids=[c[0] for c in FLATTEN_CASES])
def test_flatten_rejects_bad_input_before_writing(backend, name, error, pattern, make_args,
                                                  kwargs):
    _raises_before_writing(flatten_cast_scale, make_args, kwargs, backend, error, pattern)


@pytest.mark.parametrize("name, error, pattern, make_args, kwargs", UNFLATTEN_CASES,
                         ids=[c[0] for c in UNFLATTEN_CASES])
def test_unflatten_rejects_bad_input_before_writing(backend, name, error, pattern, make_args,
                                                    kwargs):
    _raises_before_writing(unflatten_cast_scale, make_args, kwargs, backend, error, pattern)


@pytest.mark.parametrize("bad", ["cuda", "Triton", "", None])
def test_unknown_backend_is_rejected_before_writing(bad):
    out, destination = sentinel(2), sentinel(2)
    with pytest.raises(ValueError, match=r"backend must be one of .*'torch'"):
        flatten_cast_scale([ones(2)], out, backend=bad)
    with pytest.raises(ValueError, match=r"backend must be one of .*'torch'"):
        unflatten_cast_scale(ones(2), [destination], backend=bad)
    assert torch.all(out == SENTINEL) and torch.all(destination == SENTINEL)


@pytest.mark.parametrize("offsets", [[0.5], ["3"]], ids=["fraction", "string"])
def test_non_integer_offsets_are_rejected(backend, offsets):
    with pytest.raises((TypeError, ValueError), match=r"offsets"):
        flatten_cast_scale([ones(2)], sentinel(8), offsets=offsets, backend=backend)


_WITHOUT_INTERPRETER = """
import json, torch
from fusedreduce.kernels import flatten_cast_scale, unflatten_cast_scale
out, destination = torch.full((3,), 7.0), torch.full((3,), 7.0)
calls = {
    "flatten": lambda: flatten_cast_scale([torch.ones(3)], out, backend="triton"),
    "unflatten": lambda: unflatten_cast_scale(torch.ones(3), [destination], backend="triton"),
}
report = {}
for name, call in calls.items():
    try:
        call()
        report[name] = None
    except Exception as exc:
        report[name] = [type(exc).__name__, str(exc)]
report["untouched"] = bool((out == 7).all() and (destination == 7).all())
report["auto"] = flatten_cast_scale([torch.ones(3)], scale=2.0).tolist()
print(json.dumps(report))
"""


@pytest.mark.skipif(device_mode.cuda_mode(),
                    reason="about CPU tensors under Triton without its interpreter: the CPU "
                           "test mode checks it")
@pytest.mark.skipif(not triton_available(), reason="triton cannot be imported here")
@pytest.mark.parametrize("interpret", [None, "0", ""], ids=["unset", "0", "empty"])
def test_triton_backend_on_cpu_without_the_interpreter_says_how_to_fix_it(interpret):
    # a fresh interpreter: this one imported triton with TRITON_INTERPRET=1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    done = subprocess.run([sys.executable, "-c", _WITHOUT_INTERPRETER], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("flatten", "unflatten"):
        assert report[name] is not None, f"{name} ran Triton on CPU without the interpreter"
        kind, message = report[name]
        assert kind == "RuntimeError" and "TRITON_INTERPRET" in message, report[name]
    assert report["untouched"]
    assert report["auto"] == [2.0, 2.0, 2.0], "backend='auto' must fall back to torch on CPU"


# ------------------------------------------------ overlapping memory (helpers and cases)

def _tensors_over_out(size, views):
    """``(tensors, out)``: a sentinel ``out`` and tensors of which some are views of it."""
    out = sentinel(size)
    return views(out), out


def _destinations_over_flat(size, views):
    """``(flat, tensors)``: a ``flat`` of distinct values and destinations of which some
    are views of it."""
    flat = torch.arange(float(size), device=DEVICE())
    return flat, views(flat)


def _views_of(tensor, views):
    return views(tensor)


def test_interleaved_strided_destinations_are_accepted(backend):
    """``x[:, 0]`` and ``x[:, 1]`` share a byte span but not an element."""
    x = torch.full((4, 2), SENTINEL, device=DEVICE())
    for scale in (2.0, -0.5):  # the second call runs the kept launch
        flat = torch.arange(8.0, device=DEVICE()) * scale + 1
        unflatten_cast_scale(flat, [x[:, 0], x[:, 1]], scale=scale, backend=backend)
        assert torch.equal(x[:, 0], flat[:4] * scale) and torch.equal(x[:, 1], flat[4:] * scale)
    # the same interleaved views as inputs, and an input beside out in one storage
    storage = torch.arange(16.0, device=DEVICE())
    out = storage[8:]
    flatten_cast_scale([storage[:8].view(4, 2)[:, 1], storage[:8].view(4, 2)[:, 0]], out,
                       scale=0.5, backend=backend)
    assert out.tolist() == [0.5, 1.5, 2.5, 3.5, 0.0, 1.0, 2.0, 3.0]
    assert storage[:8].tolist() == [float(i) for i in range(8)]


def test_overlap_is_checked_when_a_kept_layout_changes(backend):
    """A valid call keeps its launch; a later call with an overlapping tensor has a
    new signature (another address), so it is validated, refused, and writes nothing."""
    a, b = ones(2), torch.full((3,), 2.0, device=DEVICE())
    out = sentinel(5)
    flatten_cast_scale([a, b], out, scale=3.0, backend=backend)
    assert out.tolist() == [3.0, 3.0, 6.0, 6.0, 6.0]
    with pytest.raises(ValueError, match=r"tensors\[1\] overlaps out"):
        flatten_cast_scale([a, out[2:5]], out, scale=3.0, backend=backend)
    assert out.tolist() == [3.0, 3.0, 6.0, 6.0, 6.0]
    flatten_cast_scale([a, b], out, scale=-1.0, backend=backend)  # the kept layout still runs
    assert out.tolist() == [-1.0, -1.0, -2.0, -2.0, -2.0]

    flat, d0, d1 = torch.arange(5.0, device=DEVICE()), sentinel(2), sentinel(3)
    unflatten_cast_scale(flat, [d0, d1], backend=backend)
    d0.fill_(SENTINEL)
    for destinations, pattern in [([d0, flat[2:5]], r"tensors\[1\] overlaps flat"),
                                  ([d0, sentinel(1).expand(3)], r"tensors\[1\] has elements"),
                                  ([d1[1:], d1], r"tensors\[0\] and tensors\[1\] share")]:
        before = [t.clone() for t in destinations]
        with pytest.raises(ValueError, match=pattern):
            unflatten_cast_scale(flat, destinations, scale=2.0, backend=backend)
        assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert all(torch.equal(t, b) for t, b in zip(destinations, before))


@pytest.mark.parametrize("container", ["set", "empty generator"])
def test_a_kept_launch_does_not_skip_the_container_check(backend, container):
    x = ones(3)
    if container == "set":
        out, first, again = sentinel(3), [x], {x}
    else:
        out, first, again = sentinel(0), [], (t for t in [])
    flatten_cast_scale(first, out, backend=backend)
    with pytest.raises(TypeError, match=r"tensors must be a list or tuple of tensors"):
        flatten_cast_scale(again, out, backend=backend)
