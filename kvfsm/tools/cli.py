"""The `kvfsm` command line: one subcommand per module, imported on demand.

Each command module exposes `configure(parser)` and `run(args) -> int`.
Only the chosen command's module is imported, so `kvfsm diagram` never pays
for torch.

Exit statuses shared by every command: 0 done, 1 the command's own verdict
(a check failed), 2 a usage error or a missing dependency (one line
`kvfsm COMMAND: error: ...`, never a traceback), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ._cliargs import CommandError, UsageError

__all__ = ["main", "COMMANDS"]

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvfsm.tools.simulate", "run N prefill->decode transfers and verify every lifecycle"),
    "diagram": (
        "kvfsm.tools.diagrams",
        "draw the lifecycle or a wire protocol table from the code (mermaid, dot, svg, png)",
    ),
    "bench": ("kvfsm.tools.bench", "measure the lifecycle's speed and memory against hand-written baselines"),
}

#: Exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="kvfsm",
        description="Lifecycle of KV-cache transfers for disaggregated LLM serving.",
        epilog="Options of a command go after its name: kvfsm COMMAND --help.",
    )
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.error(f"a command is required: {', '.join(COMMANDS)} (kvfsm COMMAND --help)")
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(
            f"unrecognized option {argv[0]!r}: give a command first ({', '.join(COMMANDS)}), "
            f"then its options (kvfsm COMMAND --help)"
        )
    # Parse the command name first, then let only that module add its options.
    known = parser.parse_args(argv[:1])
    module_name, help_text = COMMANDS[known.command]
    module = importlib.import_module(module_name)
    command_parser = argparse.ArgumentParser(prog=f"kvfsm {known.command}", description=help_text)
    command_parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: warnings, -vv: info, -vvv: debug)"
    )
    module.configure(command_parser)
    args = command_parser.parse_args(argv[1:])
    levels = [logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]
    logging.basicConfig(level=levels[min(args.verbose, 3)], format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(module.run(args))
    except UsageError as exc:
        command_parser.error(str(exc))
    except CommandError as exc:
        print(f"{command_parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{command_parser.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
