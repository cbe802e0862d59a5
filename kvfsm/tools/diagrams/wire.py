"""The wire protocol's record tables drawn from their rows.

`kvfsm.backends.wire` declares three per-record tables (`decode`, `claim`,
`room`). Their mermaid is `wire.mermaid()` itself; dot, svg and png come
from `wire_dot()` here, which reads the same rows and nothing else. Every
rendering carries a title (`kvfsm wire protocol: decode records`) from
which the drift check reads which table a committed file holds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..._errors import ConfigError
from ...backends import wire as _wire
from ...backends.wire import WireRow, WireTable
from .._cliargs import CommandError
from .formats import END_NODE, FORMATS, START_NODE, dot_program, format_for_path, require_dot_program

__all__ = ["WIRE_TABLES", "wire_table", "wire_title", "wire_dot", "render_wire", "wire_of"]

#: The wire protocol's record tables by name, in declaration order (`kvfsm diagram --wire NAME`).
WIRE_TABLES: dict[str, WireTable] = {table.name: table for table in _wire.TABLES}
_ANY_NODE = "__any__"


def wire_table(table: str | WireTable) -> WireTable:
    """One of `WIRE_TABLES`, by name or as itself."""
    if isinstance(table, WireTable):
        return table
    try:
        return WIRE_TABLES[table]
    except (KeyError, TypeError):
        raise ConfigError(f"wire table must be one of {', '.join(WIRE_TABLES)}; got {table!r}") from None


def wire_title(table: str | WireTable) -> str:
    """The title every rendering of a wire table carries (what `--check` reads the table from)."""
    return f"kvfsm wire protocol: {wire_table(table).name} records"


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def wire_dot(table: str | WireTable) -> str:
    """Graphviz source of a wire table, one edge per (row, source state), drawn from its rows.

    A row that leaves every state of the table is drawn once, from an
    "any state" marker; a record that does not exist yet (a source of
    None) is the entry dot, a dropped record (a dest of None) the exit dot.
    Rows that send messages are blue, labelled `input / MESSAGE, ...`.
    """
    table = wire_table(table)
    states = tuple(table.states)
    title = wire_title(table)
    lines = [
        f"digraph {_dot_quote(title)} {{",
        f"  graph [label={_dot_quote(title)}, labelloc=t, fontname=Helvetica, fontsize=14, rankdir=TB, nodesep=0.5];",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, fontsize=12];',
        "  edge [fontname=Helvetica, fontsize=10];",
    ]
    sources = {source for row in table.rows for source in row.sources}
    if None in sources:
        lines.append(f'  {START_NODE} [label="", shape=circle, style=filled, fillcolor=black, width=0.2];')
    for state in states:
        lines.append(f"  {state.name} [label={_dot_quote(state.name)}];")
    if any(set(row.sources) >= set(states) for row in table.rows):
        lines.append(f'  {_ANY_NODE} [label="any state", shape=plaintext, style="", fontname="Helvetica-Oblique"];')
    if any(row.dest is None for row in table.rows):
        lines.append(f'  {END_NODE} [label="", shape=doublecircle, style=filled, fillcolor=black, width=0.15];')
    # One edge per (origin, target); each of its rows is one line of the label, in row order.
    edges: dict[tuple[str, str], list[WireRow]] = {}
    for row in table.rows:
        target = END_NODE if row.dest is None else row.dest.name
        if set(row.sources) >= set(states):
            origins = [_ANY_NODE]
        else:
            origins = [START_NODE if source is None else source.name for source in row.sources]
        for origin in origins:
            edges.setdefault((origin, target), []).append(row)
    for (origin, target), rows in edges.items():
        label = "\n".join(row.input + (" / " + ", ".join(row.sends) if row.sends else "") for row in rows)
        style = ", color=navy, fontcolor=navy" if any(row.sends for row in rows) else ""
        lines.append(f"  {origin} -> {target} [label={_dot_quote(label)}{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_wire(table: str | WireTable, fmt: str = "mermaid") -> bytes:
    """A wire table (`decode`, `claim`, `room`) drawn in `fmt` (one of `FORMATS`), as bytes.

    mermaid is `kvfsm.backends.wire.mermaid()`; dot is `wire_dot()`; svg and
    png are that laid out by graphviz's `dot` program (`GraphvizMissing` if
    it is not on PATH; the Python package is not needed).
    """
    table = wire_table(table)
    if fmt not in FORMATS:
        raise ConfigError(f"diagram format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "mermaid":
        return _wire.mermaid(table).encode("utf-8")
    source = wire_dot(table)
    if fmt == "dot":
        return source.encode("utf-8")
    require_dot_program(fmt)
    dot = dot_program()
    assert dot is not None
    try:
        done = subprocess.run([dot, f"-T{fmt}"], input=source.encode("utf-8"), capture_output=True, check=True)
    except subprocess.CalledProcessError as exc:
        raise CommandError(
            f"graphviz's dot failed on the {table.name} table: {exc.stderr.decode(errors='replace')}"
        ) from None
    return done.stdout


def wire_of(path: str | Path, fmt: str | None = None) -> str | None:
    """The wire table whose diagram the file at `path` holds, or None (as `role_of` for roles)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    named = [name for name in WIRE_TABLES if wire_title(name).encode() in data]
    if len(named) == 1:
        return named[0]
    fmt = fmt or format_for_path(path) or "mermaid"
    matching = [name for name in WIRE_TABLES if render_wire(name, fmt) == data]
    return matching[0] if len(matching) == 1 else None
