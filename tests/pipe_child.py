"""A child process that runs the calls its parent sends over a pipe.

The two-process tests (kvfsm's engines in tests/integration, SGLang's
queues in tests/sglang, vLLM's engines in tests/vllm) each put one endpoint
in a spawned child and drive it step by step. This module is what they
share: the parent's half (`PipeChild`: post a call, wait for its answer
within a limit, kill the child to play a crash, stop it) and the child's
(`serve`: answer calls until told to exit, `exit_child`: end without the
interpreter's exit handlers, which engines' threads and NIXL's bundled
libraries can crash). Every answer is `(ok, value)`; a call that raised in
the child comes back as its traceback, raised in the parent as
`RuntimeError`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class PipeChild:
    """The parent's half: `target(conn, *args)` runs in a spawned child."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], label: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.label = label
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()

    # Underscored: the peers turn every other attribute into a remote call (`peer.send(...)`).

    def _post(self, name: str, args: tuple[Any, ...] = ()) -> None:
        try:
            self._conn.send((name, args))
        except OSError as exc:  # the child is gone: say why, from what it sent last, instead of "broken pipe"
            raise RuntimeError(f"{self.label}: cannot post {name}: {self._why_gone()}") from exc

    def _why_gone(self) -> str:
        """What a child that ended said last (`build_or_exit` sends its traceback first), and its exit code."""
        self.process.join(5)
        said = ""
        with contextlib.suppress(EOFError, OSError):
            if self._conn.poll(0):
                said = f"; it said:\n{self._conn.recv()[1]}"
        return f"the child ended (exit code {self.process.exitcode}){said}"

    def _receive(self, what: str, timeout: float) -> Any:
        """The next answer; `TimeoutError` past `timeout`, `RuntimeError` if the call raised in the child."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.label}: {what} did not answer in {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"{self.label}: {what} failed in the child:\n{value}")
        return value

    def _call(self, name: str, *args: Any, timeout: float) -> Any:
        self._post(name, args)
        return self._receive(f"{name}{args}", timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self, grace: float = 10.0) -> None:
        """Ask the child to exit, wait `grace` seconds, then kill it."""
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("exit", ()))
            self.process.join(grace)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def build_or_exit(conn: Connection, build: Callable[[], Any]) -> Any:
    """`build()` in the child; if it raises, send its traceback and end the child."""
    try:
        return build()
    except BaseException:
        conn.send((False, traceback.format_exc()))
        conn.close()
        os._exit(1)


def answer(conn: Connection, endpoint: Any, name: str, args: tuple[Any, ...]) -> None:
    """Run one call on `endpoint` and send its result, or its traceback."""
    try:
        conn.send((True, getattr(endpoint, name)(*args)))
    except Exception:
        conn.send((False, traceback.format_exc()))


def serve(conn: Connection, endpoint: Any) -> None:
    """Answer calls on `endpoint` until told to exit or the parent goes away."""
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        if name == "exit":
            return
        answer(conn, endpoint, name, args)


def exit_child(close: Callable[[], object]) -> None:
    """Close the endpoint (errors ignored) and end the child without the interpreter's exit handlers."""
    with contextlib.suppress(Exception):
        close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
