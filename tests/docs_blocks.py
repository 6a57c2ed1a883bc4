"""The code blocks of the docs and what each one asks of the checkout.

Functions over Markdown text that read and run nothing (tests/test_docs.py
runs what they find), except ``unresolved``, which imports fusedreduce:

- ``scan`` finds the fenced code blocks of a Markdown file, each with the
  ``<!-- test: ... -->`` marker in front of it, and the markers that are wrong;
  ``inline_code`` finds the inline code spans of its prose;
- ``command_lines``, ``split_commands`` and ``argv_of`` turn a shell block into
  the commands it runs, and ``checks`` says what one command needs from the
  checkout when it runs one of the project's programs (a ``--help`` that lists
  its options, a file, an extra of pyproject.toml);
- ``fusedreduce_references`` lists the fusedreduce names a Python block uses,
  and ``unresolved`` says why one of them does not exist;
- ``missing_optional`` tells, from a program's output, a failure for want of
  a package an extra of pyproject.toml installs (a skip, not a failure).

The conventions themselves are described in tests/test_docs.py's docstring.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import re
import shlex
import textwrap
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Set, Tuple

PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "console", "shell"})
#: what may follow ``test:`` in a marker; ``skip`` needs its reason after it;
#: ``output`` stands before a text block: what the run block before it prints
RUN, RUN_ONE_RANK, SKIP, OUTPUT = "run", "run 1 rank", "skip", "output"


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str          # the file, relative to the checkout
    line: int          # the opening fence's line (1-based); the code starts on the next
    language: str      # the info string's first word, lower case ("" for a bare fence)
    source: str        # the code, dedented by the fence's indentation
    marker: str = ""   # RUN, RUN_ONE_RANK, SKIP, OUTPUT or "" (none)
    reason: str = ""   # SKIP's reason
    expected: str = ""  # a run block's expected output: the OUTPUT block after it

    @property
    def kind(self) -> str:
        """``"python"``, ``"shell"`` or ``""`` (a block nothing reads)."""
        if self.language in PYTHON:
            return "python"
        return "shell" if self.language in SHELL else ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def padded_source(self) -> str:
        """The code behind blank lines, so that its line numbers are the file's."""
        return "\n" * self.line + self.source


# ------------------------------------------------------------------ Markdown

_FENCE = re.compile(r"(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)")
_COMMENT = re.compile(r"<!--(?P<body>.*?)-->")


def _opening_fence(line: str) -> Optional[Tuple[int, str, str]]:
    match = _FENCE.fullmatch(line.rstrip("\n"))
    if not match:
        return None
    fence, info = match["fence"], match["info"].strip()
    if fence[0] == "`" and "`" in info:  # CommonMark: that is inline code, not a fence
        return None
    return len(match["indent"]), fence, info


def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _dedent(line: str, indent: int) -> str:
    return line[min(indent, len(line) - len(line.lstrip(" "))):]


def _marker(line: str) -> Optional[str]:
    """The text after ``<!--`` of a line that is a ``test`` comment, else None.

    Any comment line whose first word starts with "test" counts, so that a
    misspelt marker (``<!-- tests: run -->``, ``<!-- test run -->``) is an
    error rather than a silently plain comment.
    """
    match = _COMMENT.fullmatch(line.strip())
    if not match or not match["body"].strip().lower().startswith("test"):
        return None
    return match["body"].strip()


def parse_marker(body: str) -> Tuple[str, str]:
    """``(action, reason)`` of a marker's text (``test: run``); ValueError if wrong."""
    match = re.fullmatch(r"test:\s*(?P<what>.*)", body, flags=re.S)
    what = " ".join(match["what"].split()) if match else ""
    if what in (RUN, RUN_ONE_RANK, OUTPUT):
        return what, ""
    if what.split(" ", 1)[0] == SKIP:
        reason = what[len(SKIP):].strip()
        if not reason:
            raise ValueError("`<!-- test: skip -->` needs a reason: `<!-- test: skip REASON -->`")
        return SKIP, reason
    raise ValueError(f"unknown marker `<!-- {body} -->`: the markers are `<!-- test: run -->`, "
                     f"`<!-- test: run 1 rank -->`, `<!-- test: skip REASON -->` and "
                     f"`<!-- test: output -->`")


