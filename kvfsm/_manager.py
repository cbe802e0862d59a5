"""`TransferManager` and `TransferHandle`: rooms opened, driven, closed.

The manager owns one lock, the status table, the deadlines and the
observers of one role. Every event goes through `TransferManager._fire`,
the single choke point (h11's `_process_event`): under the lock it enforces
due deadlines, decides whether the event applies to the room's state (from
the table compiled out of the `transitions` machine), and lets the engine
run the machine's hooks, which alone write the status table. Logging and
observers run after the lock is released.

With the compiled engine (the default) the handles are of a subclass
generated per manager (`_fastpath.py`) whose event methods first try the
common case inline: same lock, same deadline check, the step's hook lines
pasted in. Anything unusual falls through to `_fire`, so `_fire` stays the
one place every rule is decided; the fast path only skips the calls on the
way to the answer `_fire` would give (tests/property proves it against the
`transitions` engine). `open` and `close` have the same shape: a short
common case, then the general one.

Decisions, and the rule of DESIGN.md each one keeps:

* A terminal room absorbs everything; the event is counted in
  `stats.late_events` (rule 2). An out-of-order event on a live room fails
  it with `INVALID_EVENT`, or raises `InvalidTransition` in strict mode and
  changes nothing (rule 3).
* The handle *is* the record of one generation of a room. Closing a room
  marks its handle closed and removes it from the table; a stale handle's
  events are counted and dropped, so they can never reach a reopened room
  of the same id (rule 4). A bounded memory of recently closed rooms keeps
  `UnknownRoom` messages specific without growing forever.
* `abort()` runs the `abort` event under the lock and returns after the
  hooks wrote `Failed` (rule 5).
* A room's pages have a declared release phase of their own (`_release.py`):
  `Success` releases them at once; a failed room's pages are released
  only on proof that no write can land (`writes_drained()`, `fenced()`),
  and quarantined when `Timeouts.drain` passes without one, never freed
  on a timer unless the manager was built with `on_drain_deadline=
  "release"` (rule 6). A closed room whose pages are not released is
  remembered (`_held`) until they are, so a proof that comes after
  `close()` still lands and `holds_pages(room)` still answers.
* Deadlines are checked on every event and status read and, if started, by
  one reaper thread per manager (rule 7).

Everything lifecycle-specific comes from the manager's `Lifecycle`
(`KV_LIFECYCLE` by default): its machine, the handle class with one
method per declared event (`handle_base`, generated from the event specs),
the deadline phases, the `Timeouts` class and the failure state.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from . import _fastpath
from ._errors import (
    ConfigError,
    DuplicateRoom,
    InvalidRoomId,
    InvalidTransition,
    KVTransferError,
    NotQuarantined,
    RoomNotFailed,
    UnknownRoom,
)
from ._lifecycle import KV_LIFECYCLE, PROGRESS_ARGS, EventSpec, Lifecycle, PhaseTimeouts, Timeouts
from ._machine import ENGINES, CompiledEngine, Engine, Step, StepRun, lifecycle_machine
from ._observe import Observer, StateChange
from ._release import DRAIN_POLICIES, PROOFS, RELEASE_TABLE, PagesState
from ._states import (
    MAX_INT_ROOM_ID,
    MAX_ROOM_ID_CHARS,
    MIN_INT_ROOM_ID,
    FailureKind,
    FailureReason,
    KVPoll,
    Role,
    RoomId,
    State,
)
from ._status import ManagerStats, StatusTable, held_nbytes, pages_step

__all__ = ["TransferManager", "TransferHandle", "handle_base"]

logger = logging.getLogger("kvfsm")

DEFAULT_TIMEOUTS = Timeouts()
# Module constants: an enum class-attribute lookup (~60 ns on CPython 3.11)
# is too slow for the paths every request takes.
_RELEASED, _DRAINING, _QUARANTINED = PagesState.RELEASED, PagesState.DRAINING, PagesState.QUARANTINED
#: The release phase's steps an observer may ask for (succeeded/failed are the lifecycle's own steps).
_PAGES_NOTICES: tuple[str, ...] = tuple(i for i in RELEASE_TABLE.inputs() if i not in ("succeeded", "failed"))


_ROOM_ID_EXPECTED = (
    f"an int in [{MIN_INT_ROOM_ID}, {MAX_INT_ROOM_ID}] or a str of 1 to {MAX_ROOM_ID_CHARS} characters "
    "(a bootstrap room id)"
)


def _check_room_id(room: object) -> None:
    """Refuse what no method accepts as a room id; every method checks the same way.

    `True` and `1.0` hash like room 1, so a lookup alone would find room 1:
    the type is checked before any lookup, not only at `open`.
    """
    cls = room.__class__
    if cls is int:
        if MIN_INT_ROOM_ID <= room <= MAX_INT_ROOM_ID:  # type: ignore[operator]
            return
    elif cls is str and 0 < len(room) <= MAX_ROOM_ID_CHARS:  # type: ignore[arg-type]
        return
    raise InvalidRoomId(room, _ROOM_ID_EXPECTED)


class TransferHandle:
    """One room, one generation: the only way events reach that room.

    Event methods return True when the event changed the room, False when
    it was absorbed: late (the room is terminal), stale (this generation was
    closed) or out of order (the room failed with `INVALID_EVENT` instead).
    `state` is a plain attribute, cheap enough to read every scheduler
    iteration; `poll()` also enforces due deadlines first.
    """

    __slots__ = (
        "__weakref__",
        "_manager",
        "_table",
        "chunks",
        "closed",
        "entered_at",
        "finished_at",
        "generation",
        "last_chunk_at",
        "nbytes",
        "opened_at",
        "pages_nbytes",
        "pages_state",
        "reason",
        "room",
        "state",
        "transfer_started_at",
    )

    #: The room's lifecycle state and the release phase of its pages: written by
    #: the machine's hooks only (the engine sets both when the room opens, right
    #: after this constructor). Typed as the KV lifecycle's states; a handle of
    #: another lifecycle holds a member of its `lifecycle.State`, an `IntEnum`
    #: read the same way (by name and value, compared with `is`).
    state: KVPoll
    pages_state: PagesState

    def __init__(self, manager: TransferManager, room: RoomId, generation: int, now: float) -> None:
        self.room = room
        self.generation = generation
        self.reason: FailureReason | None = None
        self.opened_at = now
        self.entered_at = now
        self.transfer_started_at: float | None = None
        self.last_chunk_at: float | None = None
        self.finished_at: float | None = None
        self.nbytes = 0
        self.pages_nbytes = 0
        self.chunks = 0
        self.closed = False
        self._manager = manager
        self._table = manager._table

    # -- events ---------------------------------------------------------------
    # A lifecycle's declared events are methods of its handle class
    # (`handle_base`, generated from the event specs). The type checker sees
    # the KV lifecycle's (tests/unit check these stubs against its specs).
    if TYPE_CHECKING:

        def bootstrapped(self) -> bool: ...
        def transfer_started(self) -> bool: ...
        def chunk_done(self, nbytes: int, last: bool = False) -> bool: ...
        def transfer_done(self) -> bool: ...

    def fail(self, reason: FailureReason) -> bool:
        """A structured failure from the backend or peer: -> Failed."""
        if not isinstance(reason, FailureReason):
            raise TypeError(
                f"fail() of room {self.room!r} needs a kvfsm.FailureReason; got {type(reason).__name__}: {reason!r}"
            )
        return self._manager._fire(self, "fail", reason)

    def abort(self, reason: str = "aborted") -> bool:
        """Give up on the room. Synchronous and idempotent.

        When this returns, the status table says `Failed` and the reason is
        recorded. On a terminal room it changes nothing (counted as late).
        """
        if not isinstance(reason, str):
            raise TypeError(
                f"abort() of room {self.room!r} takes a str reason; got {type(reason).__name__}: {reason!r}"
            )
        return self._manager._fire(self, "abort", FailureReason(FailureKind.ABORTED, reason))

    def writes_drained(self) -> None:
        """Proof from the backend: no write into this room's pages is in flight, none can start.

        Not a lifecycle event: it never changes the state. It releases the
        pages of a failed room (draining or quarantined), also after
        `close()`; on a live or succeeded room it is ignored.
        """
        self._manager._prove(self, "drained", None)

    def fenced(self, why: str) -> None:
        """Proof from the engine: the peer that could write into these pages is fenced.

        Its connection is closed, its process is gone, or its next
        incarnation says the old one holds no writes (`why` says which, for
        the log). Releases the pages of a failed room, as `writes_drained()`.
        """
        if not isinstance(why, str) or not why:
            raise TypeError(f"fenced(why) of room {self.room!r} takes a non-empty str; got {why!r}")
        self._manager._prove(self, "fenced", why)

    def holds(self, nbytes: int) -> None:
        """The backend gave this room `nbytes` of the server's pages (what a quarantine counts)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise TypeError(f"holds(nbytes) of room {self.room!r} takes an int >= 0; got {nbytes!r}")
        self.pages_nbytes = nbytes

    def close(self) -> None:
        """Close this generation of the room (see `TransferManager.close`)."""
        self._manager._close(self)

    # -- reads ------------------------------------------------------------------

    def poll(self) -> KVPoll:
        """The state after enforcing due deadlines (what a scheduler should call)."""
        manager = self._manager
        if manager._clock() >= self._table.deadlines.next_due:
            manager.check_deadlines()
        if self.closed:
            raise manager._unknown(self.room)
        return self.state

    @property
    def is_terminal(self) -> bool:
        return self._table.terminal[self.state]

    @property
    def status(self) -> KVPoll:
        """What the status table says of this room: the `KVPoll` its state reports."""
        return self._table.reports[self.state]

    @property
    def lifecycle(self) -> Lifecycle:
        return self._table.lifecycle

    @property
    def failure(self) -> FailureReason | None:
        """The reason the room failed, or None (also None once closed)."""
        return self.reason

    @property
    def release_safe(self) -> bool:
        """Whether the server may free this room's KV pages now: its pages are released (rule 6)."""
        return self._manager._release_safe(self)

    @property
    def transfer_latency(self) -> float | None:
        """Seconds from the first chunk's start to the last chunk's completion."""
        if self.transfer_started_at is None:
            return None
        end = self.last_chunk_at if self.last_chunk_at is not None else self.finished_at
        if end is None:
            return None
        return end - self.transfer_started_at

    def failure_exception(self) -> NoReturn:
        """Raise `KVTransferError` with this room's recorded reason.

        Raises `RoomNotFailed` if the room has not failed.
        """
        if self.state is not self._table.lifecycle.failure:
            raise RoomNotFailed(self.room, self.state)
        raise KVTransferError(self.room, self.reason)

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        pages = "" if self.pages_state is _RELEASED or not self.is_terminal else f", pages {self.pages_state.value}"
        return f"<TransferHandle room={self.room!r} gen={self.generation} {self.state.name}{closed}{pages}>"


