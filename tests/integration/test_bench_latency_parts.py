"""benchmarks/latency_parts.py measures each part it names and refuses a part it does not know.

Its figures are never asserted (they are what the machine gives); what is
asserted: every part asked for prints a positive figure, a missing engine
is a printed skip rather than a crash, a bad `--only` is a usage error,
and it returns with nothing left running (its echo processes are joined).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane's round trip")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "latency_parts.py"


def _run(*options: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, str(SCRIPT), *options], env=env, capture_output=True, text=True, timeout=120)


def test_every_part_asked_for_prints_a_figure(tmp_path: Path) -> None:
    engines = [e for e in ("mooncake", "nixl") if importlib.util.find_spec(e)]
    parts = ",".join(["tcp", "zmq", "zmq-tuning", "control", "naps", "codec", *engines])
    done = _run("--only", parts, "--count", "50", "--json", str(tmp_path / "parts.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {
        line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1])
        for line in done.stdout.splitlines()[1:]
        if re.search(r"\d$", line)
    }
    expected = 10 + (4 if "mooncake" in engines else 0) + (2 if "nixl" in engines else 0)
    assert len(figures) == expected, done.stdout
    assert all(value > 0 for value in figures.values()), figures
    # The engines' samples, one per write (what vs_sglang.py's raw rows are made of).
    data = json.loads((tmp_path / "parts.json").read_text())
    assert len(data["figures_us"]) == expected
    assert {name: len(data["samples_s"][name]) for name in engines} == dict.fromkeys(engines, 50)
    if "mooncake" in engines:  # the marker after the writes: each sample checked its token landed
        assert len(data["samples_s"]["mooncake_marker"]) == 50


def test_an_unknown_part_is_a_usage_error() -> None:
    done = _run("--only", "tcp,frob")
    assert done.returncode == 2
    assert "unknown part 'frob'" in done.stderr


def test_a_loop_nap_that_is_not_positive_is_a_usage_error() -> None:
    done = _run("--only", "naps", "--stream", "4", "--stream-beside-loop", "0")
    assert done.returncode == 2
    assert "--stream-beside-loop must be a positive number of seconds; got 0.0" in done.stderr
