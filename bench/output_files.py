"""The files the benchmark commands write (``--json``, ``--plot``): checked when
a command starts, made with their directories when written. No torch here:
a command may parse its arguments before it imports torch or Triton.
"""
from __future__ import annotations

import argparse
import os


def output_file(text: str) -> str:
    """An argparse ``type`` for a file a command writes (``--json``, ``--plot``):
    refused when the command starts, not after its measurements, where the
    path names a directory or the directories on its way cannot be made
    (the nearest one that exists is not a writable directory). Missing
    directories are made when the file is written (``open_output``)."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file's path")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent} is not writable")
    return text


def make_parents(path: str) -> str:
    """Make the directories on ``path``'s way (``output_file`` checked they can
    be made); ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def open_output(path: str):
    """``open(path, "w")`` after making the directories on its way."""
    return open(make_parents(path), "w")
