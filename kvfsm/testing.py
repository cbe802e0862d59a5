"""kvfsm's conformance kit: hypothesis strategies and stateful tests for backends.

A backend author proves their adapter keeps kvfsm's rules by subclassing
one class and supplying one factory::

    from kvfsm.testing import BackendConformance, BackendPair

    class MyEngineConformance(BackendConformance):
        def make_backends(self, sender, receiver):
            ...  # build both endpoints on these managers, register pools
            return BackendPair(sender=..., receiver=..., peer=..., ...)

    TestMyEngine = MyEngineConformance.TestCase      # collected by pytest

Hypothesis then runs random interleavings of requests, chunked sends,
aborts on either side in every state, peer failures, late events, clock
jumps past deadlines and page releases, and checks after every step:

* one writer: the manager's status table agrees with every handle;
* terminal states absorb: a room that ended never changes again, and late
  events change nothing;
* abort is synchronous: when `abort()` returns the room is `Failed` with an
  `ABORTED` reason (or was already terminal and is unchanged);
* the release gate: `Success` is release-safe at once; a `Failed` room
  becomes release-safe once the adapter reports its writes drained, and
  pages freed then are never written again (the kit poisons them and
  checks the poison after every settle);
* deadlines on an injected clock: no open room outlives its phase's
  deadline once the manager looked at the clock, and the reason says
  `TIMEOUT`;
* structured failures: every `Failed` room has a reason and
  `failure_exception()` raises `KVTransferError` carrying it;
* data integrity, where the pair can read and write pages: every page of
  a successful transfer arrived intact, in order.

`LifecycleConformance` runs the same rules (and an exact model of the
transition table) against a bare `TransferManager`, no adapter needed: a
manager subclass or another engine can be checked with it too.

The strategies (`room_ids`, `failure_reasons`, `events`,
`event_sequences`, `faults`, `timeouts`) are public for authors' own
property tests. This module imports hypothesis (a runtime dependency of
kvfsm) but neither torch nor any engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ._errors import DuplicateRoom, InvalidTransition, KVTransferError, UnknownRoom
from ._manager import TransferHandle, TransferManager
from ._states import NON_TERMINAL, TERMINAL, FailureKind, FailureReason, KVPoll, Role, Timeouts
from ._table import EVENTS, TRANSITIONS

if TYPE_CHECKING:
    from .backends.base import KVBackend

__all__ = [
    "ManualClock",
    "Event",
    "Fault",
    "room_ids",
    "failure_reasons",
    "events",
    "event_sequences",
    "faults",
    "timeouts",
    "expected_state",
    "BackendPair",
    "LifecycleConformance",
    "BackendConformance",
]

# -- a clock tests move by hand ------------------------------------------------------------


class ManualClock:
    """A monotonic clock that only moves when told to (inject it into managers)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back; got advance({seconds!r})")
        self.now += seconds


# -- strategies -----------------------------------------------------------------------------


def room_ids() -> st.SearchStrategy[int | str]:
    """Room ids as servers use them: SGLang's 63-bit ints, or short strings."""
    return st.one_of(
        st.integers(min_value=0, max_value=2**63 - 1),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-:", min_size=1, max_size=16),
    )


def failure_reasons(kinds: st.SearchStrategy[FailureKind] | None = None) -> st.SearchStrategy[FailureReason]:
    """Reasons a backend or peer reports through `handle.fail()` (state left to the manager)."""
    return st.builds(
        FailureReason,
        kind=kinds if kinds is not None else st.sampled_from(FailureKind),
        message=st.text(max_size=40),
        from_peer=st.booleans(),
    )


