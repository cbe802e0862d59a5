"""The README's install lines are true: checked with `pip install --dry-run`.

Nothing is installed. Three claims, each resolved by pip itself:

* installing kvfsm where torch is already installed keeps that torch (no
  other torch, no CUDA packages, no triton): the server case;
* the README's line for PyTorch's CPU index resolves to the CPU wheel with
  no CUDA packages (skipped, saying why, where that index cannot be reached);
* the public package index alone resolves `torch==2.13.0` to the CUDA build,
  which is why the README says so (skipped where no index can be reached).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvfsm

REPO = Path(kvfsm.__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
CUDA = re.compile(r"^(torch|nvidia-.*|triton|cuda-.*)$", re.IGNORECASE)

pytest.importorskip("torch", reason="the claims are about installing next to an installed torch")


def _dry_run(args: list[str], report: Path, *, isolated: bool = False) -> list[dict[str, Any]]:
    """What `pip install --dry-run args` would install (name, version), as pip reports it."""
    env = dict(os.environ)
    if isolated:
        # Only the index named on the command line: no local wheel folders or extra indexes.
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        if isolated and re.search(r"connect|resolve|network|timed out|No matching distribution", result.stderr, re.I):
            pytest.skip(f"the package index is not reachable from here: {last}")
        raise AssertionError(f"{' '.join(command)} failed: {result.stderr}")
    installs: list[dict[str, Any]] = json.loads(report.read_text())["install"]
    return installs


def _names(installs: list[dict[str, Any]]) -> dict[str, str]:
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}


def _reachable(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def test_installing_kvfsm_next_to_an_installed_torch_keeps_it(tmp_path: Path) -> None:
    wanted = _names(_dry_run(["--no-build-isolation", "-e", f"{REPO}[test]"], tmp_path / "report.json"))
    assert "kvfsm" in wanted
    pulled = sorted(name for name in wanted if CUDA.match(name))
    assert pulled == [], f"installing kvfsm would replace or add {pulled} next to the installed torch"


def _cpu_line() -> list[str]:
    match = re.search(r"`pip install (torch==[^`]*--index-url https://download\.pytorch\.org/whl/cpu)`", README)
    assert match, "the README names PyTorch's CPU index for installs outside this project's machines"
    return match.group(1).split()


def test_the_readme_cpu_index_line_gets_the_cpu_build(tmp_path: Path) -> None:
    if not _reachable("download.pytorch.org"):
        pytest.skip("PyTorch's CPU index (download.pytorch.org) cannot be reached from here")
    wanted = _names(_dry_run(["--ignore-installed", *_cpu_line()], tmp_path / "report.json", isolated=True))
    assert wanted.get("torch", "").endswith("+cpu"), wanted
    assert sorted(name for name in wanted if CUDA.match(name) and name != "torch") == []


def test_the_public_index_alone_gets_the_cuda_build_as_the_readme_says(tmp_path: Path) -> None:
    assert "from the public package index alone it resolves to the CUDA build" in " ".join(README.split())
    version = _cpu_line()[0]
    wanted = _names(_dry_run(["--ignore-installed", version], tmp_path / "report.json", isolated=True))
    assert any(name.startswith("nvidia-") for name in wanted), wanted
