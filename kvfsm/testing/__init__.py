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
declared lifecycle and of the release phase) against a bare
`TransferManager`, no adapter needed: a manager subclass, another engine
or another declared lifecycle (`lifecycle = ...`) can be checked with it.

The strategies (`room_ids`, `failure_reasons`, `events`,
`event_sequences`, `faults`, `timeouts`) are public for authors' own
property tests. The package imports hypothesis (a runtime dependency of
kvfsm) but neither torch nor any engine.

The parts: `strategies` (the strategies and `ManualClock`),
`lifecycle_kit` (`LifecycleConformance`), `backend_kit`
(`BackendConformance`, `BackendPair`) and `_checks` (the rule checks
both kits run).
"""

from .backend_kit import BackendConformance, BackendPair
from .lifecycle_kit import LifecycleConformance
from .strategies import (
    Event,
    Fault,
    ManualClock,
    event_sequences,
    events,
    expected_state,
    failure_reasons,
    faults,
    happy_events,
    room_ids,
    timeouts,
)

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
    "BackendPair",
    "LifecycleConformance",
    "BackendConformance",
]
