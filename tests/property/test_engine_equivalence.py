"""The compiled engine behaves exactly like `transitions` running the machine.

`TransferManager(engine="compiled")` (the default) runs code generated from
the machine's callbacks, with a fast path inlined into the handles' event
methods; `engine="transitions"` lets `transitions` trigger every event and
call the hooks' plain bodies. On any program of opens, events (in order or
not, through live or stale handles), closes, status reads, drains and clock
ticks over several rooms, these must agree:

* the observed traces (every `StateChange` a subscriber receives);
* every write to the status table, in order (a recording dict stands in
  for the table's dict);
* what each call returned or raised, and after every step the table, the
  live counts, the counters, the deadline queues and every handle's fields.

Observers force the compiled engine off its fast path, so each program also
runs on an unobserved compiled manager (the fast path) and an unobserved
`transitions` one, whose writes, results and snapshots must match too.

Every program runs over one of the shipped lifecycles (`kvfsm.lifecycles`):
its events, happy path and timeouts are read from the declaration, so a new
lifecycle is covered by adding it to `LIFECYCLES_UNDER_TEST`. Proofs,
quarantines and operator overrides of the release phase are steps too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import attrs
from hypothesis import given
from hypothesis import strategies as st

import kvfsm
from kvfsm import RoomId, _status
from kvfsm.lifecycles import SHIPPED
from kvfsm.testing import happy_events
from tests.helpers import FakeClock

ROOMS = st.integers(min_value=0, max_value=2)
# Mostly the room's latest handle; sometimes an older (closed) generation's.
HANDLE_AGE = st.sampled_from([0, 0, 0, 0, 1, 2])
REASONS = st.builds(
    kvfsm.FailureReason,
    kind=st.sampled_from(list(kvfsm.FailureKind)),
    message=st.sampled_from(["", "peer reset", "nixl: timeout"]),
    state=st.sampled_from([None, kvfsm.KVPoll.Transferring]),
    from_peer=st.booleans(),
)
LIFECYCLES_UNDER_TEST = tuple(SHIPPED.values())


def _events(lifecycle: kvfsm.Lifecycle) -> st.SearchStrategy[tuple[Any, ...]]:
    # The forward events are listed several times: a program then often carries a
    # room through its whole lifecycle, with the odd event out of order.
    forward = [name for name, spec in lifecycle.event_specs.items() if not spec.internal]
    internal = [name for name, spec in lifecycle.event_specs.items() if spec.internal]
    lifecycle_event = st.sampled_from(forward).map(lambda name: (name,))
    progress = st.tuples(
        st.sampled_from(internal),
        st.one_of(st.integers(min_value=0, max_value=1 << 20), st.sampled_from([0, -1, True, 2.0])),
        st.booleans(),
    )
    return st.one_of(
        lifecycle_event,
        lifecycle_event,
        lifecycle_event,
        progress,
        st.tuples(st.just("abort"), st.one_of(st.sampled_from(["aborted", "client went away"]), st.just(7))),
        st.tuples(st.just("fail"), st.one_of(REASONS, st.just("not a reason"))),
        st.tuples(st.just("writes_drained")),
        st.tuples(st.just("fenced"), st.sampled_from(["peer process gone", ""])),
    )


def _ops(lifecycle: kvfsm.Lifecycle) -> st.SearchStrategy[tuple[Any, ...]]:
    event_op = st.tuples(st.just("event"), ROOMS, HANDLE_AGE, _events(lifecycle))
    return st.one_of(
        event_op,
        event_op,
        event_op,
        event_op,
        st.tuples(st.just("open"), ROOMS),
        st.tuples(st.just("open"), ROOMS),
        st.tuples(st.just("close"), ROOMS),
        st.tuples(st.just("handle_close"), ROOMS, HANDLE_AGE),
        st.tuples(st.just("status"), ROOMS),
        st.tuples(st.just("poll"), ROOMS, HANDLE_AGE),
        st.tuples(st.just("release_safe"), ROOMS),
        st.tuples(st.just("holds_pages"), ROOMS),
        st.tuples(st.just("release_quarantined"), ROOMS),
        st.tuples(st.just("check_deadlines")),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 4.0, 6.0, 40.0])),
    )


def _happy(lifecycle: kvfsm.Lifecycle, room: int, length: int, nbytes: object, last: bool) -> list[tuple[Any, ...]]:
    steps: list[tuple[Any, ...]] = [("open", room)]
    for event in happy_events(lifecycle):
        args: tuple[Any, ...] = (nbytes, last) if lifecycle.is_internal(event.name) else ()
        steps.append(("event", room, 0, (event.name, *args)))
    steps.append(("close", room))
    return steps[:length]


# A room carried through (a prefix of) its lifecycle in one go: random ops
# alone rarely line up four in-order events on one room.
NBYTES = st.sampled_from([4096, 4096, 0, -1, True, 2.0])


def _programs(lifecycle: kvfsm.Lifecycle) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    happy = st.builds(_happy, st.just(lifecycle), ROOMS, st.integers(min_value=1, max_value=8), NBYTES, st.booleans())
    return st.lists(st.one_of(happy, _ops(lifecycle).map(lambda op: [op])), max_size=25).map(
        lambda parts: [op for part in parts for op in part]
    )


def _timeouts(lifecycle: kvfsm.Lifecycle) -> st.SearchStrategy[kvfsm.PhaseTimeouts]:
    phases = lifecycle.phases
    return st.sampled_from(
        [
            lifecycle.Timeouts(**{phase: 5.0 for phase in phases}, drain=3.0),
            lifecycle.Timeouts(**{phase: (3.0 if i % 2 == 0 else None) for i, phase in enumerate(phases)}, drain=None),
            lifecycle.Timeouts(),
        ]
    )


CASES = st.sampled_from(LIFECYCLES_UNDER_TEST).flatmap(
    lambda lifecycle: st.tuples(st.just(lifecycle), _programs(lifecycle), _timeouts(lifecycle))
)


class RecordingDict(dict[RoomId, kvfsm.KVPoll]):
    """A status table that logs every write (a dict subclass: no fast-path opcode skips it)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, RoomId, kvfsm.KVPoll | None]] = []

    def __setitem__(self, key: RoomId, value: kvfsm.KVPoll) -> None:
        self.writes.append(("set", key, value))
        super().__setitem__(key, value)

    def __delitem__(self, key: RoomId) -> None:
        self.writes.append(("del", key, None))
        super().__delitem__(key)