def _check_arg(handle: TransferHandle, event: str, name: str, value: object) -> None:
    """Validate one argument of a declared event's handle method (its `EventArg`)."""
    arg = PROGRESS_ARGS[name]
    if arg.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{event}({name}) of room {handle.room!r} must be an int; got {value!r}")
        if arg.minimum is not None and value < arg.minimum:
            raise ValueError(f"{event}({name}) of room {handle.room!r} must be >= {arg.minimum}; got {value}")


def _event_method_source(spec: EventSpec, lifecycle: Lifecycle) -> list[str]:
    sig = _fastpath.signature(spec)
    names = [a.name for a in spec.args]
    lines = [f"def {spec.name}(self{sig.params}):"]
    lines += [
        f"    check_arg(self, {spec.name!r}, {name!r}, {name})" for name in names if PROGRESS_ARGS[name].kind is int
    ]
    nbytes = "nbytes" if "nbytes" in names else "0"
    last = "bool(last)" if "last" in names else "False"
    extra = f", None, {nbytes}, {last}" if spec.internal else ""
    lines.append(f"    return self._manager._fire(self, {spec.name!r}{extra})")
    return lines


def _event_doc(spec: EventSpec, lifecycle: Lifecycle) -> str:
    sources = " or ".join(spec.sources)
    where = f"{sources} (internal: progress only, the state stays)" if spec.internal else f"{sources} -> {spec.dest}"
    doc = spec.doc[:1].upper() + spec.doc[1:] if spec.doc else f"Event {spec.name!r}"
    return f"{doc}: {where}."