@attrs.frozen
class Event:
    """One lifecycle event with its arguments, replayable on any handle."""

    name: str
    nbytes: int = 0
    last: bool = False
    reason: FailureReason | None = None

    def apply(self, handle: TransferHandle) -> bool:
        """Fire it; returns what the handle returned (True when the event changed the room)."""
        if self.name == "chunk_done":
            return handle.chunk_done(self.nbytes, self.last)
        if self.name == "fail":
            assert self.reason is not None
            return handle.fail(self.reason)
        if self.name == "abort":
            return handle.abort(self.reason.message if self.reason is not None else "aborted")
        if self.name == "timeout":
            raise ValueError("timeout is fired by the manager's clock, not by a handle; advance the clock instead")
        method: Callable[[], bool] = getattr(handle, self.name)
        return method()


_HANDLE_EVENTS = tuple(name for name in EVENTS if name != "timeout")


def events(names: tuple[str, ...] = _HANDLE_EVENTS) -> st.SearchStrategy[Event]:
    """Any event a handle accepts, with random arguments (in or out of order)."""

    def build(name: str) -> st.SearchStrategy[Event]:
        if name == "chunk_done":
            return st.builds(Event, st.just(name), nbytes=st.integers(0, 1 << 20), last=st.booleans())
        if name == "fail":
            return st.builds(Event, st.just(name), reason=failure_reasons())
        if name == "abort":
            return st.builds(
                Event,
                st.just(name),
                reason=st.builds(FailureReason, st.just(FailureKind.ABORTED), st.text(max_size=20)),
            )
        return st.just(Event(name))

    return st.sampled_from(names).flatmap(build)


def event_sequences(max_size: int = 12, happy_bias: bool = True) -> st.SearchStrategy[list[Event]]:
    """Sequences of events; with `happy_bias`, often the happy path with faults spliced in."""
    random_sequences = st.lists(events(), max_size=max_size)
    if not happy_bias:
        return random_sequences
    happy = [Event("bootstrapped"), Event("transfer_started"), Event("chunk_done", 4096, True), Event("transfer_done")]

    @st.composite
    def spliced(draw: st.DrawFn) -> list[Event]:
        prefix = happy[: draw(st.integers(0, len(happy)))]
        return prefix + draw(st.lists(events(), max_size=max(0, max_size - len(prefix))))

    return st.one_of(random_sequences, spliced())


@attrs.frozen
class Fault:
    """Something going wrong around a transfer.

    `kind` is one of: "abort" (the server gives up), "fail" (a backend or
    peer reports `reason`), "timeout" (the clock jumps `seconds` ahead),
    "late" (a stale completion arrives after the room ended), "close" (the
    room is closed while in flight).
    """

    kind: str
    reason: FailureReason | None = None
    seconds: float = 0.0


def faults(max_seconds: float = 600.0) -> st.SearchStrategy[Fault]:
    return st.one_of(
        st.just(Fault("abort")),
        st.builds(Fault, st.just("fail"), reason=failure_reasons()),
        st.builds(Fault, st.just("timeout"), seconds=st.floats(0.0, max_seconds, allow_nan=False)),
        st.just(Fault("late")),
        st.just(Fault("close")),
    )


def timeouts(max_seconds: float = 600.0) -> st.SearchStrategy[Timeouts]:
    """Phase timeouts, each a positive number of seconds or None."""
    seconds = st.one_of(st.none(), st.floats(min_value=0.5, max_value=max_seconds, allow_nan=False))
    return st.builds(Timeouts, bootstrap=seconds, waiting=seconds, transferring=seconds, drain=seconds)


def expected_state(state: KVPoll, event: str, *, strict: bool = False) -> KVPoll | None:
    """What the declared table says `event` does in `state`.

    The new state; `state` itself for an internal transition or an event
    absorbed by a terminal state; `Failed` for an out-of-order event (rule
    3); None in strict mode, where an out-of-order event must raise.
    """
    for spec in TRANSITIONS:
        if spec.event == event and state in spec.sources:
            return spec.dest if spec.dest is not None else state
    if state in TERMINAL:
        return state
    return None if strict else KVPoll.Failed


# -- checks shared by both machines -----------------------------------------------------------