@contextmanager
def recorded_tables() -> Iterator[list[RecordingDict]]:
    made: list[RecordingDict] = []

    def factory() -> dict[RoomId, kvfsm.KVPoll]:
        table = RecordingDict()
        made.append(table)
        return table

    with mock.patch.object(_status, "new_status_map", factory):
        yield made


class Run:
    """One manager executing the program, with everything it did recorded."""

    HANDLE_FIELDS = (
        "room",
        "generation",
        "state",
        "reason",
        "opened_at",
        "entered_at",
        "transfer_started_at",
        "last_chunk_at",
        "finished_at",
        "nbytes",
        "chunks",
        "closed",
        "pages_state",
        "pages_nbytes",
    )

    def __init__(
        self,
        engine: str,
        observed: bool,
        timeouts: kvfsm.PhaseTimeouts,
        strict: bool,
        lifecycle: kvfsm.Lifecycle = kvfsm.KV_LIFECYCLE,
    ) -> None:
        self.clock = FakeClock()
        with recorded_tables() as made:
            self.manager = kvfsm.TransferManager(
                "receiver", lifecycle=lifecycle, timeouts=timeouts, clock=self.clock, strict=strict, engine=engine
            )
        (self.table,) = made
        self.trace: list[kvfsm.StateChange] = []
        if observed:
            self.manager.subscribe(self.trace.append)
        self.handles: dict[int, list[kvfsm.TransferHandle]] = {}
        self.results: list[object] = []
        self.snapshots: list[object] = []

    def handle(self, room: int, age: int) -> kvfsm.TransferHandle | None:
        opened = self.handles.get(room)
        if not opened:
            return None
        return opened[-1 - min(age, len(opened) - 1)]

    def step(self, op: tuple[Any, ...]) -> None:
        try:
            result = self._do(op)
        except Exception as error:  # every error must match too, message included
            result = ("raised", type(error).__name__, str(error))
        self.results.append(result)
        self.snapshots.append(self.snapshot())

    def _do(self, op: tuple[Any, ...]) -> object:
        m, kind = self.manager, op[0]
        if kind == "open":
            self.handles.setdefault(op[1], []).append(m.open(op[1]))
            return "opened"
        if kind == "close":
            m.close(op[1])
            return "closed"
        if kind == "status":
            return m.status(op[1])
        if kind == "release_safe":
            return m.release_safe(op[1])
        if kind == "holds_pages":
            return m.holds_pages(op[1])
        if kind == "release_quarantined":
            return m.release_quarantined(op[1], "the test's operator")
        if kind == "check_deadlines":
            return m.check_deadlines()
        if kind == "tick":
            self.clock.advance(op[1])
            return None
        handle = self.handle(op[1], op[2])
        if handle is None:
            return "no handle"
        if kind == "handle_close":
            handle.close()
            return "closed"
        if kind == "poll":
            return handle.poll()
        name, *args = op[3]
        method: Callable[..., object] = getattr(handle, name)
        return method(*args)

    def snapshot(self) -> object:
        m = self.manager
        deadlines = m._table.deadlines
        handles = [
            tuple(getattr(h, field) for field in self.HANDLE_FIELDS) for opened in self.handles.values() for h in opened
        ]
        return (
            dict(self.table),
            list(m._table.live),
            attrs.asdict(m.stats),
            m.counts(),
            [list(q) if q is not None else None for q in deadlines._queues],
            [(h.room, getattr(h, "generation"), h.pages_state) for h in deadlines._drain_queue],  # noqa: B009
            deadlines.next_due,
            handles,
            sorted((room, [h.generation for h in held]) for room, held in m._held.items()),
        )


