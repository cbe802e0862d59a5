"""The lifecycle drawn from the machine the code runs.

Every diagram here comes from `build_machine(role, machine_cls=...)`: the
same call, the same table and the same options that build the machine the
managers dispatch through, only with `transitions`' `GraphMachine` as the
class. Nothing about states or edges is typed here, so a diagram cannot
drift from the code. What this module adds is presentation only: an entry
marker on the initial state, the terminal states marked (double border in
graphviz, an exit marker `[*]` in mermaid, colours in both), and
optionally one state highlighted (a room's live state).

Any declared lifecycle is drawn the same way (`lifecycle=`, the CLI's
`--lifecycle module:NAME`): its machine is built by the same
`build_machine(role, lifecycle=...)` call the managers use.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from transitions import Machine
from transitions.extensions.diagrams import GraphMachine
from transitions.extensions.diagrams_mermaid import Graph as _MermaidGraph

from ..._errors import ConfigError
from ..._lifecycle import KV_LIFECYCLE, Lifecycle
from ..._machine import build_machine
from ..._states import KVPoll, Role
from .formats import (
    END_NODE,
    FORMATS,
    START_NODE,
    TEXT_FORMATS,
    GraphvizMissing,
    format_for_path,
    require_dot_program,
    require_graphviz_package,
)

__all__ = [
    "LifecycleGraphMachine",
    "diagram_machine",
    "terminal_states",
    "parse_state",
    "render",
    "render_text",
    "role_of",
    "lifecycle_title",
]


def terminal_states(machine: Machine) -> list[str]:
    """The states of `machine` that no event leaves, in state-value order (`KVPoll` order for KV).

    Read from the machine rather than from `kvfsm.TERMINAL`, so the marks
    on a diagram say what the machine does, not what it is meant to do.
    """
    sources = {source for event in machine.events.values() for source in event.transitions}
    return [name for name in machine.states if name not in sources]


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
            container.node(START_NODE, label="", shape="circle", style="filled", fillcolor="black", width="0.2")
            super()._add_nodes(states, container)
            container.node(END_NODE, label="", shape="doublecircle", style="filled", fillcolor="black", width="0.15")

        def _add_edges(self, transitions: list[dict[str, Any]], container: Any) -> None:
            container.edge(START_NODE, self.machine.initial, label="open")
            super()._add_edges(transitions, container)
            for name in terminal_states(self.machine):
                container.edge(name, END_NODE, label="close", style="dashed")

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
            require_graphviz_package(graph_engine)
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


def lifecycle_title(role: Role | str, lifecycle: Lifecycle = KV_LIFECYCLE) -> str:
    """The title every rendering of `lifecycle` for `role` carries."""
    role = Role.coerce(role)
    suffix = "" if lifecycle is KV_LIFECYCLE else f" ({lifecycle.name})"
    return f"kvfsm {role.value} lifecycle{suffix}"


def diagram_machine(
    role: Role | str, engine: str = "mermaid", lifecycle: Lifecycle = KV_LIFECYCLE
) -> LifecycleGraphMachine:
    """The lifecycle machine of `role` as a `GraphMachine`, built exactly like the live one."""
    role = Role.coerce(role)
    machine = build_machine(
        role,
        lifecycle=lifecycle,
        machine_cls=LifecycleGraphMachine,
        graph_engine=engine,
        title=lifecycle_title(role, lifecycle),
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


def _graph(
    role: Role | str, engine: str, highlight: KVPoll | str | int | None, lifecycle: Lifecycle = KV_LIFECYCLE
) -> Any:
    machine = diagram_machine(role, engine, lifecycle)
    graph = machine.graph_cls(machine)
    for name in terminal_states(machine):
        graph.set_node_style(name, "failed" if name == lifecycle.failure.name else "success")
    if highlight is not None:
        graph.set_node_style(parse_state(highlight).name, "active")
    return graph.get_graph(title=machine.title)


def render(
    role: Role | str = Role.SENDER,
    fmt: str = "mermaid",
    *,
    highlight: KVPoll | str | int | None = None,
    lifecycle: Lifecycle = KV_LIFECYCLE,
) -> bytes:
    """The lifecycle diagram of `role` in `fmt` (one of `FORMATS`), as bytes.

    `highlight` marks one state (e.g. a room's live state). Raises
    `GraphvizMissing` when `fmt` needs graphviz and it is not installed.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"diagram format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "mermaid":
        source: str = _graph(role, "mermaid", highlight, lifecycle).source
        return (source.rstrip("\n") + "\n").encode("utf-8")
    require_graphviz_package(fmt)
    graph = _graph(role, "graphviz", highlight, lifecycle)
    if fmt == "dot":
        return str(graph.source).encode("utf-8")
    require_dot_program(fmt)
    data = graph.pipe(format=fmt)
    assert isinstance(data, bytes)
    return data


def render_text(
    role: Role | str = Role.SENDER,
    fmt: str = "mermaid",
    *,
    highlight: KVPoll | str | int | None = None,
    lifecycle: Lifecycle = KV_LIFECYCLE,
) -> str:
    """`render()` for the text formats (mermaid, dot, svg), decoded."""
    if fmt not in TEXT_FORMATS:
        raise ConfigError(f"format {fmt!r} is binary; text formats are {', '.join(sorted(TEXT_FORMATS))}")
    return render(role, fmt, highlight=highlight, lifecycle=lifecycle).decode("utf-8")


def role_of(path: str | Path, fmt: str | None = None) -> Role | None:
    """The role whose diagram the file at `path` holds, or None if it cannot tell.

    Read from the title every rendering carries (`kvfsm receiver lifecycle`);
    a file without a readable title (png) is matched against each role's
    rendering. None when the file is missing, matches neither role, or is in
    a format this machine cannot render the lifecycle in (a png of a wire
    table needs only graphviz's `dot` program, a lifecycle png also the
    Python package).
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
    try:
        matching = [role for role in Role if render(role, fmt) == data]
    except GraphvizMissing:
        return None
    return matching[0] if len(matching) == 1 else None
