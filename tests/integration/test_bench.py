"""`kvfsm bench` runs end to end and its non-timing findings hold.

Timings are never asserted here (they are ratios printed by the bench, not
test outcomes). What is asserted does not depend on the machine's speed:
the threaded run loses or mismatches no status, lifecycles leave no garbage
cycles, a live room stays under the memory goal, and the JSON report holds
every section and goal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvfsm.tools import bench
from kvfsm.tools.cli import main


def test_threads_and_memory_goals_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--only", "memory,threads", "--repeats", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["threads"]["lost"] == 0
    assert data["threads"]["mismatched"] == 0
    assert data["threads"]["regressions"] == 0
    assert data["memory"]["gc_collected_after_lifecycles"] == 0
    assert data["memory"]["bytes_per_live_room"]["kvfsm"] <= 600
    assert code == 0, capsys.readouterr().out  # 0 even if a timing goal were missed (no --strict)


def test_every_section_reports_its_figures_and_goals() -> None:
    lines: list[str] = []
    data = bench.run_benchmarks(
        quick=True,
        sections=["lifecycle", "abort", "reads", "scale"],
        sizes=[100, 1_000],
        repeats=1,
        out=lines.append,
    )
    assert {"lifecycle", "abort", "reads", "scale"} <= data.keys()
    assert set(data["scale"]["seconds_per_transition"]) == {"100", "1000"}
    goals = {goal["goal"] for goal in data["goals"]}
    assert "lifecycle vs SGLang-style baseline" in goals
    assert "poll_many per room vs dict lookup" in goals
    assert "status(room) vs dict lookup" not in goals  # retired: its floor is above the old goal
    assert data["reads"]["poll_many_ratio"] > 0
    for goal in data["goals"]:
        assert goal["value"] > 0
        assert ("met" if goal["met"] else "MISSED") in "\n".join(lines)
    assert all(seconds > 0 for seconds in data["lifecycle"]["seconds_per_lifecycle"].values())


def test_room_sizes_are_parsed_with_suffixes() -> None:
    assert bench._sizes("1k,10K,1.5m,7") == [1_000, 10_000, 1_500_000, 7]
    with pytest.raises(argparse.ArgumentTypeError, match="room counts"):
        bench._sizes("lots")
