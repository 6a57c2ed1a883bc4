"""The examples in the public docstrings run and print what they show."""
import doctest
import importlib

import pytest

MODULES = ["fusedreduce.kernels", "fusedreduce.kernels._checks", "fusedreduce.kernels._common",
           "fusedreduce.kernels._backends", "fusedreduce.kernels._prepared",
           "fusedreduce.kernels._norms", "fusedreduce.kernels._instrument", "fusedreduce.buckets",
           "fusedreduce.precision", "fusedreduce.clipping", "fusedreduce.param_swap",
           "fusedreduce.buffer_lifetime", "fusedreduce.bench.step_model"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} has no examples left to run"
    assert result.failed == 0
