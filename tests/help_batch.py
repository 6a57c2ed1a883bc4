"""Run many ``python *argv --help``-style command lines in one process.

``test_docs.py`` checks that every command the documentation quotes exists
with the options it names, by reading each program's ``--help``. Started one
by one, each of those processes spends most of its time importing torch;
here every command line runs in turn in this one process (a module through
``runpy.run_module``, a script through ``runpy.run_path`` with its
directory first on ``sys.path``, both as ``__main__`` with the command's
``sys.argv``), its output captured and its exit status taken from
``SystemExit``. A command that fails here is run again alone by the caller.

Reads a JSON list of argv lists on stdin; writes a JSON list of
``[status, output]`` (status None: it ran past the per-command limit).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import traceback

#: seconds one command may run (a --help returns in well under one)
LIMIT_S = 60


class _TooLong(Exception):
    pass


def _alarm(signum, frame):
    raise _TooLong()


def run_one(argv):
    """``[status, output]`` of ``python *argv`` run in this process."""
    out = io.StringIO()
    saved, path = sys.argv, list(sys.path)
    status = 0
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                else:
                    # as ``python script.py`` does: the script's directory first on the path
                    sys.argv = list(argv)
                    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                    runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as exc:
                code = exc.code
                status = 0 if code is None else code if isinstance(code, int) else 1
                if not isinstance(code, (int, type(None))):
                    print(code)
            except _TooLong:
                status = None
                print(f"ran past {LIMIT_S} s")
            except BaseException:  # noqa: BLE001 - reported as the command's failure
                status = 1
                traceback.print_exc()
    finally:
        signal.alarm(0)
        sys.argv = saved
        sys.path[:] = path
    return [status, out.getvalue()]


def main() -> None:
    argvs = json.load(sys.stdin)
    results = [run_one(argv) for argv in argvs]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