class _RoomLedger:
    """What the kit remembers per handle: the first terminal state it saw."""

    def __init__(self) -> None:
        self.final: dict[int, tuple[TransferHandle, KVPoll]] = {}

    def observe(self, handle: TransferHandle) -> None:
        state = handle.state
        seen = self.final.get(id(handle))
        if seen is None:
            if state in TERMINAL:
                self.final[id(handle)] = (handle, state)
            return
        assert state is seen[1], (
            f"rule 2 broken: room {handle.room!r} (gen {handle.generation}) ended {seen[1].name} but is now {state.name}"
        )


def _check_agreement(manager: TransferManager, handles: list[TransferHandle]) -> None:
    """Rule 1: the status table says what each open handle says.

    The handle is read before and after the table; if an adapter thread
    moved the room in between, this round proves nothing and is skipped.
    """
    for handle in handles:
        before = handle.state
        if handle.closed:
            continue
        try:
            table = manager.status(handle.room)
        except UnknownRoom:
            continue  # closed by an adapter thread between the two reads
        try:
            current = manager.get(handle.room)
        except UnknownRoom:
            continue
        if handle.state is before and not handle.closed and current is handle:
            assert table is before, (
                f"rule 1 broken: room {handle.room!r} handle says {before.name}, table says {table.name}"
            )


def _check_failure(handle: TransferHandle) -> None:
    """Rule 8: a Failed room has a structured reason and raises it."""
    if handle.closed or handle.state is not KVPoll.Failed:
        return
    reason = handle.reason
    assert isinstance(reason, FailureReason), f"room {handle.room!r} is Failed without a FailureReason"
    assert reason.state in NON_TERMINAL, f"room {handle.room!r}: reason.state {reason.state!r} is not where it failed"
    raised = _raised_by(handle.failure_exception)
    assert isinstance(raised, KVTransferError), f"failure_exception() of room {handle.room!r} raised {raised!r}"
    assert (raised.room, raised.reason) == (handle.room, reason)


def _raised_by(call: Callable[[], object]) -> BaseException | None:
    """The exception `call()` raised, or None."""
    try:
        call()
    except Exception as error:
        return error
    return None


def _check_deadlines(manager: TransferManager, clock: ManualClock, handles: list[TransferHandle]) -> None:
    """Rule 7: after the manager looked at the clock, no open room is past its phase deadline.

    Rooms the manager timed out just now must say so: `TIMEOUT`, naming the phase.
    """
    expired = set(manager.check_deadlines())
    now = clock()
    for handle in handles:
        state = handle.state
        if handle.closed:
            continue
        if handle.room in expired and manager.get(handle.room) is handle:
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.TIMEOUT, f"room {handle.room!r} expired with reason {reason}"
            assert reason.state in NON_TERMINAL
            assert "deadline" in reason.message, f"a timeout must name the phase deadline; got {reason.message!r}"
        if state in TERMINAL:
            continue
        limit = manager.timeouts.for_state(state)
        if limit is not None:
            assert now < handle.entered_at + limit, (
                f"rule 7 broken: room {handle.room!r} is {state.name} since t={handle.entered_at} "
                f"with a {limit}s deadline, and it is t={now}"
            )


# -- the bare-manager machine ---------------------------------------------------------------


