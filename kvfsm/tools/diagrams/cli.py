"""`kvfsm diagram`: draw a diagram, or check that a committed one has not drifted.

`check()` compares a committed file with what the code renders now (the
lifecycle machine of a role, or a wire table) and says how to regenerate
it; `configure`/`run` are the command line over `render`, `render_wire`
and `check`. A file given to `--check` without `--role` or `--wire` is
recognised by the title every rendering carries.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import attrs

from ..._errors import ConfigError
from ..._lifecycle import KV_LIFECYCLE, Lifecycle, lifecycle_by_name
from ..._states import KVPoll, Role
from ...backends.wire import WireTable
from .._cliargs import CommandError, UsageError, output_path
from .formats import FORMATS, TEXT_FORMATS, GraphvizMissing, format_for_path
from .lifecycle import parse_state, render, role_of
from .wire import WIRE_TABLES, render_wire, wire_of, wire_title

__all__ = ["DiagramCheck", "check", "configure", "run"]


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
    lifecycle: Lifecycle = KV_LIFECYCLE,
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
        expected = render(role, fmt, highlight=highlight, lifecycle=lifecycle)
        source, now = "the machine", "machine now"
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
        "--lifecycle",
        metavar="MODULE:NAME",
        type=_lifecycle_argument,
        default=None,
        help="draw this declared kvfsm.Lifecycle (e.g. kvfsm.lifecycles:KV_OFFLOAD_LIFECYCLE) instead of the KV "
        "lifecycle; with --role, and --check needs it too",
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


def _lifecycle_argument(text: str) -> tuple[str, Lifecycle]:
    try:
        return text, lifecycle_by_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    if args.lifecycle is not None and not wire:
        parts.insert(1, f"--lifecycle {args.lifecycle[0]}")
    if args.highlight is not None and not wire:
        parts.append(f"--highlight {args.highlight.name}")
    parts.append(f"--output {path}")
    return " ".join(parts)


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
        render(Role.SENDER, fmt)  # a format the lifecycle cannot be drawn in here says what to install
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
    lifecycle = KV_LIFECYCLE
    if args.lifecycle is not None:
        if args.wire is not None:
            raise UsageError("--lifecycle names a lifecycle to draw; it does not go with --wire")
        if args.highlight is not None:
            raise UsageError("--highlight takes a KVPoll state; it does not go with --lifecycle")
        lifecycle = args.lifecycle[1]
        if args.role is None:
            args.role = Role.SENDER.value
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
                result = check(args.check, args.role, fmt, highlight=args.highlight, lifecycle=lifecycle)
            stream = sys.stdout if result.up_to_date else sys.stderr
            stream.write(result.explain(_command_line(args, fmt, args.check)).rstrip("\n") + "\n")
            return 0 if result.up_to_date else 1
        if args.output is None and fmt not in TEXT_FORMATS:
            sys.stderr.write(f"kvfsm diagram: error: {fmt} is binary; pass --output PATH\n")
            return 2
        if args.wire is not None:
            data = render_wire(args.wire, fmt)
        else:
            data = render(args.role, fmt, highlight=args.highlight, lifecycle=lifecycle)
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
