"""The test harness's child processes (`tests/pipe_child.py`): a child that died says why."""

from __future__ import annotations

from multiprocessing.connection import Connection

import pytest

from tests.pipe_child import PipeChild, build_or_exit


def _fail_to_build() -> None:
    raise OSError("port 16805 is taken")


def _child_that_fails_at_start(conn: Connection) -> None:
    build_or_exit(conn, _fail_to_build)


def test_a_call_to_a_child_that_died_at_start_raises_its_traceback_not_broken_pipe() -> None:
    child = PipeChild(_child_that_fails_at_start, (), "demo")
    try:
        child.process.join(60)
        assert child.process.exitcode == 1
        with pytest.raises(RuntimeError, match=r"(?s)demo: cannot post addresses: .*exit code 1.*port 16805 is taken"):
            child._call("addresses", timeout=5)
    finally:
        child.stop()
