"""Hypothesis strategies for kvfsm's vocabulary, and a clock tests move by hand.

Public for backend authors' own property tests, and what both conformance
kits draw from: room ids, failure reasons, handle events and sequences of
them, faults, `Timeouts`, and `expected_state`, the exact model of the
declared transition table the kits check the manager against. Every
strategy takes a `lifecycle` (default `KV_LIFECYCLE`): the events, the
happy path and the timeouts are read from its declaration.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from hypothesis import strategies as st

from .._lifecycle import KV_LIFECYCLE, Lifecycle, PhaseTimeouts
from .._manager import TransferHandle
from .._states import FailureKind, FailureReason, KVPoll, State

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
    "happy_events",
]


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
        if self.name == "fail":
            assert self.reason is not None
            return handle.fail(self.reason)
        if self.name == "abort":
            return handle.abort(self.reason.message if self.reason is not None else "aborted")
        if self.name == "timeout":
            raise ValueError("timeout is fired by the manager's clock, not by a handle; advance the clock instead")
        method: Callable[..., bool] = getattr(handle, self.name)
        spec = handle.lifecycle.event_specs.get(self.name)
        if spec is not None and spec.internal:
            values = {"nbytes": self.nbytes, "last": self.last}
            return method(*(values[arg.name] for arg in spec.args))
        return method()


def _handle_events(lifecycle: Lifecycle) -> tuple[str, ...]:
    return tuple(name for name in lifecycle.events if name != "timeout")


def events(names: tuple[str, ...] | None = None, *, lifecycle: Lifecycle = KV_LIFECYCLE) -> st.SearchStrategy[Event]:
    """Any event a handle of `lifecycle` accepts, with random arguments (in or out of order)."""

    def build(name: str) -> st.SearchStrategy[Event]:
        if lifecycle.is_internal(name):
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

    return st.sampled_from(names if names is not None else _handle_events(lifecycle)).flatmap(build)


def happy_events(lifecycle: Lifecycle = KV_LIFECYCLE) -> list[Event]:
    """The lifecycle's shortest way to success, with a progress event wherever one is accepted."""
    out: list[Event] = []
    state = lifecycle.initial
    for name in lifecycle.forward_events(state, KVPoll.Success):
        for progress, spec in lifecycle.event_specs.items():
            if spec.internal and state.name in spec.sources:
                out.append(Event(progress, 4096, True))
        out.append(Event(name))
        for t in lifecycle.transitions:
            if t.event == name and state in t.sources:
                state = t.dest
                break
    return out


def event_sequences(
    max_size: int = 12, happy_bias: bool = True, *, lifecycle: Lifecycle = KV_LIFECYCLE
) -> st.SearchStrategy[list[Event]]:
    """Sequences of events; with `happy_bias`, often the happy path with faults spliced in."""
    random_sequences = st.lists(events(lifecycle=lifecycle), max_size=max_size)
    if not happy_bias:
        return random_sequences
    happy = happy_events(lifecycle)

    @st.composite
    def spliced(draw: st.DrawFn) -> list[Event]:
        prefix = happy[: draw(st.integers(0, len(happy)))]
        return prefix + draw(st.lists(events(lifecycle=lifecycle), max_size=max(0, max_size - len(prefix))))

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


def timeouts(max_seconds: float = 600.0, *, lifecycle: Lifecycle = KV_LIFECYCLE) -> st.SearchStrategy[PhaseTimeouts]:
    """Timeouts of `lifecycle`'s phases and `drain`, each a positive number of seconds or None."""
    seconds = st.one_of(st.none(), st.floats(min_value=0.5, max_value=max_seconds, allow_nan=False))
    fields = {phase: seconds for phase in lifecycle.phases}
    return st.builds(lifecycle.Timeouts, **fields, drain=seconds)


def expected_state(
    state: State, event: str, *, strict: bool = False, lifecycle: Lifecycle = KV_LIFECYCLE
) -> State | None:
    """What the declared lifecycle says `event` does in `state`.

    The new state; `state` itself for an internal transition or an event
    absorbed by a terminal state; the failure state for an out-of-order
    event (rule 3); None in strict mode, where an out-of-order event must
    raise.
    """
    for spec in lifecycle.transitions:
        if spec.event == event and state in spec.sources:
            return spec.dest if spec.dest is not None else state
    if state in lifecycle.terminal:
        return state
    return None if strict else lifecycle.failure
