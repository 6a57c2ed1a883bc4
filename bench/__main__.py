"""``python -m bench <benchmark> [options]``: run one benchmark (``--help`` lists them)."""
from __future__ import annotations

import argparse
import sys

from . import adasum, collectives, hooks, kernels

# name -> module with add_arguments(parser) and run(args) -> exit status
BENCHMARKS = {"kernels": kernels, "collectives": collectives, "hooks": hooks, "adasum": adasum}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    subparsers = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module in BENCHMARKS.items():
        summary = module.__doc__.strip().splitlines()[0]
        sub = subparsers.add_parser(name, help=summary, description=summary)
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    return BENCHMARKS[args.benchmark].run(args)


if __name__ == "__main__":
    sys.exit(main())
