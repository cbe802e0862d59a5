"""The hand-written baselines `kvfsm bench` measures kvfsm against, and their drivers.

Kept apart from the harness (`bench.py`: timing, sections, goals, the
command line) so that what is measured against is read in one place and
can be reviewed for fairness on its own:

* `SGLangStyleManager` / `SGLangStyleSender` are what kvfsm replaces:
  SGLang's shared status dict with `update_status` (insert, or
  `max(old, new)` unless `Failed`), a slotted request object with
  timestamps, a failure record under a lock.
* `BareSender` is the least code that could track a request at all.
* `machine_per_request` and `shared_machine` run `transitions` itself,
  built from kvfsm's own declaration: one machine per request, and one
  shared machine with `add_model`/`remove_model`.

Each `*_lifecycles` function returns a closure that runs the same happy
lifecycle (open, bootstrapped, transfer_started, one chunk, done, close)
over a range of rooms, so the harness times every candidate identically.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .._lifecycle import Timeouts
from .._machine import build_machine
from .._manager import TransferManager
from .._release import PagesState
from .._states import FailureReason, KVPoll, Role, RoomId
from .._status import StatusTable, retire

__all__ = [
    "BOOTSTRAPPING",
    "SGLangStyleManager",
    "SGLangStyleSender",
    "BareSender",
    "kvfsm_lifecycles",
    "sglang_lifecycles",
    "bare_lifecycles",
    "machine_per_request",
    "shared_machine",
]


_FAILED, _BOOT, _WAIT, _XFER, _OK = 0, 1, 2, 3, 4  # SGLang's KVPoll: plain ints
#: SGLang's integer for a room still bootstrapping (the baselines' status dicts hold ints).
BOOTSTRAPPING = _BOOT


class SGLangStyleManager:
    """SGLang's KV manager status bookkeeping, as it is written there."""

    def __init__(self) -> None:
        self.request_status: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self.failure_lock = threading.Lock()

    def update_status(self, bootstrap_room: int, status: int) -> None:
        if bootstrap_room not in self.request_status:
            self.request_status[bootstrap_room] = status
        elif status == _FAILED:
            self.request_status[bootstrap_room] = _FAILED
        else:
            self.request_status[bootstrap_room] = max(self.request_status[bootstrap_room], status)

    def check_status(self, bootstrap_room: int) -> int:
        return self.request_status[bootstrap_room]

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        with self.failure_lock:
            self.failure_records[bootstrap_room] = failure_reason


class SGLangStyleSender:
    """A slotted request object with timestamps, SGLang style (no state machine)."""

    __slots__ = (
        "bootstrap_room",
        "chunks",
        "conclude_state",
        "entered_at",
        "finished_at",
        "init_time",
        "kv_mgr",
        "last_chunk_at",
        "nbytes",
        "state",
        "transfer_started_at",
    )

    def __init__(self, mgr: SGLangStyleManager, bootstrap_room: int) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.init_time = self.entered_at = time.monotonic()
        self.transfer_started_at: float | None = None
        self.last_chunk_at: float | None = None
        self.finished_at: float | None = None
        self.nbytes = self.chunks = 0
        self.state = _BOOT
        self.conclude_state: int | None = None
        mgr.update_status(bootstrap_room, _BOOT)

    def bootstrapped(self) -> None:
        if self.state == _BOOT:
            self.state = _WAIT
            self.entered_at = time.monotonic()
            self.kv_mgr.update_status(self.bootstrap_room, _WAIT)

    def transfer_started(self) -> None:
        if self.state == _WAIT:
            self.state = _XFER
            self.entered_at = self.transfer_started_at = time.monotonic()
            self.kv_mgr.update_status(self.bootstrap_room, _XFER)

    def chunk_done(self, nbytes: int, last: bool = False) -> None:
        if self.state == _XFER:
            self.nbytes += nbytes
            self.chunks += 1
            if last:
                self.last_chunk_at = time.monotonic()

    def transfer_done(self) -> None:
        if self.state == _XFER:
            self.state = _OK
            self.entered_at = self.finished_at = time.monotonic()
            self.kv_mgr.update_status(self.bootstrap_room, _OK)

    def abort(self) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.conclude_state = self.state = _FAILED
        self.finished_at = time.monotonic()
        self.kv_mgr.update_status(self.bootstrap_room, _FAILED)

    def clear(self) -> None:
        if self.bootstrap_room in self.kv_mgr.request_status:
            self.kv_mgr.request_status.pop(self.bootstrap_room)


