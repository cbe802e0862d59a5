"""What every diagram shares: the formats, and what each needs installed.

Kept apart from the drawings (`lifecycle.py`, `wire.py`) so that both say
the same thing about graphviz: the Python package for `dot` source of a
lifecycle, Debian's `dot` program for svg and png, and one clear
`GraphvizMissing` error naming what to install.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from .._cliargs import MissingDependency

__all__ = ["FORMATS", "TEXT_FORMATS", "GraphvizMissing", "format_for_path", "graphviz_importable", "dot_program"]

#: Every output format, in the order the CLI lists them.
FORMATS: tuple[str, ...] = ("mermaid", "dot", "svg", "png")
#: Formats that are text (written to stdout when no --output is given).
TEXT_FORMATS: frozenset[str] = frozenset({"mermaid", "dot", "svg"})
_SUFFIXES: dict[str, str] = {
    ".mmd": "mermaid",
    ".mermaid": "mermaid",
    ".dot": "dot",
    ".gv": "dot",
    ".svg": "svg",
    ".png": "png",
}
START_NODE = "__start__"
END_NODE = "__end__"


class GraphvizMissing(MissingDependency):
    """A format needs graphviz (the Python package or Debian's `dot` program) and it is absent."""


def graphviz_importable() -> bool:
    return importlib.util.find_spec("graphviz") is not None


def dot_program() -> str | None:
    return shutil.which("dot")


def require_graphviz_package(what: str) -> None:
    if not graphviz_importable():
        raise GraphvizMissing(
            f"format {what!r} needs the Python package 'graphviz' (pip install graphviz, "
            f"or pip install 'kvfsm[diagrams]'); it is not installed. "
            f"--format mermaid needs nothing extra."
        )


def require_dot_program(fmt: str) -> None:
    if dot_program() is None:
        raise GraphvizMissing(
            f"format {fmt!r} needs graphviz's 'dot' program, which is not on PATH: install the Debian "
            f"package 'graphviz' (apt-get install graphviz). --format mermaid or dot needs no system package."
        )


def format_for_path(path: str | Path) -> str | None:
    """The format a file name implies (`.mmd`, `.dot`/`.gv`, `.svg`, `.png`), or None."""
    return _SUFFIXES.get(Path(path).suffix.lower())
