"""The layers hold: imports only go down, and across packages only public names.

Every module of fusedreduce/, kernels/ and bench/ is parsed (never imported)
and each of its imports, at any depth (a function's lazy import counts), is
checked against the rules docs/architecture.md states:

1. **Trees.** kernels/ (``fusedreduce.kernels``) is the bottom: it imports
   nothing of fusedreduce/ or bench/, nor ``torch.distributed``; fusedreduce/
   imports nothing of bench/ (``fusedreduce.bench``), which sits on top.
2. **kernels' public API.** fusedreduce/ and bench/ take from the kernels
   only ``fusedreduce.kernels`` itself and the names of its ``__all__``: no
   kernels submodule, and no other attribute of a name bound to the package
   (``kernels._checks``).
3. **Private modules.** A module whose dotted name has a component with a
   leading underscore (``kernels._common``, ``fusedreduce._checks``) is
   imported only from inside the package that contains it, in its own tree:
   ``kernels/norm/`` may import ``kernels._common``, bench/ may not import
   ``fusedreduce._checks``.
4. **Private names.** No module imports another module's private name
   (``from .sharded import _all_gather``), in any tree: a helper two modules
   share is public, or lives in one of them.
5. **Layers.** Every fusedreduce/ module has a layer in ``LAYERS`` (a new
   module fails until it is given one, a removed one until its entry goes),
   and imports only modules of its own layer or below; the kernels are
   below every layer.

Third-party private names (``torch._utils``) are not this test's business.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the source trees and the package each one installs as, bottom first
TREES = (("fusedreduce.kernels", "kernels"), ("fusedreduce", "fusedreduce"),
         ("fusedreduce.bench", "bench"))
KERNELS = "fusedreduce.kernels"

#: the layers of fusedreduce/, bottom first (the kernels' public API is below
#: them all); an import goes to its own layer or one below
LAYER_NAMES = ("foundations", "layout and buffers", "collectives and pipelines", "engine",
               "user APIs", "integrations")
#: every module of fusedreduce/ (``__init__`` is the package), by layer name
LAYERS = {
    # argument checks, dtypes, the process group, the bucket plan, clipping math,
    # an optimizer's param_groups swapped for a block
    "_checks": "foundations",
    "precision": "foundations",
    "process_group": "foundations",
    "checkpoint_group": "foundations",
    "buckets": "foundations",
    "clipping": "foundations",
    "param_swap": "foundations",
    "rank_agreement": "foundations",
    "node_groups": "foundations",
    # what lives in the buffers, and for how long
    "bucket_views": "layout and buffers",
    "buffer_lifetime": "layout and buffers",
    # flatten -> collective -> write back, per kind of collective
    "allreduce": "collectives and pipelines",
    "sharded": "collectives and pipelines",
    "param_shard": "collectives and pipelines",
    "adasum": "collectives and pipelines",
    "broadcast": "collectives and pipelines",
    "grad_collectives": "collectives and pipelines",
    "node_collectives": "collectives and pipelines",
    "wire_collectives": "collectives and pipelines",
    "node_scatter": "collectives and pipelines",
    "feedback_state": "collectives and pipelines",
    # running the buckets during backward
    "overlap": "engine",
    "bucket_engine": "engine",
    "shard_buffers": "engine",
    "nonfinite": "engine",
    "owned_writeback": "engine",
    "replicated_writeback": "engine",
    "uneven_inputs": "engine",
    "join_scaling": "engine",
    # what users construct and call
    "reducer": "user APIs",
    "adasum_reducer": "user APIs",
    "hooks": "user APIs",
    "node_hook": "user APIs",
    "sharded_optimizer": "user APIs",
    "sharded_params": "user APIs",
    "shard_transport": "user APIs",
    "sharded_grads": "user APIs",
    "sharded_checkpoint": "user APIs",
    "torch_clip": "user APIs",
    "optimizer_checkpoint": "user APIs",
    "replicated_step": "user APIs",
    "sharded_step": "user APIs",
    "optimizer_options": "user APIs",
    "step_checks": "user APIs",
    "adasum_delta": "user APIs",
    "optimizer": "user APIs",
    "local_ranks": "user APIs",
    "__init__": "user APIs",
    # glue for other frameworks
    "lightning": "integrations",
}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def modules_of(trees: Sequence[Tuple[str, Path]]) -> Dict[str, Tuple[Path, bool]]:
    """``{dotted name: (file, is a package's __init__)}`` of every module of the
    trees, each tree a ``(package, folder)``."""
    found: Dict[str, Tuple[Path, bool]] = {}
    for package, folder in trees:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package] + parts)] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool,
               known: Dict[str, Tuple[Path, bool]]
               ) -> Iterator[Tuple[int, str, Optional[str], Optional[str]]]:
    """``(line, target module, name taken from it or None, name bound)`` for
    every import in the module, relative ones resolved; ``from P import m``
    of a module ``m`` is an import of ``P.m``."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                # ``import a.b`` binds ``a``, not the module ``a.b``
                bound = alias.asname or (None if "." in alias.name else alias.name)
                yield node.lineno, alias.name, None, bound
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{path}:{node.lineno}: a relative import above the top")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                bound = alias.asname or alias.name
                if f"{base}.{alias.name}" in known:
                    yield node.lineno, f"{base}.{alias.name}", None, bound
                else:
                    yield node.lineno, base, alias.name, bound


def _tree_of(module: str, trees: Sequence[Tuple[str, Path]]) -> int:
    """The index in ``trees`` of the tree ``module`` belongs to (the longest match)."""
    best = max((len(pkg), i) for i, (pkg, _) in enumerate(trees)
               if module == pkg or module.startswith(pkg + "."))
    return best[1]


def _kernels_all(known: Dict[str, Tuple[Path, bool]]) -> List[str]:
    """``fusedreduce.kernels.__all__``, read from its source."""
    for node in ast.parse(known[KERNELS][0].read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("fusedreduce.kernels has no __all__")


def violations(trees: Sequence[Tuple[str, Path]] = tuple((p, ROOT / f) for p, f in TREES),
               layers: Dict[str, str] = LAYERS) -> List[str]:
    """Every break of the module docstring's rules, one line each; ``trees``
    bottom first, the middle one layered by ``layers``."""
    known = modules_of(trees)
    public = set(_kernels_all(known))
    layered = trees[1][0]
    problems = []
    names = {(layered if m == "__init__" else f"{layered}.{m}") for m in layers}
    for module in sorted(names - set(known)):
        problems.append(f"{module}: in LAYERS but there is no such module")
    for module, (path, is_package) in sorted(known.items()):
        tree = _tree_of(module, trees)
        where = path.relative_to(trees[tree][1].parent).as_posix()
        if module not in names and tree == 1:
            problems.append(f"{where}: a module without a layer: give it one in LAYERS "
                            f"(tests/test_layers.py) and docs/architecture.md")
        kernels_names = set()
        for line, target, taken, bound in imports_of(module, path, is_package, known):
            at = f"{where}:{line}"
            if tree == 0 and (target + ".").startswith("torch.distributed."):
                problems.append(f"{at}: the kernels import {target}: they do no communication")
            if not (target == "fusedreduce" or target.startswith("fusedreduce.")):
                continue
            shown = target if taken is None else f"{target}.{taken}"
            target_tree = _tree_of(target, trees)
            if target_tree > tree:
                problems.append(f"{at}: imports {shown}, from the {trees[target_tree][0]} "
                                f"tree above it")
            if tree != 0 and target_tree == 0:
                if target != KERNELS:
                    problems.append(f"{at}: imports {shown}: outside the kernels use only "
                                    f"{KERNELS} and its __all__")
                elif taken is None and bound is not None:
                    kernels_names.add(bound)
                elif taken not in public:
                    problems.append(f"{at}: imports {shown}, not in {KERNELS}.__all__")
            dotted = target.split(".")
            for i, part in enumerate(dotted):
                if _private(part):
                    owner = ".".join(dotted[:i])
                    inside = module == owner or module.startswith(owner + ".")
                    if not inside or target_tree != tree:
                        problems.append(f"{at}: imports the private module "
                                        f"{'.'.join(dotted[:i + 1])} from outside {owner}")
                    break
            if taken is not None and _private(taken) and target in known:
                problems.append(f"{at}: imports {shown}, another module's private name")
            if tree == 1 and target_tree == 1 and target != module and module in names:
                target_short = target[len(layered) + 1:] or "__init__"
                mine = layers[module[len(layered) + 1:] or "__init__"]
                theirs = layers.get(target_short)
                if theirs is not None and LAYER_NAMES.index(theirs) > LAYER_NAMES.index(mine):
                    problems.append(f"{at}: imports {shown} ({theirs}) from {mine}: an "
                                    f"import going up")
        if kernels_names:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id in kernels_names and node.attr not in public:
                    problems.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}, "
                                    f"not in {KERNELS}.__all__")
    return problems


def test_every_import_goes_down_and_takes_only_public_names():
    problems = violations()
    assert not problems, "\n".join(problems)


def test_the_architecture_page_shows_every_layer_and_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for layer in LAYER_NAMES:
        assert layer in page, layer
    for module in LAYERS:
        assert f"{module}.py" in page or module == "__init__", module


# --- the checker catches what it is for: planted violations in a small tree

CLEAN = {
    "kernels/__init__.py": "from ._common import ROW\nfrom . import _checks\n"
                           "__all__ = ['ROW', 'refuse']\nrefuse = _checks.refuse\n",
    "kernels/_checks.py": "def refuse():\n    pass\n",
    "kernels/_common.py": "ROW = 4\n",
    "kernels/norm/__init__.py": "",
    "kernels/norm/ops.py": "from .._common import ROW\n",
    "pkg/__init__.py": "from .api import run\n",
    "pkg/_checks.py": "def check():\n    pass\n",
    "pkg/base.py": "from . import kernels\nfrom ._checks import check\n"
                   "from .kernels import ROW, refuse\nkernels.refuse()\n",
    "pkg/api.py": "from .base import ROW\n\ndef run():\n    from .base import check\n",
    "bench/__init__.py": "",
    "bench/tool.py": "from fusedreduce import kernels\nfrom fusedreduce.api import run\n",
}
SMALL_LAYERS = {"__init__": "user APIs", "_checks": "foundations", "base": "foundations",
                "api": "user APIs"}


def _small_tree(tmp_path: Path, changes: Dict[str, str]) -> List[str]:
    files = {**CLEAN, **changes}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    layers = dict(SMALL_LAYERS)
    for rel in changes:
        if rel.startswith("pkg/") and Path(rel).stem not in layers:
            layers[Path(rel).stem] = "foundations"
    trees = (("fusedreduce.kernels", tmp_path / "kernels"), ("fusedreduce", tmp_path / "pkg"),
             ("fusedreduce.bench", tmp_path / "bench"))
    return violations(trees, layers)


def test_a_clean_small_tree_passes(tmp_path):
    assert _small_tree(tmp_path, {}) == []


PLANTED = {
    "a private kernels module": (
        {"pkg/base.py": "from .kernels._checks import refuse\n"},
        "imports the private module fusedreduce.kernels._checks from outside "
        "fusedreduce.kernels"),
    "a kernels name outside __all__": (
        {"pkg/base.py": "from .kernels import _checks\n"},
        "imports the private module fusedreduce.kernels._checks"),
    "a public kernels name outside __all__": (
        {"pkg/base.py": "from .kernels import norm_helper\n"},
        "imports fusedreduce.kernels.norm_helper, not in fusedreduce.kernels.__all__"),
    "a kernels attribute outside __all__": (
        {"bench/tool.py": "from fusedreduce import kernels\nkernels._checks.refuse()\n"},
        "uses kernels._checks, not in fusedreduce.kernels.__all__"),
    "a kernels submodule": (
        {"pkg/base.py": "import fusedreduce.kernels.norm.ops\n"},
        "imports fusedreduce.kernels.norm.ops: outside the kernels use only"),
    "another module's private name": (
        {"pkg/base.py": "def _helper():\n    pass\n",
         "pkg/api.py": "from .base import _helper\n"},
        "imports fusedreduce.base._helper, another module's private name"),
    "a private name inside the kernels": (
        {"kernels/norm/ops.py": "from .._checks import _hidden\n",
         "kernels/_checks.py": "def _hidden():\n    pass\n"},
        "imports fusedreduce.kernels._checks._hidden, another module's private name"),
    "a private module from another tree": (
        {"bench/tool.py": "from fusedreduce._checks import check\n"},
        "imports the private module fusedreduce._checks from outside fusedreduce"),
    "an import going up a layer": (
        {"pkg/base.py": "from .api import run\n"},
        "imports fusedreduce.api.run (user APIs) from foundations: an import going up"),
    "a lazy import going up": (
        {"pkg/base.py": "def late():\n    from . import api\n"},
        "imports fusedreduce.api (user APIs) from foundations"),
    "the kernels importing the package": (
        {"kernels/_common.py": "from fusedreduce.api import run\nROW = 4\n"},
        "imports fusedreduce.api.run, from the fusedreduce tree above it"),
    "the kernels communicating": (
        {"kernels/_common.py": "import torch.distributed as dist\nROW = 4\n"},
        "kernels/_common.py:1: the kernels import torch.distributed"),
    "the package importing the benchmarks": (
        {"pkg/api.py": "from .bench import tool\n"},
        "imports fusedreduce.bench.tool, from the fusedreduce.bench tree above it"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_violation_is_reported(tmp_path, case):
    changes, expected = PLANTED[case]
    found = _small_tree(tmp_path, changes)
    assert any(expected in line for line in found), found


def test_a_module_without_a_layer_is_reported(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "new.py").write_text("")
    found = _small_tree(tmp_path, {})
    assert any("pkg/new.py: a module without a layer" in line for line in found), found


def test_a_layer_for_a_removed_module_is_reported(tmp_path):
    trees = (("fusedreduce.kernels", tmp_path / "kernels"), ("fusedreduce", tmp_path / "pkg"),
             ("fusedreduce.bench", tmp_path / "bench"))
    _small_tree(tmp_path, {})
    found = violations(trees, {**SMALL_LAYERS, "gone": "foundations"})
    assert found == ["fusedreduce.gone: in LAYERS but there is no such module"]
