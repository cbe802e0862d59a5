"""Sphinx directives that render kvfsm's docs from the code, at build time.

Nothing the reader sees about the lifecycle is typed into the docs by hand:

* ``kvfsm-diagram`` inlines the SVG that `kvfsm.tools.diagrams` draws from the
  live `transitions` machine (graphviz at build time; no JavaScript, no
  CDN), so the page shows the machine the code runs.
* ``kvfsm-transitions`` is the declaration (`kvfsm.TRANSITIONS`) as a table.
* ``kvfsm-event-matrix`` is every (state, event) pair, read from the
  machine: where the event leads, or what the manager does instead (late
  events absorbed, out-of-order events failing the room).
* ``kvfsm-cli-reference`` runs ``kvfsm <command> --help`` for every entry
  of `kvfsm.tools.cli.COMMANDS`, so a new command appears without a docs edit.

The wire protocol page is drawn from `kvfsm.backends.wire` the same way:

* ``kvfsm-wire-diagram`` inlines the SVG of one record table (`decode`,
  `claim`, `room`) that `kvfsm.tools.diagrams.render_wire` lays out from its rows.
* ``kvfsm-wire-rows`` is that table's rows: input, from, to, messages sent.
* ``kvfsm-wire-messages`` is `wire.MESSAGES`; ``kvfsm-wire-fields`` every
  header field with the check `codec.decode` applies to it.
* ``kvfsm-wire-bounds`` is every bound on what the network feeds an
  endpoint, each value read from the code that enforces it.

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
from kvfsm._lifecycle import KV_LIFECYCLE, Lifecycle, lifecycle_by_name
from kvfsm._machine import lifecycle_machine
from kvfsm._release import RELEASE_TABLE
from kvfsm.backends import wire
from kvfsm.tools import diagrams
from kvfsm.tools.cli import COMMANDS, main

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


def _figure(svg: str, prefix: str, caption: str, data: str) -> list[nodes.Node]:
    """An inline SVG figure for html, its caption for the other builders."""
    markup = (
        f'<figure class="kvfsm-diagram" id="{prefix}" {data}>\n'
        f"{_inline_svg(svg, prefix, caption)}\n"
        f"<figcaption>{html.escape(caption)}</figcaption>\n</figure>\n"
    )
    fallback = addnodes.only(expr="not html")
    fallback += nodes.paragraph(text=caption)
    return [nodes.raw("", markup, format="html"), fallback]


def _lifecycle_option(arg: str | None) -> Lifecycle:
    """``:lifecycle: module:NAME`` names a declared lifecycle (default: the KV lifecycle)."""
    return lifecycle_by_name(str(directives.unchanged_required(arg or "")))


class DiagramDirective(SphinxDirective):
    """``kvfsm-diagram``: the lifecycle diagram of a role, drawn now from the machine."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "role": lambda arg: directives.choice(arg, [r.value for r in kvfsm.Role]),
        "highlight": directives.unchanged,
        "caption": directives.unchanged,
        "lifecycle": _lifecycle_option,
    }

    def run(self) -> list[nodes.Node]:
        role = self.options.get("role", "sender")
        highlight = self.options.get("highlight")
        lifecycle: Lifecycle = self.options.get("lifecycle", KV_LIFECYCLE)
        caption = self.options.get("caption", f"The {role} lifecycle, drawn from the machine kvfsm runs.")
        name = "" if lifecycle is KV_LIFECYCLE else f"{lifecycle.name}-"
        prefix = f"kvfsm-{name}{role}-{highlight or 'plain'}".lower()
        try:
            svg = diagrams.render_text(role, "svg", highlight=highlight, lifecycle=lifecycle)
        except diagrams.GraphvizMissing as exc:
            logger.warning("kvfsm-diagram: %s; showing the mermaid source instead", exc, location=self.get_location())
            source = diagrams.render_text(role, "mermaid", highlight=highlight, lifecycle=lifecycle)
            return [nodes.literal_block(source, source, language="text")]
        return _figure(svg, prefix, caption, f'data-role="{role}"')


