"""`kvfsm.tools.diagrams` and `kvfsm diagram`: drawn from the live machine, checkable for drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfsm import NON_TERMINAL, TERMINAL, ConfigError, KVPoll, Role
from kvfsm._machine import lifecycle_machine
from kvfsm.backends import wire
from kvfsm.backends.wire import WireTable
from kvfsm.tools import diagrams as kd
from kvfsm.tools.cli import main
from kvfsm.tools.diagrams import formats

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted((REPO / "docs" / "diagrams").glob("lifecycle-*.mmd"))
needs_graphviz_py = pytest.mark.skipif(not formats.graphviz_importable(), reason="python package 'graphviz' missing")
# svg and png need both: the Python package builds the graph, Debian's `dot` renders it.
needs_dot = pytest.mark.skipif(
    formats.dot_program() is None or not formats.graphviz_importable(),
    reason="graphviz 'dot' (Debian: graphviz) or the python package 'graphviz' not installed",
)


def machine_edges(role: Role) -> dict[tuple[str, str], set[str]]:
    """(source, dest) -> events, read from the machine the managers run."""
    edges: dict[tuple[str, str], set[str]] = {}
    for name, event in lifecycle_machine(role).events.items():
        for source, candidates in event.transitions.items():
            for transition in candidates:
                dest = transition.dest if transition.dest is not None else source
                edges.setdefault((source, dest), set()).add(name)
    return edges


def mermaid_edges(text: str) -> dict[tuple[str, str], set[str]]:
    edges: dict[tuple[str, str], set[str]] = {}
    for source, dest, labels in re.findall(r"^\s*(\w+) --> (\w+): (.+)$", text, flags=re.M):
        events = {label.replace(" [internal]", "").strip() for label in labels.split("|")}
        edges[(source, dest)] = events
    return edges


def dot_edges(text: str) -> dict[tuple[str, str], set[str]]:
    edges: dict[tuple[str, str], set[str]] = {}
    for source, dest, quoted, bare in re.findall(r'^\s*(\w+) -> (\w+) \[label=(?:"([^"]*)"|(\w+))', text, flags=re.M):
        if source.startswith("__") or dest.startswith("__"):
            continue  # the entry and exit markers, not machine edges
        label = quoted or bare
        edges[(source, dest)] = {part.replace(" [internal]", "").strip() for part in label.split("|")}
    return edges


@pytest.mark.parametrize("role", list(Role))
def test_diagram_machine_has_the_live_machines_transitions(role: Role) -> None:
    live = lifecycle_machine(role)
    drawn = kd.diagram_machine(role)
    assert set(drawn.events) == set(live.events)
    for name, event in live.events.items():
        drawn_event = drawn.events[name]
        assert set(drawn_event.transitions) == set(event.transitions)
        for source, candidates in event.transitions.items():
            assert [t.dest for t in drawn_event.transitions[source]] == [t.dest for t in candidates]
    assert drawn.initial == live.initial


@pytest.mark.parametrize("role", list(Role))
def test_terminal_states_are_read_from_the_machine(role: Role) -> None:
    assert kd.terminal_states(lifecycle_machine(role)) == ["Failed", "Success"]
    assert {KVPoll[name] for name in kd.terminal_states(kd.diagram_machine(role))} == TERMINAL


@pytest.mark.parametrize("role", list(Role))
def test_mermaid_edges_are_exactly_the_machines(role: Role) -> None:
    assert mermaid_edges(kd.render_text(role, "mermaid")) == machine_edges(role)


@needs_graphviz_py
@pytest.mark.parametrize("role", list(Role))
def test_dot_edges_are_exactly_the_machines(role: Role) -> None:
    assert dot_edges(kd.render_text(role, "dot")) == machine_edges(role)


@pytest.mark.parametrize("fmt", ["mermaid", pytest.param("dot", marks=needs_graphviz_py)])
def test_fail_timeout_abort_edges_leave_every_non_terminal_state(fmt: str) -> None:
    text = kd.render_text("receiver", fmt)
    edges = mermaid_edges(text) if fmt == "mermaid" else dot_edges(text)
    for state in NON_TERMINAL:
        assert {"fail", "timeout", "abort"} <= edges[(state.name, "Failed")], state
    for state in TERMINAL:
        assert not [edge for edge in edges if edge[0] == state.name], f"{state.name} must absorb every event"


def test_mermaid_marks_terminal_states_and_the_entry() -> None:
    text = kd.render_text("sender", "mermaid")
    for state in TERMINAL:
        assert f"{state.name} --> [*]" in text
    for state in NON_TERMINAL:
        assert f"{state.name} --> [*]" not in text
        assert f"Class {state.name} s_default" in text
    assert "Class Success s_success" in text
    assert "Class Failed s_failed" in text
    assert "[*] --> Bootstrapping" in text
    assert text.startswith("---\ntitle: kvfsm sender lifecycle\n---\n")


@needs_graphviz_py
def test_dot_marks_terminal_states_with_a_double_border() -> None:
    nodes = dict(re.findall(r"^\s*(\w+) \[label=\"\w+\\l\"(.*)\]$", kd.render_text("sender", "dot"), flags=re.M))
    for state in TERMINAL:
        assert "peripheries=2" in nodes[state.name]
    for state in NON_TERMINAL:
        assert "peripheries" not in nodes[state.name]


@pytest.mark.parametrize("spelling", ["Transferring", "transferring", "3", 3, KVPoll.Transferring])
def test_highlight_marks_one_state(spelling: str | int | KVPoll) -> None:
    text = kd.render_text("sender", "mermaid", highlight=spelling)
    assert "Class Transferring s_active" in text
    assert re.findall(r"^\s*Class (\w+) s_active$", text, flags=re.M) == ["Transferring"]


def test_highlight_of_an_unknown_state_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"Bootstrapping \(1\).*got 'Done'"):
        kd.render("sender", "mermaid", highlight="Done")
    with pytest.raises(SystemExit) as exited:
        main(["diagram", "--highlight", "7"])
    assert exited.value.code == 2


def test_output_is_deterministic_and_roles_differ_only_in_title() -> None:
    assert kd.render("sender") == kd.render("sender")
    sender, receiver = kd.render_text("sender"), kd.render_text("receiver")
    assert sender != receiver
    assert sender.replace("sender", "receiver") == receiver


def test_unknown_format_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mermaid, dot, svg, png; got 'jpeg'"):
        kd.render("sender", "jpeg")
    with pytest.raises(ConfigError, match="binary"):
        kd.render_text("sender", "png")


#: The committed diagrams of the other shipped lifecycles: file stem -> (role, lifecycle).
OTHER_LIFECYCLES = {
    "staged-kv": ("receiver", "kvfsm.lifecycles:STAGED_KV_LIFECYCLE"),
    "kv-offload": ("sender", "kvfsm.lifecycles:KV_OFFLOAD_LIFECYCLE"),
}


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_diagrams_match_the_machine(path: Path) -> None:
    from kvfsm._lifecycle import lifecycle_by_name

    role = path.stem.removeprefix("lifecycle-")
    if role in OTHER_LIFECYCLES:
        role, name = OTHER_LIFECYCLES[role]
        result = kd.check(path, role, lifecycle=lifecycle_by_name(name))
        assert result.up_to_date, result.explain(f"kvfsm diagram --lifecycle {name} --role {role} --output {path}")
        return
    result = kd.check(path, role)
    assert result.up_to_date, result.explain(f"kvfsm diagram --role {role} --output {path}")


def test_the_committed_diagrams_exist() -> None:
    expected = {f"lifecycle-{r.value}.mmd" for r in Role} | {f"lifecycle-{name}.mmd" for name in OTHER_LIFECYCLES}
    assert {p.name for p in COMMITTED} == expected


def test_a_drifted_lifecycle_diagram_fails_its_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lifecycle-kv-offload.mmd"
    spec = "kvfsm.lifecycles:KV_OFFLOAD_LIFECYCLE"
    assert main(["diagram", "--lifecycle", spec, "--output", str(path)]) == 0
    assert main(["diagram", "--lifecycle", spec, "--check", str(path)]) == 0
    path.write_text(path.read_text().replace("  Writing --> Stored: stored\n", ""))
    assert main(["diagram", "--lifecycle", spec, "--check", str(path)]) == 1
    assert f"kvfsm diagram --lifecycle {spec} --role sender" in capsys.readouterr().err


def test_check_passes_on_a_fresh_rendering(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lifecycle.mmd"
    assert main(["diagram", "--role", "receiver", "--output", str(path)]) == 0
    assert main(["diagram", "--role", "receiver", "--check", str(path)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_check_fails_on_a_drifted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lifecycle.mmd"
    good = kd.render_text("sender", "mermaid")
    # A diagram committed before someone removed abort from WaitingForInput's edges.
    path.write_text(
        good.replace("WaitingForInput --> Failed: fail | timeout | abort", "WaitingForInput --> Failed: fail")
    )
    assert main(["diagram", "--role", "sender", "--check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "differs from what the machine renders now" in err
    assert "+  WaitingForInput --> Failed: fail | timeout | abort" in err
    assert f"kvfsm diagram --role sender --format mermaid --output {path}" in err


def test_check_fails_when_the_role_or_highlight_differs(tmp_path: Path) -> None:
    path = tmp_path / "lifecycle.mmd"
    path.write_bytes(kd.render("sender"))
    assert main(["diagram", "--role", "receiver", "--check", str(path)]) == 1
    assert main(["diagram", "--role", "sender", "--highlight", "Failed", "--check", str(path)]) == 1


def test_check_fails_on_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check", str(tmp_path / "nope.mmd")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err
    # No role to read from a missing file: both commands are offered, neither assumed.
    assert "--role sender" in err and "--role receiver" in err
    assert main(["diagram", "--role", "receiver", "--check", str(tmp_path / "nope.mmd")]) == 1
    err = capsys.readouterr().err
    assert "--role receiver" in err and "--role sender" not in err


def test_stdout_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--role", "receiver"]) == 0
    assert capsys.readouterr().out == kd.render_text("receiver", "mermaid")


def test_format_follows_the_file_name(tmp_path: Path) -> None:
    assert kd.format_for_path("x/lifecycle.GV") == "dot"
    assert kd.format_for_path("lifecycle.txt") is None
    path = tmp_path / "lifecycle.mmd"
    assert main(["diagram", "--output", str(path)]) == 0
    assert path.read_bytes() == kd.render("sender", "mermaid")


def test_binary_format_to_stdout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--format", "png"]) == 2
    assert "pass --output PATH" in capsys.readouterr().err


@needs_graphviz_py
@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_missing_dot_program_names_the_debian_package(
    fmt: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(formats, "dot_program", lambda: None)
    with pytest.raises(kd.GraphvizMissing, match=r"Debian package 'graphviz' \(apt-get install graphviz\)") as info:
        kd.render("sender", fmt)
    assert isinstance(info.value, RuntimeError)
    assert main(["diagram", "--output", str(tmp_path / f"x.{fmt}")]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
    assert not (tmp_path / f"x.{fmt}").exists()


def test_missing_python_graphviz_names_the_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "graphviz_importable", lambda: False)
    with pytest.raises(kd.GraphvizMissing, match="Python package 'graphviz'"):
        kd.render("sender", "dot")
    # mermaid needs nothing.
    assert kd.render("sender", "mermaid").startswith(b"---")


@needs_dot
def test_svg_is_deterministic_and_names_every_state(tmp_path: Path) -> None:
    svg = kd.render_text("receiver", "svg", highlight="WaitingForInput")
    assert svg == kd.render_text("receiver", "svg", highlight="WaitingForInput")
    assert "<svg" in svg
    for state in KVPoll:
        assert f">{state.name}</text>" in svg
    path = tmp_path / "lifecycle.svg"
    assert main(["diagram", "--role", "receiver", "--highlight", "WaitingForInput", "-o", str(path)]) == 0
    assert main(["diagram", "--role", "receiver", "--highlight", "WaitingForInput", "--check", str(path)]) == 0
    assert main(["diagram", "--role", "receiver", "--check", str(path)]) == 1


@needs_dot
def test_png_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "lifecycle.png"
    assert main(["diagram", "--output", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert main(["diagram", "--check", str(path)]) == 0


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_check_without_role_reads_the_role_from_the_file(
    role: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The old `--check` assumed the sender: on a receiver file it reported a
    # difference and suggested overwriting it with the sender's diagram.
    path = tmp_path / f"lifecycle-{role}.mmd"
    path.write_text(kd.render_text(role, "mermaid"))
    assert kd.role_of(path) is Role(role)
    assert main(["diagram", "--check", str(path)]) == 0
    assert "up to date" in capsys.readouterr().out
    path.write_text(kd.render_text(role, "mermaid").replace("Transferring", "Transfering"))
    assert main(["diagram", "--check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"kvfsm diagram --role {role} --format mermaid --output {path}" in err
    other = "sender" if role == "receiver" else "receiver"
    assert f"--role {other}" not in err


def test_check_without_role_on_a_file_naming_no_role_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mystery.mmd"
    path.write_text("stateDiagram-v2\n  A --> B\n")
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--check", str(path)])
    assert info.value.code == 2
    assert "pass --role" in capsys.readouterr().err


def test_output_in_a_missing_folder_is_refused_before_rendering(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["diagram", "-o", str(tmp_path / "no" / "such" / "x.mmd")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvfsm diagram: error:" in err and "does not exist" in err
    assert "Traceback" not in err


# -- the wire protocol's tables (kvfsm diagram --wire) --------------------------------

WIRE_COMMITTED = sorted((REPO / "docs" / "diagrams").glob("wire-*.mmd"))


def table_edges(table: WireTable) -> set[tuple[str, str, str]]:
    """(origin, target, label line) for every row and source, as `wire_dot` must draw them."""
    states = set(table.states)
    edges = set()
    for row in table.rows:
        target = "__end__" if row.dest is None else row.dest.name
        label = row.input + (" / " + ", ".join(row.sends) if row.sends else "")
        if set(row.sources) >= states:
            edges.add(("__any__", target, label))
            continue
        for source in row.sources:
            edges.add(("__start__" if source is None else source.name, target, label))
    return edges


def wire_dot_edges(text: str) -> set[tuple[str, str, str]]:
    edges = set()
    for origin, target, label in re.findall(r'^\s*(\w+) -> (\w+) \[label="((?:[^"\\]|\\.)*)"', text, flags=re.M):
        for line in label.split("\\n"):
            edges.add((origin, target, line))
    return edges


def mermaid_wire_edges(text: str) -> set[tuple[str, str, str]]:
    edges = set()
    for origin, target, label in re.findall(r"^\s*(\[\*\]|\w+) --> (\[\*\]|\w+): (.+)$", text, flags=re.M):
        edges.add((origin, target, label))
    return edges


@pytest.mark.parametrize("name", list(kd.WIRE_TABLES))
def test_wire_dot_draws_exactly_the_tables_rows(name: str) -> None:
    table = kd.WIRE_TABLES[name]
    text = kd.render_wire(name, "dot").decode()
    assert wire_dot_edges(text) == table_edges(table)
    for state in table.states:
        assert f'{state.name} [label="{state.name}"];' in text
    # Every (origin, target) pair is one edge: rows sharing it are lines of one label.
    pairs = re.findall(r"^\s*(\w+) -> (\w+) \[", text, flags=re.M)
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("name", list(kd.WIRE_TABLES))
def test_wire_mermaid_is_the_wire_modules_own_drawing(name: str) -> None:
    table = kd.WIRE_TABLES[name]
    text = kd.render_wire(name).decode()
    assert text == wire.mermaid(table)
    rows = {
        ("[*]" if source is None else source.name, "[*]" if row.dest is None else row.dest.name, label)
        for row in table.rows
        for source in row.sources
        for label in [row.input + (" / " + ", ".join(row.sends) if row.sends else "")]
    }
    assert mermaid_wire_edges(text) == rows


@pytest.mark.parametrize("name", list(kd.WIRE_TABLES))
def test_every_wire_rendering_carries_its_title(name: str) -> None:
    title = kd.wire_title(name)
    assert title == f"kvfsm wire protocol: {name} records"
    for fmt in ("mermaid", "dot"):
        rendered = kd.render_wire(name, fmt).decode()
        assert title in rendered
        others = [other for other in kd.WIRE_TABLES if other != name]
        assert not any(kd.wire_title(other) in rendered for other in others)
        assert not any(f"kvfsm {role.value} lifecycle" in rendered for role in Role)


def test_the_wire_tables_are_the_modules() -> None:
    assert list(kd.WIRE_TABLES.values()) == list(wire.TABLES)
    assert kd.wire_table("claim") is wire.CLAIM_TABLE
    assert kd.wire_table(wire.ROOM_TABLE) is wire.ROOM_TABLE
    with pytest.raises(ConfigError, match="decode, claim, room; got 'rooms'"):
        kd.render_wire("rooms")
    with pytest.raises(ConfigError, match="mermaid, dot, svg, png; got 'jpeg'"):
        kd.render_wire("room", "jpeg")


def test_the_committed_wire_diagrams_exist() -> None:
    assert {p.name for p in WIRE_COMMITTED} == {f"wire-{name}.mmd" for name in kd.WIRE_TABLES}


@pytest.mark.parametrize("path", WIRE_COMMITTED, ids=lambda p: p.name)
def test_committed_wire_diagrams_match_the_tables(path: Path) -> None:
    name = path.stem.removeprefix("wire-")
    result = kd.check(path, wire=name)
    assert result.up_to_date, result.explain(f"kvfsm diagram --wire {name} --output {path}")
    assert kd.wire_of(path) == name


@pytest.mark.parametrize("path", WIRE_COMMITTED, ids=lambda p: p.name)
def test_a_changed_table_makes_its_committed_diagram_fail_the_check(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The code changes (a row dropped), the committed file does not: CI's check must go red.
    name = path.stem.removeprefix("wire-")
    table = kd.WIRE_TABLES[name]
    dropped = table.rows[1]
    changed = WireTable(table.name, table.states, tuple(r for r in table.rows if r is not dropped), table.doc)
    monkeypatch.setitem(kd.WIRE_TABLES, name, changed)
    result = kd.check(path, wire=name)
    assert not result.up_to_date and not result.missing
    assert f"-    {'[*]' if dropped.sources[0] is None else dropped.sources[0].name} --> " in result.diff
    assert main(["diagram", "--wire", name, "--check", str(path)]) == 1
    assert main(["diagram", "--check", str(path)]) == 1  # the table read from the title, even now
    err = capsys.readouterr().err
    assert "differs from what kvfsm.backends.wire renders now" in err
    assert f"kvfsm diagram --wire {name} --format mermaid --output {path}" in err


@pytest.mark.parametrize("name", list(kd.WIRE_TABLES))
def test_wire_check_without_a_subject_reads_the_table_from_the_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name}.mmd"
    assert main(["diagram", "--wire", name, "-o", str(path)]) == 0
    assert path.read_bytes() == kd.render_wire(name)
    assert kd.wire_of(path) == name and kd.role_of(path) is None
    assert main(["diagram", "--check", str(path)]) == 0
    assert "up to date with kvfsm.backends.wire" in capsys.readouterr().out
    path.write_text(kd.render_wire(name).decode().replace(" --> ", " -> ", 1))
    assert main(["diagram", "--check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"kvfsm diagram --wire {name} --format mermaid --output {path}" in err
    assert "--role" not in err
    # Another table's file is a difference, not a pass.
    other = next(n for n in kd.WIRE_TABLES if n != name)
    assert main(["diagram", "--wire", other, "--check", str(path)]) == 1


def test_wire_check_of_a_missing_file_offers_the_wire_commands_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "wire-decode.mmd"
    assert main(["diagram", "--check", str(missing)]) == 1
    err = capsys.readouterr().err
    for name in kd.WIRE_TABLES:
        assert f"kvfsm diagram --wire {name} --format mermaid --output {missing}" in err
    assert main(["diagram", "--wire", "decode", "--check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "--wire decode" in err and "--wire claim" not in err


def test_wire_takes_no_highlight_and_no_role(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--wire", "room", "--highlight", "Failed"], ["--wire", "room", "--role", "sender"]):
        with pytest.raises(SystemExit) as info:
            main(["diagram", *argv])
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--highlight marks a lifecycle state" in err and "not allowed with argument --wire" in err
    with pytest.raises(ConfigError, match="takes none"):
        kd.check("x.mmd", wire="room", highlight="Failed")


def test_wire_stdout_is_the_mermaid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--wire", "decode"]) == 0
    assert capsys.readouterr().out == wire.mermaid(wire.DECODE_TABLE)
    assert main(["diagram", "--wire", "decode", "--format", "png"]) == 2
    assert "pass --output PATH" in capsys.readouterr().err


def test_wire_svg_without_dot_names_the_debian_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(formats, "dot_program", lambda: None)
    with pytest.raises(kd.GraphvizMissing, match=r"apt-get install graphviz"):
        kd.render_wire("claim", "svg")
    assert main(["diagram", "--wire", "claim", "-o", str(tmp_path / "claim.svg")]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
    # dot is text kvfsm writes itself: it needs neither graphviz package nor program.
    monkeypatch.setattr(formats, "graphviz_importable", lambda: False)
    assert kd.render_wire("claim", "dot").startswith(b'digraph "kvfsm wire protocol: claim records"')


needs_dot_program = pytest.mark.skipif(
    formats.dot_program() is None, reason="graphviz 'dot' (Debian: graphviz) missing"
)


@needs_dot_program
@pytest.mark.parametrize("name", list(kd.WIRE_TABLES))
def test_wire_svg_and_png_are_laid_out_by_dot(name: str, tmp_path: Path) -> None:
    svg = kd.render_wire(name, "svg").decode()
    assert svg == kd.render_wire(name, "svg").decode()
    for state in kd.WIRE_TABLES[name].states:
        assert f">{state.name}</text>" in svg
    png = tmp_path / f"{name}.png"
    assert main(["diagram", "--wire", name, "-o", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # A png has no readable title: the table is found by rendering each one.
    assert kd.wire_of(png) == name
    assert main(["diagram", "--check", str(png)]) == 0


def test_highlight_on_a_file_that_holds_a_wire_table_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Read from the file, the table takes no highlight: refused, not silently ignored.
    path = tmp_path / "claim.mmd"
    path.write_bytes(kd.render_wire("claim"))
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--highlight", "Failed", "--check", str(path)])
    assert info.value.code == 2
    assert "holds the claim wire table" in capsys.readouterr().err