def _fences(lines: List[str]):
    """``(opening index, closing index, indentation, info string)`` of each
    fenced block of ``lines``; the closing index is ``len(lines)`` for a fence
    never closed."""
    index = 0
    while index < len(lines):
        fence = _opening_fence(lines[index])
        if fence is None:
            index += 1
            continue
        indent, chars, info = fence
        end = index + 1
        while end < len(lines) and not _closes(lines[end], chars):
            end += 1
        yield index, end, indent, info
        index = end + 1


def scan(text: str, path: str) -> Tuple[List[Block], List[str]]:
    """The fenced code blocks of ``text``, and its marker problems (``path:line: why``).

    A marker applies to the code block right after it (only blank lines
    between); ``run`` markers only to Python blocks; an ``output`` marker to
    a block that is not Python or commands, right after a ``run`` block (only
    prose between), whose ``expected`` it becomes. A fence that is never
    closed is a problem too: everything after it would silently be code.
    """
    blocks: List[Block] = []
    problems: List[str] = []
    pending: Optional[Tuple[int, str, str]] = None  # (line, action, reason)
    lines = text.splitlines()
    fences = {start: (end, indent, info) for start, end, indent, info in _fences(lines)}
    index = 0
    while index < len(lines):
        number = index + 1
        if index in fences:
            end, indent, info = fences[index]
            if end == len(lines):
                problems.append(f"{path}:{number}: this code block is never closed")
            source = "\n".join(_dedent(line, indent) for line in lines[index + 1:end])
            language = info.split()[0].lower() if info else ""
            action, reason = pending[1:] if pending else ("", "")
            block = Block(path, number, language, source + "\n" if source else "", action,
                          reason)
            if action in (RUN, RUN_ONE_RANK) and block.kind != "python":
                problems.append(f"{path}:{pending[0]}: `<!-- test: {action} -->` is in front "
                                f"of a ```{language} block; only Python blocks run")
            if action == OUTPUT:
                if block.kind:
                    problems.append(f"{path}:{pending[0]}: `<!-- test: output -->` is in front "
                                    f"of a ```{language} block; the output goes in a ```text "
                                    f"block")
                elif not blocks or blocks[-1].marker not in (RUN, RUN_ONE_RANK):
                    problems.append(f"{path}:{pending[0]}: `<!-- test: output -->` must follow "
                                    f"a `<!-- test: run -->` block (no other code block "
                                    f"between)")
                else:
                    blocks[-1] = dataclasses.replace(blocks[-1], expected=block.source)
            blocks.append(block)
            pending = None
            index = end + 1
            continue
        stripped = lines[index].strip()
        if pending and stripped:
            problems.append(f"{path}:{pending[0]}: the marker is not followed by a code block")
            pending = None
        body = _marker(stripped)
        if body is not None:
            try:
                pending = (number, *parse_marker(body))
            except ValueError as exc:
                problems.append(f"{path}:{number}: {exc}")
        index += 1
    if pending:
        problems.append(f"{path}:{pending[0]}: the marker is not followed by a code block")
    return blocks, problems


# a code span: a run of backticks, code not crossing a blank line, the same run
_SPAN = re.compile(r"(?<!`)(?P<ticks>`+)(?!`)(?P<code>(?:(?!\n[ \t]*\n).)+?)(?<!`)(?P=ticks)(?!`)",
                   flags=re.S)


def inline_code(text: str) -> List[Tuple[int, str]]:
    """The inline code spans of ``text`` outside its code blocks, each with the
    line it starts on; a span's line breaks read as spaces (CommonMark)."""
    lines = text.splitlines()
    for start, end, _, _ in _fences(lines):
        for index in range(start, min(end, len(lines) - 1) + 1):
            lines[index] = ""
    prose = "\n".join(lines)
    return [(prose.count("\n", 0, match.start("code")) + 1,
             re.sub(r"\s*\n\s*", " ", match["code"]).strip())
            for match in _SPAN.finditer(prose)]


# ------------------------------------------------------------------ commands