class LifecycleConformance(RuleBasedStateMachine):
    """The rules of DESIGN.md against a bare `TransferManager`, with an exact table model.

    Override `make_manager` to check a subclass or another engine; set
    `strict = True` to check strict mode; `role` and `timeouts_under_test`
    are class attributes.
    """

    role: ClassVar[Role] = Role.RECEIVER
    strict: ClassVar[bool] = False
    timeouts_under_test: ClassVar[Timeouts] = Timeouts(bootstrap=30.0, waiting=60.0, transferring=90.0, drain=20.0)

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.manager = self.make_manager(self.clock)
        self.ledger = _RoomLedger()
        self.live: dict[Hashable, TransferHandle] = {}
        self.closed_handles: list[TransferHandle] = []
        self.drained: set[int] = set()
        self._ids = itertools.count()

    def make_manager(self, clock: ManualClock) -> TransferManager:
        return TransferManager(self.role, timeouts=self.timeouts_under_test, clock=clock, strict=self.strict)

    # rules

    @rule(room=st.one_of(room_ids(), st.integers(0, 3)))
    def open_room(self, room: int | str) -> None:
        if room in self.live:
            raised = _raised_by(lambda: self.manager.open(room))
            assert isinstance(raised, DuplicateRoom), f"rule 4 broken: opening live room {room!r} gave {raised!r}"
            assert self.manager.get(room) is self.live[room]
            return
        handle = self.manager.open(room)
        assert handle.state is KVPoll.Bootstrapping
        assert self.manager.status(room) is KVPoll.Bootstrapping
        self.live[room] = handle

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), event=events())
    def fire(self, data: st.DataObject, event: Event) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self._enforce_deadlines()
        before = handle.state
        expected = expected_state(before, event.name, strict=self.strict)
        if expected is None:
            raised = _raised_by(lambda: event.apply(handle))
            assert isinstance(raised, InvalidTransition), f"strict mode: {event.name} in {before.name} gave {raised!r}"
            assert (raised.state, raised.event) == (before, event.name)
            assert handle.state is before, "strict mode must change nothing"
            return
        changed = event.apply(handle)
        assert handle.state is expected, (
            f"{event.name} in {before.name}: expected {expected.name}, got {handle.state.name}"
        )
        if before in TERMINAL:
            assert not changed, "an event on a terminal room reported a change"
        if event.name == "abort" and before not in TERMINAL:
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.ABORTED, "rule 5: abort must record an ABORTED reason synchronously"
            assert self.manager.status(handle.room) is KVPoll.Failed
        if event.name == "fail" and before not in TERMINAL and event.reason is not None:
            reason = handle.reason
            assert reason is not None
            assert (reason.kind, reason.message, reason.state) == (event.reason.kind, event.reason.message, before)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def writes_drained(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self._enforce_deadlines()
        before = handle.state
        handle.writes_drained()
        assert handle.state is before, "rule 6: writes_drained() must never change a state"
        if before is KVPoll.Failed:
            self.drained.add(id(handle))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.live.values(), key=repr)), label="room")
        self.manager.close(handle.room)
        assert handle.closed
        assert handle.state in TERMINAL
        del self.live[handle.room]
        self.closed_handles.append(handle)
        try:
            self.manager.status(handle.room)
        except UnknownRoom:
            pass
        else:
            raise AssertionError(f"rule 4 broken: closed room {handle.room!r} still has a status")

    @precondition(lambda self: bool(self.closed_handles))
    @rule(data=st.data(), event=events())
    def stale_event(self, data: st.DataObject, event: Event) -> None:
        handle = data.draw(st.sampled_from(self.closed_handles), label="closed room")
        successor = self.live.get(handle.room)
        successor_state = successor.state if successor is not None else None
        late = self.manager.stats.late_events
        assert not event.apply(handle), "an event on a closed generation reported a change"
        assert self.manager.stats.late_events == late + 1, "a stale event must be counted as late"
        if successor is not None:
            assert successor.state is successor_state, "rule 4 broken: a stale event reached the reopened room"

    @rule(seconds=st.floats(min_value=0.0, max_value=120.0, allow_nan=False))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # invariants

    @invariant()
    def status_table_agrees(self) -> None:
        _check_agreement(self.manager, list(self.live.values()))
        counts = self.manager.counts()
        for state in KVPoll:
            expected = sum(1 for handle in self.live.values() if handle.state is state)
            assert counts[state] == expected, f"counts()[{state.name}] is {counts[state]}, expected {expected}"

    @invariant()
    def terminal_states_absorb(self) -> None:
        for handle in [*self.live.values(), *self.closed_handles]:
            self.ledger.observe(handle)

    @invariant()
    def failures_are_structured(self) -> None:
        for handle in self.live.values():
            _check_failure(handle)

    @invariant()
    def release_gate(self) -> None:
        drain = self.manager.timeouts.drain
        for handle in self.live.values():
            state = handle.state
            if state is KVPoll.Success:
                expected = True
            elif state is KVPoll.Failed:
                assert handle.finished_at is not None
                past_deadline = drain is not None and self.clock() >= handle.finished_at + drain
                expected = id(handle) in self.drained or past_deadline
            else:
                expected = False
            assert handle.release_safe is expected, (
                f"rule 6 broken: room {handle.room!r} is {state.name} (drained: {id(handle) in self.drained}) "
                f"and release_safe is {handle.release_safe}"
            )

    @invariant()
    def deadlines_enforced(self) -> None:
        _check_deadlines(self.manager, self.clock, list(self.live.values()))

    def _enforce_deadlines(self) -> None:
        # Events enforce due deadlines before they apply; the model does the same.
        self.manager.check_deadlines()

    def teardown(self) -> None:
        self.manager.stop_reaper()


