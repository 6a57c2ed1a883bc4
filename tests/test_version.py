"""``fusedreduce.__version__`` is the installed distribution's version.

The version is written once, in ``fusedreduce/__init__.py``; pyproject.toml
reads it from there when the package is built (``[tool.setuptools.dynamic]``).
"""
from importlib.metadata import version

from packaging.version import Version

import fusedreduce


def test_the_package_version_is_the_installed_distributions():
    # an install older than the checkout's __init__.py fails here: reinstall it
    assert fusedreduce.__version__ == version("fusedreduce")


def test_the_package_version_is_a_canonical_pep_440_version():
    # Version() raises InvalidVersion on anything PEP 440 does not allow; the
    # canonical spelling is the one wheel names and package indexes use
    assert str(Version(fusedreduce.__version__)) == fusedreduce.__version__