def command_lines(block: Block) -> List[Tuple[int, str]]:
    """The command lines of a shell block, each with its line in the file.

    Backslash continuations are joined; comment lines are dropped. Where a
    block has ``$ `` prompts (a console transcript), only the prompted lines
    are commands, the others being their output.
    """
    raw = block.source.splitlines()
    prompted = any(line.lstrip().startswith("$ ") for line in raw)
    found = []
    index = 0
    while index < len(raw):
        start, text = index, raw[index].strip()
        while text.endswith("\\") and index + 1 < len(raw):
            index += 1
            text = text[:-1].rstrip() + " " + raw[index].strip()
        index += 1
        if prompted:
            if not text.startswith("$ "):
                continue
            text = text[2:].strip()
        if text and not text.startswith("#"):
            found.append((block.line + 1 + start, text))
    return found


def split_commands(line: str) -> List[str]:
    """The commands of a shell line: cut at unquoted ``&&``, ``||``, ``|`` and
    ``;``, and at an unquoted ``#`` that starts a word (a comment)."""
    commands, current, quote = [], [], ""
    index = 0
    while index < len(line):
        char = line[index]
        if quote:
            current.append(char)
            if char == quote:
                quote = ""
            elif char == "\\" and quote == '"' and index + 1 < len(line):
                current.append(line[index + 1])
                index += 1
        elif char in "'\"":
            quote = char
            current.append(char)
        elif char == "\\" and index + 1 < len(line):
            current.append(line[index:index + 2])
            index += 1
        elif char == "#" and (index == 0 or line[index - 1] in " \t;|&"):
            break
        elif line.startswith(("&&", "||"), index):
            commands.append("".join(current))
            current = []
            index += 1
        elif char in "|;":
            commands.append("".join(current))
            current = []
        else:
            current.append(char)
        index += 1
    commands.append("".join(current))
    return [command.strip() for command in commands if command.strip()]


def argv_of(command: str) -> List[str]:
    """A command's words as the shell splits them, leading ``VAR=value``
    assignments and ``env``/``time`` dropped."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: the words still name the program
        words = command.split()
    while words and (words[0] in ("env", "time")
                     or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0])):
        words = words[1:]
    return words


@dataclass(frozen=True)
class Help:
    """``python *argv`` (in the checkout) exits 0 and its output names each option."""

    argv: Tuple[str, ...]
    options: Tuple[str, ...]


@dataclass(frozen=True)
class Exists:
    """A path of the checkout."""

    path: str


@dataclass(frozen=True)
class Extras:
    """Extras of pyproject.toml's ``[project.optional-dependencies]``."""

    extras: Tuple[str, ...]


@dataclass(frozen=True)
class Script:
    """A console script of pyproject.toml's ``[project.scripts]``."""

    name: str


@dataclass(frozen=True)
class Wrong:
    """The command is wrong as written."""

    message: str


_PYTHON_PROGRAM = re.compile(r"python(3(\.\d+)?)?")
_BENCH = ("fusedreduce.bench", "bench")  # bench: a checkout's alias (bench/__main__.py)
# pip install's options that take a value (the value is not a requirement)
_PIP_VALUES = frozenset({
    "-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--upgrade-strategy",
    "--python-version", "--platform", "--implementation", "--abi", "--only-binary",
    "--no-binary", "-C", "--config-settings", "--progress-bar", "--trusted-host",
    "--src", "--cache-dir", "--log", "--proxy", "--timeout", "--retries"})


def checks(argv: Sequence[str]) -> List[object]:
    """What one command asks of the checkout: ``Help``, ``Exists``, ``Extras``,
    ``Script`` and ``Wrong`` items; empty for a command of no program of this
    project (``git``, ``cd``, ``torchrun train.py``, ``pip install torch``)."""
    argv = list(argv)
    if not argv:
        return []
    program, args = os.path.basename(argv[0]), argv[1:]
    if program == "fusedreduce-bench":
        return [Script(program), _bench(args)]
    if _PYTHON_PROGRAM.fullmatch(program):
        return _python(args)
    if program == "torchrun":
        return _torchrun(args)
    if program in ("pip", "pip3"):
        return _pip(args)
    if program == "pytest":
        return _pytest(args)
    if program == "mkdocs":
        return _mkdocs(args)
    if program in ("bash", "sh"):
        words = [arg for arg in args if not arg.startswith("-")]
        return _ci(words[0]) if words else []
    return _ci(argv[0])