@given(case=CASES, strict=st.booleans())
def test_compiled_and_transitions_engines_are_indistinguishable(
    case: tuple[kvfsm.Lifecycle, list[tuple[Any, ...]], kvfsm.PhaseTimeouts], strict: bool
) -> None:
    lifecycle, program, timeouts = case
    runs = {
        (engine, observed): Run(engine, observed, timeouts, strict, lifecycle)
        for engine in ("transitions", "compiled")
        for observed in (True, False)
    }
    for op in program:
        for run in runs.values():
            run.step(op)
    reference = runs["transitions", True]
    for key, run in runs.items():
        assert run.results == reference.results, key
        assert run.table.writes == reference.table.writes, key
        assert run.snapshots == reference.snapshots, key
    assert runs["compiled", True].trace == reference.trace


def test_the_fast_path_is_taken_and_writes_like_the_machine() -> None:
    """A plain lifecycle on the compiled engine never enters the generic choke point."""
    timeouts = kvfsm.Timeouts(bootstrap=5.0, waiting=5.0, transferring=5.0)
    compiled = Run("compiled", False, timeouts, False)
    reference = Run("transitions", False, timeouts, False)
    program: list[tuple[Any, ...]] = [
        ("open", 1),
        ("event", 1, 0, ("bootstrapped",)),
        ("event", 1, 0, ("transfer_started",)),
        ("event", 1, 0, ("chunk_done", 4096, True)),
        ("event", 1, 0, ("transfer_done",)),
        ("close", 1),
        ("open", 2),
        ("event", 2, 0, ("abort", "client went away")),
        ("close", 2),
    ]
    with mock.patch.object(kvfsm.TransferManager, "_fire", side_effect=AssertionError("slow path taken")):
        for op in program:
            compiled.step(op)
    for op in program:
        reference.step(op)
    assert compiled.results == reference.results
    assert compiled.table.writes == reference.table.writes
    assert compiled.snapshots == reference.snapshots
    assert ("set", 1, kvfsm.KVPoll.Success) in compiled.table.writes
