"""kvfsm over Mooncake next to SGLang's own Mooncake backend, in one run.

What it measures
----------------
The cross-process KV-transfer lifecycle of two implementations on the same
Mooncake Transfer Engine build (TCP on 127.0.0.1, ``P2PHANDSHAKE``, CPU
tensors):

* **kvfsm**: ``MooncakeBackend(manager, RemoteConfig(...))`` with one
  ``TransferManager`` per role, used through its public API only
  (``register_pools``, ``bootstrap``, ``expect``, ``send``, handles);
* **SGLang 0.5.23**: its ``MooncakeKVManager`` / ``MooncakeKVSender`` /
  ``MooncakeKVReceiver`` with the ``MooncakeKVBootstrapServer`` that its
  prefill starts.

Each implementation runs as a prefill process and a decode process, started
afresh for every case (``_vs_sglang_peer.py``, run by that implementation's
interpreter). Both processes of both implementations run the same
scheduler loop (``SchedulerLoop`` there), written after SGLang's
disaggregation queues: up to N requests in flight; each loop turn polls
every in-flight request (kvfsm with one ``manager.poll_many(rooms)``, the
batch read it has for a scheduler loop; SGLang with a ``poll()`` per sender
or receiver, as its queues do); a request that reaches ``WaitingForInput`` gets its
pages (decode: ``expect`` / ``send_metadata``; prefill: every chunk through
``send``, the aux slot with the last); a terminal request is concluded
(SGLang: ``clear()``, or ``failure_exception()`` and, on the decode, its
deferred release until the prefill acknowledged the abort; kvfsm: the room is
closed once ``release_safe``) and its pages go back to the free list. When a
turn finished nothing the loop naps ``--poll-sleep`` seconds (100 µs).

The pools are the same on both sides: 2 layers of K and V (float32), one
64 KiB page spread over those 4 regions, 64-byte aux (metadata) slots, pages
picked at random from a free list with the same seeds. The prefill fills
every source byte of a request (a fixed random pattern XOR a per-request
key) and its aux slot; once the decode sees ``Success`` it compares **every
byte** of every page and of the aux slot. A request counts as ok only if
both processes saw ``Success`` and every byte arrived. The cost of filling
and checking is measured on the loop's thread and left out of the CPU
figures; torch runs one intra-op thread in every child (otherwise its OpenMP
workers spin on the second core after each check and slow down both
implementations, kvfsm's one-page latency by 1.7x here). ``--no-check``
leaves both out, as the raw rows do: a request is then ok on ``Success`` in
both processes alone, and the report says the bytes were not checked. On a
machine whose cores the engine's own threads need, that is how far the
harness's work moves the ratios to the raw engine (``docs/performance.md``).

Cases (each both implementations, back to back, the order alternating):

* ``lat``: one 64 KiB page per request, one request at a time: the latency
  of a request is from the first of the two processes opening it to the last
  of the two seeing it terminal (``time.perf_counter``, a clock the processes
  share);
* ``4``, ``16``, ``64``: requests of 4 MiB (64 pages, sent in 2 chunks) with
  that many in flight: throughput (bytes of ok requests over the wall time of
  the measured requests) and CPU per request (both processes, all threads,
  over the measured phase);
* ``256``: the same for kvfsm alone (``--sglang-max-inflight``).

Beside the whole request's latency, every request's **critical path** is
reported (p50 and p99): from the prefill calling its last ``send()`` (kvfsm:
``send(last=True)``; SGLang: its sender's last ``send()``, the one that
completes the page count it was given) to the decode's loop seeing
``Success``. That is the TTFT disaggregation adds when the decode's claim
went out while the prefill was computing (issue 23). Each round also runs
the **raw** engine on the same writes (``benchmarks/latency_parts.py`` in a
child process, two engines in one process, bytes not checked): for the
one-page case one page's four 16 KiB writes, timed from the first submit to
the last completion (Mooncake: four ``transfer_submit_write``; NIXL: one
transfer of four descriptors), the baseline of the critical path; for the
in-flight cases (up to ``--raw-max-inflight``, 64) the same requests' writes
(random pages, runs coalesced, one write per run and region) with as many
requests in flight and kvfsm's per-decode budget of writes in flight, the
baseline of throughput. For Mooncake's in-flight cases a second raw row,
``raw Mooncake beside loop``, runs the same writes with the receiving engine
in a process of its own and, in both processes, a thread doing what the
loop above does when nothing concluded (glance at the requests, nap
``--poll-sleep``): the kvfsm and SGLang rows run beside that loop, the bare
row does not, and on a small machine that alone moves the engine's figure
(``docs/performance.md``). ``--no-raw`` skips them. ``--trace`` marks each
step of kvfsm's one-page critical path inside kvfsm's own calls, in both
processes (``benchmarks/_trace.py``), and prints each step's median time
after the last ``send()``. The goals of issue 23 are
printed below issue 12's, each a ratio within a round, with the range over
the rounds.

With ``--nixl`` every case also runs kvfsm over NIXL (``NixlBackend``, UCX
over TCP, the same loop, pools and checks): its own rows and goals (every
request succeeds; 256 against 16 in flight), no ratio to SGLang, whose
backend here is Mooncake.

The first requests of each case (``--warmup``) open connections and warm the
engine and are not measured. Figures are printed side by side with the
ratio kvfsm / SGLang from this same run and the goals of issue 12; a case in
which some requests failed says so in its row (failure reasons are grouped
below the table), and its ratios are not comparable.

Every process it starts is ended, bounded in time: each phase of each case
has a limit, a request still in flight at ``--case-timeout`` is aborted and
counted as failed, a child whose parent went away exits by itself, and the
parent stops (at last kills) its children on exit, error, SIGINT or SIGTERM.

How to run
----------
From the project root, with kvfsm importable (``PYTHONPATH=.``), Mooncake
(``mooncake-transfer-engine-non-cuda``), pyzmq and torch::

    PYTHONPATH=. python benchmarks/vs_sglang.py --sglang-python /path/to/sglang-venv/bin/python
    PYTHONPATH=. python benchmarks/vs_sglang.py                 # kvfsm's figures alone
    PYTHONPATH=. python benchmarks/vs_sglang.py --quick         # lat,4,16 with fewer requests
    PYTHONPATH=. python benchmarks/vs_sglang.py --nixl          # kvfsm over NIXL too
    PYTHONPATH=. python benchmarks/vs_sglang.py --cases lat,16 --json out.json

SGLang needs its own interpreter (it brings its own torch): a venv with
``torch==2.14.1 torchvision==0.29.1 triton``, ``pip install --no-deps
sglang==0.5.23``, its import dependencies and
``mooncake-transfer-engine-non-cuda`` (the recipe is in
docs/performance.md). Its children inherit this process's environment
(``PYTHONPATH`` included) plus the settings below. No engine tuning is
applied to either side (no ``MC_*`` variables are set); both get the same
phase timeouts (``--room-timeout``, ``--drain``) and Mooncake's log level
``GLOG_minloglevel=2``.

Exit status: 0 when every case ran (whatever its figures and goals), 1 if
any request's bytes arrived wrong, 2 if a case could not run (a process
failed to start or crashed; its log's tail is printed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PAGE_BYTES = 64 << 10
REQUEST_PAGES = 64  # 4 MiB at 64 KiB pages
PEER = Path(__file__).resolve().with_name("_vs_sglang_peer.py")  # what each child process runs
PARTS = Path(__file__).resolve().with_name("latency_parts.py")  # the raw engines' writes (the `raw` rows)
SETUP_TIMEOUT = 300.0  # a child's imports and engine start (SGLang takes ~20 s on a busy machine)
EXIT_GRACE = 15.0  # a child's own shutdown before it is terminated
IMPLS = ("kvfsm", "kvfsm-nixl", "sglang", "raw", "raw-loop", "raw-nixl")
IMPL_TITLES = {
    "kvfsm": "kvfsm over Mooncake",
    "kvfsm-nixl": "kvfsm over NIXL",
    "sglang": "SGLang 0.5.23 Mooncake",
    "raw": "raw Mooncake writes",
    "raw-loop": "raw Mooncake beside loop",
    "raw-nixl": "raw NIXL writes",
}
# The raw rows and the latency_parts engine each runs. `raw-loop`: the same writes as `raw`, the
# receiver in a process of its own and a scheduler loop's thread (--poll-sleep) in both, as the
# kvfsm and SGLang rows have; in-flight cases only.
RAW_ENGINES = {"raw": "mooncake", "raw-loop": "mooncake", "raw-nixl": "nixl"}
RAW_TIMEOUT = 300.0  # seconds for one raw measurement (engine start included)
RAW_STREAM_REQUESTS = 256  # at most this many requests in a raw throughput figure
Key = tuple[str, str]  # (implementation, case name)


# ============================================================================
# Cases
# ============================================================================


@dataclass(frozen=True)
class Case:
    """One measured configuration, run by each implementation in its own pair of processes."""

    name: str  # "lat" or the number in flight
    inflight: int
    pages: int  # per request
    chunks: int  # prefill send() calls per request
    requests: int  # measured
    warmup: int  # not measured, before the measured ones

    @property
    def title(self) -> str:
        if self.name == "lat":
            return f"{_size(self.pages * PAGE_BYTES)} request, 1 in flight"
        return f"{_size(self.pages * PAGE_BYTES)} requests, {self.inflight} in flight"


def plan_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for name in args.cases:
        if name == "lat":
            cases.append(Case("lat", 1, 1, 1, args.latency_requests, args.warmup or 10))
        else:
            inflight = int(name)
            requests = args.requests or max(100, 2 * inflight)
            warmup = args.warmup or min(inflight, 16)
            cases.append(Case(name, inflight, args.pages_per_request, args.chunks, requests, warmup))
    return cases


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes:.0f} B"


# ============================================================================
# Parent side: start the children, collect, summarize, print.
# ============================================================================


class CaseError(RuntimeError):
    """A case could not run: a child did not start, crashed or did not report in time."""


class Child:
    """One child process (`_vs_sglang_peer.py`) and the socket to it; `stop()` always ends it."""

    def __init__(self, python: str, settings: dict[str, Any], env: dict[str, str], log_dir: Path) -> None:
        self.name = f"{settings['impl']} {settings['role']}"
        self.log_path = log_dir / f"{settings['impl']}-{settings['role']}.log"
        ours, theirs = socket.socketpair()
        with open(self.log_path, "wb") as log, _spawn_errors(self.name, python):
            self.process = subprocess.Popen(
                [python, "-u", str(PEER), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() ends all of it
            )
        theirs.close()
        self.pid = self.process.pid
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(json.dumps(settings).encode())

    def send(self, message: dict[str, Any]) -> None:
        self.conn.send_bytes(json.dumps(message).encode())

    def receive(self, what: str, deadline: float) -> dict[str, Any]:
        """The child's next message, by `deadline` (time.monotonic())."""
        try:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise CaseError(f"{self.name}: no {what} in time{self._tail()}")
            message: dict[str, Any] = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)  # it exited: say how
            raise CaseError(
                f"{self.name} exited (status {self.process.returncode}) before its {what}{self._tail()}"
            ) from None
        if message["kind"] == "error":
            raise CaseError(f"{self.name} failed:\n{message['text']}{self._tail()}")
        return message

    def _tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n  its log ends:\n    " + "\n    ".join(text) if text else ""

    def ask_exit(self) -> None:
        with contextlib.suppress(OSError):  # it may be gone already
            self.send({"kind": "exit"})

    def stop(self, grace: float = EXIT_GRACE) -> None:
        """Ask it to exit; after `grace` seconds terminate, then kill, its process group."""
        self.ask_exit()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break  # reaped: its group id may now belong to someone else
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait)
        self.conn.close()