@functools.cache
def handle_base(lifecycle: Lifecycle) -> type[TransferHandle]:
    """The handle class of `lifecycle`: `TransferHandle` with one method per declared event.

    Generated once per lifecycle from its event specs, so a lifecycle's
    events and its handle's methods cannot disagree. The compiled engine's
    fast path subclasses it per manager (`_fastpath.handle_class`).
    """
    namespace: dict[str, Any] = {"check_arg": _check_arg}
    source: list[str] = []
    for spec in lifecycle.event_specs.values():
        source += _event_method_source(spec, lifecycle)
    exec(compile("\n".join(source) + "\n", f"<kvfsm handle of lifecycle {lifecycle.name}>", "exec"), namespace)
    methods: dict[str, Any] = {}
    for name, spec in lifecycle.event_specs.items():
        method = namespace[name]
        method.__doc__ = _event_doc(spec, lifecycle)
        method.__qualname__ = f"TransferHandle.{name}"
        methods[name] = method
    cls = type("TransferHandle", (TransferHandle,), {"__slots__": (), "__module__": __name__, **methods})
    cls.__qualname__ = "TransferHandle"
    return cls


class TransferManager:
    """All rooms of one role (prefill = sender, decode = receiver) in one process.

    `open(room)` returns the room's handle; backends drive it with events,
    the scheduler reads `status(room)` or `handle.state`, frees pages when
    `release_safe(room)` and finally `close(room)`. Thread-safe: events may
    come from any thread while another polls.
    """

    def __init__(
        self,
        role: Role | str,
        *,
        lifecycle: Lifecycle = KV_LIFECYCLE,
        timeouts: PhaseTimeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = False,
        engine: str = "compiled",
        remember_closed: int = 65536,
        on_drain_deadline: str = "quarantine",
    ) -> None:
        self.role = Role.coerce(role)
        if not isinstance(lifecycle, Lifecycle):
            raise TypeError(f"lifecycle must be a kvfsm.Lifecycle; got {type(lifecycle).__name__}: {lifecycle!r}")
        if timeouts is None:
            timeouts = DEFAULT_TIMEOUTS if lifecycle is KV_LIFECYCLE else lifecycle.Timeouts()
        if not isinstance(timeouts, lifecycle.Timeouts):
            expected = "kvfsm.Timeouts" if lifecycle is KV_LIFECYCLE else f"{lifecycle.name!r} lifecycle's Timeouts"
            raise TypeError(
                f"timeouts must be a {expected} (phases {', '.join(lifecycle.phases) or 'none'}, and drain); "
                f"got {type(timeouts).__name__}: {timeouts!r}"
            )
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds; got {clock!r}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool; got {strict!r}")
        if engine not in ENGINES:
            raise ConfigError(f"engine must be one of {sorted(ENGINES)}; got {engine!r}")
        if isinstance(remember_closed, bool) or not isinstance(remember_closed, int) or remember_closed < 0:
            raise ConfigError(f"remember_closed must be an int >= 0; got {remember_closed!r}")
        if on_drain_deadline not in DRAIN_POLICIES:
            raise ConfigError(
                f"on_drain_deadline must be one of {', '.join(map(repr, DRAIN_POLICIES))}; got {on_drain_deadline!r}"
            )
        # Instance attributes are kept under CPython's 30 shared keys: past that, every
        # attribute read of the manager (status() reads three) falls off its fast path
        # (measured: status() 122 -> 148 ns). Derived values are properties instead.
        self.timeouts = timeouts
        self.strict = strict
        #: What the drain deadline does to pages still waiting for proof ("quarantine", the default, or "release").
        self.on_drain_deadline = on_drain_deadline
        self._clock = clock
        self._lock = threading.Lock()
        self._table = StatusTable(timeouts, lifecycle)
        # Read on every status call: bound here to skip a lookup each time.
        self._status = self._table.status
        self._deadlines = self._table.deadlines
        self._stats = self._table.stats
        self._terminal = self._table.terminal
        self._engine: Engine = ENGINES[engine](lifecycle_machine(self.role, lifecycle), self._table)
        self._rows = self._engine.rows
        self._enter_initial: StepRun = self._engine._enter_initial
        self._retire: StepRun = self._engine.retire
        self._rooms: dict[RoomId, TransferHandle] = {}
        # Two generations of tombstones: the newest `remember_closed` closes
        # at least, twice that at most, for O(1) per close without an LRU.
        # room -> (generation, final state, when it ended): see `last_closed`.
        self._closed: dict[RoomId, tuple[int, State, float | None]] = {}
        self._closed_older: dict[RoomId, tuple[int, State, float | None]] = {}
        self._remember_closed = remember_closed
        # Closed rooms whose pages are not released yet (draining or quarantined), by room id.
        self._held: dict[RoomId, list[TransferHandle]] = {}
        self._generation = 0
        # Observers and the events each wants (None: every one), and per event whether
        # anyone does: a step nobody observes builds no notice and keeps its fast path.
        # `_watching` is updated in place, never replaced: the generated fast path holds it.
        self._observers: tuple[tuple[Observer, frozenset[str] | None], ...] = ()
        self._watching: dict[str, bool] = {}
        self._watch()
        self._outbox: deque[StateChange] = deque()
        self._dispatching = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._reaper_stop: threading.Event | None = None
        self._handle_cls: type[TransferHandle] = handle_base(lifecycle)
        if isinstance(self._engine, CompiledEngine):
            self._handle_cls = _fastpath.handle_class(self._handle_cls, self, self._engine)

    # -- public reads -----------------------------------------------------------

    @property
    def stats(self) -> ManagerStats:
        """Counters since creation (late, invalid, timeouts, final states, ...)."""
        return self._table.stats

    @property
    def engine(self) -> str:
        return self._engine.name

    @property
    def lifecycle(self) -> Lifecycle:
        """The declared lifecycle of this manager's rooms (`KV_LIFECYCLE` by default)."""
        return self._table.lifecycle

    @property
    def notice_events(self) -> frozenset[str]:
        """What an observer may ask for: every lifecycle event, a room's open and close, the release phase's steps."""
        return frozenset({*self._table.lifecycle.events, "open", "close", *_PAGES_NOTICES})

    @property
    def _drain_input(self) -> str:
        return DRAIN_POLICIES[self.on_drain_deadline]

    def status(self, room: RoomId) -> KVPoll:
        """The room's state after enforcing due deadlines; `UnknownRoom` if not open."""
        if room.__class__ is not int and room.__class__ is not str:
            _check_room_id(room)
        if self._clock() >= self._deadlines.next_due:
            self.check_deadlines()
        try:
            return self._status[room]
        except KeyError:
            raise self._unknown(room) from None

    def poll_many(self, rooms: Iterable[RoomId]) -> list[KVPoll]:
        """The states of `rooms`, in order: `status()` for many rooms, one clock read.

        What a scheduler calls once per iteration for its in-flight rooms.
        Due deadlines are enforced first, exactly as `status()` does (one
        clock read for the whole batch); `UnknownRoom` if any room is not open.
        """
        if self._clock() >= self._deadlines.next_due:
            self.check_deadlines()
        status = self._status
        try:
            return [status[room] for room in rooms]
        except KeyError as exc:
            raise self._unknown(exc.args[0]) from None

    def get(self, room: RoomId) -> TransferHandle:
        """The handle of the open room; `UnknownRoom` if not open."""
        if room.__class__ is not int and room.__class__ is not str:
            _check_room_id(room)
        try:
            return self._rooms[room]
        except KeyError:
            raise self._unknown(room) from None

    def failure(self, room: RoomId) -> FailureReason | None:
        """The recorded reason of a `Failed` room, else None."""
        return self.get(room).reason

    def release_safe(self, room: RoomId) -> bool:
        """Whether the server may free the room's KV pages now (rule 6)."""
        return self._release_safe(self.get(room))

    def counts(self) -> dict[KVPoll, int]:
        """Open rooms per reported `KVPoll` (every value listed, zeros included).

        For the KV lifecycle, rooms per state; a lifecycle with more states
        counts each under the value it reports (see `state_counts`).
        """
        live = self._table.live
        reports = self._table.reports
        out = {state: 0 for state in KVPoll}
        for value, n in enumerate(live):
            out[reports[value]] += n
        return out

    def state_counts(self) -> dict[State, int]:
        """Open rooms per lifecycle state (every state listed, zeros included)."""
        live = self._table.live
        return {state: live[state] for state in self.lifecycle.State}

    def holds_pages(self, room: RoomId) -> bool:
        """Whether pages of any generation of `room`, open or closed, are not release-safe yet.

        A closed room whose pages are draining or quarantined still holds
        them: a server that asks after `close()` (SGLang's deferred release
        after `clear()`) gets the release gate's answer, not "unknown".
        """
        _check_room_id(room)
        if self._clock() >= self._deadlines.next_due:
            self.check_deadlines()  # a drain deadline due quarantines (or, opted in, releases) first
        if room in self._held:
            return True
        handle = self._rooms.get(room)
        return handle is not None and not self._release_safe(handle)

    def quarantined(self) -> list[TransferHandle]:
        """The rooms (open or closed) whose pages are quarantined now, oldest failure first."""
        if self._clock() >= self._deadlines.next_due:
            self.check_deadlines()
        with self._lock:
            found = [h for h in self._rooms.values() if h.pages_state is _QUARANTINED]
            found += [h for held in self._held.values() for h in held if h.pages_state is _QUARANTINED]
        return sorted(found, key=lambda h: (h.finished_at or 0.0, h.generation))

    def release_quarantined(self, room: RoomId, why: str) -> int:
        """Release the quarantined pages of `room` (every generation of it): an operator's explicit override.

        For pages an operator knows are safe (the peer's host was rebooted,
        say) although no proof reached kvfsm. Counted in
        `stats.quarantine_overrides` and logged with `why`. Returns how many
        generations were released; `NotQuarantined` if none was quarantined.
        """
        _check_room_id(room)
        if not isinstance(why, str) or not why:
            raise TypeError(f"release_quarantined({room!r}, why) needs a non-empty str saying why; got {why!r}")
        released: list[TransferHandle] = []
        notices = self._outbox
        if self._clock() >= self._deadlines.next_due:
            self.check_deadlines()
        with self._lock:
            candidates = [*self._held.get(room, ())]
            live = self._rooms.get(room)
            if live is not None:
                candidates.append(live)
            for handle in candidates:
                if handle.pages_state is _QUARANTINED:
                    self._pages(handle, "override", self._clock(), notices)
                    released.append(handle)
            self._stats.quarantine_overrides += len(released)
            pages = ", ".join(sorted({h.pages_state.value for h in candidates})) or "not open or held"
        if notices:
            self._dispatch()
        if not released:
            raise NotQuarantined(room, pages)
        for handle in released:
            logger.warning(
                "kvfsm %s room %r gen %d: quarantined pages (%d bytes) released by an operator: %s",
                self.role.value,
                room,
                handle.generation,
                held_nbytes(handle),
                why,
            )
        return len(released)

    def last_closed(self, room: RoomId) -> tuple[int, State, float | None] | None:
        """The newest closed generation of `room` still remembered: (generation, final state, when it ended).

        A cross-process backend reads it to learn of a generation that was
        opened and closed without ever reaching it (no `bootstrap()`).
        """
        return self._closed.get(room) or self._closed_older.get(room)

    def allowed_events(self, state: State) -> tuple[str, ...]:
        """Events the lifecycle accepts in `state`, in declaration order."""
        return tuple(name for name, row in self._rows.items() if row[state] is not None)

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room: object) -> bool:
        # `True in manager` must not find room 1 (see _check_room_id).
        return (room.__class__ is int or room.__class__ is str) and room in self._rooms

    def __iter__(self) -> Iterator[TransferHandle]:
        """A snapshot of the open rooms' handles."""
        with self._lock:
            return iter(list(self._rooms.values()))

    def __repr__(self) -> str:
        kind = "" if self.lifecycle is KV_LIFECYCLE else f" lifecycle={self.lifecycle.name}"
        return f"<TransferManager {self.role.value}{kind} open={len(self._rooms)} engine={self._engine.name}>"

    # -- rooms ------------------------------------------------------------------

    def open(self, room: RoomId) -> TransferHandle:
        """Open `room` in the initial state and return its handle (`DuplicateRoom` if open)."""
        _check_room_id(room)
        lock = self._lock
        lock.acquire()
        try:
            now = self._clock()
            if now < self._deadlines.next_due and not self._watching["open"] and room not in self._rooms:
                return self._new_handle(room, now)
        finally:
            lock.release()
        return self._open(room)

    def _new_handle(self, room: RoomId, now: float) -> TransferHandle:
        """A new generation of `room`, in the initial state (lock held; `room` is not open)."""
        self._generation += 1
        handle = self._handle_cls(self, room, self._generation, now)
        self._rooms[room] = handle
        self._enter_initial(handle, now, None)
        self._stats.opened += 1
        return handle

    def _open(self, room: RoomId) -> TransferHandle:
        """`open` with due deadlines, observers or a duplicate to deal with."""
        # Notices go straight into the outbox under the lock, so the outbox holds
        # every room's steps in the order they happened (rule 16).
        notices = self._outbox
        expired: list[tuple[TransferHandle, str]] = []
        try:
            with self._lock:
                now = self._clock()
                if now >= self._deadlines.next_due:
                    self._expire(now, expired, notices)
                existing = self._rooms.get(room)
                if existing is not None:
                    raise DuplicateRoom(room, existing.state, existing.generation)
                handle = self._new_handle(room, now)
                if self._watching["open"]:
                    notices.append(StateChange(self.role, room, handle.generation, "open", None, handle.state, now))
        finally:
            if expired or notices:
                self._after(expired, notices)
        return handle

    def close(self, room: RoomId) -> None:
        """Close the open room: forget its status and reason, keep a tombstone.

        A room still in flight is aborted first, so nothing that waits on it
        hangs. Free its pages before closing, once `release_safe(room)`; a
        room closed before that keeps its pages' release phase (see
        `holds_pages`).
        """
        if room.__class__ is not int and room.__class__ is not str:
            _check_room_id(room)
        handle = self._rooms.get(room)
        if handle is None:
            raise self._unknown(room)
        if self._terminal[handle.state] and not self._watching["close"]:
            # The common case, without a notice to build: see `_close`.
            lock = self._lock
            lock.acquire()
            try:
                if not handle.closed:
                    self._tombstone(handle)
                    return
            finally:
                lock.release()
        self._close(handle)

    def _tombstone(self, handle: TransferHandle) -> None:
        """Retire a terminal room and remember it closed (lock held; the handle is open)."""
        room = handle.room
        handle.closed = True
        del self._rooms[room]
        self._retire(handle, 0.0, None)
        if handle.pages_state is not _RELEASED:
            self._held.setdefault(room, []).append(handle)
        if self._remember_closed:
            closed = self._closed
            closed[room] = (handle.generation, handle.state, handle.finished_at)
            if len(closed) >= self._remember_closed:
                self._closed_older, self._closed = closed, {}

    def check_deadlines(self) -> list[RoomId]:
        """Fail every room whose phase deadline passed; return their ids."""
        # Notices go straight into the outbox under the lock, so the outbox holds
        # every room's steps in the order they happened (rule 16).
        notices = self._outbox
        expired: list[tuple[TransferHandle, str]] = []
        with self._lock:
            self._expire(self._clock(), expired, notices)
        if expired or notices:
            self._after(expired, notices)
        return [handle.room for handle, what in expired if what == "timeout"]

    # -- observers and the reaper ---------------------------------------------------

    def subscribe(self, observer: Observer, events: Iterable[str] | None = None) -> Callable[[], None]:
        """Call `observer(StateChange)` after every step (or only `events`); returns an unsubscribe function.

        Observers run after the manager's lock is released, in the order the
        steps happened (possibly on another emitting thread). An exception in
        an observer is logged and does not reach the emitter. `events` names
        table events and "open" / "close"; a step no observer wants costs
        nothing (a backend that only stops failed rooms watches
        "fail", "timeout", "abort" and "close", and the common steps keep
        their fast path). The release phase's steps ("drained", "fenced",
        "drain_deadline", "drain_deadline_release", "override") are notices
        too: their `pages` field says where the pages went, and the room's
        state does not change (`source is dest`).
        """
        if not callable(observer):
            raise TypeError(f"observer must be callable; got {observer!r}")
        wanted: frozenset[str] | None = None
        if events is not None:
            wanted = frozenset(events)
            unknown = sorted(wanted - self.notice_events)
            if unknown:
                raise ConfigError(
                    f"subscribe(events=...) takes {', '.join(sorted(self.notice_events))}; got {', '.join(unknown)}"
                )
        entry = (observer, wanted)
        with self._lock:
            self._observers = (*self._observers, entry)
            self._watch()

        def unsubscribe() -> None:
            with self._lock:
                self._observers = tuple(o for o in self._observers if o is not entry)
                self._watch()

        return unsubscribe

    def _watch(self) -> None:
        """Recompute which events anyone observes (lock held, or in the constructor)."""
        for event in self.notice_events:
            self._watching[event] = any(events is None or event in events for _observer, events in self._observers)

    def start_reaper(self, interval: float | None = None) -> None:
        """Start one daemon thread that calls `check_deadlines()` every `interval` s.

        The default interval is a tenth of the shortest configured phase
        timeout (the drain deadline included), between 10 ms and 1 s.
        Starting a running reaper does nothing.
        """
        if interval is None:
            limits = [t for t in (*self.timeouts.phase_limits().values(), self.timeouts.drain) if t]
            interval = min(1.0, max(0.01, min(limits) / 10)) if limits else 1.0
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not (interval > 0 and math.isfinite(interval))
        ):
            raise ConfigError(f"reaper interval must be a positive number of seconds; got {interval!r}")
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=self._reap, args=(stop, float(interval)), name=f"kvfsm-reaper-{self.role.value}", daemon=True
            )
            self._reaper, self._reaper_stop = thread, stop
        thread.start()

    def stop_reaper(self, timeout: float | None = 5.0) -> None:
        """Stop the reaper thread, if any, and wait for it to end."""
        with self._lock:
            thread, stop = self._reaper, self._reaper_stop
            self._reaper = self._reaper_stop = None
        if thread is not None and stop is not None:
            stop.set()
            if thread is not threading.current_thread():
                thread.join(timeout)

    @property
    def reaper_running(self) -> bool:
        return self._reaper is not None and self._reaper.is_alive()

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_reaper()

    def _reap(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            try:
                self.check_deadlines()
            except Exception:  # pragma: no cover - a reaper must outlive a bad observer or clock
                logger.exception("kvfsm %s reaper: check_deadlines failed", self.role.value)

    # -- the choke point ------------------------------------------------------------

    def _fire(
        self,
        handle: TransferHandle,
        event: str,
        reason: FailureReason | None = None,
        nbytes: int = 0,
        last: bool = False,
    ) -> bool:
        # Notices go straight into the outbox under the lock, so the outbox holds
        # every room's steps in the order they happened (rule 16).
        notices = self._outbox
        expired: list[tuple[TransferHandle, str]] = []
        applied = False
        late: State | None = None
        invalid: str | None = None
        error: InvalidTransition | None = None
        with self._lock:
            now = self._clock()
            if now >= self._table.deadlines.next_due:
                self._expire(now, expired, notices)
            state = handle.state
            if handle.closed:
                stats = self._table.stats
                stats.late_events += 1
                stats.stale_events += 1
                late = state
            else:
                step = self._rows[event][state]
                if step is None:
                    if self._terminal[state]:
                        self._table.stats.late_events += 1
                        late = state
                    else:
                        self._table.stats.invalid_events += 1
                        allowed = self.allowed_events(state)
                        if self.strict:
                            error = InvalidTransition(handle.room, state, event, allowed)
                        else:
                            invalid = event
                            reason = FailureReason(
                                FailureKind.INVALID_EVENT,
                                f"event {event!r} is not allowed in {state.name} (allowed: {', '.join(allowed)})",
                                state,
                            )
                            self._apply(handle, self._rows["fail"][state], now, reason, notices)  # type: ignore[arg-type]
                else:
                    if reason is not None and reason.state is None:
                        reason = FailureReason(reason.kind, reason.message, state, reason.from_peer)
                    if step.dest is None:
                        handle.nbytes += nbytes
                        handle.chunks += 1
                        if last:
                            handle.last_chunk_at = now
                    elif event == "abort":
                        self._table.stats.aborts += 1
                    self._apply(handle, step, now, reason, notices, nbytes, last)
                    applied = True
        if expired or notices:
            self._after(expired, notices)
        if error is not None:
            raise error
        if late is not None:
            logger.debug(
                "kvfsm %s room %r gen %d: %s event %r ignored (room is %s)",
                self.role.value,
                handle.room,
                handle.generation,
                "stale" if handle.closed else "late",
                event,
                late.name,
            )
        elif invalid is not None:
            logger.warning(
                "kvfsm %s room %r: out-of-order event %r failed the room: %s",
                self.role.value,
                handle.room,
                invalid,
                handle.reason,
            )
        elif applied and reason is not None:
            self._log_failure(handle, reason)
        return applied

    def _apply(
        self,
        handle: TransferHandle,
        step: Step,
        now: float,
        reason: FailureReason | None,
        notices: deque[StateChange],
        nbytes: int = 0,
        last: bool = False,
    ) -> None:
        """Run one step under the lock and queue its notice (if anyone watches the event)."""
        self._engine.fire(handle, step, now, reason)
        if self._watching[step.event]:
            notices.append(
                StateChange(
                    self.role,
                    handle.room,
                    handle.generation,
                    step.event,
                    step.source,
                    handle.state,
                    now,
                    reason,
                    nbytes,
                    last,
                )
            )

    def _expire(self, now: float, expired: list[tuple[TransferHandle, str]], notices: deque[StateChange]) -> None:
        """Fail every room whose phase deadline is due, and step the pages whose drain deadline is (lock held)."""
        deadlines = self._table.deadlines
        for handle, state, limit in deadlines.due(now):
            reason = FailureReason(
                FailureKind.TIMEOUT,
                f"{self.lifecycle.phase_of(state)} deadline of {limit:g}s passed ({state.name} since t={handle.entered_at:.3f}, now t={now:.3f})",
                state,
            )
            self._table.stats.timeouts += 1
            self._apply(handle, self._rows["timeout"][state], now, reason, notices)  # type: ignore[arg-type]
            expired.append((handle, "timeout"))  # type: ignore[arg-type]
        for handle in deadlines.drain_due(now):
            if handle.pages_state is _DRAINING:  # else a proof came first
                self._pages(handle, self._drain_input, now, notices)  # type: ignore[arg-type]
                expired.append((handle, self._drain_input))  # type: ignore[arg-type]
        deadlines.refresh()

    def _pages(self, handle: TransferHandle, input: str, now: float, notices: deque[StateChange]) -> bool:
        """Step `handle`'s release phase by `input` and queue its notice (lock held); whether it moved."""
        before = pages_step(handle, input, self._table)
        if before is None:
            return False
        stats = self._stats
        if handle.pages_state is _RELEASED:
            if input == "drain_deadline_release":
                stats.drain_deadline_releases += 1
            elif before is _QUARANTINED and input in PROOFS:
                stats.released_after_quarantine += 1
            if handle.closed:
                held = self._held.get(handle.room)
                if held is not None:
                    held.remove(handle)
                    if not held:
                        del self._held[handle.room]
        if self._watching[input]:
            notices.append(
                StateChange(
                    self.role,
                    handle.room,
                    handle.generation,
                    input,
                    handle.state,
                    handle.state,
                    now,
                    None,
                    held_nbytes(handle),
                    False,
                    handle.pages_state,
                )
            )
        return True

    def _after(self, expired: list[tuple[TransferHandle, str]], notices: deque[StateChange]) -> None:
        """Outside the lock: log timeouts and drain deadlines, hand the queued notices to observers."""
        for handle, what in expired:
            if what == "timeout":
                logger.warning("kvfsm %s room %r timed out: %s", self.role.value, handle.room, handle.reason)
            elif what == "drain_deadline":
                logger.warning(
                    "kvfsm %s room %r gen %d: no proof that its writes stopped within the drain deadline of %gs; "
                    "its pages (%d bytes) are quarantined, not released, until a proof arrives "
                    "(writes_drained, fenced) or an operator calls release_quarantined()",
                    self.role.value,
                    handle.room,
                    handle.generation,
                    self._deadlines.drain_limit,
                    held_nbytes(handle),
                )
            else:
                logger.warning(
                    "kvfsm %s room %r gen %d: drain deadline of %gs passed without proof; its pages are released "
                    'although a peer write may still land (on_drain_deadline="release")',
                    self.role.value,
                    handle.room,
                    handle.generation,
                    self._deadlines.drain_limit,
                )
        if notices:
            self._dispatch()

    def _dispatch(self) -> None:
        # Whoever holds _dispatching delivers everything queued, in order; a
        # thread that finds it taken leaves its notices to that thread. The
        # re-check after release catches notices queued in between.
        while self._outbox:
            if not self._dispatching.acquire(blocking=False):
                return
            try:
                while True:
                    try:
                        notice = self._outbox.popleft()
                    except IndexError:
                        break
                    for observer, events in self._observers:
                        if events is not None and notice.event not in events:
                            continue
                        try:
                            observer(notice)
                        except Exception:
                            logger.exception(
                                "kvfsm %s observer %r failed on room %r event %r",
                                self.role.value,
                                observer,
                                notice.room,
                                notice.event,
                            )
            finally:
                self._dispatching.release()

    def _log_failure(self, handle: TransferHandle, reason: FailureReason) -> None:
        if reason.kind is FailureKind.ABORTED and not reason.from_peer:
            logger.info("kvfsm %s room %r aborted: %s", self.role.value, handle.room, reason)
        else:
            logger.warning("kvfsm %s room %r failed: %s", self.role.value, handle.room, reason)

    def _prove(self, handle: TransferHandle, proof: str, why: str | None) -> None:
        """A proof that no write into the room's pages can land: release them if they wait for one."""
        notices = self._outbox
        with self._lock:
            before = handle.pages_state
            moved = self._pages(handle, proof, self._clock(), notices)
            if moved and proof == "fenced":
                self._stats.fences += 1
        if notices:
            self._dispatch()
        if not moved:
            logger.debug(
                "kvfsm %s room %r: %s ignored (room is %s%s, pages %s)",
                self.role.value,
                handle.room,
                "writes_drained" if proof == "drained" else "fenced",
                handle.state.name,
                ", closed" if handle.closed else "",
                before.value,
            )
        elif before is _QUARANTINED:
            logger.warning(
                "kvfsm %s room %r gen %d: quarantined pages released: proof arrived (%s%s)",
                self.role.value,
                handle.room,
                handle.generation,
                proof,
                f": {why}" if why else "",
            )
        elif why:
            logger.info("kvfsm %s room %r: pages released, peer fenced: %s", self.role.value, handle.room, why)

    def _release_safe(self, handle: TransferHandle) -> bool:
        pages = handle.pages_state
        if pages is _RELEASED:
            return True
        if pages is _DRAINING and self._clock() >= self._deadlines.next_due:
            self.check_deadlines()  # the opt-in timer release answers on time
            return handle.pages_state is _RELEASED
        return False

    def _close(self, handle: TransferHandle) -> None:
        state = handle.state
        if not self._terminal[state] and not handle.closed:
            handle.abort(f"closed while {state.name}")
        notice: StateChange | None = None
        lock = self._lock
        lock.acquire()
        try:
            closed_already = handle.closed
            if not closed_already:
                room = handle.room
                self._tombstone(handle)
                if self._watching["close"]:
                    notice = StateChange(self.role, room, handle.generation, "close", handle.state, None, self._clock())
                    self._outbox.append(notice)
        finally:
            lock.release()
        if closed_already:
            raise self._unknown(handle.room)
        if notice is not None:
            self._dispatch()

    def _unknown(self, room: RoomId) -> UnknownRoom | InvalidRoomId:
        try:
            _check_room_id(room)  # "" or a 2,000-character id: say that, as open() does
        except InvalidRoomId as exc:
            return exc
        live = self._rooms.get(room)
        if live is not None:  # a stale handle of a reopened room
            return UnknownRoom(
                room, f"this handle's generation was closed; the room is open again as generation {live.generation}"
            )
        closed = self.last_closed(room)
        if closed is not None:
            generation, final, _ended = closed
            return UnknownRoom(room, f"it was closed (generation {generation}, final state {final.name})")
        if self._remember_closed:
            return UnknownRoom(room, f"it was never opened on this {self.role.value} manager (or was closed long ago)")
        return UnknownRoom(room, f"it was never opened on this {self.role.value} manager, or was closed")
