"""Every kernel call through ``CompiledLaunch`` hands the launcher what ``JITFunction.run`` would.

    python tests/launch_fidelity.py        (without TRITON_INTERPRET; no GPU needed)

Installs the recording driver (``fusedreduce.bench.recording_driver``), then,
for random call sequences of every kernel family (flatten and unflatten layouts of mixed
dtypes, strided and misaligned tensors, float and tensor scales; the
clipping norm; AdaSum's statistics and combine), launches each call twice:
once through the library's ``CompiledLaunch`` and once through
``JITFunction.run`` itself, and requires both records to be the same: the
same compiled kernel's launcher, grid, stream, function, metadata and hooks,
and argument for argument the same values (tensors by address and dtype).
It also requires that a call repeating an earlier one of the same launch
object (the same values, dtypes and constexprs; any addresses), with every
tensor 16-byte aligned, takes the direct path, and that no call with an
unaligned tensor does.

Prints one JSON object: the calls checked per kernel and how many were
direct. Exits 1 with the falsifying example on a mismatch.
"""
from __future__ import annotations

import json
import math
import os
import sys
import weakref
from collections import Counter

from fusedreduce.bench import recording_driver  # noqa: E402

recording_driver.install(record=True)

import torch  # noqa: E402
from hypothesis import example, given, settings, strategies as st  # noqa: E402

from fusedreduce.kernels import ADASUM_CHUNK  # noqa: E402
from fusedreduce.kernels import _launcher  # noqa: E402
from fusedreduce.kernels.adasum import triton_backend as adasum  # noqa: E402
from fusedreduce.kernels.flatten import triton_backend as flatten  # noqa: E402
from fusedreduce.kernels.norm import triton_backend as norm  # noqa: E402

EXAMPLES = {"ci": 15, "compat": 8, "dev": 50, "thorough": 400}[
    os.environ.get("HYPOTHESIS_PROFILE", "ci")]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SIZES = [0, 1, 7, 2048, 2049, 5000]

checked, direct = Counter(), Counter()
# per launch object: the signatures of its aligned calls so far
seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _same_value(a, b) -> bool:
    if hasattr(a, "data_ptr") or hasattr(b, "data_ptr"):
        return (hasattr(a, "data_ptr") and hasattr(b, "data_ptr")
                and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype)
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _checked_call(self, *args):
    """CompiledLaunch.__call__, then JITFunction.run with the same arguments; compare."""
    name = self.fn.__name__
    # a compiled kernel types a Python float argument as fp32: a value that an
    # fp64 computation needs whole (a scale, a norm's order) travels as the
    # words of its float64 bits, the interpreter would hide the rounding
    floats = [p.name for p in self.fn.params
              if not p.is_constexpr and isinstance(args[p.num], float)]
    assert not floats, f"{name}: Python floats for {floats}, fp32 once compiled"
    before = self.direct_calls
    _original_call(self, *args)
    ours = recording_driver.LAUNCHES.pop()
    took_direct = self.direct_calls > before
    self.fn[self.grid](*args, **self.options)
    launcher, reference = recording_driver.LAUNCHES.pop()
    assert ours[0] is launcher, f"{name}: another compiled kernel than JITFunction.run's"
    head, ref_head = ours[1][:9], reference[:9]
    assert head[:4] == ref_head[:4] == (*self.grid3, recording_driver.STREAM), (name, head[:4])
    assert head[4] == ref_head[4] and head[5] == ref_head[5], f"{name}: function or metadata"
    assert type(head[6]) is type(ref_head[6]), f"{name}: launch metadata"
    assert head[7] is ref_head[7] and head[8] is ref_head[8], f"{name}: launch hooks"
    values, ref_values = ours[1][9:], reference[9:]
    assert len(values) == len(ref_values), (
        f"{name}: {len(values)} arguments, not {len(ref_values)}")
    for i, (a, b) in enumerate(zip(values, ref_values)):
        assert _same_value(a, b), f"{name}: argument {i}: {a!r} is not {b!r}"
    aligned = all(a.data_ptr() % 16 == 0 for a in args if hasattr(a, "data_ptr"))
    # the call without its addresses: a repeat of an aligned one must go direct
    signature = tuple(a.dtype if hasattr(a, "data_ptr") else (type(a), a) for a in args)
    assert aligned or not took_direct, f"{name}: an unaligned call went direct"
    assert took_direct or not (aligned and signature in seen.get(self, ())), (
        f"{name}: a repeated aligned call went through JITFunction.run")
    if aligned:
        seen.setdefault(self, set()).add(signature)
    checked[name] += 1
    direct[name] += took_direct


_original_call = _launcher.CompiledLaunch.__call__
_launcher.CompiledLaunch.__call__ = _checked_call


