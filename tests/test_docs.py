"""The code in the docs works as written (README.md and every docs/**/*.md).

The conventions the docs are written to (tests/docs_blocks.py reads them):

- **Fences.** ```python and ```py blocks are Python; ```bash, ```sh,
  ```console and ```shell blocks are commands; other blocks (```text, a bare
  fence, ```pycon, ```json, ...) are not read. The language is the info
  string's first word (```python title="train.py" is Python); ``` and ~~~
  fences of 3 or more characters; an indented fence (in a list item or an
  admonition) has its block dedented by the fence's indentation.
- **Python blocks** compile, and every fusedreduce name they use exists:
  ``import fusedreduce[.sub] [as x]`` (the module imports), ``from
  fusedreduce[.sub] import a, b`` (each an attribute or a submodule), and
  attribute chains on names those imports bound (``fusedreduce.hooks.x``,
  ``hooks.allreduce_hook`` after ``from fusedreduce import hooks``), followed
  through modules and classes as far as the chain goes. Other names may be
  undefined (a block may be a fragment of a loop). Chains on instances are not
  followed, with one exception, one level deep: a name bound exactly once in
  the block, by ``name = Class(...)`` with ``Class`` from fusedreduce, and a
  call ``Class(...)`` itself: ``name.attr`` and ``Class(...).attr`` must be
  an attribute of the class or an instance attribute it sets (``self.attr =``
  in its classes' source, slots, annotations) — so a renamed method fails.
- **Markers**, an HTML comment line right before a Python block (blank lines
  between allowed): ``<!-- test: run -->``: the block is a complete script,
  run as torchrun would run it on 2 gloo ranks: two processes, each running
  the script as ``python script.py`` does, with RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, OMP_NUM_THREADS=1, in a
  temporary directory of its own (not the checkout, and without the test
  session's TRITON_INTERPRET); the script calls ``init_process_group``
  itself. Both must exit 0 within RUN_TIMEOUT. Each process is a fresh fork
  of a server that imported torch and fusedreduce once (``script_ranks``:
  what differs from a new interpreter is said there), 5x faster than two
  interpreters per block.
  ``<!-- test: run 1 rank -->``: the same with one process. ``<!-- test:
  skip REASON -->``: nothing is checked (a reason is required). ``<!-- test:
  output -->`` before a ```text block right after a run block: the output
  that block shows its reader; each of its non-blank lines must be a line
  some rank printed (``rank N: ...`` lines rank N), so a shown output cannot
  go stale. Any other
  comment line starting with ``test`` is an error, as is a marker that no
  code block follows. A ``skip`` marker may also stand before a command block.
- **Commands**: each line of a command block (backslash continuations
  joined; in a block with ``$ `` prompts, only the prompted lines; comments
  dropped; split at ``&&``, ``||``, ``|`` and ``;``), and each inline code
  span of the prose (`` `pip install -e ".[examples]"` ``), that runs one of
  the project's programs: ``fusedreduce-bench [COMMAND]``, ``python -m
  fusedreduce.bench [COMMAND]`` and ``python -m bench [COMMAND]`` (``--help``
  of that command exits 0 and lists every ``--option`` the line gives;
  ``fusedreduce-bench`` must also be a console script of pyproject.toml);
  ``python -m fusedreduce.bench.MODULE`` (likewise); ``python examples/X.py``
  and ``torchrun ... examples/X.py`` (the file exists and its ``--help`` lists
  the options after it; torchrun's own arguments are only parsed, by
  torchrun's parser, to find the script); ``torchrun ... -m MODULE`` (as
  ``python -m MODULE``); ``pip install`` of the checkout or a wheel (each
  extra exists in pyproject.toml, an all-capitals one like ``NAME`` being a
  placeholder; ``fusedreduce[...]`` by name is an error: fusedreduce is on no
  package index); ``bash .ci/X`` (exists); ``mkdocs
  build|serve`` (mkdocs.yml exists); ``python -m pytest`` (each ``--option``
  is in ``pytest --help``, with the suite's conftest; each ``tests[/...]``
  path exists). Every ``--help`` runs once per session, all of them in one
  process (``help_batch.py``; one that fails there runs again alone, which
  decides). Other commands
  (``torchrun train.py``, ``git``, ``pip install torch``) are not checked.
- **Optional packages**: a Python block whose fusedreduce module, a command
  whose program, or a run block whose script fails to import a package that
  an extra of pyproject.toml installs (lightning, accelerate, scikit-learn,
  ...) is skipped, naming the package and its extras, not failed: the suite
  also runs without the extras (``pip install -e ".[test]"``).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import script_ranks
from device_mode import VARIABLE
from docs_blocks import (OUTPUT, RUN, RUN_ONE_RANK, SKIP, Block, Exists, Extras, Help, MissingDependency,
                         Reference, Script, Wrong, argv_of, canonical_name, checks, command_lines,
                         fusedreduce_references, inline_code, missing_optional, scan,
                         split_commands, unresolved)
from fusedreduce.local_ranks import FAILURE_GRACE_S
from harness import EXIT_ABORT, ROOT, once_per_session

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

#: seconds a run block's ranks get, together; a ``--help`` gets the same
RUN_TIMEOUT = 120
#: how much of each rank's output a failure shows
TAIL = 3000
#: what a rank prints when another process took its MASTER_PORT first
PORT_TAKEN = "Address already in use"


def doc_files() -> List[Path]:
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(docs.rglob("*.md"))] if docs.is_dir() \
        else [ROOT / "README.md"]


TEXTS = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
         for path in doc_files()}
SCANS = {path: scan(text, path) for path, text in TEXTS.items()}
BLOCKS = [block for blocks, _ in SCANS.values() for block in blocks]
#: "path:line" -> block (test ids, and failures that name the block, not its repr)
PYTHON_BLOCKS = {block.id: block for block in BLOCKS if block.kind == "python"}
RUN_BLOCKS = {key: block for key, block in PYTHON_BLOCKS.items()
              if block.marker in (RUN, RUN_ONE_RANK)}


def _needs(text: str) -> List[object]:
    return [need for command in split_commands(text) for need in checks(argv_of(command))]


def command_checks(path: str, text: str, blocks: List[Block]) -> List[Tuple[str, str, list]]:
    """``(path:line, the command, its checks)`` for every command of this
    project's programs in one file: each line of its command blocks, and the
    inline code spans of its prose (one entry per line)."""
    found = []
    for block in blocks:
        if block.kind == "shell" and block.marker != SKIP:
            found += [(f"{path}:{line}", command, _needs(command))
                      for line, command in command_lines(block)]
    spans: Dict[int, List[str]] = {}
    for line, code in inline_code(text):
        if _needs(code):
            spans.setdefault(line, []).append(code)
    found += [(f"{path}:{line}", "  /  ".join(codes), [n for code in codes for n in _needs(code)])
              for line, codes in spans.items()]
    return [entry for entry in found if entry[2]]


#: "path:line" -> (the command, its checks)
COMMANDS = {where: (command, needs) for path, text in TEXTS.items()
            for where, command, needs in command_checks(path, text, SCANS[path][0])}


# ------------------------------------------------------ the docs themselves

@pytest.mark.parametrize("path", list(SCANS))
def test_every_marker_is_known_and_stands_before_a_code_block(path):
    _, problems = SCANS[path]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("block_id", PYTHON_BLOCKS)
def test_python_block_compiles_and_its_fusedreduce_names_exist(block_id):
    block = PYTHON_BLOCKS[block_id]
    if block.marker == SKIP:
        pytest.skip(block.reason)
    problems = python_block_problems(block)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("block_id", RUN_BLOCKS)
def test_run_block_runs_as_a_script_on_its_ranks(block_id, tmp_path):
    run_block(RUN_BLOCKS[block_id], tmp_path)


@pytest.mark.parametrize("where", COMMANDS)
def test_command_runs_a_program_and_options_that_exist(where, help_output):
    command, needs = COMMANDS[where]
    check_command(where, command, needs, help_output)


def test_the_scan_finds_python_and_command_blocks_in_the_readme():
    blocks, _ = SCANS["README.md"]
    assert any(block.kind == "python" for block in blocks), "no Python block in README.md"
    assert any(_needs(command) for block in blocks if block.kind == "shell"
               for _, command in command_lines(block)), \
        "no command of this project's programs in README.md's command blocks"


# ------------------------------------------------------------- the checkers

def python_block_problems(block: Block) -> List[str]:
    """Why ``block`` does not compile, or which fusedreduce names it uses do
    not exist (``path:line: why`` each)."""
    source = block.padded_source()
    try:
        compile(source, block.path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return [f"{block.path}:{exc.lineno}: does not compile: {exc.msg}"]
    problems = []
    for reference in fusedreduce_references(ast.parse(source)):
        try:
            why = unresolved(reference)
        except MissingDependency as exc:
            pytest.skip(f"{block.id}: {exc} (an extra of pyproject.toml)")
        if why:
            problems.append(f"{block.path}:{reference.line}: {reference.name}: {why}")
    return problems


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(script: Path, world_size: int) -> Tuple[List[object], List[str]]:
    """Run ``script`` on ``world_size`` ranks as torchrun would; each rank's
    exit status (None: killed) and output. Each rank is a fork of a server
    that imported torch and fusedreduce once (``script_ranks``)."""
    port = _free_port()
    # a user's environment: not the test session's (TRITON_INTERPRET, the test device)
    user = {name: value for name, value in os.environ.items()
            if name not in ("TRITON_INTERPRET", VARIABLE) and not name.startswith("PYTEST_")}
    ranks = []
    for rank in range(world_size):
        env = {**user, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = script.parent / f"rank{rank}.log"
        ranks.append((script_ranks.start(str(script), env, str(log)), log))
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        codes = [process.exitcode for process, _ in ranks]
        if None not in codes:
            break
        if any(code not in (None, 0) for code in codes):  # the others may wait for it forever
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        time.sleep(0.02)
    codes, outputs = [], []
    for process, log in ranks:
        if process.exitcode is None:
            process.kill()
        process.join()
        codes.append(process.exitcode if process.exitcode is not None and
                     process.exitcode >= 0 else None)
        outputs.append(log.read_text() if log.exists() else "")
    return codes, outputs


def run_block(block: Block, directory: Path) -> None:
    """Run a ``test: run`` block as a script on its ranks; fail with its
    file:line and each rank's output unless every rank exits 0.

    A rank that aborts at interpreter exit with torch's gloo teardown abort
    (``harness.EXIT_ABORT``, after the script's work) gets one relaunch, as
    ``harness.run_torchrun`` does; so does a launch whose free port was taken
    between finding it and binding it. A script that fails for want of a
    package an extra of pyproject.toml installs is skipped, saying so.
    """
    world_size = 1 if block.marker == RUN_ONE_RANK else 2
    script = directory / (re.sub(r"\W", "_", block.id) + ".py")  # tracebacks: the doc's lines
    script.write_text(block.padded_source())
    for attempt in range(2):
        codes, outputs = _launch(script, world_size)
        if codes == [0] * world_size:
            missing = missing_output(block.expected, outputs)
            if missing:
                pytest.fail(f"{block.id}: the output shown after the block has lines no rank "
                            f"printed: {missing}; the ranks printed:\n" + "\n".join(
                                f"--- rank {rank}:\n{output[-TAIL:]}"
                                for rank, output in enumerate(outputs)), pytrace=False)
            return
        if attempt == 0 and any(EXIT_ABORT in output or PORT_TAKEN in output
                                for output in outputs):
            continue
        why = missing_optional("\n".join(outputs),
                               _pyproject()["project"].get("optional-dependencies", {}))
        if why is not None:
            pytest.skip(f"{block.id}: the script {why}")
        tails = "".join(f"\n--- rank {rank} ({'killed' if code is None else f'exit {code}'}), "
                        f"last {TAIL} characters of its output:\n{output[-TAIL:]}"
                        for rank, (code, output) in enumerate(zip(codes, outputs)))
        pytest.fail(f"{block.id}: the block failed on {world_size} rank(s) "
                    f"(line numbers are the file's):{tails}", pytrace=False)


def missing_output(expected: str, outputs: List[str]) -> List[str]:
    """The lines of a block's shown output that no rank printed: a line
    ``rank N: ...`` must be one of rank N's lines, any other one of some
    rank's (surrounding white space aside)."""
    printed = [{line.strip() for line in output.splitlines()} for output in outputs]
    missing = []
    for line in filter(None, (line.strip() for line in expected.splitlines())):
        match = re.match(r"rank (\d+):", line)
        ranks = [int(match[1])] if match and int(match[1]) < len(printed) else \
            range(len(printed))
        if not any(line in printed[rank] for rank in ranks):
            missing.append(line)
    return missing


def _help_argvs() -> List[Tuple[str, ...]]:
    """Every ``Help`` command line the documentation quotes, once each."""
    argvs = {need.argv for _, needs in COMMANDS.values() for need in needs
             if isinstance(need, Help)
             and not (need.argv[0].endswith(".py") and not (ROOT / need.argv[0]).exists())}
    return sorted(argvs)


def _run_alone(argv: Tuple[str, ...]) -> Tuple[object, str]:
    try:
        process = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                                 text=True, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {RUN_TIMEOUT} s"
    return process.returncode, process.stdout + process.stderr


@pytest.fixture(scope="session")
def help_output(tmp_path_factory):
    """``help_output(argv)``: ``(exit status, output)`` of ``python *argv`` in
    the checkout. Every command line the documentation quotes runs once per
    session, all in one process (``help_batch.py``: importing torch once
    instead of once per command), shared by every pytest-xdist worker; one
    that fails there runs again alone, in its own process, which decides."""
    def batch(_directory):
        argvs = _help_argvs()
        try:
            process = subprocess.run(
                [sys.executable, str(Path(__file__).with_name("help_batch.py"))], cwd=ROOT,
                input=json.dumps([list(a) for a in argvs]), capture_output=True, text=True,
                timeout=RUN_TIMEOUT * 2)
            results = json.loads(process.stdout)
        except (subprocess.TimeoutExpired, ValueError):
            return {}
        return {argv: tuple(result) for argv, result in zip(argvs, results)}

    by_argv = once_per_session(tmp_path_factory, "docs-help-batch", batch)

    def run(argv: Tuple[str, ...]) -> Tuple[object, str]:
        found = by_argv.get(tuple(argv))
        if found is not None and found[0] == 0:
            return found
        name = "docs-help-" + hashlib.sha1("\0".join(argv).encode()).hexdigest()[:16]
        return once_per_session(tmp_path_factory, name, lambda _directory: _run_alone(argv))
    return run


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def check_command(where: str, command: str, needs: List[object], help_output) -> None:
    """Fail with what is wrong with one command line of the docs; skip, as a
    Python block is skipped, where a program it runs needs an optional
    package that is not installed."""
    try:
        failures = command_problems(needs, help_output)
    except MissingDependency as exc:
        pytest.skip(f"{where}: {exc}")
    if failures:
        pytest.fail(f"{where}: {command}\n  " + "\n  ".join(failures), pytrace=False)


def command_problems(needs: List[object], help_output) -> List[str]:
    """What is wrong with one command line's ``needs`` (from ``docs_blocks.checks``).

    Raises:
        MissingDependency: a ``--help`` failed for want of a package that an
            extra of pyproject.toml installs.
    """
    project = _pyproject()["project"]
    extras = {canonical_name(name) for name in project.get("optional-dependencies", {})}
    failures = []
    for need in needs:
        if isinstance(need, Wrong):
            failures.append(need.message)
        elif isinstance(need, Exists) and not (ROOT / need.path).exists():
            failures.append(f"{need.path} does not exist in the checkout")
        elif isinstance(need, Script) and need.name not in project.get("scripts", {}):
            failures.append(f"{need.name} is not a console script of pyproject.toml")
        elif isinstance(need, Extras):
            missing = [extra for extra in need.extras if canonical_name(extra) not in extras]
            if missing:
                failures.append(f"pyproject.toml has no extra {', '.join(missing)} "
                                f"(it has {', '.join(sorted(extras))})")
        elif isinstance(need, Help):
            if need.argv[0].endswith(".py") and not (ROOT / need.argv[0]).exists():
                continue  # its Exists says so
            code, output = help_output(need.argv)
            command = "python " + " ".join(need.argv)
            if code != 0:
                why = missing_optional(output, project.get("optional-dependencies", {}))
                if why is not None:
                    raise MissingDependency(f"`{command}` {why}")
                failures.append(f"`{command}` exited {code}:\n{output[-TAIL:]}")
                continue
            unknown = [option for option in need.options
                       if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", output)]
            if unknown:
                failures.append(f"`{command}` does not list {', '.join(unknown)}")
    return failures


# ------------------------------------ the reading of Markdown, on inline text

def _blocks(markdown: str) -> List[Block]:
    blocks, problems = scan(textwrap.dedent(markdown), "doc.md")
    assert problems == []
    return blocks


def test_fences_of_either_kind_and_any_length_give_their_language_and_code():
    blocks = _blocks("""\
        text
        ```python
        x = 1
        ```
        ~~~~bash
        echo ```
        ~~~~
        ````py
        ```
        y = 2
        ````
        ```
        plain
        ```
        """)
    assert [(b.line, b.language, b.kind, b.source) for b in blocks] == [
        (2, "python", "python", "x = 1\n"), (5, "bash", "shell", "echo ```\n"),
        (8, "py", "python", "```\ny = 2\n"), (12, "", "", "plain\n")]


def test_attributes_after_the_language_are_not_part_of_it():
    blocks = _blocks("""\
        ```python title="train.py" linenums="1"
        pass
        ```
        ``` console
        $ ls
        ```
        """)
    assert [b.language for b in blocks] == ["python", "console"]


def test_an_indented_fence_has_its_block_dedented_by_its_indentation():
    blocks = _blocks("""\
        1. Install:

            ```python
            if True:
                x = 1

            y = 2
            ```
        """)
    assert blocks[0].source == "if True:\n    x = 1\n\ny = 2\n"
    compile(blocks[0].source, "doc.md", "exec")


def test_the_padded_source_keeps_the_files_line_numbers():
    block = _blocks("a\n\n```python\nx = (\n```\n")[0]
    with pytest.raises(SyntaxError) as error:
        compile(block.padded_source(), "doc.md", "exec")
    assert error.value.lineno == 4


def test_a_marker_applies_to_the_block_after_it_blank_lines_allowed():
    blocks = _blocks("""\
        <!-- test: run -->
        ```python
        pass
        ```
          <!--   test:   run   1   rank -->

        ```py
        pass
        ```
        <!-- test: skip needs a GPU -->
        ```python
        pass
        ```
        ```python
        pass
        ```
        """)
    assert [(b.marker, b.reason) for b in blocks] == [
        (RUN, ""), (RUN_ONE_RANK, ""), (SKIP, "needs a GPU"), ("", "")]


@pytest.mark.parametrize("marker, problem", [
    ("<!-- test: runn -->", "unknown marker"),
    ("<!-- tests: run -->", "unknown marker"),
    ("<!-- test run -->", "unknown marker"),
    ("<!-- test: run 2 ranks -->", "unknown marker"),
    ("<!-- test: skip -->", "needs a reason"),
    ("<!-- test: skip   -->", "needs a reason"),
])
def test_an_unknown_or_incomplete_marker_is_a_problem(marker, problem):
    blocks, problems = scan(f"{marker}\n```python\npass\n```\n", "doc.md")
    assert len(problems) == 1 and problems[0].startswith("doc.md:1: ") and problem in problems[0]
    assert blocks[0].marker == ""  # so the block gets the default checks


def test_a_marker_must_be_followed_by_a_code_block_and_run_only_python():
    _, problems = scan("<!-- test: run -->\nsome text\n```python\npass\n```\n"
                       "<!-- test: run -->\n```bash\nls\n```\n<!-- test: skip why -->\n", "d.md")
    assert problems == [
        "d.md:1: the marker is not followed by a code block",
        "d.md:6: `<!-- test: run -->` is in front of a ```bash block; only Python blocks run",
        "d.md:10: the marker is not followed by a code block"]


def test_an_output_block_is_the_expected_output_of_the_run_block_before_it():
    blocks, problems = scan("<!-- test: run -->\n```python\nprint('rank 0: hi')\n```\n"
                            "It prints:\n\n<!-- test: output -->\n```text\nrank 0: hi\n```\n",
                            "d.md")
    assert problems == [] and blocks[0].expected == "rank 0: hi\n"
    assert blocks[1].marker == OUTPUT


def test_an_output_block_needs_a_run_block_before_it_and_a_text_fence():
    _, problems = scan("```python\npass\n```\n<!-- test: output -->\n```text\nx\n```\n"
                       "<!-- test: run -->\n```python\npass\n```\n"
                       "<!-- test: output -->\n```python\nx\n```\n", "d.md")
    assert problems == [
        "d.md:4: `<!-- test: output -->` must follow a `<!-- test: run -->` block (no other "
        "code block between)",
        "d.md:12: `<!-- test: output -->` is in front of a ```python block; the output goes "
        "in a ```text block"]


def test_shown_output_lines_must_be_printed_by_the_rank_they_name():
    outputs = ["rank 0: 4 of 4\nrank 0: done\n", "rank 1: 2 of 4\nsame everywhere\n"]
    assert missing_output("rank 0: 4 of 4\n\n  rank 1: 2 of 4\nsame everywhere\n",
                          outputs) == []
    assert missing_output("rank 1: 4 of 4\nrank 0: 3 of 4\nnowhere\n", outputs) == [
        "rank 1: 4 of 4", "rank 0: 3 of 4", "nowhere"]


def test_markers_inside_code_blocks_and_other_comments_are_text():
    blocks, problems = scan("<!-- a comment -->\n```markdown\n<!-- test: typo -->\n```\n"
                            "Write `<!-- test: run -->` before the block.\n", "d.md")
    assert problems == [] and blocks[0].source == "<!-- test: typo -->\n"


def test_an_unclosed_fence_is_a_problem():
    _, problems = scan("text\n```python\nx = 1\n", "d.md")
    assert problems == ["d.md:2: this code block is never closed"]


def test_inline_code_spans_outside_code_blocks_are_found_at_their_lines():
    text = textwrap.dedent("""\
        Run `fusedreduce-bench all
        --quick` or ``python -m bench `x` ``.
        ```bash
        `not a span`
        ```
        An unmatched ` here

        and `the next paragraph` is apart.
        """)
    assert inline_code(text) == [(1, "fusedreduce-bench all --quick"),
                                 (2, "python -m bench `x`"), (8, "the next paragraph")]


# --------------------------------------- the reading of commands, on inline text

def _shell(body: str) -> Block:
    return _blocks(f"intro\n```bash\n{textwrap.dedent(body)}```\n")[0]


def test_continuation_lines_are_joined_and_keep_the_first_lines_number():
    block = _shell("""\
        # a comment line
        torchrun --nproc_per_node=2 \\
            examples/train_digits.py \\
            --steps 5

        ls
        """)
    assert command_lines(block) == [
        (4, "torchrun --nproc_per_node=2 examples/train_digits.py --steps 5"), (8, "ls")]


def test_in_a_block_with_prompts_only_the_prompted_lines_are_commands():
    block = _shell("""\
        $ python -m fusedreduce.bench --help
        usage: python -m fusedreduce.bench [-h] COMMAND ...
        $ ls
        """)
    assert command_lines(block) == [(3, "python -m fusedreduce.bench --help"), (5, "ls")]


def test_a_line_splits_at_and_or_pipe_and_semicolon_but_not_inside_quotes():
    assert split_commands('pip install -e ".[a]" && python x.py | tee log; echo "a && b|c"') \
        == ['pip install -e ".[a]"', "python x.py", "tee log", 'echo "a && b|c"']
    assert split_commands("a || b") == ["a", "b"]


def test_a_comment_is_cut_but_not_a_hash_inside_a_word_or_quotes():
    assert split_commands("fusedreduce-bench all --quick   # about 30 s") \
        == ["fusedreduce-bench all --quick"]
    assert split_commands("echo a#b '# not a comment' \\# && ls # c && x") \
        == ["echo a#b '# not a comment' \\#", "ls"]
    assert split_commands("# only a comment") == []


def test_argv_drops_assignments_and_unquotes():
    assert argv_of('HYPOTHESIS_PROFILE=thorough python -m pytest "tests"') \
        == ["python", "-m", "pytest", "tests"]


def _checks(command: str) -> List[object]:
    return checks(argv_of(command))


def test_the_benchmark_command_checks_its_subcommands_help_and_options():
    bench_all = Help(("-m", "fusedreduce.bench", "all", "--help"), ("--quick", "--json"))
    assert _checks("fusedreduce-bench all --quick --json=out.json") == [
        Script("fusedreduce-bench"), bench_all]
    assert _checks("python -m fusedreduce.bench all --quick --json x") == [bench_all]
    assert _checks("python3 -m bench all --quick --json x") == [bench_all]
    assert _checks("python -m fusedreduce.bench --help") == [
        Help(("-m", "fusedreduce.bench", "--help"), ("--help",))]
    assert _checks("python -m fusedreduce.bench.one_gpu_step --size 4M") == [
        Help(("-m", "fusedreduce.bench.one_gpu_step", "--help"), ("--size",))]


def test_an_example_is_checked_after_python_or_torchrun_but_not_torchruns_options():
    example = [Exists("examples/train_digits.py"),
               Help(("examples/train_digits.py", "--help"), ("--steps", "--amp"))]
    assert _checks("python examples/train_digits.py --steps 5 --amp fp16") == example
    assert _checks("torchrun --standalone --nproc_per_node 2 ./examples/train_digits.py "
                   "--steps 5 [--amp fp16]") == example
    assert _checks("torchrun --nproc_per_node=8 -m fusedreduce.bench collectives --json a") == [
        Help(("-m", "fusedreduce.bench", "collectives", "--help"), ("--json",))]
    assert _checks("torchrun --nproc_per_node=8 train.py --lr 1") == []
    assert isinstance(_checks("torchrun --no-such-option x.py")[0], Wrong)


def test_pip_install_of_the_checkout_checks_its_extras_and_by_name_is_wrong():
    assert _checks('pip install torch==2.13.0 -e ".[test,bench]"') == [Extras(("test", "bench"))]
    assert _checks("python -m pip install '.[docs]' -r requirements.txt") == [Extras(("docs",))]
    assert _checks("pip install dist/fusedreduce-0.1.0-py3-none-any.whl[bench]") == [
        Extras(("bench",))]
    assert _checks("pip install -e . triton") == []
    assert _checks('pip install -e ".[NAME]"') == []  # a placeholder
    wrong = _checks('pip install "fusedreduce[integrations]"')
    assert isinstance(wrong[0], Wrong) and "package index" in wrong[0].message
    assert wrong[1:] == [Extras(("integrations",))]
    assert isinstance(_checks("pip install fusedreduce")[0], Wrong)


def test_ci_scripts_mkdocs_and_pytest_name_their_files_and_options():
    assert _checks("bash .ci/run") == [Exists(".ci/run")]
    assert _checks("bash ./.ci/triton-matrix 3.2.0") == [Exists(".ci/triton-matrix")]
    assert _checks("mkdocs build --strict") == [Exists("mkdocs.yml")]
    assert _checks("mkdocs serve -f docs.yml") == [Exists("docs.yml")]
    assert _checks("python -m pytest --device cuda -n 4 tests/test_cuda.py::test_x tests") == [
        Help(("-m", "pytest", "--help"), ("--device",)), Exists("tests/test_cuda.py"),
        Exists("tests")]
    for other in ("git clone x", "cd fusedreduce", "pip install torch", "export A=1",
                  "python train.py --lr 1", "bash run.sh"):
        assert _checks(other) == [], other


# ------------------------------------ the reading of Python, on inline code

def _problems(code: str) -> List[str]:
    return python_block_problems(_blocks(f"```python\n{textwrap.dedent(code)}```\n")[0])


def test_the_fusedreduce_names_a_block_uses_are_its_imports_and_their_chains():
    tree = ast.parse(textwrap.dedent("""\
        import torch
        import fusedreduce as fr
        from fusedreduce import hooks, DistributedGradReducer as DGR
        from fusedreduce.kernels import flatten_cast_scale
        fr.kernels.packed_boundaries([1]).tolist()
        hooks.allreduce_hook
        model.parameters()
        torch.nn.Linear
        """))
    assert [(r.line, r.name) for r in fusedreduce_references(tree)] == [
        (2, "fusedreduce"),
        (3, "fusedreduce"), (3, "fusedreduce.DistributedGradReducer"), (3, "fusedreduce.hooks"),
        (4, "fusedreduce.kernels"), (4, "fusedreduce.kernels.flatten_cast_scale"),
        (5, "fusedreduce.kernels.packed_boundaries"),
        (5, "fusedreduce.kernels.packed_boundaries(...).tolist"),
        (6, "fusedreduce.hooks.allreduce_hook")]


def test_names_that_exist_resolve_and_fragments_with_undefined_names_pass():
    assert _problems("""\
        import fusedreduce
        import fusedreduce.kernels as k
        from fusedreduce import hooks
        from fusedreduce.kernels import flatten_cast_scale
        reducer = fusedreduce.DistributedGradReducer(params).register_hooks()
        with reducer.no_sync():
            loss.backward()
        hooks.HookState(local_size=8)
        k.packed_boundaries(numels).tolist()
        opt = fusedreduce.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))
        opt.param_groups, opt.zero_grad
        r = fusedreduce.DistributedGradReducer(params)
        r.found_nonfinite
        """) == []


def test_missing_names_modules_and_methods_are_reported_at_their_lines():
    assert _problems("""\
        import fusedreduce
        from fusedreduce import hooks, no_such_name
        from fusedreduce.no_such_module import x
        fusedreduce.hooks.allreduce_hok
        hooks.HookState.no_such_method
        reducer = fusedreduce.DistributedGradReducer(params)
        reducer.register_hook()
        fusedreduce.DistributedGradReducer(params).register_hook()
        """) == [
        "doc.md:3: fusedreduce.no_such_name: fusedreduce has no attribute or submodule "
        "'no_such_name'",
        "doc.md:4: fusedreduce.no_such_module: there is no module fusedreduce.no_such_module",
        "doc.md:4: fusedreduce.no_such_module.x: there is no module fusedreduce.no_such_module",
        "doc.md:5: fusedreduce.hooks.allreduce_hok: fusedreduce.hooks has no attribute or "
        "submodule 'allreduce_hok'",
        "doc.md:6: fusedreduce.hooks.HookState.no_such_method: fusedreduce.hooks.HookState has "
        "no attribute 'no_such_method'",
        "doc.md:8: fusedreduce.DistributedGradReducer(...).register_hook: "
        "fusedreduce.DistributedGradReducer instances have no attribute 'register_hook'",
        "doc.md:9: fusedreduce.DistributedGradReducer(...).register_hook: "
        "fusedreduce.DistributedGradReducer instances have no attribute 'register_hook'"]


def test_a_name_bound_twice_is_not_taken_for_an_instance():
    assert _problems("""\
        import fusedreduce
        opt = fusedreduce.DistributedOptimizer(sgd)
        opt = Anything()
        opt.whatever
        """) == []


def test_a_block_that_does_not_compile_names_its_line():
    assert _problems("x = 1\nfor\n") == ["doc.md:3: does not compile: invalid syntax"]


def test_a_missing_optional_dependency_skips_instead_of_failing(monkeypatch):
    for name in [name for name in sys.modules if name.split(".")[0] == "lightning"] \
            + ["lightning"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "fusedreduce.lightning", raising=False)
    with pytest.raises(pytest.skip.Exception, match="lightning"):
        _problems("from fusedreduce.lightning import CommHook\n")
    assert unresolved(Reference(1, "fusedreduce.hooks", ("allreduce_hook",))) is None


def _failed_help(missing: str):
    """A ``help_output`` whose program fails to import ``missing``."""
    traceback = (f'Traceback (most recent call last):\n  File "examples/x.py", line 3, in '
                 f'<module>\n    import {missing}\nModuleNotFoundError: No module named '
                 f"'{missing}'\n")
    return lambda argv: (1, traceback)


def test_a_command_whose_program_lacks_an_optional_dependency_skips_instead_of_failing():
    command = "python examples/train_digits.py --plot digits.png"
    needs = _checks(command)
    for missing, extras in (("sklearn", "examples"), ("lightning.pytorch", "integrations"),
                            ("matplotlib", "test, bench, examples")):
        with pytest.raises(pytest.skip.Exception,
                           match=rf"doc.md:3: `python examples/train_digits.py --help` needs "
                                 rf"{missing.split('.')[0]}, which is not installed "
                                 rf"\(pyproject.toml's extras that install it: {extras}\)$"):
            check_command("doc.md:3", command, needs, _failed_help(missing))
    # a module no extra installs (a typo, a file missing from the checkout) still fails
    for missing in ("sklearn_helpers", "fusedreduce.gone"):
        with pytest.raises(pytest.fail.Exception, match=f"No module named '{missing}'"):
            check_command("doc.md:3", command, needs, _failed_help(missing))


# ------------------------------------ the runner, on inline scripts

def test_the_runner_passes_a_script_that_runs_on_two_gloo_ranks(tmp_path):
    block = _blocks("""\
        <!-- test: run -->
        ```python
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        assert os.environ["LOCAL_WORLD_SIZE"] == "2" and os.path.exists("doc_md_2.py")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0, total
        dist.destroy_process_group()
        ```
        """)[0]
    run_block(block, tmp_path)


def test_the_runner_fails_with_the_line_and_every_ranks_output(tmp_path):
    block = _blocks("""\
        <!-- test: run -->
        ```python
        import os
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])
        assert os.environ["RANK"] == "0", "rank 1 fails here"
        ```
        """)[0]
    with pytest.raises(pytest.fail.Exception) as failure:
        run_block(block, tmp_path)
    message = str(failure.value)
    assert message.startswith("doc.md:2: the block failed on 2 rank(s)")
    assert "rank 0 of 2" in message and "rank 1 of 2" in message
    assert "line 5" in message and "rank 1 fails here" in message


def test_a_run_block_whose_script_lacks_an_optional_dependency_is_skipped(tmp_path):
    # as a script that imports lightning fails where it is not installed
    block = _blocks("""\
        <!-- test: run 1 rank -->
        ```python
        raise ModuleNotFoundError("No module named 'lightning'", name="lightning")
        ```
        """)[0]
    with pytest.raises(pytest.skip.Exception, match="doc.md:2: the script needs lightning, which "
                                                    "is not installed .*integrations"):
        run_block(block, tmp_path)


def test_each_block_starts_from_the_state_a_fresh_interpreter_has(tmp_path):
    # ranks are forks of a server that imported torch and fusedreduce: what one
    # block changes in them must not reach the next, and torchrun's one thread holds
    first, second = _blocks("""\
        <!-- test: run 1 rank -->
        ```python
        import sys
        import torch
        import fusedreduce
        assert torch.get_num_threads() == 1 and sys.argv == ["doc_md_2.py"], sys.argv
        assert not hasattr(fusedreduce, "left_by_a_block")
        fusedreduce.left_by_a_block = True
        torch.manual_seed(5)
        ```

        <!-- test: run 1 rank -->
        ```python
        import torch
        import fusedreduce
        assert not hasattr(fusedreduce, "left_by_a_block")
        assert torch.initial_seed() != 5
        ```
        """)
    run_block(first, tmp_path)
    run_block(second, tmp_path)


def test_a_rank_left_waiting_when_another_exits_is_killed_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "FAILURE_GRACE_S", 0.5)
    block = _blocks("""\
        <!-- test: run -->
        ```python
        import os
        import sys
        import time

        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)
        ```
        """)[0]
    with pytest.raises(pytest.fail.Exception) as failure:
        run_block(block, tmp_path)
    message = str(failure.value)
    assert "rank 0 (killed)" in message and "rank 1 (exit 3)" in message
