"""The `kvfsm` command line: one subcommand per module, imported on demand.

Each command module exposes `configure(parser)` and `run(args) -> int`.
Only the chosen command's module is imported, so `kvfsm diagram` never pays
for torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main", "COMMANDS"]

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvfsm.simulate", "run N prefill->decode transfers and verify every lifecycle"),
    "diagram": ("kvfsm.diagrams", "draw the lifecycle state diagram from the machine (mermaid, dot, svg, png)"),
    "bench": ("kvfsm.bench", "measure the lifecycle's speed and memory against hand-written baselines"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="kvfsm", description="Lifecycle of KV-cache transfers for disaggregated LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse the command name first, then let only that module add its options.
    known, _rest = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
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
    return int(module.run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
