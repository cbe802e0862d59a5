"""Lifecycles as values: a transfer's states and events, declared once and validated.

kvfsm is a framework for transfer lifecycles, and a lifecycle is a value a
server declares, not code it edits. A `Lifecycle` names:

* its **states** (`StateSpec`): terminal or not, the failure state or not,
  the deadline phase it belongs to (a field of the lifecycle's `Timeouts`)
  and the `KVPoll` value it reports. The reported value is what the status
  table holds and what SGLang's scheduler MIN-all-reduces across ranks, so
  a new state (a `Staging` phase, say) maps onto SGLang's integers and
  "any rank failed means every rank failed" still holds;
* its **events** (`EventSpec`): name, source states, destination (None for
  an internal, progress-only event) and the arguments the handle method
  takes, with their validation;
* its **initial** state.

`fail`, `timeout` and `abort` from every non-terminal state to the failure
state come with every lifecycle. Everything else derives from the value:
the `transitions` machine and both engines (`_machine.py`), the handle
class and its event methods (`_manager.py`, `_fastpath.py`), the status
table's hooks and deadline queues (`_status.py`, `_deadlines.py`), the
`Timeouts` class (`Lifecycle.Timeouts`), metrics per state, diagrams, the
docs' tables, the conformance kit and SGLang's legacy-status mapping
(`forward_events`). Adding a state is one edit: the declaration.

Validation happens at construction, with errors that name the lifecycle
and what was wrong (`LifecycleError`, a `ConfigError`): every state is
reachable, every live state has a way forward, forward steps never report
a lower `KVPoll` (so `max`-style legacy writes and the all-reduce agree),
exactly one failure state reports `Failed`, success states report
`Success`, names cannot shadow the handle's own attributes.

`KV_LIFECYCLE` is the five-state KV transfer of DESIGN.md, one instance
among others (`kvfsm.lifecycles` ships two more). Its state enum is
`KVPoll` itself; any other lifecycle gets a generated `IntEnum` whose
values are the states' declaration order.

Plain data and validation: no clock, no threads, no `transitions` here.
"""

from __future__ import annotations

import enum
import keyword
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from ._root_errors import ConfigError
from ._rows import Row, Table
from ._states import KVPoll, _seconds_or_none
from ._states import State as StateT

__all__ = [
    "StateSpec",
    "EventArg",
    "EventSpec",
    "TransitionSpec",
    "Lifecycle",
    "LifecycleError",
    "PhaseTimeouts",
    "KV_LIFECYCLE",
    "Timeouts",
    "TERMINAL",
    "NON_TERMINAL",
    "FAILURE_EVENTS",
    "NO_DEFAULT",
    "lifecycle_of",
]


class LifecycleError(ConfigError):
    """A lifecycle declaration that cannot work: it names the lifecycle and the problem."""

    def __init__(self, lifecycle: str, problem: str) -> None:
        self.lifecycle = lifecycle
        self.problem = problem
        super().__init__(f"lifecycle {lifecycle!r}: {problem}")


class _NoDefault(enum.Enum):
    NO_DEFAULT = "no default"


#: An argument without a default (it must be given).
NO_DEFAULT = _NoDefault.NO_DEFAULT

#: What only `fail`, `timeout` and `abort` may be called, and what the handle has already.
FREE_EVENTS = ("fail", "timeout", "abort")
RESERVED_NAMES: frozenset[str] = frozenset(
    {
        *FREE_EVENTS,
        "open",
        "close",
        "poll",
        "room",
        "state",
        "status",
        "generation",
        "reason",
        "failure",
        "failure_exception",
        "closed",
        "release_safe",
        "writes_drained",
        "fenced",
        "holds",
        "pages_state",
        "pages_nbytes",
        "is_terminal",
        "transfer_latency",
        "transfer_started_at",
        "last_chunk_at",
        "finished_at",
        "opened_at",
        "entered_at",
        "nbytes",
        "chunks",
        "lifecycle",
    }
)
#: Reported values allowed per kind of state.
_LIVE_REPORTS = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)


