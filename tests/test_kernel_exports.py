"""What the kernels export for the layers above: the validated norm and clip
functions, and the benchmarks' view of the kept launches.

The norm functions are what ``fusedreduce.clipping`` runs every clipped step;
they must hand the backend exactly what it got before they were public (the
same bits), and refuse bad arguments by name before anything is launched.
"""
import math

import pytest
import torch

from fusedreduce import kernels
from fusedreduce.kernels import _backends


def _buffers():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(5000, generator=generator),
            torch.randn(300, generator=generator).half(), torch.zeros(0)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("loss_scale", [None, 64.0, torch.tensor(64)])
def test_the_public_clip_functions_give_the_backends_bits(norm_type, loss_scale):
    buffers, postscales = _buffers(), [0.5, -0.25, 1.0]
    backend = _backends.backend_for("torch", torch.device("cpu"))
    want = backend.clip_buffers(buffers, postscales, 1.0, norm_type, loss_scale,
                                torch.float32)
    powers = kernels.norm_powers(buffers, norm_type, backend="torch")
    share = [kernels.norm_partials(buffers, norm_type, (i, 2), backend="torch")
             for i in range(2)]
    for total, scales in (
            kernels.clip_buffers(buffers, postscales, 1.0, norm_type, loss_scale,
                                 backend="torch"),
            kernels.clip_scales(powers, postscales, 1.0, norm_type, loss_scale,
                                backend="torch"),
            kernels.clip_partials(share[0] + share[1], buffers, postscales, 1.0, norm_type,
                                  loss_scale, backend="torch")):
        assert torch.equal(total, want[0])
        assert [s.item() for s in scales] == [s.item() for s in want[1]]
    assert torch.equal(powers, backend.norm_powers(buffers, norm_type))


@pytest.mark.parametrize("call, error, fragment", [
    (lambda b: kernels.norm_partials(b, 2.0, (2, 2)), ValueError, "share must be"),
    (lambda b: kernels.norm_partials(b, 2.0, [0, 1]), ValueError, "share must be"),
    (lambda b: kernels.norm_partials([], 2.0), ValueError, "at least one"),
    (lambda b: kernels.clip_buffers(b, [1.0], 1.0), ValueError, "postscales must be"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, 0.0), ValueError, "max_norm must be positive"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, "1"), TypeError, "max_norm must be a number"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, 1.0, 0.0), ValueError,
     "norm_type must be positive"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, 1.0, loss_scale=-1.0), ValueError,
     "loss_scale must be"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, 1.0, loss_scale=torch.ones(2)), ValueError,
     "loss_scale must be a one-element"),
    (lambda b: kernels.clip_buffers(b, [1.0] * 3, 1.0, norm_dtype=torch.float16), ValueError,
     "norm_dtype must be"),
    (lambda b: kernels.clip_scales(torch.ones(3), [1.0] * 3, 1.0), ValueError,
     "powers must be a 1-D float64"),
    (lambda b: kernels.clip_scales(torch.ones(3, dtype=torch.float64), [1.0] * 2, 1.0),
     ValueError, "postscales must be a list or tuple of 3"),
    (lambda b: kernels.clip_partials(torch.ones(2, 3, dtype=torch.float64), b, [1.0] * 3, 1.0),
     ValueError, "partials must be a 1-D float64"),
], ids=["share_index", "share_list", "no_buffers", "postscales_count", "max_norm_zero",
        "max_norm_string", "norm_type_zero", "loss_negative", "loss_two_elements",
        "norm_dtype", "powers_fp32", "powers_count", "partials_2d"])
def test_bad_clip_arguments_are_refused_naming_them(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call(_buffers())


def test_count_launches_counts_what_the_kept_launches_do():
    grads, out = [torch.ones(3), torch.ones(2, 2)], torch.empty(7)
    with kernels.count_launches() as counts:
        kernels.flatten_cast_scale(grads, out)
        kernels.flatten_cast_scale(grads, out)
        kernels.flatten_cast_scale([torch.ones(3), torch.ones(2, 2)], out)  # moved
    assert set(counts) == set(kernels.LAUNCH_OUTCOMES)
    assert (counts["calls"], counts["prepared"], counts["same"]) == (3, 1, 1)
    assert counts["switched"] + counts["re-pointed"] == 1
    assert kernels.kept_launch("flatten", out, grads) is not None
    assert kernels.kept_launch("unflatten", out, grads) is None  # none prepared


def test_allow_cpu_launches_lifts_the_cpu_guard_of_the_triton_backend(monkeypatch):
    monkeypatch.setattr(_backends, "_cpu_launches", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not kernels.triton_available():
        pytest.skip(kernels.triton_unavailable_reason())
    with pytest.raises(RuntimeError, match="needs Triton's interpreter"):
        kernels.resolve_backend("triton", torch.device("cpu"))
    kernels.allow_cpu_launches()
    assert kernels.resolve_backend("triton", torch.device("cpu")) == "triton"
