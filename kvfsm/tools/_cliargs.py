"""What the `kvfsm` commands share about their arguments: types and usage errors.

Every command checks what it was given before it starts working, so a bad
value (a word where a number goes, an output file in a folder that does not
exist) ends in one line, `kvfsm COMMAND: error: ...`, with exit status 2,
instead of a traceback after the work is done. The `argparse` types below
name the option's expectation in their messages (argparse would otherwise
print the function's name); `UsageError` is for checks that need several
options at once: `kvfsm.cli` turns it into the same one line.
`CommandError` is a command that cannot go on, `MissingDependency` one
that names what to install when an optional package or program it needs
is absent: one line too, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .._root_errors import ConfigError, KVFSMError

__all__ = ["UsageError", "CommandError", "MissingDependency", "positive_int", "rate", "positive_seconds", "output_path"]


class UsageError(ConfigError):
    """Options that cannot work together; `kvfsm` prints it as a usage error (exit 2)."""


class CommandError(KVFSMError, RuntimeError):
    """The command cannot go on; the message says why (`kvfsm` prints it in one line, exit 2)."""


class MissingDependency(CommandError):
    """An optional package or program is not installed; the message says how to install it."""


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _number(text: str) -> float:
    """`text` as a float, NaN if it is not a number (every range check then fails)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def rate(text: str) -> float:
    """A probability in [0, 1]."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a rate between 0 and 1; got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds; got {text!r}")
    return value


def output_path(text: str) -> str:
    """A file that can be written: its folder exists and is writable, and it is not a folder."""
    path = Path(text)
    folder = path.parent
    if text == "" or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file to write")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text
