"""The norm family: the clipping norm of a few flat buffers, and the scales it gives.

Two backends with the same functions and arguments (the protocol in
``kernels/_backends.py``): ``triton_backend`` (two launches per call, whatever
the number of buffers) and ``torch_backend`` (the fallback, a few torch ops
per buffer). ``fusedreduce.clipping`` calls them; the reducers' ``max_grad_norm``
is the public way in.

Semantics both backends implement, for buffers ``b`` with postscales ``s``:

- ``norm_powers``: per buffer, the sum of ``|x| ** p`` (the max ``|x|`` for
  ``p = inf``) as fp64, in a fixed order: rows of ``NORM_ROW`` elements, each
  row's sum in fp32 (fp64 for fp64 buffers), the rows then added in fp64 in
  order. The order depends on the layout alone, so every rank holding the same
  buffers gets the same bits, whatever its thread count;
- ``clip_scales``: from those powers, the norm of the written gradients
  ``(Σ |s|^p · power) ** (1/p)`` divided by ``loss_scale``, rounded to
  ``norm_dtype`` (fp32, or fp64 for fp64 gradients: the 0-d tensor
  ``clip_grad_norm_`` returns), and per buffer ``s · coefficient`` in fp64,
  where ``coefficient = min(1, max_norm / (norm + 1e-6))`` is torch's, taken
  in ``norm_dtype`` as torch takes it; a NaN norm gives NaN scales;
- ``clip_buffers``: the two above in one call.

The walk inside a row is each backend's own, so the backends may differ in the
last bits of the norm; every rank of a run uses the same backend.
"""