class BareSender:
    """The least code that could track a request: direct dict writes."""

    __slots__ = ("entered_at", "finished_at", "nbytes", "room", "state", "status", "transfer_started_at")

    def __init__(self, status: dict[int, int], room: int) -> None:
        self.status = status
        self.room = room
        self.entered_at = time.monotonic()
        self.transfer_started_at: float | None = None
        self.finished_at: float | None = None
        self.nbytes = 0
        self.state = _BOOT
        status[room] = _BOOT

    def bootstrapped(self) -> None:
        if self.state == _BOOT:
            self.state = _WAIT
            self.entered_at = time.monotonic()
            self.status[self.room] = _WAIT

    def transfer_started(self) -> None:
        if self.state == _WAIT:
            self.state = _XFER
            self.entered_at = self.transfer_started_at = time.monotonic()
            self.status[self.room] = _XFER

    def chunk_done(self, nbytes: int, last: bool = False) -> None:
        if self.state == _XFER:
            self.nbytes += nbytes
            if last:
                self.finished_at = time.monotonic()

    def transfer_done(self) -> None:
        if self.state == _XFER:
            self.state = _OK
            self.entered_at = self.finished_at = time.monotonic()
            self.status[self.room] = _OK

    def close(self) -> None:
        del self.status[self.room]


class _TransitionsRecord:
    """A plain record for the `transitions` variants (it attaches methods to it)."""

    def __init__(self, table: StatusTable, room: int) -> None:
        self.room: RoomId = room
        self.state = KVPoll.Bootstrapping
        self.reason: FailureReason | None = None
        self.entered_at = self.opened_at = 0.0
        self.transfer_started_at: float | None = None
        self.finished_at: float | None = None
        self.pages_state = PagesState.HELD
        self.pages_nbytes = self.nbytes = 0
        self._table = table


# -- one lifecycle, per candidate ---------------------------------------------------------


def kvfsm_lifecycles(manager: TransferManager, rooms: range) -> Callable[[], None]:
    def go() -> None:
        open_, close = manager.open, manager.close
        for room in rooms:
            h = open_(room)
            h.bootstrapped()
            h.transfer_started()
            h.chunk_done(65536, True)
            h.transfer_done()
            close(room)

    return go


def sglang_lifecycles(mgr: SGLangStyleManager, rooms: range) -> Callable[[], None]:
    def go() -> None:
        for room in rooms:
            s = SGLangStyleSender(mgr, room)
            s.bootstrapped()
            s.transfer_started()
            s.chunk_done(65536, True)
            s.transfer_done()
            s.kv_mgr.check_status(room)
            s.clear()

    return go


def bare_lifecycles(status: dict[int, int], rooms: range) -> Callable[[], None]:
    def go() -> None:
        for room in rooms:
            s = BareSender(status, room)
            s.bootstrapped()
            s.transfer_started()
            s.chunk_done(65536, True)
            s.transfer_done()
            s.close()

    return go


def machine_per_request(rooms: range) -> Callable[[], None]:
    table = StatusTable(Timeouts())

    def go() -> None:
        for room in rooms:
            record = _TransitionsRecord(table, room)
            machine = build_machine(Role.SENDER)
            machine.add_model(record)
            _transitions_lifecycle(machine, record)

    return go


def _transitions_lifecycle(machine: Any, record: _TransitionsRecord) -> None:
    """One lifecycle of a record already added to a `transitions` machine, then its retirement."""
    clock = time.monotonic
    m: Any = record
    machine.get_state("Bootstrapping").enter(_event_data(machine, record, clock()))
    m.bootstrapped(record, clock(), None)
    m.transfer_started(record, clock(), None)
    m.transfer_done(record, clock(), None)
    retire(record, clock(), None)


def _event_data(machine: Any, record: object, now: float) -> Any:
    from transitions.core import EventData

    state = machine.get_state("Bootstrapping")
    return EventData(state, None, machine, record, args=(record, now, None), kwargs={})


def shared_machine(rooms: range, background: int) -> tuple[Callable[[], None], Any]:
    table = StatusTable(Timeouts(bootstrap=None, waiting=None))
    machine = build_machine(Role.SENDER)
    others = [_TransitionsRecord(table, -1 - i) for i in range(background)]
    if others:
        machine.add_model(others)

    def go() -> None:
        for room in rooms:
            record = _TransitionsRecord(table, room)
            machine.add_model(record)
            _transitions_lifecycle(machine, record)
            machine.remove_model(record)

    return go, machine
