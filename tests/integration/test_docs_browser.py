"""The built docs, seen in a real browser: the generated diagram renders, nothing errors.

The HTML docs are built once per session with warnings as errors (or reused
from `KVFSM_DOCS_HTML`, e.g. what CI's `sphinx-build` just produced), served
on 127.0.0.1 from a thread, and loaded in headless Debian Chromium driven
over the DevTools protocol on a pipe (`--remote-debugging-pipe`: no
websocket client, no driver binary, no extra package). The browser test
asserts that the lifecycle page holds the inline SVG diagrams, with every
state drawn at a visible size, and that the page logged no console error,
threw no exception and failed no request. A screenshot is kept under the
test's temporary folder.

A probe page that logs an error on purpose proves the error collection
works before the real page is judged.

Skips, with the reason, when sphinx/myst-parser, graphviz's `dot` or
Chromium is missing.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvfsm

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PROBE_PATH = "/__kvfsm_probe__.html"
PROBE_PAGE = b"<!doctype html><title>probe</title><script>console.error('kvfsm probe error')</script>"
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
    "--window-size=1280,1600",
]
# Every wait on the browser or the server is bounded.
STEP_TIMEOUT = 30.0
SERVER_LIFETIME = 300.0


# -- the docs, built once ---------------------------------------------------------------


@pytest.fixture(scope="session")
def html_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built HTML docs: from KVFSM_DOCS_HTML if set, else built now with -W."""
    reuse = os.environ.get("KVFSM_DOCS_HTML")
    if reuse:
        path = Path(reuse)
        if not (path / "lifecycle.html").is_file():
            pytest.fail(f"KVFSM_DOCS_HTML={reuse} holds no built docs (no lifecycle.html)")
        return path
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"building the docs needs {module} (pip install 'kvfsm[docs]')")
    if shutil.which("dot") is None:
        pytest.skip("building the docs needs graphviz's dot (Debian package graphviz)")
    out = tmp_path_factory.mktemp("docs-html")
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if build.returncode != 0:
        pytest.fail(f"sphinx-build -W failed ({build.returncode}):\n{build.stdout}\n{build.stderr}")
    return out


# -- the server -----------------------------------------------------------------------------


class _DocsHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == PROBE_PATH:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(PROBE_PAGE)))
            self.end_headers()
            self.wfile.write(PROBE_PAGE)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        return  # keep the test output clean; failures show in the browser's log


