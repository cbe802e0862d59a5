"""State diagrams drawn from the code: the lifecycle machine and the wire tables.

Every diagram here comes from `build_machine(role, machine_cls=...)`: the
same call, the same table (`_table.TRANSITIONS`) and the same options that
build the machine the managers dispatch through, only with
`transitions.extensions.diagrams.GraphMachine` as the class. Nothing about
states or edges is typed here, so a diagram cannot drift from the code; the
`--check` mode of `kvfsm diagram` (and `check()`) fails when a
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

from .cli import DiagramCheck, check, configure, run
from .formats import FORMATS, TEXT_FORMATS, GraphvizMissing, format_for_path
from .lifecycle import (
    LifecycleGraphMachine,
    diagram_machine,
    parse_state,
    render,
    render_text,
    role_of,
    terminal_states,
)
from .wire import WIRE_TABLES, render_wire, wire_dot, wire_of, wire_table, wire_title

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
