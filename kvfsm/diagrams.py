"""State diagrams of the lifecycle, drawn from the machine the code runs.

Every diagram here comes from `build_machine(role, machine_cls=...)`: the
same call, the same table (`_table.TRANSITIONS`) and the same options that
build the machine the managers dispatch through, only with
`transitions.extensions.diagrams.GraphMachine` as the class. Nothing about
states or edges is typed here, so a diagram cannot drift from the code; the
`--check` mode of `kvfsm diagram` (and `check()` below) fails when a
committed diagram differs from what the machine renders now.

What this module adds on top of `transitions`' own drawing is presentation
only: an entry marker on the initial state, the terminal states marked
(double border in graphviz, an exit marker `[*]` in mermaid, colours in
both), and optionally one state highlighted (a room's live state).

Formats and what they need:

* `mermaid`: plain text, no system package (renders on GitHub, in mermaid
  live editors).
* `dot`: graphviz source text; needs the pure-Python `graphviz` package.
* `svg`, `png`: laid out by graphviz's `dot` program (Debian package
  `graphviz`); a clear `GraphvizMissing` error names what to install.

Output is deterministic: the same kvfsm, `transitions` and (for svg/png)
graphviz versions give byte-identical output, which is what `--check`
compares. Commit text formats (mermaid, dot) when you want a check that
does not depend on the graphviz version installed.

The wire protocol's record tables (`kvfsm.backends.wire`: `decode`, `claim`,
`room`) are drawn the same way, from their rows and nothing else
(`render_wire`, `kvfsm diagram --wire NAME`): mermaid is `wire.mermaid()`
itself; dot, svg and png come from `wire_dot()`, which reads the same rows.
`--check` compares them like the lifecycle's, and reads from the file's
title (`kvfsm wire protocol: decode records`) which table it holds.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
from transitions import Machine
from transitions.extensions.diagrams import GraphMachine
from transitions.extensions.diagrams_mermaid import Graph as _MermaidGraph

from ._cliargs import CommandError, MissingDependency, UsageError, output_path
from ._errors import ConfigError
from ._machine import build_machine
from ._states import KVPoll, Role
from .backends import wire as _wire
from .backends.wire import WireRow, WireTable

__all__ = [
    "FORMATS",
    "TEXT_FORMATS",
    "GraphvizMissing",
    "DiagramCheck",
    "LifecycleGraphMachine",
    "diagram_machine",
    "terminal_states",
    "render",
    "render_text",
    "check",
    "role_of",
    "WIRE_TABLES",
    "wire_table",
    "wire_title",
    "wire_dot",
    "render_wire",
    "wire_of",
    "format_for_path",
    "parse_state",
    "configure",
    "run",
]

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
_START_NODE = "__start__"
_END_NODE = "__end__"


class GraphvizMissing(MissingDependency):
    """A format needs graphviz (the Python package or Debian's `dot` program) and it is absent."""


def terminal_states(machine: Machine) -> list[str]:
    """The states of `machine` that no event leaves, in `KVPoll` order.

    Read from the machine rather than from `kvfsm.TERMINAL`, so the marks
    on a diagram say what the machine does, not what it is meant to do.
    """
    sources = {source for event in machine.events.values() for source in event.transitions}
    return [state.name for state in KVPoll if state.name not in sources]


class _MermaidLifecycle(_MermaidGraph):
    """Mermaid drawing with exit markers on the terminal states."""

    def get_graph(self, title: str | None = None, roi_state: Any = None) -> Any:
        # `transitions` writes the bare title between the `---` lines; mermaid
        # expects YAML there (`title: ...`).
        return super().get_graph(title=f"title: {title or self.machine.title}", roi_state=roi_state)

    def _add_edges(self, transitions: list[dict[str, Any]], container: list[str]) -> None:
        super()._add_edges(transitions, container)
        # `transitions` adds the entry marker `[*] --> initial` after this.
        for name in terminal_states(self.machine):
            container.append(f"{name} --> [*]")


def _graphviz_lifecycle() -> type[Any]:
    """The graphviz drawing class, built on demand (the `graphviz` package is optional)."""
    from transitions.extensions.diagrams_graphviz import Graph as GraphvizGraph

    class _GraphvizLifecycle(GraphvizGraph):
        """Graphviz drawing with an entry point and an exit point, like a UML state chart."""

        def _add_nodes(self, states: list[dict[str, Any]], container: Any) -> None:
            container.node(_START_NODE, label="", shape="circle", style="filled", fillcolor="black", width="0.2")
            super()._add_nodes(states, container)
            container.node(_END_NODE, label="", shape="doublecircle", style="filled", fillcolor="black", width="0.15")

        def _add_edges(self, transitions: list[dict[str, Any]], container: Any) -> None:
            container.edge(_START_NODE, self.machine.initial, label="open")
            super()._add_edges(transitions, container)
            for name in terminal_states(self.machine):
                container.edge(name, _END_NODE, label="close", style="dashed")

    return _GraphvizLifecycle


class LifecycleGraphMachine(GraphMachine):
    """`GraphMachine` with the lifecycle's presentation: terminal states marked.

    `transitions` reads styles from `machine.style_attributes`; each machine
    gets its own copy, in the keys its engine understands, so
    `GraphMachine`'s class-level styles are never written to.
    """

    def _init_graphviz_engine(self, graph_engine: str) -> type[Any]:
        # Each engine understands its own style keys: set this machine's.
        self.style_attributes = _styles(graph_engine)
        if graph_engine == "mermaid":
            return _MermaidLifecycle
        if graph_engine == "graphviz":
            _require_graphviz_package(graph_engine)
            return _graphviz_lifecycle()
        raise ConfigError(f"graph engine must be 'mermaid' or 'graphviz'; got {graph_engine!r}")


def _styles(engine: str) -> dict[str, Any]:
    """GraphMachine's styles plus the lifecycle's, in the keys `engine` understands."""
    styles: dict[str, Any] = copy.deepcopy(GraphMachine.style_attributes)
    marks = {
        "success": ("darkgreen", "honeydew", 2),
        "failed": ("firebrick", "mistyrose", 2),
        "active": ("red", "gold", 3),
    }
    for name, (line, fill, weight) in marks.items():
        if engine == "mermaid":
            styles["node"][name] = {"fillcolor": fill, "stroke": line, "stroke-width": f"{weight + 1}px"}
        else:
            styles["node"][name] = {"color": line, "fillcolor": fill, "peripheries": str(weight), "penwidth": "1.5"}
    return styles


def _graphviz_importable() -> bool:
    return importlib.util.find_spec("graphviz") is not None


def _dot_program() -> str | None:
    return shutil.which("dot")


def _require_graphviz_package(what: str) -> None:
    if not _graphviz_importable():
        raise GraphvizMissing(
            f"format {what!r} needs the Python package 'graphviz' (pip install graphviz, "
            f"or pip install 'kvfsm[diagrams]'); it is not installed. "
            f"--format mermaid needs nothing extra."
        )


def _require_dot_program(fmt: str) -> None:
    if _dot_program() is None:
        raise GraphvizMissing(
            f"format {fmt!r} needs graphviz's 'dot' program, which is not on PATH: install the Debian "
            f"package 'graphviz' (apt-get install graphviz). --format mermaid or dot needs no system package."
        )


def diagram_machine(role: Role | str, engine: str = "mermaid") -> LifecycleGraphMachine:
    """The lifecycle machine of `role` as a `GraphMachine`, built exactly like the live one."""
    role = Role.coerce(role)
    machine = build_machine(
        role,
        machine_cls=LifecycleGraphMachine,
        graph_engine=engine,
        title=f"kvfsm {role.value} lifecycle",
    )
    assert isinstance(machine, LifecycleGraphMachine)
    return machine


def parse_state(value: KVPoll | str | int) -> KVPoll:
    """A `KVPoll` from a member, its name (any case) or its integer value."""
    if isinstance(value, KVPoll):
        return value
    if isinstance(value, str):
        text = value.strip()
        for state in KVPoll:
            if state.name.lower() == text.lower():
                return state
        if text.isdigit():
            value = int(text)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return KVPoll(value)
        except ValueError:
            pass
    allowed = ", ".join(f"{s.name} ({s.value})" for s in KVPoll)
    raise ConfigError(f"state must be one of {allowed}; got {value!r}")


def _graph(role: Role | str, engine: str, highlight: KVPoll | str | int | None) -> Any:
    machine = diagram_machine(role, engine)
    graph = machine.graph_cls(machine)
    for name in terminal_states(machine):
        graph.set_node_style(name, "failed" if name == KVPoll.Failed.name else "success")
    if highlight is not None:
        graph.set_node_style(parse_state(highlight).name, "active")
    return graph.get_graph(title=machine.title)


def render(
    role: Role | str = Role.SENDER, fmt: str = "mermaid", *, highlight: KVPoll | str | int | None = None
) -> bytes:
    """The lifecycle diagram of `role` in `fmt` (one of `FORMATS`), as bytes.

    `highlight` marks one state (e.g. a room's live state). Raises
    `GraphvizMissing` when `fmt` needs graphviz and it is not installed.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"diagram format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "mermaid":
        source: str = _graph(role, "mermaid", highlight).source
        return (source.rstrip("\n") + "\n").encode("utf-8")
    _require_graphviz_package(fmt)
    graph = _graph(role, "graphviz", highlight)
    if fmt == "dot":
        return str(graph.source).encode("utf-8")
    _require_dot_program(fmt)
    data = graph.pipe(format=fmt)
    assert isinstance(data, bytes)
    return data


def render_text(
    role: Role | str = Role.SENDER, fmt: str = "mermaid", *, highlight: KVPoll | str | int | None = None
) -> str:
    """`render()` for the text formats (mermaid, dot, svg), decoded."""
    if fmt not in TEXT_FORMATS:
        raise ConfigError(f"format {fmt!r} is binary; text formats are {', '.join(sorted(TEXT_FORMATS))}")
    return render(role, fmt, highlight=highlight).decode("utf-8")


# -- the wire protocol's tables ------------------------------------------------------

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
        lines.append(f'  {_START_NODE} [label="", shape=circle, style=filled, fillcolor=black, width=0.2];')
    for state in states:
        lines.append(f"  {state.name} [label={_dot_quote(state.name)}];")
    if any(set(row.sources) >= set(states) for row in table.rows):
        lines.append(f'  {_ANY_NODE} [label="any state", shape=plaintext, style="", fontname="Helvetica-Oblique"];')
    if any(row.dest is None for row in table.rows):
        lines.append(f'  {_END_NODE} [label="", shape=doublecircle, style=filled, fillcolor=black, width=0.15];')
    # One edge per (origin, target); each of its rows is one line of the label, in row order.
    edges: dict[tuple[str, str], list[WireRow]] = {}
    for row in table.rows:
        target = _END_NODE if row.dest is None else row.dest.name
        if set(row.sources) >= set(states):
            origins = [_ANY_NODE]
        else:
            origins = [_START_NODE if source is None else source.name for source in row.sources]
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
    _require_dot_program(fmt)
    dot = _dot_program()
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


def format_for_path(path: str | Path) -> str | None:
    """The format a file name implies (`.mmd`, `.dot`/`.gv`, `.svg`, `.png`), or None."""
    return _SUFFIXES.get(Path(path).suffix.lower())


@attrs.frozen
class DiagramCheck:
    """The result of comparing a committed diagram with the machine's rendering."""

    path: Path
    fmt: str
    up_to_date: bool
    missing: bool
    diff: str
    #: What the file was compared with: the lifecycle machine, or the wire protocol's tables.
    source: str = "the machine"

    def explain(self, command: str) -> str:
        if self.up_to_date:
            return f"{self.path}: up to date with {self.source} ({self.fmt})"
        what = "does not exist" if self.missing else f"differs from what {self.source} renders now"
        text = f"{self.path} {what} ({self.fmt}); regenerate it with:\n  {command}\n"
        return text + self.diff


def check(
    path: str | Path,
    role: Role | str = Role.SENDER,
    fmt: str | None = None,
    *,
    highlight: KVPoll | str | int | None = None,
    wire: str | WireTable | None = None,
) -> DiagramCheck:
    """Compare the diagram committed at `path` with the one the code renders now.

    That is `role`'s lifecycle, or with `wire` given that wire table
    (`decode`, `claim`, `room`; `role` and `highlight` do not apply then).
    """
    path = Path(path)
    fmt = fmt or format_for_path(path) or "mermaid"
    if wire is not None and highlight is not None:
        raise ConfigError("highlight marks a lifecycle state; a wire table's diagram takes none")
    if wire is None:
        expected, source, now = render(role, fmt, highlight=highlight), "the machine", "machine now"
    else:
        expected, source, now = render_wire(wire, fmt), "kvfsm.backends.wire", "wire tables now"
    try:
        actual = path.read_bytes()
    except FileNotFoundError:
        return DiagramCheck(path, fmt, False, True, "", source)
    if actual == expected:
        return DiagramCheck(path, fmt, True, False, "", source)
    diff = ""
    if fmt in TEXT_FORMATS:
        lines = difflib.unified_diff(
            actual.decode("utf-8", "replace").splitlines(keepends=True),
            expected.decode("utf-8").splitlines(keepends=True),
            fromfile=f"{path} (committed)",
            tofile=f"{path} ({now})",
        )
        diff = "".join(lines)
    return DiagramCheck(path, fmt, False, False, diff, source)


# -- the `kvfsm diagram` command ---------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    subject = parser.add_mutually_exclusive_group()
    subject.add_argument(
        "--role",
        choices=[r.value for r in Role],
        default=None,
        help="whose lifecycle to draw (default: sender; with --check, the role the file's title names)",
    )
    subject.add_argument(
        "--wire",
        choices=list(WIRE_TABLES),
        default=None,
        help="draw a wire protocol table instead (kvfsm.backends.wire): a decode room's record, "
        "a decode's claim at the prefill, or a room id at the prefill",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="mermaid (no system package), dot, svg or png (Debian graphviz); "
        "default: from the --output/--check file name, else mermaid",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--output", "-o", metavar="PATH", type=output_path, help="write here (default: stdout, text formats only)"
    )
    target.add_argument(
        "--check",
        metavar="PATH",
        help="do not write: exit 1 if the diagram committed at PATH differs from what the code renders now",
    )
    parser.add_argument(
        "--highlight",
        metavar="STATE",
        type=_state_argument,
        help="mark one lifecycle state (a KVPoll name or value), e.g. a room's live state",
    )


def _state_argument(text: str) -> KVPoll:
    try:
        return parse_state(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _command_line(
    args: argparse.Namespace, fmt: str, path: str, *, role: str | None = None, wire: str | None = None
) -> str:
    """The command that writes `path` with the diagram the arguments (or `role`/`wire`) name."""
    wire = wire or (None if role else args.wire)
    parts = ["kvfsm diagram", f"--wire {wire}" if wire else f"--role {role or args.role}", f"--format {fmt}"]
    if args.highlight is not None and not wire:
        parts.append(f"--highlight {args.highlight.name}")
    parts.append(f"--output {path}")
    return " ".join(parts)


def role_of(path: str | Path, fmt: str | None = None) -> Role | None:
    """The role whose diagram the file at `path` holds, or None if it cannot tell.

    Read from the title every rendering carries (`kvfsm receiver lifecycle`);
    a file without a readable title (png) is matched against each role's
    rendering. None when the file is missing or matches neither role.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    named = [role for role in Role if f"kvfsm {role.value} lifecycle".encode() in data]
    if len(named) == 1:
        return named[0]
    fmt = fmt or format_for_path(path) or "mermaid"
    matching = [role for role in Role if render(role, fmt) == data]
    return matching[0] if len(matching) == 1 else None


def _infer_subject(args: argparse.Namespace, fmt: str) -> None:
    """Set `args.role` or `args.wire` from the --check file when neither was given."""
    if args.role is not None or args.wire is not None:
        return
    if not args.check:
        args.role = Role.SENDER.value
        return
    role = role_of(args.check, fmt)
    if role is not None:
        args.role = role.value
        return
    args.wire = wire_of(args.check, fmt)
    if args.wire is None:
        titles = [f"kvfsm {each.value} lifecycle" for each in Role] + [wire_title(name) for name in WIRE_TABLES]
        raise UsageError(
            f"--check {args.check}: cannot tell whose diagram the file holds (its title names none of "
            f"{', '.join(repr(title) for title in titles)}): pass --role or --wire"
        )


def run(args: argparse.Namespace) -> int:
    path = args.check or args.output
    fmt = args.format or (format_for_path(path) if path else None) or "mermaid"
    if args.wire is not None and args.highlight is not None:
        raise UsageError("--highlight marks a lifecycle state; it does not go with --wire")
    try:
        if args.role is None and args.wire is None and args.check and not Path(args.check).exists():
            # Nothing to read the diagram from: say so, and offer every command.
            commands = [_command_line(args, fmt, args.check, role=role.value) for role in Role]
            if args.highlight is None:
                commands += [_command_line(args, fmt, args.check, wire=name) for name in WIRE_TABLES]
            sys.stderr.write(
                f"{args.check} does not exist ({fmt}); create it with one of:\n"
                + "".join(f"  {command}\n" for command in commands)
            )
            return 1
        _infer_subject(args, fmt)
        if args.wire is not None and args.highlight is not None:
            raise UsageError(f"--highlight marks a lifecycle state; {args.check} holds the {args.wire} wire table")
        if args.check:
            if args.wire is not None:
                result = check(args.check, fmt=fmt, wire=args.wire)
            else:
                result = check(args.check, args.role, fmt, highlight=args.highlight)
            stream = sys.stdout if result.up_to_date else sys.stderr
            stream.write(result.explain(_command_line(args, fmt, args.check)).rstrip("\n") + "\n")
            return 0 if result.up_to_date else 1
        if args.output is None and fmt not in TEXT_FORMATS:
            sys.stderr.write(f"kvfsm diagram: error: {fmt} is binary; pass --output PATH\n")
            return 2
        if args.wire is not None:
            data = render_wire(args.wire, fmt)
        else:
            data = render(args.role, fmt, highlight=args.highlight)
    except GraphvizMissing as exc:
        sys.stderr.write(f"kvfsm diagram: error: {exc}\n")
        return 2
    if args.output is None:
        sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
    else:
        try:
            Path(args.output).write_bytes(data)
        except OSError as exc:  # checked before rendering; the disk may still be full
            raise CommandError(f"cannot write --output {args.output}: {exc.strerror or exc}") from None
    return 0