@contextlib.contextmanager
def _spawn_errors(name: str, python: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise CaseError(f"{name}: could not start {python}: {exc}") from exc


def child_env(impl: str, settings: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO/WARNING lines, for both sides alike
    if impl.startswith("kvfsm"):
        # The children import the same kvfsm as this process.
        import kvfsm

        root = str(Path(kvfsm.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    else:
        env.update(
            MOONCAKE_PROTOCOL="tcp",
            SGLANG_HOST_IP="127.0.0.1",
            # The same phase limits as kvfsm's Timeouts (SGLang's are whole seconds).
            SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(max(1, round(settings["room_timeout"]))),
            SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(max(1, round(settings["room_timeout"]))),
            SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=str(settings["drain"]),
        )
    return env


LIVE_CHILDREN: list[Child] = []


def run_pair(impl: str, python: str, case: Case, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Run `case` with a prefill and a decode process of `impl`; both are ended before this returns."""
    settings: dict[str, Any] = {
        **asdict(case),
        "impl": impl,
        "page_bytes": PAGE_BYTES,
        "poll_sleep": args.poll_sleep,
        "check_bytes": not args.no_check,
        "remote": dict(args.remote),
        "trace": args.trace and case.name == "lat" and impl in ("kvfsm", "kvfsm-nixl"),
        "room_timeout": args.room_timeout,
        "drain": args.drain,
        "case_timeout": args.case_timeout,
        "parent_pid": os.getpid(),
        "limit_s": SETUP_TIMEOUT + args.case_timeout + args.drain + 2 * EXIT_GRACE + 120.0,
    }
    env = child_env(impl, settings)
    children: dict[str, Child] = {}
    finished = False
    try:
        for role in ("prefill", "decode"):  # they set up in parallel
            child = children[role] = Child(python, {**settings, "role": role}, env, log_dir)
            LIVE_CHILDREN.append(child)
        deadline = time.monotonic() + SETUP_TIMEOUT
        ready = {role: child.receive("ready", deadline) for role, child in children.items()}
        _progress(f"  {impl}: prefill pid {children['prefill'].pid}, decode pid {children['decode'].pid}")
        for child in children.values():
            child.send({"kind": "go", "prefill_address": ready["prefill"]["address"]})
        deadline = time.monotonic() + args.case_timeout + args.drain + 90.0
        reports = {role: child.receive("report", deadline) for role, child in children.items()}
        finished = True
    finally:
        for child in children.values():
            child.ask_exit()  # both at once: they close their endpoints in parallel
        for child in children.values():
            # A child still running its case does not read "exit": do not wait long for it.
            child.stop(EXIT_GRACE if finished else 1.0)
            LIVE_CHILDREN.remove(child)
    row = summarize(case, impl, reports)
    row["versions"] = ready["prefill"]["versions"]
    row["pids"] = [child.pid for child in children.values()]
    return row


def summarize(case: Case, impl: str, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Join the two processes' records of each measured request into the case's figures."""
    prefill = {r["room"]: r for r in reports["prefill"]["rooms"]}
    decode = {r["room"]: r for r in reports["decode"]["rooms"]}
    measured = range(case.warmup, case.warmup + case.requests)
    ok_rooms = [r for r in measured if prefill.get(r, {}).get("ok") and decode.get(r, {}).get("ok")]
    latencies = sorted(
        max(prefill[r]["end"], decode[r]["end"]) - min(prefill[r]["start"], decode[r]["start"]) for r in ok_rooms
    )
    # The critical path: from the prefill's last send() to the decode's loop seeing Success.
    critical = sorted(
        decode[r]["end"] - prefill[r]["last_send"] for r in ok_rooms if prefill[r].get("last_send") is not None
    )
    seen = [side[r] for side in (prefill, decode) for r in measured if r in side]
    starts = [r["start"] for r in seen]
    ends = [r["end"] for r in seen if r["end"] is not None]
    elapsed = max(ends) - min(starts) if starts and ends else 0.0
    failures: collections.Counter[str] = collections.Counter()
    for side, records in (("prefill", prefill), ("decode", decode)):
        for r in measured:
            if r not in records:
                failures[f"{side}: not started before the case deadline"] += 1
            elif not records[r]["ok"]:
                failures[f"{side}: {_normalize(records[r].get('why', '?'))}"] += 1
    own_cpu = {side: reports[side]["cpu_s"] - reports[side]["harness_cpu_s"] for side in ("prefill", "decode")}
    request_bytes = case.pages * PAGE_BYTES
    return {
        "impl": impl,
        "case": case.name,
        "title": case.title,
        "inflight": case.inflight,
        "request_bytes": request_bytes,
        "requests": case.requests,
        "ok": len(ok_rooms),
        "bad": sum(1 for r in decode.values() if r.get("bad")),  # warm-up requests included
        "bytes_checked": len(ok_rooms) * request_bytes if reports["decode"].get("checked", True) else 0,
        "elapsed_s": elapsed,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p90_s": _percentile(latencies, 0.9),
        "latency_p99_s": _percentile(latencies, 0.99),
        "critical_p50_s": statistics.median(critical) if critical else None,
        "critical_p99_s": _percentile(critical, 0.99),
        "gb_s": len(ok_rooms) * request_bytes / elapsed / 1e9 if elapsed else 0.0,
        "requests_s": len(ok_rooms) / elapsed if elapsed else 0.0,
        "cpu_s_per_request": sum(own_cpu.values()) / case.requests,
        "cpu_prefill_s_per_request": own_cpu["prefill"] / case.requests,
        "cpu_decode_s_per_request": own_cpu["decode"] / case.requests,
        "harness_cpu_s_per_request": sum(reports[side]["harness_cpu_s"] for side in reports) / case.requests,
        "failures": dict(failures.most_common()),
        "trace": _trace_offsets(prefill, decode, ok_rooms),
    }


def _trace_offsets(
    prefill: dict[int, dict[str, Any]], decode: dict[int, dict[str, Any]], rooms: list[int]
) -> dict[str, float]:
    """`--trace`: each step's median time after the room's last send() (seconds), over the measured rooms.

    The steps are the marks `benchmarks/_trace.py` took in both processes,
    with the last send() (0) and the decode's loop seeing Success (the
    critical path's end) added; empty when the case was not traced.
    """
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for room in rooms:
        start = prefill[room].get("last_send")
        if start is None or "marks" not in prefill[room]:
            continue
        steps = {**prefill[room]["marks"], **decode[room].get("marks", {})}
        steps["last send() called"] = start
        steps["scheduler loop saw Success"] = decode[room]["end"]
        for step, at in steps.items():
            offsets[step].append(at - start)
    return {step: statistics.median(values) for step, values in offsets.items()}


def _percentile(ordered: list[float], fraction: float) -> float | None:
    """The value at `fraction` of a sorted list (the lower neighbour; None if empty)."""
    return ordered[int(fraction * (len(ordered) - 1))] if ordered else None


def raw_row(impl: str, samples: list[float]) -> dict[str, Any]:
    """A `raw` row: one page's writes on the bare engine (`latency_parts.raw_page_writes`), seconds each.

    Its critical path is the writes' own time, from the first submit to the
    last completion: what the critical path of kvfsm's one-page request is
    measured against. It has no whole-request, throughput or CPU figures.
    """
    ordered = sorted(samples)
    return {
        "impl": impl,
        "case": "lat",
        "title": Case("lat", 1, 1, 1, len(samples), 0).title,
        "inflight": 1,
        "request_bytes": PAGE_BYTES,
        "requests": len(samples),
        "ok": len(samples),
        "bad": 0,
        "bytes_checked": 0,  # the raw writes' bytes are not checked
        "elapsed_s": sum(samples),
        "latency_p50_s": None,
        "latency_p90_s": None,
        "latency_p99_s": None,
        "critical_p50_s": statistics.median(ordered) if ordered else None,
        "critical_p99_s": _percentile(ordered, 0.99),
        "gb_s": None,
        "requests_s": None,
        "cpu_s_per_request": None,
        "failures": {},
        "versions": {},
        "pids": [],
    }


def raw_stream_row(impl: str, case: Case, found: dict[str, float]) -> dict[str, Any]:
    """A `raw` row of an in-flight case: the bare engine's throughput with the same writes in flight."""
    return {
        **raw_row(impl, []),
        "case": case.name,
        "title": case.title,
        "inflight": case.inflight,
        "request_bytes": case.pages * PAGE_BYTES,
        "requests": int(found["requests"]),
        "ok": int(found["requests"]),
        "elapsed_s": found["seconds"],
        "gb_s": found["gb_s"],
        "requests_s": found["requests"] / found["seconds"] if found["seconds"] else None,
    }


def run_raw(impl: str, case: Case, log_dir: Path, beside_loop: float) -> dict[str, Any]:
    """Measure `impl`'s raw writes for `case` in a child process (`latency_parts.py`); its row.

    The one-page case: one page's writes, `case.requests` times (their time
    each). An in-flight case: `case.requests` requests of the same size with
    as many in flight and kvfsm's per-decode budget of writes in flight
    (`latency_parts.raw_stream`; throughput). `raw-loop` runs the same
    stream beside a scheduler loop napping `beside_loop` seconds.
    """
    out = log_dir / f"{impl}.json"
    log = log_dir / f"{impl}.log"
    engine = RAW_ENGINES[impl]
    env = child_env("kvfsm", {})
    command = [sys.executable, str(PARTS), "--only", engine, "--json", str(out)]
    if case.name == "lat":
        command += ["--count", str(case.requests)]
    else:  # one page's writes only a few times: the figure is the stream's
        requests = min(case.requests, RAW_STREAM_REQUESTS)
        command += ["--count", "5", "--stream", str(case.inflight), "--stream-requests", str(requests)]
        command += ["--stream-pages", str(case.pages)]
        if impl == "raw-loop":
            command += ["--stream-beside-loop", repr(beside_loop)]
    try:
        with open(log, "wb") as sink:
            done = subprocess.run(
                command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=RAW_TIMEOUT
            )
    except subprocess.TimeoutExpired:
        raise CaseError(f"{IMPL_TITLES[impl]}: no result after {RAW_TIMEOUT:.0f}s") from None
    tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-10:])
    if done.returncode != 0 or not out.exists():
        raise CaseError(f"{IMPL_TITLES[impl]}: latency_parts exited with {done.returncode}\n    {tail}")
    data = json.loads(out.read_text())
    if engine not in data["samples_s"]:
        raise CaseError(f"{IMPL_TITLES[impl]}: skipped ({data['skipped'].get(engine, '?')})")
    if case.name == "lat":
        return raw_row(impl, data["samples_s"][engine])
    return raw_stream_row(impl, case, data["streams"][f"{engine}/{case.inflight}"])


def _normalize(why: str) -> str:
    """A failure reason without its numbers (rooms, ports, times), so that alike failures group."""
    return re.sub(r"\d+(?:\.\d+)*", "N", why)[:160]


# -- goals and the report ---------------------------------------------------------


@dataclass
class Goal:
    """One of issue 12's goals, judged on this run's figures."""

    text: str
    value: float | None
    limit: float
    higher_is_better: bool
    note: str = ""  # why the figures are not comparable (requests failed), if they are not
    shown: str = ""  # the value as printed, where a ratio is not the natural form
    rounds: list[float] = field(default_factory=list)  # the ratio in each round, when there were several
    issue: int = 12
    met: bool = field(init=False)

    def __post_init__(self) -> None:
        value = self.value
        good = value is not None and (value >= self.limit if self.higher_is_better else value <= self.limit)
        self.met = good and not self.note

    def line(self) -> str:
        if self.shown:
            value, limit = self.shown, "all"
        else:
            value = "-" if self.value is None else f"{self.value:.2f}x"
            if len(self.rounds) > 1:
                value += f" (rounds {min(self.rounds):.2f}-{max(self.rounds):.2f})"
            limit = f"{'>=' if self.higher_is_better else '<='} {self.limit:g}x"
        note = f"; not comparable: {self.note}" if self.note and not self.shown else ""
        return f"  {'met' if self.met else 'MISSED':<7}{self.text}: {value} (goal {limit}{note})"


#: (goal, figure, baseline figure, key, limit, higher is better): issue 12's ratio goals.
RATIO_GOALS = [
    ("one-page latency (median), kvfsm / SGLang", ("kvfsm", "lat"), ("sglang", "lat"), "latency_p50_s", 0.5, False),
    ("throughput at 4 in flight, kvfsm / SGLang", ("kvfsm", "4"), ("sglang", "4"), "gb_s", 1.8, True),
    ("throughput at 16 in flight, kvfsm / SGLang", ("kvfsm", "16"), ("sglang", "16"), "gb_s", 1.5, True),
    (
        "CPU per request at 16 in flight, kvfsm / SGLang",
        ("kvfsm", "16"),
        ("sglang", "16"),
        "cpu_s_per_request",
        0.5,
        False,
    ),
    ("kvfsm: throughput at 256 in flight / at 16", ("kvfsm", "256"), ("kvfsm", "16"), "gb_s", 0.9, True),
    (
        "kvfsm over NIXL: throughput at 256 in flight / at 16",
        ("kvfsm-nixl", "256"),
        ("kvfsm-nixl", "16"),
        "gb_s",
        0.9,
        True,
    ),
]


#: Issue 23's ratio goals, the same form. The critical path runs from the prefill's last
#: send() to the decode's loop seeing Success; the raw rows are the bare engine's writes.
ISSUE23_GOALS = [
    (
        "critical path, one page (p50), kvfsm over Mooncake / raw Mooncake writes",
        ("kvfsm", "lat"),
        ("raw", "lat"),
        "critical_p50_s",
        1.5,
        False,
    ),
    (
        "critical path, one page (p50), kvfsm over NIXL / raw NIXL writes",
        ("kvfsm-nixl", "lat"),
        ("raw-nixl", "lat"),
        "critical_p50_s",
        1.5,
        False,
    ),
    ("whole one-page request (p50), kvfsm / SGLang", ("kvfsm", "lat"), ("sglang", "lat"), "latency_p50_s", 0.5, False),
    *[
        (f"throughput at {n} in flight, kvfsm / SGLang (issue 23)", ("kvfsm", n), ("sglang", n), "gb_s", 2.0, True)
        for n in ("4", "16", "64")
    ],
    *[
        (
            f"CPU per request at {n} in flight, kvfsm / SGLang (issue 23)",
            ("kvfsm", n),
            ("sglang", n),
            "cpu_s_per_request",
            0.5,
            False,
        )
        for n in ("4", "16", "64")
    ],
    *[
        (f"throughput at {n} in flight, {title} / raw {engine} writes", (impl, n), (raw, n), "gb_s", 0.9, True)
        for n in ("4", "16", "64")
        for impl, raw, title, engine in (
            ("kvfsm", "raw", "kvfsm over Mooncake", "Mooncake"),
            ("kvfsm-nixl", "raw-nixl", "kvfsm over NIXL", "NIXL"),
        )
    ],
    ("kvfsm over Mooncake: throughput at 256 in flight / at 16", ("kvfsm", "256"), ("kvfsm", "16"), "gb_s", 0.9, True),
    (
        "kvfsm over NIXL: throughput at 256 in flight / at 16 (issue 23)",
        ("kvfsm-nixl", "256"),
        ("kvfsm-nixl", "16"),
        "gb_s",
        0.9,
        True,
    ),
]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class Results:
    """Every round's figures, and what the report prints from them.

    With one round (the default) those are the round's own figures. With
    `--repeat N`: counts summed over the rounds, every other figure the
    median of the rounds' figures, and each ratio the median of the ratios
    within a round (kvfsm and SGLang of the same round ran back to back, so
    a busy spell on a shared machine moves both).
    """

    def __init__(self) -> None:
        self.rounds: dict[Key, list[dict[str, Any]]] = collections.defaultdict(list)

    def add(self, row: dict[str, Any]) -> None:
        self.rounds[(row["impl"], row["case"])].append(row)

    def __contains__(self, key: Key) -> bool:
        return key in self.rounds

    def impls(self) -> list[str]:
        return [impl for impl in IMPLS if any(i == impl for i, _ in self.rounds)]

    def rows(self) -> list[dict[str, Any]]:
        return [row for rows in self.rounds.values() for row in rows]

    def row(self, key: Key) -> dict[str, Any] | None:
        rows = self.rounds.get(key)
        if not rows:
            return None
        merged = dict(rows[0])
        for name in ("ok", "requests", "bad", "bytes_checked"):
            merged[name] = sum(r[name] for r in rows)
        for name in (
            "latency_p50_s",
            "latency_p90_s",
            "latency_p99_s",
            "critical_p50_s",
            "critical_p99_s",
            "gb_s",
            "requests_s",
            "cpu_s_per_request",
        ):
            values = [r[name] for r in rows if r.get(name) is not None]
            merged[name] = statistics.median(values) if values else None
        failures: collections.Counter[str] = collections.Counter()
        for r in rows:
            failures.update(r["failures"])
        merged["failures"] = dict(failures.most_common())
        traces: dict[str, list[float]] = collections.defaultdict(list)
        for r in rows:
            for step, offset in r.get("trace", {}).items():
                traces[step].append(offset)
        merged["trace"] = {step: statistics.median(offsets) for step, offsets in traces.items()}
        return merged

    def ratio(self, figure: Key, baseline: Key, name: str) -> tuple[float | None, list[float]]:
        """The median over rounds of figure / baseline within a round, and the rounds' ratios."""
        base = {r["round"]: r for r in self.rounds.get(baseline, [])}
        ratios = []
        for row in self.rounds.get(figure, []):
            other = base.get(row["round"])
            value = _ratio(row.get(name), other.get(name)) if other is not None else None
            if value is not None:
                ratios.append(value)
        return (statistics.median(ratios) if ratios else None), ratios

    def shortfall(self, *keys: Key) -> str:
        """Which of these figures rest on failed requests ("" if none)."""
        notes = []
        for key in keys:
            row = self.row(key)
            if row is not None and row["ok"] < row["requests"]:
                notes.append(f"{key[0]} {row['ok']}/{row['requests']} ok")
        return "; ".join(notes)


def evaluate_goals(results: Results) -> list[Goal]:
    """The goals this run measured. A ratio meets its goal only if every request behind both figures succeeded."""
    goals = []
    for impl in ("kvfsm", "kvfsm-nixl"):
        for case in ("16", "64", "256"):
            row = results.row((impl, case))
            if row is not None:
                text = f"{IMPL_TITLES[impl]}: every request succeeds at {case} in flight"
                shown = f"{row['ok']}/{row['requests']}"
                goals.append(Goal(text, row["ok"] / row["requests"], 1.0, True, shown=shown))
    for issue, table in ((12, RATIO_GOALS), (23, ISSUE23_GOALS)):
        for text, figure, baseline, name, limit, higher in table:
            if figure in results and baseline in results:
                value, rounds = results.ratio(figure, baseline, name)
                note = results.shortfall(figure, baseline)
                goals.append(Goal(text, value, limit, higher, note=note, rounds=rounds, issue=issue))
    return goals


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f} us"


def _ratio_cell(results: Results, figure: Key, baseline: Key, name: str) -> str:
    value, rounds = results.ratio(figure, baseline, name)
    cell = "-" if value is None else f"{value:.2f}x"
    if len(rounds) > 1:
        cell += f" ({min(rounds):.2f}-{max(rounds):.2f})"
    return cell


def _raw_throughput_lines(cases: list[Case], results: Results) -> list[str]:
    """Throughput of each engine's kvfsm rows against the raw engine with the same writes in flight."""
    lines = []
    for case in cases:
        if case.name == "lat":
            continue
        cells = []
        for impl, raw, label in (
            ("kvfsm", "raw", IMPL_TITLES["kvfsm"]),
            ("kvfsm", "raw-loop", "the same / raw beside the loop"),
            ("kvfsm-nixl", "raw-nixl", IMPL_TITLES["kvfsm-nixl"]),
        ):
            ours, theirs = (impl, case.name), (raw, case.name)
            if ours in results and theirs in results:
                cells.append(f"{label} {_ratio_cell(results, ours, theirs, 'gb_s')}")
        if cells:
            lines.append(f"  {case.title:<30} " + ";  ".join(cells))
    if not lines:
        return []
    return ["", "throughput against the raw engine with the same writes in flight (higher is better):", *lines]


def _critical_lines(cases: list[Case], results: Results) -> list[str]:
    """The one-page critical path (last send() to the decode seeing Success) against the raw engine and SGLang."""
    if not any(case.name == "lat" for case in cases):
        return []
    pairs = [
        ("kvfsm", "raw", "kvfsm over Mooncake / raw Mooncake writes"),
        ("kvfsm-nixl", "raw-nixl", "kvfsm over NIXL / raw NIXL writes"),
        ("kvfsm", "sglang", "kvfsm over Mooncake / SGLang"),
        ("sglang", "raw", "SGLang / raw Mooncake writes"),
    ]
    lines = []
    for figure, baseline, text in pairs:
        ours, theirs = (figure, "lat"), (baseline, "lat")
        if ours not in results or theirs not in results:
            continue
        cells = [_ratio_cell(results, ours, theirs, name) for name in ("critical_p50_s", "critical_p99_s")]
        short = results.shortfall(ours, theirs)
        lines.append(f"  {text:<44} {cells[0]:>18} {cells[1]:>18}" + (f"  * not comparable: {short}" if short else ""))
    if not lines:
        return []
    head = f"  {'':<44} {'p50':>18} {'p99':>18}"
    return [
        "",
        "critical path of a one-page request (the prefill's last send() to the decode seeing Success):",
        head,
        *lines,
    ]


def _trace_lines(results: Results) -> list[str]:
    """`--trace`: where kvfsm's one-page critical path goes, step by step (medians after the last send())."""
    lines = []
    for impl in ("kvfsm", "kvfsm-nixl"):
        row = results.row((impl, "lat"))
        if row is None or not row.get("trace"):
            continue
        lines += [
            "",
            f"where the critical path goes, {IMPL_TITLES[impl]} (--trace; medians, us after the last send()):",
        ]
        before = 0.0
        for step, offset in sorted(row["trace"].items(), key=lambda item: item[1]):
            lines.append(f"  {step:<40} {offset * 1e6:>8.0f} {f'+{(offset - before) * 1e6:.0f}':>8}")
            before = offset
    return lines


def format_report(cases: list[Case], results: Results, errors: list[str]) -> list[str]:
    impls = results.impls()
    lines = [
        f"{'case':<30} {'implementation':<24} {'ok/requests':>11} {'latency p50':>12} {'p90':>10} "
        f"{'GB/s':>7} {'req/s':>7} {'CPU/request':>12} {'critical p50':>13} {'p99':>10}"
    ]
    for case in cases:
        shown = 0
        for impl in impls:
            row = results.row((impl, case.name))
            head = case.title if shown == 0 else ""
            if row is None:
                if impl in RAW_ENGINES:
                    continue  # a case without a raw row (larger than --raw-max-inflight, or skipped)
                lines.append(f"{head:<30} {IMPL_TITLES[impl]:<24} {'not run':>11}")
                shown += 1
                continue
            shown += 1
            critical = f"{_us(row.get('critical_p50_s')):>13} {_us(row.get('critical_p99_s')):>10}"
            if impl in RAW_ENGINES:
                gb_s = "" if row["gb_s"] is None else f"{row['gb_s']:.3f}"
                lines.append(
                    f"{head:<30} {IMPL_TITLES[impl]:<24} {row['ok']:>5}/{row['requests']:<5} {'':>24}{gb_s:>7} "
                    f"{'':>21}{critical}"
                )
                continue
            flag = "" if row["ok"] == row["requests"] else " *"
            lines.append(
                f"{head:<30} {IMPL_TITLES[impl]:<24} {row['ok']:>5}/{row['requests']:<5} "
                f"{_ms(row['latency_p50_s']):>12} {_ms(row['latency_p90_s']):>10} {row['gb_s']:>7.3f} "
                f"{row['requests_s']:>7.1f} {_ms(row['cpu_s_per_request']):>12} {critical}{flag}"
                + (f"  BAD BYTES in {row['bad']}" if row["bad"] else "")
            )
    lines += _critical_lines(cases, results)
    lines += _trace_lines(results)
    lines += _raw_throughput_lines(cases, results)
    if "kvfsm" in impls and "sglang" in impls:
        lines += ["", "kvfsm / SGLang, same run (latency and CPU: lower is better; throughput: higher):"]
        lines.append(f"{'case':<30} {'latency p50':>18} {'throughput':>18} {'CPU/request':>18}")
        for case in cases:
            ours, theirs = ("kvfsm", case.name), ("sglang", case.name)
            if ours not in results or theirs not in results:
                continue
            cells = [
                _ratio_cell(results, ours, theirs, name) for name in ("latency_p50_s", "gb_s", "cpu_s_per_request")
            ]
            short = results.shortfall(ours, theirs)
            lines.append(
                f"{case.title:<30} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}"
                + (f"  * not comparable: {short}" if short else "")
            )
    failing = [row for row in map(results.row, results.rounds) if row is not None and row["failures"]]
    if failing:
        lines += ["", "* failed requests, by reason (per process; numbers replaced by N):"]
        for row in failing:
            impl = IMPL_TITLES[row["impl"]]
            lines.append(f"  {impl}, {row['title']}: {row['requests'] - row['ok']} of {row['requests']}")
            for why, count in list(row["failures"].items())[:6]:
                lines.append(f"    {count:>5} x {why}")
    if errors:
        lines += ["", "cases that could not run:"] + [f"  {e}" for e in errors]
    return lines


def _remote_option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` of --remote: a RemoteConfig field and its JSON value (a bare word is a string)."""
    from kvfsm.backends.remote import RemoteConfig

    name, sep, value = text.partition("=")
    if not sep or name not in attrs_fields(RemoteConfig):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME a RemoteConfig field; got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def attrs_fields(cls: type) -> set[str]:
    import attrs

    return {field.name for field in attrs.fields(cls)}


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- command line -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="kvfsm over Mooncake next to SGLang 0.5.23's own Mooncake backend (see the module docstring).",
    )
    parser.add_argument("--sglang-python", metavar="PATH", help="SGLang's interpreter; without it only kvfsm runs")
    parser.add_argument(
        "--cases",
        default="lat,4,16,64,256",
        help="comma-separated: 'lat' (one page, one at a time) and numbers of requests in flight (default %(default)s)",
    )
    parser.add_argument(
        "--nixl", action="store_true", help="also run kvfsm over NIXL (same loop and checks; no SGLang counterpart)"
    )
    parser.add_argument("--sglang-max-inflight", type=int, default=64, help="SGLang skips larger cases (default 64)")
    parser.add_argument("--quick", action="store_true", help="a smaller run: lat,4,16 with fewer requests")
    parser.add_argument("--latency-requests", type=int, default=200, help="measured one-page requests (default 200)")
    parser.add_argument(
        "--requests", type=int, help="measured requests per in-flight case (default max(100, 2x in flight))"
    )
    parser.add_argument("--warmup", type=int, help="unmeasured requests first (default 10, or min(in flight, 16))")
    parser.add_argument("--pages-per-request", type=int, default=REQUEST_PAGES, help="64 KiB pages (default 64: 4 MiB)")
    parser.add_argument("--chunks", type=int, default=2, help="prefill send() calls per request (default 2)")
    parser.add_argument(
        "--remote",
        type=_remote_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a RemoteConfig field for kvfsm's endpoints (VALUE as JSON), e.g. completion_markers=false; repeatable",
    )
    parser.add_argument("--poll-sleep", type=float, default=1e-4, help="loop nap when a turn concluded nothing (s)")
    parser.add_argument(
        "--room-timeout", type=float, default=10.0, help="each lifecycle phase's deadline, both sides (s)"
    )
    parser.add_argument(
        "--drain", type=float, default=5.0, help="how long a failed request's pages wait for the peer (s)"
    )
    parser.add_argument(
        "--case-timeout", type=float, default=120.0, help="requests still in flight then are aborted (s)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of every case, interleaved; medians are printed (default 1)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure, the goals and the settings there")
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="neither fill nor check the bytes (a request is ok on Success alone): the raw rows' conditions",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="mark each step of kvfsm's one-page critical path inside its calls and print where the time goes",
    )
    parser.add_argument(
        "--no-raw", action="store_true", help="skip the raw engines' rows (the same writes on the bare engine)"
    )
    parser.add_argument(
        "--raw-max-inflight", type=int, default=64, help="in-flight cases above this get no raw row (default 64)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        if args.cases == parser.get_default("cases"):
            args.cases = "lat,4,16"
        args.latency_requests = min(args.latency_requests, 50)
        args.requests = args.requests or 32
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    for name in names:
        if name != "lat" and not (name.isdigit() and int(name) > 0):
            parser.error(f"--cases: expected 'lat' or a positive number of requests in flight; got {name!r}")
    args.cases = names
    for option in ("latency_requests", "requests", "warmup", "pages_per_request", "chunks", "repeat"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1; got {value}")
    for option, positive in (("room_timeout", True), ("case_timeout", True), ("drain", True), ("poll_sleep", False)):
        value = getattr(args, option)
        if not (value > 0 or (value == 0 and not positive)):  # NaN fails both
            parser.error(
                f"--{option.replace('_', '-')} must be {'positive' if positive else 'at least 0'}; got {value}"
            )
    if args.sglang_python and not os.access(args.sglang_python, os.X_OK):
        parser.error(f"--sglang-python: {args.sglang_python} is not an executable")
    return args


@contextlib.contextmanager
def _signals_end_children() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every `finally` stops its children."""

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for child in list(LIVE_CHILDREN):
            child.stop(1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cases = plan_cases(args)
    pythons = {"kvfsm": sys.executable}
    if args.nixl:
        pythons["kvfsm-nixl"] = sys.executable
    if args.sglang_python:
        pythons["sglang"] = args.sglang_python
    raw_impls = [] if args.no_raw else ["raw", "raw-loop", *(["raw-nixl"] if args.nixl else [])]
    results = Results()
    errors: list[str] = []
    began = time.monotonic()
    with _signals_end_children(), tempfile.TemporaryDirectory(prefix="kvfsm-vs-sglang-") as logs:
        for round_ in range(args.repeat):
            for n, case in enumerate(cases):
                impls = [i for i in pythons if i != "sglang" or case.inflight <= args.sglang_max_inflight]
                where = f"round {round_ + 1}/{args.repeat}, " if args.repeat > 1 else ""
                for impl in impls if (n + round_) % 2 == 0 else impls[::-1]:  # alternate who goes first
                    _progress(
                        f"[{time.monotonic() - began:6.1f}s] {where}{IMPL_TITLES[impl]}: {case.title}, "
                        f"{case.requests} requests"
                    )
                    case_began = time.monotonic()
                    try:
                        row = run_pair(impl, pythons[impl], case, args, Path(logs))
                    except CaseError as exc:
                        errors.append(f"{where}{IMPL_TITLES[impl]}, {case.title}: {exc}")
                        _progress(f"  could not run: {exc}")
                        continue
                    results.add({**row, "round": round_})
                    _progress(
                        f"  {row['ok']}/{row['requests']} ok, {row['gb_s']:.3f} GB/s, latency p50 "
                        f"{_ms(row['latency_p50_s'])}, critical path p50 {_us(row['critical_p50_s'])} "
                        f"({time.monotonic() - case_began:.1f}s with start and stop)"
                    )
                for impl in raw_impls:  # the same writes on the bare engine, in the same round
                    if case.name != "lat" and case.inflight > args.raw_max_inflight:
                        continue
                    if impl == "raw-loop" and case.name == "lat":
                        continue  # a throughput baseline: the one-page writes are timed alone
                    what = "one page's writes" if case.name == "lat" else f"{case.title}, {case.requests} requests"
                    _progress(f"[{time.monotonic() - began:6.1f}s] {where}{IMPL_TITLES[impl]}: {what}")
                    try:
                        row = run_raw(impl, case, Path(logs), beside_loop=args.poll_sleep)
                    except CaseError as exc:
                        errors.append(f"{where}{IMPL_TITLES[impl]}: {exc}")
                        _progress(f"  could not run: {exc}")
                        continue
                    results.add({**row, "round": round_})
                    if case.name == "lat":
                        _progress(f"  p50 {_us(row['critical_p50_s'])}, p99 {_us(row['critical_p99_s'])}")
                    else:
                        _progress(f"  {row['gb_s']:.3f} GB/s")
    goals = evaluate_goals(results)
    versions = {row["impl"]: row["versions"] for row in results.rows()}
    print(
        f"kvfsm vs SGLang, {datetime.datetime.now().isoformat(timespec='minutes')}, {platform.node()}: "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    for impl, found in versions.items():
        if not found:
            continue  # the raw rows: the engine's version is on kvfsm's line
        print(f"  {IMPL_TITLES[impl]}: " + ", ".join(f"{k} {v}" for k, v in sorted(found.items())))
    checked = "bytes NOT checked (--no-check)" if args.no_check else "every byte checked"
    print(f"  TCP on 127.0.0.1, CPU tensors, 64 KiB pages, {checked}; {args.chunks} chunks per request")
    if args.repeat > 1:
        print(f"  {args.repeat} rounds: counts summed, figures and same-round ratios the median (range in brackets)")
    print()
    print("\n".join(format_report(cases, results, errors)))
    if "sglang" not in pythons:
        print("\nSGLang: not run (give its interpreter with --sglang-python PATH); kvfsm's figures alone.")
    for issue in (12, 23):
        print(f"\ngoals (issue {issue}):")
        print("\n".join(goal.line() for goal in goals if goal.issue == issue) or "  none measurable in this run")
    if args.json:
        data = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": vars(args),
            "results": results.rows(),
            "summary": [results.row(key) for key in results.rounds],
            "goals": [asdict(goal) for goal in goals],
            "errors": errors,
        }
        Path(args.json).write_text(json.dumps(data, indent=2))
    if any(row["bad"] for row in results.rows()):
        return 1
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
