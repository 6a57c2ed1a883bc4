"""``python -m bench <command>`` from a checkout, ``python -m fusedreduce.bench`` once installed."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog=f"python -m {__package__}"))
