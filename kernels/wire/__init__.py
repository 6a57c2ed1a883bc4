"""The wire family: a flat buffer quantized for the network in the flatten
pass, and the chunks that come back dequantized and summed in a fixed order.

Two backends with the same functions and arguments (the protocol in
``kernels/_backends.py``): ``triton_backend`` and ``torch_backend``. The
public entry points, with validation, are ``fusedreduce.kernels.quantize_flatten``
and ``dequantize_sum`` (``kernels/_wire.py``).

Semantics both backends implement, bit for bit:

- ``v``, the fp32 value of flat element ``e``, is what ``flatten_cast_scale``
  writes into an fp32 buffer (``fp32(x) * fp32(scale)``, fp64 inputs
  multiplied in fp64 and rounded once; gaps +0), plus ``residual[e]`` in fp32
  when a residual is given;
- ``float32`` codes are ``v``; ``bfloat16`` codes are ``v`` rounded to
  nearest even;
- ``int8`` and ``float8_e4m3fn`` are blockwise: block ``k`` (elements
  ``[k * block, (k + 1) * block)`` of the flat buffer, wherever the tensors'
  bounds fall) has the fp32 scale ``s = absmax / L`` (``L`` = 127 or 448,
  ``WIRE_LEVELS``; an fp32 division), and each code is ``v / s`` (an fp32
  division) rounded to nearest even: to an integer clamped to ``[-127, 127]``
  for int8, to e4m3 (clamped to ``±448`` first, so nothing overflows) for
  float8. An all-zero block has ``s = 0`` and codes 0;
- the dequantized value is ``fp32(code) * s`` (an fp32 product);
- a block holding an inf or NaN ``v`` has the scale NaN and codes 0: the
  whole block dequantizes to NaN, and any sum it enters shows it;
- the residual becomes ``v - dequantized`` (fp32), and 0 wherever that is not
  finite (a non-finite block, a bf16 code that rounded to inf): an error kept
  for the next step must never carry a NaN into every later step;
- codes may be chunked, ``(C, n)`` views whose rows stand apart (each
  chunk's codes followed by its scales in one buffer): flat element ``e`` is
  ``codes[e // n, e % n]``, block ``k`` of the flat buffer is row ``k //
  (n / block)`` of the scales; the values are the flat layout's, bit for bit;
- ``dequantize_sum`` adds the ``R`` dequantized rows bottom-up pairwise,
  ``((d0 + d1) + (d2 + d3)) + ...``, an odd last row carried up a level
  unchanged, in fp32 (fp64 when ``out`` is fp64).
"""