# -- the adapter machine ------------------------------------------------------------------------


@attrs.define
class BackendPair:
    """What `BackendConformance.make_backends` returns: two connected endpoints.

    `sender` / `receiver` are adapters built on the managers the kit passed
    in, pools registered. `peer` is the address both sides bootstrap with
    (the prefill endpoint's). `num_pages` is how many pages the kit may use
    (default: the receiver's pool). `write_source(page, token)` and
    `read_destination(page) -> token` let the kit check data integrity and
    the release gate: write a recognisable int into every byte group of a
    source page / read it back from a destination page (leave them None if
    the adapter moves no data). `settle()` blocks until every operation
    the adapter started has finished (its worker threads are idle); leave
    it as is for synchronous adapters. `close()` releases everything.
    """

    sender: KVBackend
    receiver: KVBackend
    peer: str
    num_pages: int | None = None
    write_source: Callable[[int, int], None] | None = None
    read_destination: Callable[[int], int] | None = None
    write_destination: Callable[[int, int], None] | None = None
    settle: Callable[[], None] = attrs.field(default=lambda: None)
    close: Callable[[], None] | None = None


_POISON = -1
#: Kinds a backend or peer may report (INVALID_EVENT is the manager's own verdict).
_REPORTED_KINDS = st.sampled_from([kind for kind in FailureKind if kind is not FailureKind.INVALID_EVENT])


def _can_expect(transfer: _Transfer) -> bool:
    return not transfer.expected and transfer.receiver.state is not KVPoll.Bootstrapping


def _can_send(transfer: _Transfer) -> bool:
    return (
        transfer.expected and transfer.sent < len(transfer.chunks) and transfer.sender.state is not KVPoll.Bootstrapping
    )


@attrs.define(eq=False)
class _Transfer:
    """One request in flight between the pair."""

    room: int
    sender: TransferHandle
    receiver: TransferHandle
    source: list[int]
    destination: list[int]
    chunks: list[list[int]]
    tokens: list[int]
    sent: int = 0
    expected: bool = False


