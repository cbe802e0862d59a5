"""Issue 7's benchmarks with plain `python`: the same as `kvfsm bench`.

    python benchmarks/lifecycle.py --quick
    python benchmarks/lifecycle.py --json bench.json

Runs the kvfsm of this checkout (not an installed one), so a branch can be
measured without reinstalling. Every option of `kvfsm bench` works here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfsm.tools.cli import main  # after the path is set

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
