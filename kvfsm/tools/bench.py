"""`kvfsm bench`: what the lifecycle costs, as ratios to hand-written code.

Every figure is printed next to a baseline measured in the same run, so the
ratios hold on any machine even though the absolute numbers do not. Each
timing is the minimum over several repeats, with the candidates measured
alternately (a noisy neighbour slows both sides, not one) and the garbage
collector off while timing (as `timeit` does). Goals are those of issues 7
and 12; a goal the run misses is printed as missed, and is a finding, not
an error: the exit status is 0 unless `--strict` is given (then 1).

The baselines (written in `_baselines.py`, apart from this harness):

* `sglang` is what kvfsm replaces: a slotted per-request object with
  timestamps that pushes every status into the manager's shared dict
  through SGLang's `update_status` (insert, or `max(old, new)` unless
  `Failed`), pops it on `clear()`, and records a failure message under a
  lock on abort. The lifecycle goals are ratios to this baseline.
* `bare` is the least code that could work at all: the same object
  writing the dict directly, no method in between. Printed for context.
* `transitions` variants: one `transitions.Machine` per request, and one
  shared machine with `add_model`/`remove_model`, both built from kvfsm's
  own declaration, plus `TransferManager(engine="transitions")`.

Sections (`--only` picks some): lifecycle, abort, reads, memory, scale,
threads. `--quick` shrinks sizes and repeats to finish in well under a
minute; the full run includes one million live rooms.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from .._lifecycle import Timeouts
from .._manager import TransferHandle, TransferManager
from .._states import FailureKind, KVPoll, RoomId
from ._baselines import (
    BOOTSTRAPPING,
    SGLangStyleManager,
    SGLangStyleSender,
    bare_lifecycles,
    kvfsm_lifecycles,
    machine_per_request,
    sglang_lifecycles,
    shared_machine,
)
from ._cliargs import CommandError, output_path, positive_int

__all__ = ["configure", "run", "run_benchmarks", "SECTIONS"]

SECTIONS = ("lifecycle", "abort", "reads", "memory", "scale", "threads")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes and fewer repeats: about 5 s (the full run: 20-45 s, 0.8 GB)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a goal is missed (default: report it, exit 0)"
    )
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="also write every figure as JSON to PATH (checked first)"
    )
    parser.add_argument(
        "--rooms",
        metavar="N[,N...]",
        type=_sizes,
        help="live-room counts of the scale section (default: 1k,10k,100k,1M; --quick: up to 100k)",
    )
    parser.add_argument(
        "--only", metavar="SECTION[,...]", type=_sections, help=f"run only these sections ({', '.join(SECTIONS)})"
    )
    parser.add_argument("--repeats", type=positive_int, default=None, help="timing repeats (the minimum is kept)")


def _sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = {"k": 1_000, "m": 1_000_000}.get(part[-1:], 1)
        number = part[:-1] if scale != 1 else part
        try:
            value = int(float(number) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected room counts like 1k,10k,1M; got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"room counts must be positive; got {text!r}")
        sizes.append(value)
    return sizes


def _sections(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return chosen


# -- timing ---------------------------------------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def _race(candidates: dict[str, Callable[[], object]], per_call: int, repeats: int) -> dict[str, float]:
    """Seconds per operation of each candidate: best of `repeats`, measured in turns."""
    best = dict.fromkeys(candidates, math.inf)
    for _ in range(repeats):
        for name, fn in candidates.items():
            best[name] = min(best[name], _timed(fn))
    return {name: seconds / per_call for name, seconds in best.items()}


def _statement(stmt: str, namespace: dict[str, Any], number: int, repeats: int) -> float:
    """Seconds per execution of one statement: `timeit`'s own loop, compiled once."""
    src = f"def _loop(_n):\n    for _ in _n:\n        {stmt}\n"
    scope = dict(namespace)
    exec(compile(src, "<kvfsm bench>", "exec"), scope)
    loop = scope["_loop"]
    # itertools.repeat, as timeit uses: iterating a range would allocate an
    # int per pass and flatter every ratio to a cheap statement.
    return min(_timed(lambda: loop(itertools.repeat(None, number))) for _ in range(repeats)) / number