class TransitionsDirective(SphinxDirective):
    """``kvfsm-transitions``: a lifecycle's declaration (default `kvfsm.TRANSITIONS`), row by row."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"lifecycle": _lifecycle_option}

    def run(self) -> list[nodes.Node]:
        lifecycle: Lifecycle = self.options.get("lifecycle", KV_LIFECYCLE)
        rows = []
        for spec in lifecycle.transitions:
            if set(spec.sources) == set(lifecycle.non_terminal):
                sources = _cell("any non-terminal state")
            else:
                sources = _cell(*_joined(_literal(s.name) for s in spec.sources))
            dest = _cell(_literal(spec.dest.name)) if spec.dest is not None else _cell("(stays: progress only)")
            rows.append([_cell(_literal(spec.event)), sources, dest, _cell(spec.doc)])
        return [_table(["event", "from", "to", "meaning"], rows, [18, 24, 18, 40], ["kvfsm-transitions"])]


class StatesDirective(SphinxDirective):
    """``kvfsm-states``: a lifecycle's states: what each reports to SGLang, its deadline phase and default."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"lifecycle": _lifecycle_option}

    def run(self) -> list[nodes.Node]:
        lifecycle: Lifecycle = self.options.get("lifecycle", KV_LIFECYCLE)
        rows = []
        for spec in lifecycle.state_specs:
            kind = "failure (terminal)" if spec.failure else "terminal" if spec.terminal else "live"
            if lifecycle.State[spec.name] is lifecycle.initial:
                kind += ", initial"
            phase = _cell(_literal(f"Timeouts.{spec.phase}"), f" = {spec.timeout}") if spec.phase else _cell("-")
            rows.append(
                [_cell(_literal(spec.name)), _cell(kind), _cell(_literal(spec.reports.name)), phase, _cell(spec.doc)]
            )
        header = ["state", "kind", "reports (KVPoll)", "deadline", "meaning"]
        return [_table(header, rows, [16, 16, 16, 22, 30], ["kvfsm-states"])]


class ReleaseRowsDirective(SphinxDirective):
    """``kvfsm-release-rows``: the release phase of a room's pages (`kvfsm._release.RELEASE_TABLE`)."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        rows = []
        for row in RELEASE_TABLE.rows:
            sources = _cell(*_joined(_literal(s.value) for s in row.sources if s is not None))
            dest = _cell(_literal(row.dest.value)) if row.dest is not None else _cell("-")
            rows.append([_cell(_literal(row.input)), sources, dest, _cell(row.doc)])
        return [_table(["step", "from", "to", "meaning"], rows, [20, 22, 14, 44], ["kvfsm-release-rows"])]


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


def _wire_table_option(arg: str | None) -> str:
    return str(directives.choice(arg or "", list(diagrams.WIRE_TABLES)))


class WireDiagramDirective(SphinxDirective):
    """``kvfsm-wire-diagram``: one wire record table, laid out now from its rows."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"table": _wire_table_option, "caption": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        name = self.options.get("table", "decode")
        caption = self.options.get("caption", f"The {name} records of the wire protocol, drawn from its table.")
        try:
            svg = diagrams.render_wire(name, "svg").decode("utf-8")
        except diagrams.GraphvizMissing as exc:
            logger.warning(
                "kvfsm-wire-diagram: %s; showing the mermaid source instead", exc, location=self.get_location()
            )
            source = diagrams.render_wire(name, "mermaid").decode("utf-8")
            return [nodes.literal_block(source, source, language="text")]
        return _figure(svg, f"kvfsm-wire-{name}", caption, f'data-wire="{name}"')


def _state_list(items: Any, table: wire.WireTable) -> nodes.entry:
    states = list(items)
    if set(states) >= set(table.states):
        return _cell("any state")
    return _cell(*_joined(_cell_text(state) for state in states))


def _cell_text(state: Any) -> nodes.Node | str:
    return "(no record yet)" if state is None else _literal(state.name)


class WireRowsDirective(SphinxDirective):
    """``kvfsm-wire-rows``: every row of one wire table, in declaration order."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"table": _wire_table_option}

    def run(self) -> list[nodes.Node]:
        table = diagrams.wire_table(self.options.get("table", "decode"))
        rows = []
        for row in table.rows:
            dest = _cell("(record dropped)") if row.dest is None else _cell(_literal(row.dest.name))
            sends = _cell(*_joined(_literal(kind) for kind in row.sends)) if row.sends else _cell("")
            rows.append([_cell(_literal(row.input)), _state_list(row.sources, table), dest, sends, _cell(row.doc)])
        header = ["input", "from", "to", "sends", "meaning"]
        return [_table(header, rows, [16, 22, 13, 14, 35], ["kvfsm-wire-rows"])]


class WireMessagesDirective(SphinxDirective):
    """``kvfsm-wire-messages``: `wire.MESSAGES`, with who sends each and its fields."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        rows = []
        for (name, sender, scope, doc), spec in zip(wire.sends_table(), wire.MESSAGES, strict=True):
            fields = _cell(*_joined(_literal(field) for field, _check in spec.fields))
            blob = "may follow" if spec.blob else "none"
            rows.append([_cell(_literal(name)), _cell(sender), _cell(scope), fields, _cell(blob), _cell(doc)])
        header = ["message", "sent by", "about", "header fields", "blob", "what it says"]
        return [_table(header, rows, [12, 9, 8, 25, 8, 38], ["kvfsm-wire-messages"])]


