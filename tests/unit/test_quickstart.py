"""The README's quick start is what CI's first stage runs, word for word.

`.ci/quickstart` runs the two commands `.ci/readme_commands.py` reads from
the README, in a fresh venv, before `.ci/run` installs anything else. These
stories keep that wiring honest: the README still has the shape the reader
expects, and CI runs that stage first.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _reader() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_commands", REPO / ".ci" / "readme_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quick_start_is_install_and_run_then_the_test_suite() -> None:
    install, test = _reader().quickstart_commands((REPO / "README.md").read_text(encoding="utf-8"))
    # CPU torch first (a bare torch pulls a CUDA build), the test extra only, then the main job.
    assert install.startswith("pip install torch==2.13.0 && ")
    assert "pip install -e '.[test]'" in install
    assert install.endswith("kvfsm simulate")
    assert test == "python -m pytest"


def test_ci_runs_the_quick_start_before_it_installs_anything() -> None:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    first_install = next(i for i, line in enumerate(commands) if re.search(r"\b(pip|apt-get)\b", line))
    quickstart = commands.index("bash .ci/quickstart")
    assert quickstart < first_install, commands[first_install]


@pytest.mark.parametrize(
    "readme",
    [
        "# x\n\nno quick start here\n",
        "# x\n\n## Quick start\n\n```sh\npip install .\n```\n\n## Next\n\n```sh\npython -m pytest\n```\n",
    ],
)
def test_a_readme_without_two_quick_start_blocks_is_refused(readme: str) -> None:
    with pytest.raises(ValueError, match=r"Quick start|two sh blocks"):
        _reader().quickstart_commands(readme)