def _statements(stmts: dict[str, str], namespace: dict[str, Any], number: int, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(stmts, math.inf)
    for _ in range(repeats):
        for name, stmt in stmts.items():
            best[name] = min(best[name], _statement(stmt, namespace, number, 1))
    return best


# -- sections ------------------------------------------------------------------------------


class Report:
    """Collects figures and goals; prints them as it goes."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.data: dict[str, Any] = {}
        self.goals: list[dict[str, Any]] = []

    def section(self, name: str, title: str) -> dict[str, Any]:
        self.out(f"\n== {title}")
        section: dict[str, Any] = self.data.setdefault(name, {})
        return section

    def line(self, label: str, value: str, note: str = "") -> None:
        self.out(f"  {label:<48} {value:>14}  {note}".rstrip())

    def goal(self, name: str, ratio: float, limit: float, *, at_most: bool = True, unit: str = "x") -> None:
        met = ratio <= limit if at_most else ratio >= limit
        sign = "<=" if at_most else ">="
        self.goals.append({"goal": name, "value": ratio, "limit": limit, "at_most": at_most, "met": met})
        verdict = "met" if met else "MISSED"
        self.out(f"  GOAL {name:<43} {ratio:>12.2f}{unit}  ({sign} {limit:g}{unit}: {verdict})")


def _ns(seconds: float) -> str:
    return f"{seconds * 1e9:,.0f} ns"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.2f} us"


def bench_lifecycle(report: Report, quick: bool, repeats: int) -> None:
    data = report.section(
        "lifecycle", "full lifecycle: open, bootstrapped, transfer_started, chunk_done(last), transfer_done, close"
    )
    n = 2_000 if quick else 10_000
    rooms = range(n)
    compiled = TransferManager("sender")
    reference = TransferManager("sender", engine="transitions")
    times = _race(
        {
            "kvfsm": kvfsm_lifecycles(compiled, rooms),
            "sglang": sglang_lifecycles(SGLangStyleManager(), rooms),
            "bare": bare_lifecycles({}, rooms),
        },
        n,
        repeats,
    )
    slow_n = max(50, n // 20)
    slow = _race(
        {
            "kvfsm_transitions_engine": kvfsm_lifecycles(reference, range(slow_n)),
            "machine_per_request": machine_per_request(range(slow_n)),
        },
        slow_n,
        max(2, repeats // 2),
    )
    times.update(slow)
    shared_sizes = [0, 1_000] if quick else [0, 1_000, 10_000]
    for size in shared_sizes:
        count = 20 if size else slow_n
        go, _machine = shared_machine(range(count), size)
        times[f"shared_machine_add_model_{size}_live"] = _race({"x": go}, count, 2)["x"]
    data["seconds_per_lifecycle"] = times
    report.line("kvfsm TransferManager (compiled engine)", _us(times["kvfsm"]))
    report.line("baseline: SGLang-style slotted object + dict", _us(times["sglang"]))
    report.line(
        "baseline: bare slotted object + dict", _us(times["bare"]), f"kvfsm = {times['kvfsm'] / times['bare']:.1f}x"
    )
    report.line("kvfsm TransferManager(engine='transitions')", _us(times["kvfsm_transitions_engine"]))
    report.line("one transitions.Machine per request", _us(times["machine_per_request"]))
    for size in shared_sizes:
        key = f"shared_machine_add_model_{size}_live"
        report.line(f"shared machine + add/remove_model, {size:,} live", _us(times[key]))
    data["ratio_to_sglang"] = times["kvfsm"] / times["sglang"]
    data["machine_per_request_speedup"] = times["machine_per_request"] / times["kvfsm"]
    report.goal("lifecycle vs SGLang-style baseline", data["ratio_to_sglang"], 3.0)
    report.goal("speed-up over a Machine per request", data["machine_per_request_speedup"], 30.0, at_most=False)


def bench_abort(report: Report, quick: bool, repeats: int) -> None:
    data = report.section("abort", "abort from Transferring")
    n = 2_000 if quick else 10_000
    best: dict[str, float] = {"kvfsm": math.inf, "sglang": math.inf}
    for _ in range(repeats):
        manager = TransferManager("sender")
        handles = []
        for room in range(n):
            h = manager.open(room)
            h.bootstrapped()
            h.transfer_started()
            handles.append(h)
        mgr = SGLangStyleManager()
        senders = []
        for room in range(n):
            s = SGLangStyleSender(mgr, room)
            s.bootstrapped()
            s.transfer_started()
            senders.append(s)

        def ours(handles: list[TransferHandle] = handles) -> None:
            for h in handles:
                h.abort("client went away")

        def theirs(senders: list[SGLangStyleSender] = senders) -> None:
            for s in senders:
                s.abort()

        best["kvfsm"] = min(best["kvfsm"], _timed(ours))
        best["sglang"] = min(best["sglang"], _timed(theirs))
        if any(h.state is not KVPoll.Failed for h in handles):  # pragma: no cover - would be a core bug
            raise AssertionError("an aborted room is not Failed")
    per = {name: seconds / n for name, seconds in best.items()}
    data["seconds_per_abort"] = per
    report.line("kvfsm handle.abort(reason)", _ns(per["kvfsm"]))
    report.line("baseline: SGLang-style abort()", _ns(per["sglang"]))
    data["ratio_to_sglang"] = per["kvfsm"] / per["sglang"]
    report.goal("abort vs SGLang-style baseline", data["ratio_to_sglang"], 3.0)


def bench_reads(report: Report, quick: bool, repeats: int | None) -> None:
    data = report.section("reads", "status reads (1,000 live rooms, deadlines armed)")
    manager = TransferManager("sender")
    handles = [manager.open(room) for room in range(1_000)]
    status = {room: BOOTSTRAPPING for room in range(1_000)}
    sglang = SGLangStyleManager()
    sglang.request_status.update(status)
    namespace: dict[str, Any] = {
        "manager": manager,
        "status": status,
        "room": 500,
        "handle": handles[500],
        "clock": time.monotonic,
        "mgr": sglang,
        "noop": _NoOp(),
    }
    # Many short repeats: the denominator is a ~20 ns dict lookup, so one
    # preempted repeat must not decide a ratio.
    number = 20_000
    if repeats is None:
        repeats = 40 if quick else 100
    stmts = {
        "dict_lookup": "status[room]",
        "status": "manager.status(room)",
        "handle_state": "handle.state",
        "handle_poll": "handle.poll()",
        "sglang_check_status": "mgr.check_status(room)",
        "clock_read": "clock()",
        "method_call": "noop.call(room)",
        "loop_alone": "pass",
    }
    per = _statements(stmts, namespace, number, repeats)
    data["seconds_per_read"] = per
    report.line("plain dict lookup  status[room]", _ns(per["dict_lookup"]))
    report.line("manager.status(room)", _ns(per["status"]))
    report.line("handle.state", _ns(per["handle_state"]))
    report.line("handle.poll()", _ns(per["handle_poll"]))
    report.line("SGLang-style kv_mgr.check_status(room)", _ns(per["sglang_check_status"]))
    report.line("the clock alone: time.monotonic()", _ns(per["clock_read"]))
    report.line("a method that only returns its argument", _ns(per["method_call"]))
    report.line("the timing loop alone (in every figure above)", _ns(per["loop_alone"]))
    # status() must call a method, read the clock and look the room up: the
    # sum of those three, each measured alone, is what no status() can beat.
    floor = per["method_call"] + per["clock_read"] + per["dict_lookup"] - 2 * per["loop_alone"]
    data["status_floor_ratio"] = floor / per["dict_lookup"]
    report.line("floor: method call + clock read + lookup", _ns(floor), f"= {floor / per['dict_lookup']:.2f}x")
    data["status_ratio"] = per["status"] / per["dict_lookup"]
    data["state_ratio"] = per["handle_state"] / per["dict_lookup"]
    # One status() call cannot get under its floor (a method call and a
    # clock read cost more than the lookup itself), so it has no goal; a
    # scheduler polling its rooms reads them all at once with poll_many.
    report.line("status(room) / dict lookup (no goal: floor above)", f"{data['status_ratio']:.2f}x")
    report.goal("handle.state vs dict lookup", data["state_ratio"], 2.0)
    # The scheduler's loop: every in-flight room, once per iteration.
    rooms = list(range(1_000))
    batch = _statements(
        {"poll_many": "manager.poll_many(rooms)", "dict_comprehension": "[status[r] for r in rooms]"},
        {**namespace, "rooms": rooms},
        max(1, number // 100),
        repeats,
    )
    per_room = {name: seconds / len(rooms) for name, seconds in batch.items()}
    data["seconds_per_room_polled"] = per_room
    report.line(f"manager.poll_many(rooms), per room ({len(rooms):,} rooms)", _ns(per_room["poll_many"]))
    report.line("baseline: [status[r] for r in rooms], per room", _ns(per_room["dict_comprehension"]))
    data["poll_many_ratio"] = per_room["poll_many"] / per_room["dict_comprehension"]
    report.goal("poll_many per room vs dict lookup", data["poll_many_ratio"], 1.5)


class _NoOp:
    def call(self, room: RoomId) -> RoomId:
        return room


def bench_memory(report: Report, quick: bool, repeats: int) -> None:
    data = report.section("memory", "memory and garbage")
    n = 20_000 if quick else 100_000
    rooms = list(range(1_000_000, 1_000_000 + n))  # ids are the caller's; not counted
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        manager = TransferManager("sender")
        for room in rooms:
            manager.open(room)
        ours = (tracemalloc.get_traced_memory()[0] - before) / n
        del manager
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        mgr = SGLangStyleManager()
        keep = [SGLangStyleSender(mgr, room) for room in rooms]
        theirs = (tracemalloc.get_traced_memory()[0] - before) / n
        del keep, mgr
    finally:
        tracemalloc.stop()
    data["bytes_per_live_room"] = {"kvfsm": ours, "sglang": theirs}
    report.line(f"kvfsm, per live room ({n:,} open)", f"{ours:,.0f} B")
    report.line("baseline: SGLang-style object + dict entry", f"{theirs:,.0f} B")
    report.goal("bytes per live room", ours, 600.0, unit=" B")

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        manager = TransferManager("sender")
        kvfsm_lifecycles(manager, range(10_000))()
        for room in range(5_000):  # the failure paths too: abort and timeouts
            h = manager.open(room)
            h.bootstrapped()
            h.abort("bench")
            manager.close(room)
        garbage = gc.collect()
    finally:
        if enabled:
            gc.enable()
    data["gc_collected_after_lifecycles"] = garbage
    report.line("objects gc collected after 15,000 lifecycles", f"{garbage:,}")
    report.goal("garbage cycles per 15k lifecycles", float(garbage), 0.0, unit="")


def bench_scale(report: Report, quick: bool, repeats: int, sizes: Sequence[int] | None) -> None:
    if sizes is None:
        sizes = [1_000, 10_000, 100_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
    data = report.section(
        "scale", "per-transition cost with N live rooms (bootstrapped, transfer_started, transfer_done)"
    )
    k = 1_000
    # Every size is set up first and measured in turns, round after round, so
    # a busy spell on the machine slows one round of all sizes, not one size.
    setups = []
    for size in sizes:
        manager = TransferManager("sender")
        mgr = SGLangStyleManager()
        for room in range(size):
            manager.open(room)
        background = [SGLangStyleSender(mgr, room) for room in range(size)]
        setups.append((size, manager, mgr, background))
    best_ours = dict.fromkeys(sizes, math.inf)
    best_theirs = dict.fromkeys(sizes, math.inf)
    for rep in range(repeats):
        for size, manager, mgr, _background in setups:
            ids = range(size + rep * k, size + (rep + 1) * k)
            handles = [manager.open(room) for room in ids]
            senders = [SGLangStyleSender(mgr, room) for room in ids]

            def ours(handles: list[TransferHandle] = handles) -> None:
                for h in handles:
                    h.bootstrapped()
                for h in handles:
                    h.transfer_started()
                for h in handles:
                    h.transfer_done()

            def theirs(senders: list[SGLangStyleSender] = senders) -> None:
                for s in senders:
                    s.bootstrapped()
                for s in senders:
                    s.transfer_started()
                for s in senders:
                    s.transfer_done()

            best_ours[size] = min(best_ours[size], _timed(ours))
            best_theirs[size] = min(best_theirs[size], _timed(theirs))
            for room in ids:
                manager.close(room)
            for sender in senders:
                sender.clear()
    per_transition = {str(size): best_ours[size] / (3 * k) for size in sizes}
    per_baseline = {str(size): best_theirs[size] / (3 * k) for size in sizes}
    for size in sizes:
        report.line(
            f"{size:>9,} live rooms", _ns(per_transition[str(size)]), f"baseline {_ns(per_baseline[str(size)])}"
        )
    del setups
    gc.collect()
    flat = max(per_transition.values()) / min(per_transition.values())
    flat_base = max(per_baseline.values()) / min(per_baseline.values())
    data.update(
        seconds_per_transition=per_transition, baseline=per_baseline, flatness=flat, baseline_flatness=flat_base
    )
    report.line("baseline flatness (max/min over the sizes)", f"{flat_base:.2f}x")
    report.goal(f"flatness {min(sizes):,}..{max(sizes):,} live rooms", flat, 1.2)


def bench_threads(report: Report, quick: bool, repeats: int) -> None:
    rooms = 20_000 if quick else 100_000
    threads = 8
    data = report.section("threads", f"{threads} emitter threads + 1 poller over {rooms:,} rooms")
    manager = TransferManager("receiver", timeouts=Timeouts(bootstrap=None, waiting=None))
    handles = [manager.open(room) for room in range(rooms)]
    # Every 10th room is aborted by another emitter while its owner finishes it.
    racing = {room for room in range(0, rooms, 10)}
    done = threading.Event()
    regressions: list[tuple[RoomId, int, int]] = []
    polls = [0]
    sweeps = [0]

    def emitter(index: int) -> None:
        # Thread i drives rooms i, i+8, ... and, right after each, aborts the
        # room thread i+1 is driving at the same moment (for racing rooms).
        mine = handles[index::threads]
        theirs = handles[(index + 1) % threads :: threads]
        for j, h in enumerate(mine):
            h.bootstrapped()
            h.transfer_started()
            for chunk in range(3):
                h.chunk_done(4096, last=chunk == 2)
            h.transfer_done()
            if j < len(theirs) and theirs[j].room in racing:
                theirs[j].abort("raced")

    rank = {KVPoll.Bootstrapping: 1, KVPoll.WaitingForInput: 2, KVPoll.Transferring: 3}

    def poller() -> None:
        # Like a scheduler: one sweep over the rooms per iteration, then a
        # short pause (a poller spinning flat out would only measure how the
        # GIL shares time). A room's status may only move forward, and a
        # terminal one never changes.
        seen: list[KVPoll] = [KVPoll.Bootstrapping] * rooms
        status = manager.status
        while not done.is_set():
            sweeps[0] += 1
            time.sleep(0.001)
            for room in range(0, rooms, 7):
                now = status(room)
                before = seen[room]
                if before is not now and (before not in rank or rank.get(now, 9) < rank[before]):
                    regressions.append((room, int(before), int(now)))
                seen[room] = now
                polls[0] += 1

    workers = [threading.Thread(target=emitter, args=(i,)) for i in range(threads)]
    watcher = threading.Thread(target=poller)
    events = rooms * 6 + len(racing)  # bootstrapped, started, 3 chunks, done; the aborts
    start = time.perf_counter()
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - start
    done.set()
    watcher.join()
    lost = mismatched = 0
    for h in handles:
        status = manager.status(h.room)
        if status not in (KVPoll.Success, KVPoll.Failed):
            lost += 1
        if status is not h.state:
            mismatched += 1
        if h.room not in racing and status is not KVPoll.Success:
            mismatched += 1
        if status is KVPoll.Failed and (h.reason is None or h.reason.kind is not FailureKind.ABORTED):
            mismatched += 1
    counts = manager.counts()
    if sum(counts.values()) != rooms or counts[KVPoll.Success] + counts[KVPoll.Failed] != rooms:
        mismatched += 1
    data.update(
        rooms=rooms,
        threads=threads,
        seconds=elapsed,
        events_per_second=events / elapsed,
        polls=polls[0],
        poller_sweeps=sweeps[0],
        lost=lost,
        mismatched=mismatched,
        regressions=len(regressions),
        aborted_before_success=counts[KVPoll.Failed],
    )
    # The same events from one thread, nobody polling: what the threads cost.
    single = TransferManager("receiver", timeouts=Timeouts(bootstrap=None, waiting=None))
    solo = [single.open(room) for room in range(rooms)]
    start = time.perf_counter()
    for h in solo:
        h.bootstrapped()
        h.transfer_started()
        for chunk in range(3):
            h.chunk_done(4096, last=chunk == 2)
        h.transfer_done()
    for h in solo:
        if h.room in racing:
            h.abort("raced")
    solo_rate = events / (time.perf_counter() - start)
    data["single_thread_events_per_second"] = solo_rate
    report.line("events per second (all emitters together)", f"{events / elapsed:,.0f}")
    report.line("the same events from one thread, no poller", f"{solo_rate:,.0f}")
    report.line("status reads by the poller meanwhile", f"{polls[0]:,} in {sweeps[0]:,} sweeps")
    report.line("raced rooms that ended Failed (abort won)", f"{counts[KVPoll.Failed]:,} of {len(racing):,}")
    report.goal("lost + mismatched statuses", float(lost + mismatched + len(regressions)), 0.0, unit="")


def run_benchmarks(
    *,
    quick: bool = False,
    sections: Sequence[str] = SECTIONS,
    sizes: Sequence[int] | None = None,
    repeats: int | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the chosen sections; return every figure and goal as plain data."""
    report = Report(out)
    reps = repeats if repeats is not None else (7 if quick else 15)
    import platform
    import sys

    import transitions

    out(
        f"kvfsm bench ({'quick' if quick else 'full'}): Python {platform.python_version()} "
        f"({platform.python_implementation()}), transitions {transitions.__version__}, "
        f"best of {reps} repeats"
    )
    report.data["environment"] = {
        "python": sys.version,
        "transitions": transitions.__version__,
        "quick": quick,
        "repeats": reps,
    }
    for name in SECTIONS:
        if name not in sections:
            continue
        if name == "lifecycle":
            bench_lifecycle(report, quick, reps)
        elif name == "abort":
            bench_abort(report, quick, reps)
        elif name == "reads":
            bench_reads(report, quick, repeats)
        elif name == "memory":
            bench_memory(report, quick, reps)
        elif name == "scale":
            bench_scale(report, quick, reps * 2, sizes)
        elif name == "threads":
            bench_threads(report, quick, reps)
    missed = [g["goal"] for g in report.goals if not g["met"]]
    out(
        f"\n{len(report.goals) - len(missed)} of {len(report.goals)} goals met"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    if missed:
        out(
            "A missed goal is a finding about this run, not a failure of the bench "
            "(exit status 0; --strict makes it 1). Timings on a busy machine vary: run it again to confirm."
        )
    report.data["goals"] = report.goals
    return report.data


def run(args: argparse.Namespace) -> int:
    sections = args.only or list(SECTIONS)
    data = run_benchmarks(quick=args.quick, sections=sections, sizes=args.rooms, repeats=args.repeats)
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2, default=str)
        except OSError as exc:  # checked before the run; the disk may still be full
            raise CommandError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
    return 1 if args.strict and not all(goal["met"] for goal in data["goals"]) else 0