def _timeout_ok(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _seconds_or_none(f"StateSpec.{attribute.name}")(_instance, attribute, value)


@attrs.frozen(slots=True)
class StateSpec:
    """One state of a lifecycle.

    `reports` is the `KVPoll` value the status table holds for a room in
    this state. `phase` names its deadline (a field of the lifecycle's
    `Timeouts`, defaulting to `timeout` seconds; None: no deadline).
    `opens_transfer` stamps the start of the transfer-latency window on
    entry (default: the first states that report `Transferring`).
    """

    name: str
    reports: KVPoll
    terminal: bool = False
    failure: bool = False
    phase: str | None = None
    timeout: float | None = attrs.field(default=None, validator=_timeout_ok)
    doc: str = ""
    opens_transfer: bool | None = None


@attrs.frozen(slots=True)
class EventArg:
    """One argument of an event's handle method: its name, type, default and lower bound."""

    name: str
    kind: type
    default: object = NO_DEFAULT
    minimum: int | None = None
    doc: str = ""


#: What an internal (progress-only) event can record on its room: bytes moved and the last chunk's time.
PROGRESS_ARGS: dict[str, EventArg] = {
    "nbytes": EventArg("nbytes", int, minimum=0, doc="bytes that landed (added to the room's byte count)"),
    "last": EventArg("last", bool, default=False, doc="the last chunk: its time ends the transfer-latency window"),
}


@attrs.frozen(slots=True)
class EventSpec:
    """One event: from any of `sources` (state names) to `dest` (None: internal, progress only)."""

    name: str
    sources: tuple[str, ...]
    dest: str | None
    args: tuple[EventArg, ...] = ()
    doc: str = ""

    @property
    def internal(self) -> bool:
        return self.dest is None


@attrs.frozen(slots=True)
class TransitionSpec:
    """One row of a lifecycle, in its states: `event` moves a room from any of `sources` to `dest`."""

    event: str
    sources: tuple[Any, ...]
    dest: Any
    doc: str


class PhaseTimeouts:
    """Base of every lifecycle's `Timeouts`: seconds per deadline phase, and `drain`.

    `None` means the phase never times out. `drain` bounds how long a failed
    room's pages wait for a proof that no write can land before they are
    quarantined (see the release phase, `_release.py`).
    """

    __slots__ = ()
    if TYPE_CHECKING:  # every lifecycle's class has these (attrs defines them, one field per phase)
        drain: float | None

        def __init__(self, **seconds: float | None) -> None: ...

    #: The lifecycle this class belongs to (set when it is made).
    lifecycle: ClassVar[Lifecycle]
    #: Deadline phases, in lifecycle order (the fields besides `drain`).
    phases: ClassVar[tuple[str, ...]]

    def for_state(self, state: StateT) -> float | None:
        """The deadline of the phase `state` belongs to (None for terminal states and phases without one)."""
        phase = self.lifecycle._phase_by_value[state]
        value: float | None = None if phase is None else getattr(self, phase)
        return value

    def phase_limits(self) -> dict[str, float | None]:
        """{phase: seconds or None} for every phase (drain left out)."""
        return {phase: getattr(self, phase) for phase in self.phases}


def _identifier(lifecycle: str, what: str, name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise LifecycleError(lifecycle, f"{what} must be a Python identifier not starting with '_'; got {name!r}")
    return name


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.replace("-", "_").split("_") if part)


class Lifecycle:
    """A validated, immutable declaration of one kind of transfer's lifecycle.

    Build one with `Lifecycle(name, states=[StateSpec...], events=[EventSpec...],
    initial="StateName")`; pass it to `TransferManager(role, lifecycle=...)`.
    Read-only attributes (all derived at construction):

    * `State`: the enum of its states (`KVPoll` for `KV_LIFECYCLE`);
      `initial`, `failure` (the failure state), `terminal`, `non_terminal`,
      `successes`;
    * `reports`: the `KVPoll` each state reports, indexed by state value;
    * `transitions` (rows in states, the free failure events included),
      `events` (names, in declaration order), `failure_events`,
      `event_specs` (by name), `table` (the `Row`/`Table` form);
    * `phases` and the `Timeouts` class with one field per phase and `drain`.
    """

    __slots__ = (
        "State",
        "Timeouts",
        "_frozen",
        "_phase_by_value",
        "_specs_by_value",
        "doc",
        "event_specs",
        "events",
        "failure",
        "failure_events",
        "initial",
        "name",
        "non_terminal",
        "phases",
        "reports",
        "state_specs",
        "successes",
        "table",
        "terminal",
        "transfer_openers",
        "transitions",
    )

    name: str
    doc: str
    State: type[enum.IntEnum]
    state_specs: tuple[StateSpec, ...]
    initial: StateT
    failure: StateT
    terminal: frozenset[StateT]
    non_terminal: tuple[StateT, ...]
    successes: tuple[StateT, ...]
    reports: tuple[KVPoll, ...]
    transfer_openers: frozenset[StateT]
    event_specs: dict[str, EventSpec]
    events: tuple[str, ...]
    transitions: tuple[TransitionSpec, ...]
    failure_events: frozenset[str]
    table: Table
    phases: tuple[str, ...]
    Timeouts: type[PhaseTimeouts]
    _phase_by_value: tuple[str | None, ...]
    _specs_by_value: tuple[StateSpec, ...]

    def __init__(
        self,
        name: str,
        *,
        states: Sequence[StateSpec],
        events: Sequence[EventSpec],
        initial: str,
        doc: str = "",
        drain_timeout: float | None = 30.0,
        timeouts_name: str | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise LifecycleError(str(name), "the name must be a non-empty string")
        set_ = object.__setattr__
        set_(self, "_frozen", False)
        self.name = name
        self.doc = doc
        self._declare_states(tuple(states), initial)
        self._declare_events(tuple(events))
        self._check_graph()
        self._make_timeouts(drain_timeout, timeouts_name)
        self._frozen = True

    # -- construction -----------------------------------------------------------------

    def _declare_states(self, states: tuple[StateSpec, ...], initial: str) -> None:
        name = self.name
        if not states:
            raise LifecycleError(name, "it declares no state")
        seen: set[str] = set()
        for spec in states:
            if not isinstance(spec, StateSpec):
                raise LifecycleError(name, f"states must be kvfsm.StateSpec; got {type(spec).__name__}: {spec!r}")
            _identifier(name, "a state name", spec.name)
            if spec.name in seen:
                raise LifecycleError(name, f"state {spec.name!r} is declared twice")
            seen.add(spec.name)
            if not isinstance(spec.reports, KVPoll):
                raise LifecycleError(name, f"state {spec.name!r} must report a kvfsm.KVPoll; got {spec.reports!r}")
            if spec.failure and not spec.terminal:
                raise LifecycleError(name, f"failure state {spec.name!r} must be terminal")
            if spec.failure and spec.reports is not KVPoll.Failed:
                raise LifecycleError(
                    name,
                    f"failure state {spec.name!r} must report Failed (so MIN all-reduce fails every rank); "
                    f"got {spec.reports.name}",
                )
            if spec.terminal and not spec.failure and spec.reports is not KVPoll.Success:
                raise LifecycleError(name, f"terminal state {spec.name!r} must report Success; got {spec.reports.name}")
            if not spec.terminal and spec.reports not in _LIVE_REPORTS:
                raise LifecycleError(
                    name,
                    f"live state {spec.name!r} must report Bootstrapping, WaitingForInput or Transferring; "
                    f"got {spec.reports.name}",
                )
            if spec.phase is not None:
                if spec.terminal:
                    raise LifecycleError(name, f"terminal state {spec.name!r} cannot have a deadline phase")
                _identifier(name, f"the phase of state {spec.name!r}", spec.phase)
                if spec.phase == "drain":
                    raise LifecycleError(name, "phase 'drain' is reserved for the release phase's Timeouts.drain")
            elif spec.timeout is not None:
                raise LifecycleError(name, f"state {spec.name!r} has a timeout but no phase to hold it")
        failures = [s for s in states if s.failure]
        if len(failures) != 1:
            raise LifecycleError(
                name, f"exactly one state must be the failure state; got {len(failures)}: {[s.name for s in failures]}"
            )
        if not any(s.terminal and not s.failure for s in states):
            raise LifecycleError(name, "no terminal state that succeeds (reports Success)")
        if initial not in seen:
            raise LifecycleError(name, f"initial state {initial!r} is not declared (states: {', '.join(sorted(seen))})")
        # KVPoll itself when the states are exactly KVPoll's, each reporting itself.
        enum_cls: type[enum.IntEnum] = KVPoll
        if seen != {p.name for p in KVPoll} or not all(s.reports is KVPoll[s.name] for s in states):
            members = [(s.name, i) for i, s in enumerate(states)]
            enum_cls = enum.IntEnum(f"{_camel(name)}State", members, module=__name__)  # type: ignore[misc,no-redef]
        by_name = {s.name: s for s in states}
        specs = tuple(by_name[member.name] for member in enum_cls)
        self.State = enum_cls
        self.state_specs = specs
        self._specs_by_value = specs
        self.initial = enum_cls[initial]
        if by_name[initial].terminal:
            raise LifecycleError(name, f"initial state {initial!r} is terminal")
        self.failure = enum_cls[failures[0].name]
        self.terminal = frozenset(m for m in enum_cls if specs[m].terminal)
        self.successes = tuple(m for m in enum_cls if specs[m].terminal and not specs[m].failure)
        # Live states in declaration order (the order a room passes them).
        self.non_terminal = tuple(enum_cls[s.name] for s in states if not s.terminal)
        self.reports = tuple(spec.reports for spec in specs)
        phases: dict[str, float | None] = {}
        for spec in states:
            if spec.phase is None:
                continue
            if spec.phase in phases and phases[spec.phase] != spec.timeout:
                raise LifecycleError(
                    name,
                    f"phase {spec.phase!r} is given two default timeouts ({phases[spec.phase]} and {spec.timeout})",
                )
            phases[spec.phase] = spec.timeout
        self.phases = tuple(phases)
        self._phase_by_value = tuple(spec.phase for spec in specs)
        openers = {m for m in enum_cls if specs[m].opens_transfer}
        if not any(s.opens_transfer is not None for s in states):
            openers = {m for m in self.non_terminal if specs[m].reports is KVPoll.Transferring}
        self.transfer_openers = frozenset(openers)

    def _declare_events(self, events: tuple[EventSpec, ...]) -> None:
        name, states_enum = self.name, self.State
        specs: dict[str, EventSpec] = {}
        transitions: list[TransitionSpec] = []
        for event in events:
            if not isinstance(event, EventSpec):
                raise LifecycleError(name, f"events must be kvfsm.EventSpec; got {type(event).__name__}: {event!r}")
            _identifier(name, "an event name", event.name)
            if event.name in RESERVED_NAMES:
                raise LifecycleError(
                    name,
                    f"event {event.name!r} is reserved (fail, timeout and abort come with every lifecycle; "
                    "the handle has the other names already)",
                )
            if event.name in specs:
                raise LifecycleError(name, f"event {event.name!r} is declared twice")
            if not event.sources:
                raise LifecycleError(name, f"event {event.name!r} has no source state")
            sources = []
            for source in event.sources:
                if source not in states_enum.__members__:
                    raise LifecycleError(name, f"event {event.name!r} starts in undeclared state {source!r}")
                member = states_enum[source]
                if member in self.terminal:
                    raise LifecycleError(
                        name, f"event {event.name!r} leaves terminal state {source!r} (terminal states absorb)"
                    )
                if member in sources:
                    raise LifecycleError(name, f"event {event.name!r} names source {source!r} twice")
                sources.append(member)
            dest: StateT | None = None
            if event.dest is not None:
                if event.dest not in states_enum.__members__:
                    raise LifecycleError(name, f"event {event.name!r} goes to undeclared state {event.dest!r}")
                dest = states_enum[event.dest]
                if dest is self.failure:
                    raise LifecycleError(
                        name, f"event {event.name!r} goes to the failure state: use fail(reason), which carries why"
                    )
                if event.args:
                    raise LifecycleError(
                        name,
                        f"event {event.name!r} moves the room, so it takes no arguments (got "
                        f"{', '.join(a.name for a in event.args)}); only internal events record progress",
                    )
            else:
                self._check_progress_args(event)
            specs[event.name] = event
            transitions.append(TransitionSpec(event.name, tuple(sources), dest, event.doc))
        live = self.non_terminal
        transitions += [
            TransitionSpec("fail", live, self.failure, "a backend or peer reported a structured failure"),
            TransitionSpec("timeout", live, self.failure, "the current phase's deadline passed"),
            TransitionSpec("abort", live, self.failure, "the server gave up on the request"),
        ]
        self.event_specs = specs
        self.transitions = tuple(transitions)
        self.events = tuple(t.event for t in transitions)
        self.failure_events = frozenset(FREE_EVENTS)
        rows = [
            Row(t.event, (source,), source if t.dest is None else t.dest, (), t.doc)
            for t in transitions
            for source in t.sources
        ]
        try:
            self.table = Table(name, states_enum, tuple(rows), self.doc)
        except ValueError as exc:  # pragma: no cover - duplicates are refused above
            raise LifecycleError(name, str(exc)) from None

    def _check_progress_args(self, event: EventSpec) -> None:
        seen: set[str] = set()
        for arg in event.args:
            if not isinstance(arg, EventArg):
                raise LifecycleError(self.name, f"event {event.name!r}: args must be kvfsm.EventArg; got {arg!r}")
            known = PROGRESS_ARGS.get(arg.name)
            if known is None or arg.kind is not known.kind:
                allowed = ", ".join(f"{a.name}: {a.kind.__name__}" for a in PROGRESS_ARGS.values())
                raise LifecycleError(
                    self.name,
                    f"internal event {event.name!r} takes progress arguments only ({allowed}); got "
                    f"{arg.name}: {getattr(arg.kind, '__name__', arg.kind)}",
                )
            if arg.name in seen:
                raise LifecycleError(self.name, f"event {event.name!r} names argument {arg.name!r} twice")
            seen.add(arg.name)
        defaults = [a.default is not NO_DEFAULT for a in event.args]
        if defaults != sorted(defaults):
            raise LifecycleError(self.name, f"event {event.name!r}: arguments with defaults must come last")

    def _check_graph(self) -> None:
        name = self.name
        forward: dict[StateT, set[StateT]] = {s: set() for s in self.State}
        for t in self.transitions:
            for source in t.sources:
                if t.dest is not None:
                    forward[source].add(t.dest)
                backwards = t.dest is not None and self.reports[t.dest] < self.reports[source]
                if backwards and t.event not in FREE_EVENTS:
                    raise LifecycleError(
                        name,
                        f"event {t.event!r} goes from {source.name} (reports {self.reports[source].name}) back to "
                        f"{t.dest.name} (reports {self.reports[t.dest].name}): forward steps never report less",
                    )
        reached = {self.initial}
        todo = deque([self.initial])
        while todo:
            for dest in forward[todo.popleft()]:
                if dest not in reached:
                    reached.add(dest)
                    todo.append(dest)
        unreached = [s.name for s in self.State if s not in reached]
        if unreached:
            raise LifecycleError(name, f"states {', '.join(unreached)} cannot be reached from {self.initial.name}")
        for state in self.non_terminal:
            ways = [
                t.event
                for t in self.transitions
                if state in t.sources and t.dest is not None and t.event not in FREE_EVENTS
            ]
            if not ways:
                raise LifecycleError(name, f"live state {state.name} has no way forward (only fail/timeout/abort)")

    def _make_timeouts(self, drain: float | None, class_name: str | None) -> None:
        fields: dict[str, Any] = {}
        defaults = {spec.phase: spec.timeout for spec in self.state_specs if spec.phase is not None}
        for phase in self.phases:
            fields[phase] = attrs.field(default=defaults[phase], validator=_seconds_or_none(phase))
        _seconds_or_none("drain")(None, None, drain)  # type: ignore[arg-type]
        fields["drain"] = attrs.field(default=drain, validator=_seconds_or_none("drain"))
        cls_name = class_name or f"{_camel(self.name)}Timeouts"
        cls: Any = attrs.make_class(cls_name, fields, bases=(PhaseTimeouts,), frozen=True, slots=True)
        cls.__module__ = __name__
        cls.__doc__ = (
            f"Deadlines in seconds of lifecycle {self.name!r}, one per phase ({', '.join(self.phases) or 'none'}), "
            "measured from entering it, and `drain`, how long a failed room's pages wait for proof that no write "
            "can land before they are quarantined. `None` means no deadline."
        )
        cls.lifecycle = self
        cls.phases = self.phases
        self.Timeouts = cls
        _BY_ENUM.setdefault(self.State, self)

    def __setattr__(self, attr: str, value: object) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"kvfsm.Lifecycle {self.name!r} is immutable; cannot set {attr!r}")
        object.__setattr__(self, attr, value)

    # -- reads ---------------------------------------------------------------------------

    def spec(self, state: StateT) -> StateSpec:
        """The declaration of `state`."""
        return self._specs_by_value[state]

    def phase_of(self, state: StateT) -> str | None:
        """The deadline phase of `state` (None: no deadline, or terminal)."""
        return self._phase_by_value[state]

    def allowed_events(self, state: StateT) -> tuple[str, ...]:
        """Events the lifecycle accepts in `state`, in declaration order."""
        return self.table.allowed(state)

    def is_internal(self, event: str) -> bool:
        spec = self.event_specs.get(event)
        return spec is not None and spec.internal

    def forward_events(self, current: StateT, target: KVPoll) -> tuple[str, ...]:
        """The shortest chain of forward events from `current` to a state reporting `target`.

        Empty when `current` already reports `target` or more (what `max`
        made a no-op), or when no chain leads there. SGLang's legacy integer
        writes (`update_status`) are translated with it.
        """
        if self.reports[current] >= target:
            return ()
        paths: dict[StateT, tuple[str, ...]] = {current: ()}
        todo = deque([current])
        while todo:
            state = todo.popleft()
            for t in self.transitions:
                if t.event in FREE_EVENTS or t.dest is None or state not in t.sources or t.dest in paths:
                    continue
                path = (*paths[state], t.event)
                if self.reports[t.dest] >= target:
                    return path if self.reports[t.dest] == target else ()
                paths[t.dest] = path
                todo.append(t.dest)
        return ()

    def event_into(self, target: KVPoll) -> str | None:
        """The first forward event whose destination reports `target` (None: none does)."""
        for t in self.transitions:
            if t.event not in FREE_EVENTS and t.dest is not None and self.reports[t.dest] is target:
                return t.event
        return None

    def __repr__(self) -> str:
        states = ", ".join(m.name for m in self.State)
        return f"<kvfsm.Lifecycle {self.name!r}: {states}>"

    def __reduce__(self) -> str | tuple[Any, ...]:
        raise TypeError(f"kvfsm.Lifecycle {self.name!r} is not picklable: import it by name instead")


#: The lifecycle each state enum belongs to (the first declared, for `KVPoll`: every
#: lifecycle whose states are KVPoll's reports and terminates them alike).
_BY_ENUM: dict[type[enum.IntEnum], Lifecycle] = {}


def lifecycle_of(state: StateT) -> Lifecycle:
    """The lifecycle a state belongs to (`KV_LIFECYCLE` for a `KVPoll`); what observers read reports from."""
    return _BY_ENUM[type(state)]


# -- the KV transfer lifecycle of DESIGN.md ---------------------------------------------------

KV_LIFECYCLE = Lifecycle(
    "kv",
    doc="One KV transfer between a prefill (sender) and a decode (receiver): SGLang's KVPoll lifecycle.",
    states=(
        StateSpec(
            "Bootstrapping",
            KVPoll.Bootstrapping,
            phase="bootstrap",
            timeout=300.0,
            doc="the two sides find each other and exchange metadata",
        ),
        StateSpec(
            "WaitingForInput",
            KVPoll.WaitingForInput,
            phase="waiting",
            timeout=300.0,
            doc="both sides know each other; waiting for the first chunk",
        ),
        StateSpec(
            "Transferring",
            KVPoll.Transferring,
            phase="transferring",
            timeout=None,
            doc="chunks are being written",
        ),
        StateSpec("Success", KVPoll.Success, terminal=True, doc="every chunk and the commit marker landed"),
        StateSpec("Failed", KVPoll.Failed, terminal=True, failure=True, doc="failed, timed out or aborted"),
    ),
    events=(
        EventSpec(
            "bootstrapped",
            ("Bootstrapping",),
            "WaitingForInput",
            doc="handshake done: the peer is known and both sides hold each other's metadata",
        ),
        EventSpec("transfer_started", ("WaitingForInput",), "Transferring", doc="the first chunk's write was issued"),
        EventSpec(
            "chunk_done",
            ("Transferring",),
            None,
            (PROGRESS_ARGS["nbytes"], PROGRESS_ARGS["last"]),
            doc="one chunk landed (progress only: bytes, last-chunk time)",
        ),
        EventSpec("transfer_done", ("Transferring",), "Success", doc="every chunk and the commit marker landed"),
    ),
    initial="Bootstrapping",
    timeouts_name="Timeouts",
)

#: The KV lifecycle's states no event can leave.
TERMINAL: frozenset[KVPoll] = KV_LIFECYCLE.terminal  # type: ignore[assignment]
#: The KV lifecycle's live states, in lifecycle order.
NON_TERMINAL: tuple[KVPoll, ...] = KV_LIFECYCLE.non_terminal  # type: ignore[assignment]
#: Events that end a room in its failure state; each needs a `FailureReason`.
FAILURE_EVENTS: frozenset[str] = KV_LIFECYCLE.failure_events

if TYPE_CHECKING:  # what the type checker sees of the generated class (a test checks they agree)

    @attrs.frozen(slots=True)
    class Timeouts(PhaseTimeouts):
        """Deadlines in seconds of the KV lifecycle's phases, and `drain`."""

        bootstrap: float | None = 300.0
        waiting: float | None = 300.0
        transferring: float | None = None
        drain: float | None = 30.0

else:
    Timeouts = KV_LIFECYCLE.Timeouts


def lifecycle_by_name(spec: str) -> Lifecycle:
    """`module:NAME` (or `module.NAME`) -> the Lifecycle it names; what the CLI's `--lifecycle` takes."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"a lifecycle is named module:NAME (e.g. kvfsm.lifecycles:KV_OFFLOAD); got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} of lifecycle {spec!r}: {exc}") from None
    value = getattr(module, attr, None)
    if not isinstance(value, Lifecycle):
        raise ConfigError(f"{spec!r} is not a kvfsm.Lifecycle; got {type(value).__name__}")
    return value
