"""fusedreduce's benchmarks: the kernels and the collectives against their torch baselines.

Installed as ``fusedreduce.bench`` with the console script ``fusedreduce-bench``
(``python -m bench`` from a checkout); ``bench/cli.py`` is the command line.
Every command prints aligned tables and, with ``--json PATH``, writes
``{"machine", "config", "results"}`` (the schema is in docs/benchmarks/index.md,
"The JSON"); ``--plot PATH.png`` draws GB/s against size.
"""
