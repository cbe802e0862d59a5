"""benchmarks/latency_parts.py measures each part it names and refuses a part it does not know.

Its figures are never asserted (they are what the machine gives); what is
asserted: every part asked for prints a positive figure, a missing engine
is a printed skip rather than a crash, a bad `--only` is a usage error,
and it returns with nothing left running (its echo processes are joined).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
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
    expected = 10 + (4 if "mooncake" in engines else 0) + (4 if "nixl" in engines else 0)
    assert len(figures) == expected, done.stdout
    assert all(value > 0 for value in figures.values()), figures
    # The engines' samples, one per write (what vs_sglang.py's raw rows are made of).
    data = json.loads((tmp_path / "parts.json").read_text())
    assert len(data["figures_us"]) == expected
    assert {name: len(data["samples_s"][name]) for name in engines} == dict.fromkeys(engines, 50)
    if "mooncake" in engines:  # the marker after the writes: each sample checked its token landed
        assert len(data["samples_s"]["mooncake_marker"]) == 50
    if "nixl" in engines:  # into a second process, alone and after a notification (each counted on arrival)
        assert [len(data["samples_s"][name]) for name in ("nixl_apart", "nixl_after_note")] == [50, 50]


def test_an_unknown_part_is_a_usage_error() -> None:
    done = _run("--only", "tcp,frob")
    assert done.returncode == 2
    assert "unknown part 'frob'" in done.stderr


@pytest.mark.parametrize("nap", ["-0.001", "nan"])
def test_a_loop_nap_below_zero_is_a_usage_error(nap: str) -> None:
    done = _run("--only", "naps", "--stream", "4", "--stream-beside-loop", nap)
    assert done.returncode == 2
    assert f"--stream-beside-loop must be at least 0 seconds; got {float(nap)}" in done.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs Mooncake Transfer Engine")
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find the receiver process")
def test_the_stream_receiver_ends_when_its_writer_is_killed() -> None:
    """The raw stream beside a loop starts a receiver process; killed mid-stream, the writer takes it along."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    stream = ["--stream", "4", "--stream-requests", "100000", "--stream-beside-loop", "0.0001"]
    writer = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--only", "mooncake", "--count", "5", *stream],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        receivers: list[int] = []
        deadline = time.monotonic() + 90
        while not receivers and time.monotonic() < deadline and writer.poll() is None:
            # The spawn context's resource tracker is a child too; the receiver is the one running Mooncake.
            receivers = [c for c in _children(writer.pid) if _has_mooncake(c)]
            time.sleep(0.2)
        assert receivers, "the stream's receiver process never started"
        time.sleep(1.0)  # the stream is under way
        writer.kill()
        writer.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in receivers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in receivers), f"receiver {receivers} outlived its killed writer"
    finally:
        if writer.poll() is None:
            writer.kill()
        for pid in _children(writer.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _has_mooncake(pid: int) -> bool:
    try:
        return "mooncake" in (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False