class WireFieldsDirective(SphinxDirective):
    """``kvfsm-wire-fields``: each header field, the check `codec.decode` applies, and where it appears."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        uses: dict[tuple[str, Any], list[str]] = {}
        for spec in wire.MESSAGES:
            for field, check in spec.fields:
                uses.setdefault((field, check), []).append(spec.name)
        rows = []
        for (field, check), messages in uses.items():
            # The codec's own description of the check, the text its refusals quote.
            must = wire.CHECK_DOCS[check]
            rows.append([_cell(_literal(field)), _cell(must), _cell(*_joined(_literal(m) for m in messages))])
        return [_table(["field", "must be", "in"], rows, [14, 50, 36], ["kvfsm-wire-fields"])]


def _size(value: int) -> str:
    """A byte count in the largest binary unit that divides it (6 MiB, 4 KiB), else in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift} {unit}"
    return f"{value:,} bytes"


def _remote_defaults() -> tuple[dict[str, Any], dict[str, Any]]:
    """RemoteConfig's defaults and ControlPlane's keyword defaults, read from the classes."""
    import inspect

    import attrs

    from kvfsm.backends.control import ControlPlane
    from kvfsm.backends.remote import RemoteConfig

    config = {field.name: field.default for field in attrs.fields(RemoteConfig)}
    plane = {
        name: parameter.default
        for name, parameter in inspect.signature(ControlPlane.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return config, plane


class WireBoundsDirective(SphinxDirective):
    """``kvfsm-wire-bounds``: what bounds the network's input to an endpoint, values from the code."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from kvfsm.backends import _remote_endpoint, _remote_sender, control, remote

        config, plane = _remote_defaults()
        window = config["heartbeat_interval"] * config["heartbeat_misses"]
        bounds: list[tuple[str, str, str, str]] = [
            (
                "ZeroMQ frame size",
                f"{_size(wire.MAX_HEADER_BYTES)} + {_size(plane['max_message_bytes'] - wire.MAX_HEADER_BYTES)}",
                "each frame, by the PULL socket's MAXMSGSIZE (ControlPlane max_message_bytes)",
                "ZeroMQ disconnects the sending connection before the frame is read",
            ),
            (
                "messages queued per connection",
                f"{plane['receive_queue']:,}",
                "the PULL socket's RCVHWM (ControlPlane receive_queue)",
                "ZeroMQ stops reading that connection until the queue drains",
            ),
            (
                "frames per message",
                "3 or 4",
                "codec.envelope (magic, envelope, header, optional blob)",
                "dropped, counted as malformed",
            ),
            (
                "envelope frame (type, session id and secret, MAC)",
                _size(wire.MAX_ENVELOPE_BYTES),
                "wire.MAX_ENVELOPE_BYTES, read before any JSON; a frame naming no session stops here",
                "dropped, counted as oversized (no session: unauthenticated)",
            ),
            (
                "header frame",
                _size(wire.MAX_HEADER_BYTES),
                "wire.MAX_HEADER_BYTES, checked before the JSON is parsed",
                "dropped, counted as oversized",
            ),
            (
                "HELLO / HELLO_ACK header (parsed before a session vouches for it)",
                _size(wire.MAX_HELLO_BYTES),
                "wire.MAX_HELLO_BYTES, checked before the JSON is parsed",
                "dropped, counted as oversized",
            ),
            (
                "blob frame (engine metadata, aux bytes)",
                _size(wire.MAX_BLOB_BYTES),
                "wire.MAX_BLOB_BYTES",
                "dropped, counted as oversized",
            ),
            (
                "text fields, reasons",
                f"{wire.MAX_TEXT:,} characters",
                "wire.MAX_TEXT (reasons are cut to kvfsm.MAX_REASON_CHARS with a marker at the call)",
                "dropped, counted as malformed",
            ),
            (
                "pages in one ROOM",
                f"{wire.MAX_PAGES:,}",
                "wire.MAX_PAGES (expect() refuses more at the call)",
                "dropped, counted as malformed",
            ),
            (
                "messages taken in per loop turn",
                f"{plane['frames_per_turn']}",
                "ControlPlane frames_per_turn; their handling ends as soon as housekeeping is due",
                "the rest wait in ZeroMQ's queue; before housekeeping every message waiting is taken in",
            ),
            (
                "messages taken in, not handled yet",
                f"{plane['max_backlog']:,} and {_size(plane['max_backlog_bytes'])}",
                "ControlPlane max_backlog, max_backlog_bytes (their senders already count as heard)",
                "nothing more is taken in until it drains: ZeroMQ queues, then stops reading",
            ),
            (
                "housekeeping period",
                f"at most min({remote._MOST_TICK:g} s, heartbeat_interval / 4)",
                "RemoteBackend's ControlPlane tick: heartbeats, liveness, expiries",
                "runs whatever arrives",
            ),
            (
                "half-open sessions (HELLO answered, not confirmed)",
                f"{config['max_half_open']} and {_size(_remote_endpoint._HALF_OPEN_BYTES)} of HELLOs",
                "RemoteConfig.max_half_open",
                "a new HELLO evicts the oldest half-open session (never a confirmed one) and tells it BYE",
            ),
            (
                "sessions, so outgoing sockets",
                f"{config['max_sessions']}",
                "RemoteConfig.max_sessions (one PUSH socket per session)",
                "a HELLO is answered BYE once only confirmed sessions are left (counted in hellos_dropped)",
            ),
            (
                "sockets kept open a moment for a last BYE",
                f"{control._LINGERING}, {control._LINGER:g} s each",
                "ControlPlane close_channel(flush=True)",
                "the oldest is closed at once (its BYE may not leave)",
            ),
            (
                "handshake attempts of a decode the prefill did not accept",
                f"{config['handshake_attempts']}",
                "RemoteConfig.handshake_attempts (a jittered pause, doubling, between them)",
                "the rooms waiting on it fail BOOTSTRAP_ERROR at once",
            ),
            (
                "one engine call about one decode (a submit, its peer's opening)",
                f"{config['engine_call_timeout']:g} s",
                "RemoteConfig.engine_call_timeout, watched by the prefill's housekeeping",
                "that decode's session is lost, its rooms fail TRANSFER_ERROR; other lanes go on",
            ),
            (
                "early claims and aborts of one session",
                f"{config['max_pending_per_session']:,}",
                "RemoteConfig.max_pending_per_session",
                "a claim is refused (ABORT, ABORT_ACK); an abort dropped, counted in pending_dropped",
            ),
            (
                "early claims and aborts, all sessions",
                f"{config['max_pending']:,}",
                "RemoteConfig.max_pending",
                "the oldest is dropped (a claim refused), counted in pending_dropped",
            ),
            (
                "how long an early claim or abort, or the hold of a room id, lasts",
                f"{config['pending_ttl']:g} s",
                "RemoteConfig.pending_ttl",
                "an early claim is refused, an early abort forgotten, a held room id freed",
            ),
            (
                "finished claims a session remembers (replays recognised)",
                f"{_remote_endpoint._SEEN_PER_SESSION:,}",
                "per session, oldest forgotten first",
                "a replay older than that finds no record: dropped as stale, or held as an early claim",
            ),
            (
                "room ids whose last bootstrapped generation the prefill remembers",
                f"{_remote_sender._REMEMBER_BOOTSTRAPS:,}",
                "fed by the prefill's own scheduler, not by the network",
                "the oldest forgotten",
            ),
            (
                "silence before a session is lost",
                f"{window:g} s",
                f"RemoteConfig.heartbeat_interval * heartbeat_misses (after a BYE: a grace of at most "
                f"{_remote_endpoint._BYE_GRACE:g} s)",
                "every room that depends on the session fails PEER_LOST",
            ),
        ]
        rows = [[_cell(what), _cell(value), _cell(where), _cell(beyond)] for what, value, where, beyond in bounds]
        header = ["what", "default", "enforced by", "beyond it"]
        return [_table(header, rows, [24, 14, 34, 28], ["kvfsm-wire-bounds"])]


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
    app.add_directive("kvfsm-states", StatesDirective)
    app.add_directive("kvfsm-release-rows", ReleaseRowsDirective)
    app.add_directive("kvfsm-event-matrix", EventMatrixDirective)
    app.add_directive("kvfsm-cli-reference", CliReferenceDirective)
    app.add_directive("kvfsm-wire-diagram", WireDiagramDirective)
    app.add_directive("kvfsm-wire-rows", WireRowsDirective)
    app.add_directive("kvfsm-wire-messages", WireMessagesDirective)
    app.add_directive("kvfsm-wire-fields", WireFieldsDirective)
    app.add_directive("kvfsm-wire-bounds", WireBoundsDirective)
    app.add_css_file("kvfsm.css")
    return {"version": kvfsm.__version__, "parallel_read_safe": True, "parallel_write_safe": True}
