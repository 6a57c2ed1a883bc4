"""The AdaSum family: per-segment statistics of two flat buffers, and their combine.

Two backends with the same functions and arguments (the protocol in
``kernels/_backends.py``): ``triton_backend`` (one launch per step, whatever the
number of segments) and ``torch_backend`` (the fallback). The public entry
points, with validation, are ``fusedreduce.kernels.adasum_*``.

Semantics both backends implement, for buffers ``a`` and ``b`` cut into
segments at ``boundaries``:

- ``chunk_stats``: each chunk's ``(Σxy, Σx², Σy²)`` in fp64, chunks of
  ``ADASUM_CHUNK`` elements counted from each segment's start; a chunk's row
  depends on its values only, never on where it sits;
- ``reduce_chunks``: a segment's rows added one after the other in chunk order;
- ``combine``: ``ca·a + cb·b`` with ``ca = 1 - a·b / (2‖a‖²)``,
  ``cb = 1 - a·b / (2‖b‖²)`` (1 below ``ADASUM_NORM_FLOOR``), in fp64 for fp64
  buffers, else in fp32 while ``|ca|, |cb| <= ADASUM_FP32_LIMIT`` and in fp64
  beyond it, rounded once into the buffer's dtype.

The walk inside a chunk is each backend's own, so the backends may differ in
the last bits of a statistic; every rank of a run uses the same backend.
"""
