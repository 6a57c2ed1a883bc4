"""fusedreduce benchmarks, run as ``python -m bench <benchmark> [options]``.

``kernels`` times the flatten/unflatten kernels against plain torch; see
``bench/kernels.py``. Each benchmark prints an aligned table and, with
``--json PATH``, writes ``{"machine", "config", "results"}``.
"""
