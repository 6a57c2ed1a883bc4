"""Griffe extension: load subpackages that setuptools installs from another folder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import griffe


class MappedSubpackages(griffe.Extension):
    def __init__(self, subpackages: list[str]) -> None:
        super().__init__()
        self.subpackages = subpackages

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for dotted in self.subpackages:
            parent_name, _, name = dotted.rpartition(".")
            if parent_name != pkg.path:
                continue
            spec = importlib.util.find_spec(dotted)
            folder = Path(next(iter(spec.submodule_search_locations)))
            module = griffe.GriffeLoader(extensions=loader.extensions, docstring_parser=loader.docstring_parser).load(folder)
            module.name = name
            pkg.set_member(name, module)