@pytest.fixture(scope="session")
def docs_url(html_dir: Path) -> Iterator[str]:
    """The docs served on 127.0.0.1 (a free port) by a thread that stops by itself."""
    handler = functools.partial(_DocsHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    # A safety net: the server never outlives a hung session by much.
    stopper = threading.Timer(SERVER_LIFETIME, server.shutdown)
    stopper.daemon = True
    stopper.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stopper.cancel()
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- the browser ------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in (os.environ.get("KVFSM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4)."""

    def __init__(self, binary: str, profile: Path, log: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        null = os.open(os.devnull, os.O_RDWR)
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        args = [binary, *BROWSER_FLAGS, f"--user-data-dir={profile}", "about:blank"]
        try:
            self.pid = os.posix_spawn(
                binary,
                args,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, null, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                    (os.POSIX_SPAWN_DUP2, to_browser_r, 3),
                    (os.POSIX_SPAWN_DUP2, from_browser_w, 4),
                ],
                setsid=True,
            )
        finally:
            for fd in (to_browser_r, from_browser_w, null, log_fd):
                os.close(fd)
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._replies[-1] = {"closed": True}
                    self._cond.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._cond:
                        self._replies[message["id"]] = message
                        self._cond.notify_all()
                else:
                    self._events.put(message)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        with self._cond:
            self._next_id += 1
            command_id = self._next_id
        message: dict[str, Any] = {"id": command_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + STEP_TIMEOUT
        with self._cond:
            while command_id not in self._replies:
                if -1 in self._replies:
                    raise RuntimeError(f"the browser closed its pipe while {method} was pending")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply to {method} within {STEP_TIMEOUT}s")
                self._cond.wait(left)
            reply = self._replies.pop(command_id)
        if "error" in reply:
            raise RuntimeError(f"{method} failed: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def events_until(self, method: str, session: str) -> list[dict[str, Any]]:
        """Every event received until `method` arrives for `session` (inclusive)."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} within {STEP_TIMEOUT}s")
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(event)
            if event.get("method") == method and event.get("sessionId") == session:
                return seen

    def drain_events(self) -> list[dict[str, Any]]:
        seen = []
        while True:
            try:
                seen.append(self._events.get_nowait())
            except queue.Empty:
                return seen

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.send("Browser.close")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid, _status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.05)
        else:
            os.killpg(self.pid, signal.SIGKILL)  # its own session: only what it started
            os.waitpid(self.pid, 0)
        os.close(self._to_browser)
        self._reader.join(5)
        os.close(self._from_browser)


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = _chromium()
    if binary is None:
        pytest.skip("no headless browser: install Debian's chromium (or set KVFSM_CHROMIUM)")
    folder = tmp_path_factory.mktemp("chromium")
    instance = Browser(binary, folder / "profile", folder / "chromium.log")
    try:
        yield instance
    finally:
        instance.close()


def _problems(events: list[dict[str, Any]]) -> list[str]:
    """Console errors, uncaught exceptions, failed or 4xx/5xx requests, in words."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            found.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            found.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            found.append(f"log error: {entry.get('text')} ({entry.get('url', '')})")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            found.append(f"request failed: {params.get('errorText')} ({params.get('type')})")
        elif method == "Network.responseReceived" and params.get("response", {}).get("status", 200) >= 400:
            response = params["response"]
            found.append(f"HTTP {response['status']}: {response.get('url')}")
    return found


def _open_page(browser: Browser, url: str) -> tuple[str, list[dict[str, Any]]]:
    """Load `url` in a new tab; return its session and every event up to the load."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Network", "Page"):
        browser.send(f"{domain}.enable", session=session)
    browser.drain_events()
    browser.send("Page.navigate", {"url": url}, session=session)
    events = browser.events_until("Page.loadEventFired", session)
    # Let late console messages and requests of the page arrive.
    browser.send(
        "Runtime.evaluate", {"expression": "new Promise(r => setTimeout(r, 300))", "awaitPromise": True}, session
    )
    events += browser.drain_events()
    return session, [e for e in events if e.get("sessionId") in (session, None)]


_DIAGRAMS_JS = """
JSON.stringify([...document.querySelectorAll('figure.kvfsm-diagram')].map(fig => {
  const svg = fig.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : null;
  return {
    role: fig.dataset.role,
    svg: !!svg,
    width: box ? box.width : 0,
    height: box ? box.height : 0,
    nodes: svg ? svg.querySelectorAll('g.node').length : 0,
    texts: svg ? [...svg.querySelectorAll('text')].map(t => t.textContent) : [],
  };
}))
"""


def test_error_collection_sees_a_console_error(browser: Browser, docs_url: str) -> None:
    """The harness itself: a page that logs an error must be reported."""
    _session, events = _open_page(browser, docs_url + PROBE_PATH)
    assert any("kvfsm probe error" in problem for problem in _problems(events)), events


def test_lifecycle_page_renders_the_diagram_without_errors(browser: Browser, docs_url: str, tmp_path: Path) -> None:
    session, events = _open_page(browser, docs_url + "/lifecycle.html")
    shot = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
    screenshot = tmp_path / "lifecycle.png"
    screenshot.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {screenshot}")

    result = browser.send("Runtime.evaluate", {"expression": _DIAGRAMS_JS, "returnByValue": True}, session)
    figures = json.loads(result["result"]["value"])
    assert [f["role"] for f in figures] == ["sender", "receiver"], figures
    for figure in figures:
        assert figure["svg"], f"no SVG in the {figure['role']} figure"
        assert figure["width"] > 200, f"{figure['role']} diagram is not visible: {figure}"
        assert figure["height"] > 50, f"{figure['role']} diagram is not visible: {figure}"
        for state in kvfsm.KVPoll:
            assert state.name in figure["texts"], f"{state.name} missing from the {figure['role']} diagram"
        assert figure["texts"].count("fail | timeout | abort") == len(kvfsm.NON_TERMINAL)
    assert _problems(events) == [], "the lifecycle page had errors"
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    assert screenshot.stat().st_size > 10_000


def test_built_pages_hold_what_the_code_declares(html_dir: Path) -> None:
    """No browser needed: the generated parts of the docs are there."""
    lifecycle = (html_dir / "lifecycle.html").read_text(encoding="utf-8")
    assert lifecycle.count("<svg") == 2
    for spec in kvfsm.TRANSITIONS:
        assert f'<span class="pre">{spec.event}</span>' in lifecycle, spec.event
    api = (html_dir / "api.html").read_text(encoding="utf-8")
    missing = [name for name in kvfsm.__all__ if f'id="kvfsm.{name}"' not in api]
    assert missing == [], f"names of kvfsm.__all__ missing from the API reference: {missing}"
    cli = (html_dir / "cli.html").read_text(encoding="utf-8")
    from kvfsm.tools.cli import COMMANDS

    for command in COMMANDS:
        assert f"usage: kvfsm {command}" in cli, command
    assert "<svg" in (html_dir / "index.html").read_text(encoding="utf-8")
    # The wire page: one drawing per wire table, every message, row input and state named.
    from kvfsm.backends import wire

    page = (html_dir / "wire.html").read_text(encoding="utf-8")
    for table in wire.TABLES:
        assert f'data-wire="{table.name}"' in page, table.name
        for state in table.states:
            assert f">{state.name}</text>" in page, (table.name, state.name)
        for row in table.rows:
            assert f'<span class="pre">{row.input.split()[-1]}</span>' in page, (table.name, row.input)
    assert page.count("<svg") == len(wire.TABLES)
    for message in wire.MESSAGES:
        assert f'<span class="pre">{message.name}</span>' in page, message.name
    assert 'id="threat-model"' in page