def _options(args: Sequence[str]) -> Tuple[str, ...]:
    """The ``--long`` options among ``args`` (``[--opt]``, an optional one as a
    usage line writes it, included; ``--opt=value`` as ``--opt``)."""
    found = []
    for arg in args:
        word = arg.strip("[]").split("=", 1)[0]
        if re.fullmatch(r"--[A-Za-z0-9][\w-]*", word) and word not in found:
            found.append(word)
    return tuple(found)


def _bench(args: Sequence[str]) -> Help:
    command = [args[0]] if args and not args[0].startswith("-") else []
    return Help(("-m", "fusedreduce.bench", *command, "--help"), _options(args))


def _python(args: Sequence[str]) -> List[object]:
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "-m" and index + 1 < len(args):
            return _module(args[index + 1], args[index + 2:])
        if arg.startswith("-m") and len(arg) > 2:
            return _module(arg[2:], args[index + 1:])
        if arg == "-c":
            return []
        if not arg.startswith("-"):
            return _script(arg, args[index + 1:])
        index += 2 if arg in ("-X", "-W") else 1
    return []


def _module(name: str, args: Sequence[str]) -> List[object]:
    if name in _BENCH:
        return [_bench(args)]
    for package in _BENCH:
        if name.startswith(package + "."):
            module = "fusedreduce.bench." + name[len(package) + 1:]
            return [Help(("-m", module, "--help"), _options(args))]
    if name.startswith("fusedreduce."):
        return [Help(("-m", name, "--help"), _options(args))]
    if name == "pytest":
        return _pytest(args)
    if name == "pip":
        return _pip(args)
    if name == "torch.distributed.run":
        return _torchrun(args)
    if name == "mkdocs":
        return _mkdocs(args)
    return []


def _script(path: str, args: Sequence[str]) -> List[object]:
    path = path[2:] if path.startswith("./") else path
    if not path.startswith("examples/"):
        return []  # the user's own script
    return [Exists(path), Help((path, "--help"), _options(args))]


def _torchrun(args: Sequence[str]) -> List[object]:
    """torchrun's own parser finds the script (or ``-m`` module) after its options."""
    from torch.distributed.run import get_args_parser

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = get_args_parser().parse_args(list(args))
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        if "required: training_script" in errors.getvalue():
            return []  # no script: torchrun's options alone, as prose quotes them
        return [Wrong(f"torchrun refuses these arguments: {lines[-1] if lines else args}")]
    if parsed.module:
        return _module(parsed.training_script, parsed.training_script_args)
    if parsed.no_python:
        return []
    return _script(parsed.training_script, parsed.training_script_args)


