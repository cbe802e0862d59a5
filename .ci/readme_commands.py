"""Print the README's quick-start commands, one per line: the only copy CI runs.

The quick start is the two ``sh`` blocks under the README's "## Quick start"
heading: the first installs and runs the main job, the second runs the test
suite. `.ci/quickstart` runs exactly what this prints, so the README and
CI's first stage cannot drift apart; `tests/unit/test_quickstart.py` checks
that the README still has that shape.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADING = "## Quick start"


def quickstart_commands(readme: str) -> list[str]:
    """The commands of the quick start's ``sh`` blocks, in order (a block's lines joined)."""
    start = readme.find(f"\n{HEADING}\n")
    if start < 0:
        raise ValueError(f"the README has no {HEADING!r} section")
    end = readme.find("\n## ", start + len(HEADING) + 1)
    section = readme[start : end if end >= 0 else len(readme)]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    commands = [" ".join(line.strip() for line in block.strip().splitlines()) for block in blocks]
    if len(commands) != 2 or not all(commands):
        raise ValueError(f"the quick start must have two sh blocks (install and run; test); found {len(commands)}")
    return commands


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "README.md"
    try:
        commands = quickstart_commands(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