class BackendConformance(RuleBasedStateMachine):
    """The rules of DESIGN.md against a backend adapter pair. Subclass and implement `make_backends`.

    The kit opens each request's room on a sender and a receiver manager
    (both on an injected `ManualClock`, with `timeouts_under_test`),
    bootstraps both through the adapters, registers the receiver's
    destination pages (`expect`), sends the source pages in random chunks,
    and meanwhile aborts either side in any state, fails rooms as a peer
    would, fires late events, jumps the clock past deadlines, settles the
    adapters and releases the pages of finished rooms.

    Every step that reaches the adapter ends with `settle()`, so the next
    step is chosen from a state no adapter thread can still change:
    hypothesis needs that to replay and shrink a failure. Within a step,
    adapter threads still race the kit (an abort against a completing
    transfer).
    """

    timeouts_under_test: ClassVar[Timeouts] = Timeouts(bootstrap=30.0, waiting=60.0, transferring=90.0, drain=3600.0)
    max_pages_per_request: ClassVar[int] = 4

    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        raise NotImplementedError(f"{type(self).__name__} must implement make_backends(sender, receiver)")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.sender_manager = TransferManager(Role.SENDER, timeouts=self.timeouts_under_test, clock=self.clock)
        self.receiver_manager = TransferManager(Role.RECEIVER, timeouts=self.timeouts_under_test, clock=self.clock)
        self.pair = self.make_backends(self.sender_manager, self.receiver_manager)
        pools = self.pair.receiver.pools
        num_pages = self.pair.num_pages if self.pair.num_pages is not None else (pools.num_pages if pools else 0)
        if num_pages < 1:
            raise ValueError(f"{type(self).__name__}.make_backends: the pair needs at least one page (got {num_pages})")
        self.free_source = list(range(num_pages))
        self.free_destination = list(range(num_pages))
        self.poisoned: set[int] = set()
        self.transfers: list[_Transfer] = []
        self.finished: list[_Transfer] = []
        self.ledger = _RoomLedger()
        self._rooms = itertools.count(1)
        self._tokens = itertools.count(1)

    # rules

    @precondition(lambda self: bool(self.free_source) and bool(self.free_destination))
    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        limit = min(self.max_pages_per_request, len(self.free_source), len(self.free_destination))
        count = data.draw(st.integers(0, limit), label="pages")
        source = data.draw(st.permutations(self.free_source), label="source pages")[:count]
        destination = data.draw(st.permutations(self.free_destination), label="destination pages")[:count]
        cuts = (
            sorted(data.draw(st.sets(st.integers(1, max(1, count - 1)), max_size=2), label="chunk cuts"))
            if count > 1
            else []
        )
        bounds = [0, *[c for c in cuts if 0 < c < count], count]
        chunks = [source[a:b] for a, b in itertools.pairwise(bounds)] or [[]]
        if count and data.draw(st.booleans(), label="empty last chunk"):
            chunks.append([])  # SGLang's pattern: the pages, then send([], last=True) for the aux slot
        for page in source:
            self.free_source.remove(page)
        for page in destination:
            self.free_destination.remove(page)
            self.poisoned.discard(page)
        tokens = [next(self._tokens) for _ in source]
        if self.pair.write_source is not None:
            for page, token in zip(source, tokens, strict=True):
                self.pair.write_source(page, token)
        room = next(self._rooms)
        sender = self.sender_manager.open(room)
        receiver = self.receiver_manager.open(room)
        transfer = _Transfer(room, sender, receiver, source, destination, chunks, tokens)
        self.transfers.append(transfer)
        self.pair.receiver.bootstrap(receiver, self.pair.peer)
        self.pair.sender.bootstrap(sender, self.pair.peer)
        self.pair.settle()

    def _pick(self, data: st.DataObject) -> _Transfer:
        return data.draw(st.sampled_from(self.transfers), label="request")

    @precondition(lambda self: any(_can_expect(t) for t in self.transfers))
    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        """The receiver posts its destination pages (once its room left Bootstrapping)."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_expect(t)]), label="request")
        transfer.expected = True
        self.pair.receiver.expect(transfer.receiver, transfer.destination)
        self.pair.settle()

    @precondition(lambda self: any(_can_send(t) for t in self.transfers))
    @rule(data=st.data())
    def send_chunk(self, data: st.DataObject) -> None:
        """The sender sends its next chunk (once the receiver posted pages and the sender left Bootstrapping)."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_send(t)]), label="request")
        chunk = transfer.chunks[transfer.sent]
        transfer.sent += 1
        self.pair.sender.send(transfer.sender, chunk, last=transfer.sent == len(transfer.chunks))
        self.pair.settle()

    @precondition(lambda self: any(_can_expect(t) or _can_send(t) for t in self.transfers))
    @rule(data=st.data())
    def run_to_completion(self, data: st.DataObject) -> None:
        """The happy path of one request in one step: post pages, send every chunk, settle."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_expect(t) or _can_send(t)]))
        if _can_expect(transfer):
            transfer.expected = True
            self.pair.receiver.expect(transfer.receiver, transfer.destination)
            # A cross-process sender may leave Bootstrapping only once the posted pages
            # reach it: settled first, whether it can send is the same on every replay.
            self.pair.settle()
        while _can_send(transfer):
            chunk = transfer.chunks[transfer.sent]
            transfer.sent += 1
            self.pair.sender.send(transfer.sender, chunk, last=transfer.sent == len(transfer.chunks))
            self.pair.settle()
        self.settle()

    @precondition(lambda self: bool(self.transfers))
    @rule(data=st.data(), side=st.sampled_from(["sender", "receiver"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        """The server gives up on one side, in whatever state it is."""
        transfer = self._pick(data)
        handle = transfer.sender if side == "sender" else transfer.receiver
        manager = self.sender_manager if side == "sender" else self.receiver_manager
        if handle.abort("conformance kit abort"):
            # Rule 5: synchronous. When abort() returns, the table says Failed, with the reason.
            assert manager.status(handle.room) is KVPoll.Failed
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.ABORTED
        else:
            # It had already ended (maybe a moment ago, on an adapter thread): nothing changed.
            assert handle.is_terminal
        self.pair.settle()

    @precondition(lambda self: bool(self.transfers))
    @rule(data=st.data(), side=st.sampled_from(["sender", "receiver"]), reason=failure_reasons(_REPORTED_KINDS))
    def peer_fails(self, data: st.DataObject, side: str, reason: FailureReason) -> None:
        """The peer (or the engine) reports a failure on one side."""
        transfer = self._pick(data)
        handle = transfer.sender if side == "sender" else transfer.receiver
        if handle.fail(reason):
            recorded = handle.reason
            assert recorded is not None
            assert (recorded.kind, recorded.message) == (reason.kind, reason.message)
        assert handle.is_terminal
        self.pair.settle()

    @precondition(lambda self: any(t.sender.is_terminal or t.receiver.is_terminal for t in self.transfers))
    @rule(data=st.data(), event=st.sampled_from(["bootstrapped", "transfer_started", "transfer_done"]))
    def late_event(self, data: st.DataObject, event: str) -> None:
        ended = [h for t in self.transfers for h in (t.sender, t.receiver) if h.is_terminal]
        handle = data.draw(st.sampled_from(ended), label="ended room")
        before = handle.state
        assert not getattr(handle, event)(), "a late event reported a change"
        assert handle.state is before

    @rule(seconds=st.sampled_from([1.0, 29.0, 31.0, 61.0, 91.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.sender_manager.check_deadlines()
        self.receiver_manager.check_deadlines()
        self.pair.settle()

    @rule()
    def settle(self) -> None:
        self.pair.settle()
        for transfer in self.transfers:
            self._check_settled(transfer)
        self._check_poison()

    @precondition(lambda self: any(t.receiver.release_safe or t.receiver.closed for t in self.transfers))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Free a finished request's pages (only when the release gate says so) and close its rooms."""
        ready = [t for t in self.transfers if t.receiver.release_safe or t.receiver.closed]
        transfer = data.draw(st.sampled_from(ready), label="request")
        if transfer.receiver.state is KVPoll.Success:
            self.pair.settle()
            self._check_integrity(transfer)
        for handle, manager in ((transfer.sender, self.sender_manager), (transfer.receiver, self.receiver_manager)):
            if not handle.closed:
                manager.close(handle.room)
        # Closing a live room aborts it; an adapter may drain on its own thread.
        self.pair.settle()
        self.transfers.remove(transfer)
        self.finished.append(transfer)
        if transfer.sender.release_safe or transfer.sender.state is KVPoll.Success:
            self.free_source.extend(transfer.source)
        # Source pages of a sender not yet drained stay out of circulation.
        # Released destination pages are poisoned: no write may land there any more.
        if self.pair.write_destination is not None:
            for page in transfer.destination:
                self.pair.write_destination(page, _POISON)
            self.poisoned.update(transfer.destination)
        self.free_destination.extend(transfer.destination)

    # invariants

    @invariant()
    def status_tables_agree(self) -> None:
        _check_agreement(self.sender_manager, [t.sender for t in self.transfers])
        _check_agreement(self.receiver_manager, [t.receiver for t in self.transfers])

    @invariant()
    def terminal_states_absorb(self) -> None:
        for transfer in [*self.transfers, *self.finished]:
            self.ledger.observe(transfer.sender)
            self.ledger.observe(transfer.receiver)

    @invariant()
    def failures_are_structured(self) -> None:
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                _check_failure(handle)

    @invariant()
    def adapter_events_are_in_order(self) -> None:
        """The kit only fires events a state accepts; an INVALID_EVENT failure is the adapter's."""
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                reason = handle.reason
                if reason is not None:
                    assert reason.kind is not FailureKind.INVALID_EVENT, (
                        f"the adapter emitted an out-of-order event on room {handle.room!r} "
                        f"({handle._manager.role.value}): {reason.message}"
                    )

    @invariant()
    def deadlines_enforced(self) -> None:
        _check_deadlines(self.sender_manager, self.clock, [t.sender for t in self.transfers])
        _check_deadlines(self.receiver_manager, self.clock, [t.receiver for t in self.transfers])

    @invariant()
    def only_ended_rooms_are_release_safe(self) -> None:
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                safe = handle.release_safe
                state = handle.state  # read after: states only move forward
                if safe:
                    assert state in TERMINAL, f"rule 6 broken: room {handle.room!r} is release-safe while {state.name}"
                if state is KVPoll.Success:
                    assert handle.release_safe, "rule 6 broken: Success must be release-safe at once"

    # checks after settle

    def _check_settled(self, transfer: _Transfer) -> None:
        sender, receiver = transfer.sender, transfer.receiver
        # Once settled, a failed room's adapter has stopped writing: the gate is open (rule 6).
        for handle in (sender, receiver):
            if handle.state is KVPoll.Failed and not handle.closed:
                assert handle.release_safe, (
                    f"rule 6: room {handle.room!r} ({handle._manager.role.value}) failed and the adapter settled, "
                    f"but it never reported writes_drained()"
                )
        if sender.state is KVPoll.Success:
            assert transfer.sent == len(transfer.chunks), "the sender succeeded before its last chunk was sent"
        if receiver.state is KVPoll.Success:
            assert transfer.expected, "the receiver succeeded before its pages were expected"
            if self.pair.read_destination is not None:
                # An adapter that moves data cannot be done before the last chunk was sent.
                assert transfer.sent == len(transfer.chunks), "the receiver succeeded before every chunk was sent"
            self._check_integrity(transfer)
        everything_issued = transfer.expected and transfer.sent == len(transfer.chunks)
        if everything_issued and not sender.is_terminal and not receiver.is_terminal:
            both_bootstrapped = sender.state is not KVPoll.Bootstrapping and receiver.state is not KVPoll.Bootstrapping
            assert not both_bootstrapped, (
                f"room {transfer.room}: every chunk was sent and expected and the adapter settled, "
                f"yet sender is {sender.state.name} and receiver {receiver.state.name}"
            )

    def _check_integrity(self, transfer: _Transfer) -> None:
        read = self.pair.read_destination
        if read is None:
            return
        for page, token in zip(transfer.destination, transfer.tokens, strict=True):
            assert read(page) == token, (
                f"room {transfer.room}: destination page {page} holds {read(page)}, expected {token}"
            )

    def _check_poison(self) -> None:
        read = self.pair.read_destination
        if read is None:
            return
        for page in self.poisoned:
            assert read(page) == _POISON, (
                f"rule 6 broken: destination page {page} was written after its failed room's pages were released"
            )

    def teardown(self) -> None:
        try:
            self.pair.settle()
        finally:
            for backend in (self.pair.sender, self.pair.receiver):
                backend.close()
            if self.pair.close is not None:
                self.pair.close()
            self.sender_manager.stop_reaper()
            self.receiver_manager.stop_reaper()