def canonical_name(name: str) -> str:
    """A project's or an extra's name as PEP 503/685 compare them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(args: Sequence[str]) -> List[object]:
    if not args or args[0] != "install":
        return []
    found: List[object] = []
    words = iter(args[1:])
    for word in words:
        if word in _PIP_VALUES:
            next(words, None)
        elif not word.startswith("-"):
            found.extend(_requirement(word))
    return found


def _requirement(spec: str) -> List[object]:
    """fusedreduce comes from a checkout or a wheel: a local path's extras must
    exist, and fusedreduce by name (from an index) is an error."""
    match = re.fullmatch(r"(?P<name>[^\[\]]*?)\s*\[(?P<extras>[^\]]*)\](?P<rest>.*)", spec)
    if match:
        name, rest = match["name"].strip(), match["rest"]
        extras = tuple(e.strip() for e in match["extras"].split(",") if e.strip())
    else:
        name, rest, extras = re.split(r"[<>=!~;@ ]", spec, maxsplit=1)[0], "", ()
    local = (name.startswith((".", "/", "~")) or "/" in name
             or name.endswith((".whl", ".tar.gz", ".zip")))
    by_name = canonical_name(name) == "fusedreduce"
    # an all-capitals extra is a placeholder: pip install -e ".[NAME]"
    extras = tuple(extra for extra in extras if not re.fullmatch(r"[A-Z][A-Z_]*", extra))
    found: List[object] = []
    if by_name and "@" not in rest:  # "fusedreduce @ git+..." is a direct reference
        extra = f"[{','.join(extras)}]" if extras else ""
        found.append(Wrong(f"pip install {spec!r} looks fusedreduce up on a package index, "
                           f"where it is not: install the checkout, pip install -e "
                           f"\".{extra}\" (or a wheel's path)"))
    if extras and (local or by_name):
        found.append(Extras(extras))
    return found


def _pytest(args: Sequence[str]) -> List[object]:
    found: List[object] = [Help(("-m", "pytest", "--help"), _options(args))]
    for arg in args:
        if arg == "tests" or arg.startswith("tests/"):
            found.append(Exists(arg.split("::", 1)[0].rstrip("/")))
    return found


def _mkdocs(args: Sequence[str]) -> List[object]:
    if not args or args[0] not in ("build", "serve", "gh-deploy"):
        return []
    for flag, value in zip(args, args[1:]):
        if flag in ("-f", "--config-file"):
            return [Exists(value)]
    return [Exists("mkdocs.yml")]


def _ci(path: str) -> List[object]:
    path = path[2:] if path.startswith("./") else path
    return [Exists(path)] if path.startswith(".ci/") else []


# ------------------------------------------------------------ Python blocks

@dataclass(frozen=True)
class Reference:
    """A fusedreduce name a Python block uses.

    ``module.attributes[0].attributes[1]...`` must exist (followed through
    modules and classes only), and, when ``instance_attribute`` is set, the
    class it names must give its instances that attribute.
    """

    line: int
    module: str
    attributes: Tuple[str, ...] = ()
    instance_attribute: str = ""

    @property
    def name(self) -> str:
        name = ".".join((self.module, *self.attributes))
        return f"{name}(...).{self.instance_attribute}" if self.instance_attribute else name


def _ours(module: Optional[str]) -> bool:
    return module == "fusedreduce" or (module or "").startswith("fusedreduce.")


def _chain(node: ast.AST) -> Tuple[Optional[ast.AST], Tuple[str, ...]]:
    """``a.b.c`` -> (the node of ``a``, ("b", "c"))."""
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    return node, tuple(reversed(attributes))


def _bindings(tree: ast.AST) -> Counter:
    """How many times each name is bound anywhere in ``tree``."""
    counts: Counter = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            counts[node.id] += 1
        elif isinstance(node, ast.arg):
            counts[node.arg] += 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            counts[node.name] += 1
        elif isinstance(node, ast.alias):
            counts[(node.asname or node.name).split(".")[0]] += 1
    return counts


def fusedreduce_references(tree: ast.AST) -> List[Reference]:
    """The fusedreduce names ``tree`` uses (see tests/test_docs.py for the rules)."""
    found: List[Reference] = []
    bound: Dict[str, Tuple[str, Tuple[str, ...]]] = {}  # name -> (module, attributes)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    found.append(Reference(node.lineno, alias.name))
                    if alias.asname:
                        bound[alias.asname] = (alias.name, ())
                    else:
                        bound["fusedreduce"] = ("fusedreduce", ())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            found.append(Reference(node.lineno, node.module))
            for alias in node.names:
                if alias.name != "*":
                    found.append(Reference(node.lineno, node.module, (alias.name,)))
                    bound[alias.asname or alias.name] = (node.module, (alias.name,))

    def resolve(node: ast.AST) -> Optional[Tuple[str, Tuple[str, ...]]]:
        base, attributes = _chain(node)
        if isinstance(base, ast.Name) and base.id in bound:
            module, prefix = bound[base.id]
            return module, prefix + attributes
        return None

    # name = Class(...) with the class from fusedreduce, the name bound once
    once = _bindings(tree)
    instances: Dict[str, Tuple[str, Tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Call) \
                and once[target.id] == 1:
            made = resolve(node.value.func)
            if made:
                instances[target.id] = made

    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        base, attributes = _chain(node)
        made = None
        if isinstance(base, ast.Name) and base.id in instances:
            made = instances[base.id]
        elif isinstance(base, ast.Call):
            made = resolve(base.func)
        if made:
            found.append(Reference(node.lineno, made[0], made[1], attributes[0]))
        elif resolve(node):
            found.append(Reference(node.lineno, *resolve(node)))
    return sorted(set(found), key=lambda r: (r.line, r.name))


class MissingDependency(Exception):
    """A fusedreduce module, or a program a command runs, needs an optional
    package that is not installed."""


#: the import name of an optional dependency, where it is not its distribution's name
IMPORT_NAMES = {"scikit-learn": "sklearn", "mkdocs-material": "material",
                "pytest-xdist": "xdist"}


def extras_installing(module: str, optional: Dict[str, Sequence[str]]) -> List[str]:
    """The extras of ``optional`` (pyproject.toml's ``[project.optional-dependencies]``)
    whose requirements install the top-level module ``module``."""
    def imported(requirement: str) -> str:
        name = canonical_name(re.split(r"[\[<>=!~;@ ]", requirement, maxsplit=1)[0])
        return IMPORT_NAMES.get(name, name.replace("-", "_"))

    return [extra for extra, requirements in optional.items()
            if any(imported(requirement) == module for requirement in requirements)]


def missing_optional(output: str, optional: Dict[str, Sequence[str]]) -> Optional[str]:
    """Why a program failed, when its output's last ``ModuleNotFoundError``
    names a module an extra of ``optional`` installs (``sklearn`` of
    ``examples``, say): a package the reader installs with that extra, not
    a fault of the docs. None for any other failure."""
    names = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", output)
    if not names:
        return None
    module = names[-1].split(".")[0]
    extras = extras_installing(module, optional)
    if not extras or _ours(module):
        return None
    return (f"needs {module}, which is not installed (pyproject.toml's extras that install "
            f"it: {', '.join(extras)})")


def _import(name: str):
    """The module ``name``; None if there is no such fusedreduce module."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = exc
        while missing is not None and not isinstance(missing, ModuleNotFoundError):
            missing = missing.__cause__ or missing.__context__
        if missing is None or not missing.name:
            raise
        if not _ours(missing.name):  # fusedreduce.lightning without lightning, say
            raise MissingDependency(f"{name} needs {missing.name}, which is not installed: "
                                    f"{exc}") from exc
        if name == missing.name or name.startswith(missing.name + "."):
            return None
        raise


def unresolved(reference: Reference) -> Optional[str]:
    """Why ``reference`` names nothing, or None when it exists (or cannot be
    followed further: an attribute of a function or of a constant)."""
    target = _import(reference.module)
    if target is None:
        return f"there is no module {reference.module}"
    name = reference.module
    for attribute in reference.attributes:
        if inspect.ismodule(target):
            found = getattr(target, attribute, None)
            if found is None and not hasattr(target, attribute):
                found = _import(f"{target.__name__}.{attribute}")
            if found is None and not hasattr(target, attribute):
                return f"{name} has no attribute or submodule {attribute!r}"
            target = found
        elif inspect.isclass(target):
            if not hasattr(target, attribute):
                return f"{name} has no attribute {attribute!r}"
            target = getattr(target, attribute)
        else:
            return None
        name += "." + attribute
    if reference.instance_attribute and inspect.isclass(target):
        if reference.instance_attribute not in instance_attributes(target):
            return f"{name} instances have no attribute {reference.instance_attribute!r}"
    return None


@lru_cache(maxsize=None)
def instance_attributes(cls: type) -> Set[str]:
    """What an instance of ``cls`` has: its class's attributes, ``__slots__``,
    annotated fields, and every ``self.NAME = ...`` in its classes' source."""
    names = set(dir(cls))
    for klass in inspect.getmro(cls):
        names.update(getattr(klass, "__annotations__", {}))
        slots = getattr(klass, "__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # built-in classes have no source
            continue
        names.update(node.attr for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                     and isinstance(node.value, ast.Name) and node.value.id == "self")
    return names
