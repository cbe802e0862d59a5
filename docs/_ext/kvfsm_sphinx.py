"""Sphinx directives that render kvfsm's docs from the code, at build time.

Nothing the reader sees about the lifecycle is typed into the docs by hand:

* ``kvfsm-diagram`` inlines the SVG that `kvfsm.diagrams` draws from the
  live `transitions` machine (graphviz at build time; no JavaScript, no
  CDN), so the page shows the machine the code runs.
* ``kvfsm-transitions`` is the declaration (`kvfsm.TRANSITIONS`) as a table.
* ``kvfsm-event-matrix`` is every (state, event) pair, read from the
  machine: where the event leads, or what the manager does instead (late
  events absorbed, out-of-order events failing the room).
* ``kvfsm-cli-reference`` runs ``kvfsm <command> --help`` for every entry
  of `kvfsm.cli.COMMANDS`, so a new command appears without a docs edit.

If graphviz's ``dot`` is missing the diagram falls back to its mermaid
source and logs a warning naming the Debian package (an error under -W).
"""

from __future__ import annotations

import contextlib
import html
import io
import os
import re
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

import kvfsm
from kvfsm import diagrams
from kvfsm._machine import lifecycle_machine
from kvfsm.cli import COMMANDS, main

logger = logging.getLogger(__name__)

_HELP_COLUMNS = "88"


def _literal(text: str) -> nodes.literal:
    return nodes.literal(text, text)


def _cell(*content: nodes.Node | str) -> nodes.entry:
    paragraph = nodes.paragraph()
    for item in content:
        paragraph += nodes.Text(item) if isinstance(item, str) else item
    entry = nodes.entry()
    entry += paragraph
    return entry


def _table(header: list[str], rows: list[list[nodes.entry]], widths: list[int], classes: list[str]) -> nodes.table:
    table = nodes.table(classes=classes)
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    row = nodes.row()
    for title in header:
        row += _cell(title)
    head += row
    group += head
    body = nodes.tbody()
    for cells in rows:
        row = nodes.row()
        for cell in cells:
            row += cell
        body += row
    group += body
    return table


def _inline_svg(svg: str, prefix: str, label: str) -> str:
    """The SVG without its XML prolog and comments, ids made unique on the page, labelled."""
    svg = re.sub(r"<\?xml[^>]*\?>\s*", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg)
    svg = re.sub(r"<!--.*?-->\s*", "", svg, flags=re.S)
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = svg.replace("<svg ", f'<svg role="img" aria-label="{html.escape(label)}" ', 1)
    return svg.strip()


class DiagramDirective(SphinxDirective):
    """``kvfsm-diagram``: the lifecycle diagram of a role, drawn now from the machine."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "role": lambda arg: directives.choice(arg, [r.value for r in kvfsm.Role]),
        "highlight": directives.unchanged,
        "caption": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        role = self.options.get("role", "sender")
        highlight = self.options.get("highlight")
        caption = self.options.get("caption", f"The {role} lifecycle, drawn from the machine kvfsm runs.")
        prefix = f"kvfsm-{role}-{highlight or 'plain'}".lower()
        try:
            svg = diagrams.render_text(role, "svg", highlight=highlight)
        except diagrams.GraphvizMissing as exc:
            logger.warning("kvfsm-diagram: %s; showing the mermaid source instead", exc, location=self.get_location())
            source = diagrams.render_text(role, "mermaid", highlight=highlight)
            return [nodes.literal_block(source, source, language="text")]
        markup = (
            f'<figure class="kvfsm-diagram" id="{prefix}" data-role="{role}">\n'
            f"{_inline_svg(svg, prefix, caption)}\n"
            f"<figcaption>{html.escape(caption)}</figcaption>\n</figure>\n"
        )
        # Other builders (latex, text, doctest) get the caption instead.
        fallback = addnodes.only(expr="not html")
        fallback += nodes.paragraph(text=caption)
        return [nodes.raw("", markup, format="html"), fallback]


class TransitionsDirective(SphinxDirective):
    """``kvfsm-transitions``: the declaration `kvfsm.TRANSITIONS`, row by row."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        rows = []
        for spec in kvfsm.TRANSITIONS:
            if set(spec.sources) == set(kvfsm.NON_TERMINAL):
                sources = _cell("any non-terminal state")
            else:
                sources = _cell(*_joined(_literal(s.name) for s in spec.sources))
            dest = _cell(_literal(spec.dest.name)) if spec.dest is not None else _cell("(stays: progress only)")
            rows.append([_cell(_literal(spec.event)), sources, dest, _cell(spec.doc)])
        return [_table(["event", "from", "to", "meaning"], rows, [18, 24, 18, 40], ["kvfsm-transitions"])]


def _joined(items: Any) -> list[nodes.Node | str]:
    out: list[nodes.Node | str] = []
    for item in items:
        if out:
            out.append(", ")
        out.append(item)
    return out


class EventMatrixDirective(SphinxDirective):
    """``kvfsm-event-matrix``: what every event does in every state, read from the machine."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "role": lambda arg: directives.choice(arg, [r.value for r in kvfsm.Role]),
    }

    def run(self) -> list[nodes.Node]:
        machine = lifecycle_machine(kvfsm.Role.coerce(self.options.get("role", "sender")))
        rows = []
        for event, spec in machine.events.items():
            cells = [_cell(_literal(event))]
            for state in kvfsm.KVPoll:
                candidates = spec.transitions.get(state.name, [])
                if candidates:
                    dest = candidates[0].dest
                    cells.append(_cell(_literal(dest)) if dest is not None else _cell("stays (progress)"))
                elif state in kvfsm.TERMINAL:
                    cells.append(_cell("absorbed (late)"))
                else:
                    cells.append(_cell(_literal("Failed"), " (out of order)"))
            rows.append(cells)
        header = ["event \\ state", *(state.name for state in kvfsm.KVPoll)]
        return [_table(header, rows, [16] + [14] * len(kvfsm.KVPoll), ["kvfsm-event-matrix"])]


def command_help(command: str | None) -> str:
    """What ``kvfsm [command] --help`` prints, at a fixed width."""
    argv = ["--help"] if command is None else [command, "--help"]
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue().rstrip() + "\n"


class CliReferenceDirective(SphinxDirective):
    """``kvfsm-cli-reference``: ``--help`` of ``kvfsm`` and of every registered command."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        result: list[nodes.Node] = []
        for command in [None, *COMMANDS]:
            title = "kvfsm" if command is None else f"kvfsm {command}"
            text = command_help(command)
            anchor = nodes.make_id(f"cli-{command or 'kvfsm'}")
            rubric = nodes.rubric(title, "", _literal(title), ids=[anchor])
            result += [rubric, nodes.literal_block(text, text, language="text")]
        return result


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("kvfsm-diagram", DiagramDirective)
    app.add_directive("kvfsm-transitions", TransitionsDirective)
    app.add_directive("kvfsm-event-matrix", EventMatrixDirective)
    app.add_directive("kvfsm-cli-reference", CliReferenceDirective)
    app.add_css_file("kvfsm.css")
    return {"version": kvfsm.__version__, "parallel_read_safe": True, "parallel_write_safe": True}
