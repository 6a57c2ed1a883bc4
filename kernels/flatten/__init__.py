"""The flatten family: many tensors into one flat buffer and back, cast and scaled.

Two backends with the same functions and arguments (the protocol in
``kernels/_backends.py``): ``triton_backend`` (one launch per call, whatever the
number of tensors) and ``torch_backend`` (the fallback, a few multi-tensor torch
ops). The public entry points, with validation, are
``fusedreduce.kernels.flatten_cast_scale`` and ``unflatten_cast_scale``.

Semantics both backends implement:

- element ``j`` of tensor ``i`` (in row-major order) lives at
  ``flat[starts[i] + j]``;
- each element is ``cast_to(dst_dtype)(x * scale)`` with ``x`` and ``scale`` in
  fp32, or in fp64 when the source or the destination is fp64; 16-bit results
  are rounded from an fp32 value;
- ``flatten`` writes every element of the buffer: a segment's ``extent`` past
  its tensor, and anything before the first segment, as +0.0;
- ``unflatten`` with ``accumulate`` adds in the compute dtype and rounds once.
"""
