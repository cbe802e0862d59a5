"""The `kvfsm` command line as a newcomer meets it: errors in one line, Ctrl-C, long runs.

Every usage error ends in `kvfsm COMMAND: error: ...` with exit status 2
and no traceback, before any work is done; a missing optional engine names
what to install; Ctrl-C ends a run with one line and exit status 130.
Subprocesses run the console entry point exactly as a shell would.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvfsm
from kvfsm.tools import bench
from kvfsm.tools._native_log import route_line
from kvfsm.tools.cli import main

REPO = Path(kvfsm.__file__).resolve().parents[1]


def _env(*front: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, front), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _kvfsm(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.tools.cli", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=timeout,
    )


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out == ""  # refused before anything ran
    return captured.err


def test_a_bad_number_names_what_was_expected(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, ["simulate", "--requests", "abc"])
    assert "kvfsm simulate: error: argument --requests: expected a positive integer; got 'abc'" in err
    assert "_positive_int" not in err
    err = _usage_error(capsys, ["simulate", "--abort-rate", "often"])
    assert "expected a rate between 0 and 1; got 'often'" in err
    err = _usage_error(capsys, ["simulate", "--transfer-timeout", "0"])
    assert "expected a positive number of seconds; got '0'" in err


@pytest.mark.parametrize("backend", ["local", "fake", "mooncake"])
def test_a_bad_page_size_is_a_usage_error_like_the_others(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    # It used to exit 1 through SystemExit without the `kvfsm simulate: error:` prefix.
    err = _usage_error(capsys, ["simulate", "--backend", backend, "--page-size", "3", "--no-progress"])
    assert "kvfsm simulate: error: --page-size must be a multiple of" in err


def test_an_option_before_the_command_is_named_not_a_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, ["--frobnicate"])
    assert "unrecognized option '--frobnicate'" in err
    assert "the following arguments are required" not in err
    err = _usage_error(capsys, [])
    assert "a command is required: simulate, diagram, bench" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--backend", "fake", "--requests", "5", "--no-progress", "--json"],
        ["bench", "--quick", "--only", "reads", "--json"],
        ["diagram", "-o"],
    ],
)
def test_an_output_path_in_a_missing_folder_is_refused_before_the_run(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to fail with a traceback after the whole run, verification block unprinted.
    target = tmp_path / "no" / "such" / "out.json"
    err = _usage_error(capsys, [*argv, str(target)])
    assert f"the folder {target.parent} does not exist" in err
    err = _usage_error(capsys, [*argv, str(tmp_path)])
    assert "is a folder, not a file to write" in err


@pytest.mark.parametrize(
    ("backend", "module", "install"),
    [
        ("mooncake", "zmq", "pip install 'kvfsm[engines]'"),
        ("mooncake", "mooncake.engine", "libibverbs1"),
        ("nixl", "zmq", "pip install 'kvfsm[engines]'"),
        ("nixl", "nixl._api", "pip install --no-deps nixl==1.5.1"),
    ],
)
def test_a_missing_engine_is_one_line_naming_what_to_install(
    backend: str, module: str, install: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each module the engine needs is hidden in turn, the others shown as present, so the
    # story is the same whichever extras this environment has.
    from kvfsm.tools import simulate_remote

    needed = simulate_remote.ENGINE_MODULES[backend]
    assert module in needed
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == module else (real("json") if name in needed else real(name, *rest)),
    )
    assert main(["simulate", "--backend", backend, "--requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()]
    assert f"kvfsm simulate: error: --backend {backend} needs Python module {module!r}" in err
    assert install in err


def test_an_engine_that_fails_to_import_in_its_process_is_one_line_too(tmp_path: Path) -> None:
    # A package that is there but cannot be imported (the parent only looks
    # for it): the prefill and decode processes report it instead of nested
    # tracebacks ending in "No module named 'zmq'".
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip(
            "Mooncake Transfer Engine is not installed (mooncake-transfer-engine-non-cuda): the parent refuses first"
        )
    shadow = tmp_path / "zmq"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'zmq'\", name='zmq')\n")
    result = _kvfsm("simulate", "--backend", "mooncake", "--requests", "2", "--no-progress", env=_env(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["kvfsm simulate: error: " + lines[0].removeprefix("kvfsm simulate: error: ")]
    assert "needs Python module 'zmq'" in lines[0]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")  # pragma: no cover


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads memory from /proc (Linux)")
def test_a_huge_run_shows_progress_at_once_stays_small_and_ctrl_c_prints_one_line() -> None:
    # Before, `--requests 1000000000000` built a generator per request up
    # front: 3.2 GB in 15 s, nothing printed, and Ctrl-C a traceback.
    process = subprocess.Popen(
        [sys.executable, "-m", "kvfsm.tools.cli", "simulate", "--backend", "fake", "--requests", str(10**12)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        # As at a terminal. A job started in the background by a shell without job control (`cmd &`)
        # inherits SIGINT ignored, and Python keeps it so: Ctrl-C would do nothing (seen in a local CI run).
        preexec_fn=_sigint_as_at_a_terminal,
    )
    try:
        assert process.stderr is not None
        ready, _, _ = select.select([process.stderr], [], [], 60)
        assert ready, "no progress line within 60 s of starting"
        first = process.stderr.readline()
        assert f"0/{10**12}" in first, first
        time.sleep(1.5)  # let requests run (not a timing assertion)
        rss = _rss_mib(process.pid)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert "Traceback" not in err
    summary = [line for line in err.splitlines() if line.startswith("kvfsm simulate:")]
    assert len(summary) == 1, err
    assert f"of {10**12:,} requests" in summary[0] and "interrupted after" in summary[0]
    assert "all checks passed so far" in summary[0]
    assert out == ""  # no summary table for an interrupted run
    assert rss < 300, f"{rss:.0f} MiB after 1.5 s"


def test_simulate_writes_only_progress_to_stderr() -> None:
    # The README's setup (CPU torch, which does not pull numpy) printed
    # "UserWarning: Failed to initialize NumPy" on every run; numpy is now a
    # dependency. Nothing but the progress bar may reach stderr.
    result = _kvfsm("simulate", "--requests", "30", "--pages", "2", "--page-size", "1024")
    assert result.returncode == 0, result.stderr
    noise = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("simulate [")]
    assert noise == []
    assert "all checks passed" in result.stdout


def test_bench_reports_a_missed_goal_and_exits_zero_unless_strict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def one_missed(**_kwargs: object) -> dict[str, object]:
        return {"goals": [{"goal": "g", "value": 2.0, "limit": 1.0, "at_most": True, "met": False}]}

    monkeypatch.setattr(bench, "run_benchmarks", one_missed)
    assert main(["bench", "--quick"]) == 0
    assert main(["bench", "--quick", "--strict"]) == 1


def test_bench_quick_exits_zero_and_says_what_a_missed_goal_means(capsys: pytest.CaptureFixture[str]) -> None:
    # `kvfsm bench --quick` always exited 1 (the retired single status() goal).
    assert main(["bench", "--quick", "--only", "reads", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "GOAL poll_many per room vs dict lookup" in out
    assert "GOAL status(room)" not in out
    if "MISSED" in out:
        assert "not a failure of the bench" in out


def test_native_log_lines_are_parsed_by_level() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("kvfsm.native")
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    passthrough = io.StringIO()
    try:
        route_line("E1201 08:59:18.034448 11000 transfer_metadata.cpp:1098] Local segment descriptor not found\n")
        route_line("E1201 08:59:18.034448 11000 tcp_transport.cpp:12] connect failed: refused\n")
        route_line("I1201 08:59:18.034468 11000 tcp_transport.cpp:391] TcpTransport: listen on port 15067\n")
        route_line("some other library's text\n", passthrough)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.DEBUG, "Local segment descriptor not found (transfer_metadata.cpp:1098)"),
        (logging.ERROR, "connect failed: refused (tcp_transport.cpp:12)"),
        (logging.INFO, "TcpTransport: listen on port 15067 (tcp_transport.cpp:391)"),
    ]
    assert passthrough.getvalue() == "some other library's text\n"


def test_a_mooncake_simulate_prints_no_engine_log_lines_unless_asked() -> None:
    from .remote_peer import engine_missing

    pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)
    # Before: about 20 glog lines on stderr per run, one of them an `E...`.
    quiet = _kvfsm("simulate", "--backend", "mooncake", "--requests", "4", "--pages", "2", "--no-progress")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == ""
    loud = _kvfsm("simulate", "-vv", "--backend", "mooncake", "--requests", "4", "--pages", "2", "--no-progress")
    assert loud.returncode == 0, loud.stderr
    assert "INFO kvfsm.native: " in loud.stderr and "(transfer_engine_impl.cpp:" in loud.stderr