def _tensor(dtype, size, strided=False, offset=0):
    """A tensor of ``size`` elements, ``offset`` elements into its storage, or strided."""
    if strided:
        return torch.randn(2 * size, dtype=torch.float64).to(dtype)[::2]
    return torch.randn(size + offset, dtype=torch.float64).to(dtype)[offset:]


scale_kinds = st.sampled_from(["float", "fp32", "fp64", "fp32 unaligned"])


def _scale(kind, value):
    if kind == "float":
        return value
    if kind == "fp64":
        return torch.tensor([value], dtype=torch.float64)
    if kind == "fp32":
        return torch.tensor([value], dtype=torch.float32)
    return torch.tensor([0.0, value], dtype=torch.float32)[1:]  # 4 bytes past an aligned start


@st.composite
def flatten_cases(draw):
    n = draw(st.integers(1, 5))
    tensors = [_tensor(draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SIZES)),
                       strided=draw(st.booleans()) and draw(st.booleans()))
               for _ in range(n)]
    flat_dtype = draw(st.sampled_from(DTYPES))
    starts, pos = [], draw(st.sampled_from([0, 3]))
    for t in tensors:
        starts.append(pos)
        pos += t.numel() + draw(st.sampled_from([0, 5]))
    flat = _tensor(flat_dtype, pos, offset=draw(st.sampled_from([0, 0, 1])))
    calls = draw(st.lists(st.tuples(scale_kinds, st.floats(-4, 4, allow_nan=False),
                                    st.booleans()), min_size=1, max_size=5))
    return tensors, starts, flat, calls


# each family's coverage of the direct path must not hang on the drawn
# examples: one explicit case per family repeats an aligned call
@given(flatten_cases())
@example(([torch.randn(7).half(), torch.randn(2049)], [0, 16], torch.empty(2065),
          [("float", 0.5, False)]))
def check_flatten_and_unflatten(case):
    tensors, starts, flat, calls = case
    gather = flatten.prepare_flatten(tensors, starts, [t.numel() for t in tensors], flat)
    scatter = flatten.prepare_unflatten(flat, tensors, starts)
    for kind, value, flag in calls:
        for _ in range(2):  # a repeat: direct when every address is aligned
            gather(tensors, flat, _scale(kind, value), flag)
            scatter(flat, tensors, _scale(kind, value), flag)


@given(buffers=st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from(SIZES[1:]),
                                  st.sampled_from([0, 0, 1])), min_size=1, max_size=3),
       calls=st.lists(st.tuples(st.sampled_from([2.0, math.inf, 1.5, 0.1]),
                                st.floats(0.1, 10), st.sampled_from([None, "float", "fp32"])),
                      min_size=1, max_size=4))
@example(buffers=[(torch.float32, 2049, 0)], calls=[(2.0, 1.0, None), (2.0, 1.0, None)])
def check_clipping_norm(buffers, calls):
    made = [_tensor(dtype, size, offset=offset) for dtype, size, offset in buffers]
    for norm_type, max_norm, loss in calls:
        loss_scale = None if loss is None else _scale(loss, 1024.0)
        norm.clip_buffers(made, [1.0] * len(made), max_norm, norm_type, loss_scale)
        norm.norm_powers(made, norm_type)


@given(dtype=st.sampled_from(DTYPES),
       lengths=st.lists(st.sampled_from([1, 5, ADASUM_CHUNK, ADASUM_CHUNK + 3]),
                        min_size=1, max_size=3),
       offsets=st.tuples(st.sampled_from([0, 0, 1]), st.sampled_from([0, 0, 1])),
       repeats=st.integers(1, 3))
@example(dtype=torch.float32, lengths=[5, ADASUM_CHUNK + 3], offsets=(0, 0), repeats=2)
def check_adasum(dtype, lengths, offsets, repeats):
    boundaries = [0]
    for length in lengths:
        boundaries.append(boundaries[-1] + length)
    a = _tensor(dtype, boundaries[-1], offset=offsets[0])
    b = _tensor(dtype, boundaries[-1], offset=offsets[1])
    counts = [-(-length // ADASUM_CHUNK) for length in lengths]
    for _ in range(repeats):
        partials = torch.zeros(sum(counts), 3, dtype=torch.float64)
        stats = torch.zeros(len(lengths), 3, dtype=torch.float64)
        adasum.chunk_stats(a, b, boundaries, partials)
        adasum.reduce_chunks(partials, counts, stats)
        adasum.combine(a, b, boundaries, stats, a)


def main() -> int:
    for check in (check_flatten_and_unflatten, check_clipping_norm, check_adasum):
        settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                 print_blob=True)(check)()
    print(json.dumps({"checked": dict(checked), "direct": dict(direct)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
