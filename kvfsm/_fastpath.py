"""The compiled engine's fast path: event methods generated for one manager.

A scheduler polls every in-flight room every iteration and a busy node runs
thousands of transfers a second, so an event must cost about what a
hand-written `if state == X: state = Y; status[room] = Y` costs. This module
generates, once per manager, a subclass of `TransferHandle` whose event
methods do exactly that much and nothing else on the common path:

    take the lock, read the clock; if no deadline is due and nobody
    observes, and the room is in a state the machine accepts the event in,
    run the step's lines (the machine's exit and entry hooks, pasted in by
    the compiled engine) and return True.

Everything else (a deadline is due, observers want notices, the event is
late, stale or out of order, an argument needs validation) falls back to
the generic handle method, which goes through `TransferManager._fire`, the
single choke point. So the fast path is only ever a shortcut of the slow
one: same hooks, same lock, same results, as the engine-equivalence
property test checks against the `transitions` engine.

The rows come from the compiled machine, never from the table directly:
which states accept which event, and what each step does, is read from the
`transitions` machine the lifecycle was declared into. The methods
themselves are generated from the lifecycle's event specs (`_signature`:
parameters, the guard that lets arguments through unchecked, the progress
an internal event records), the same specs the generic methods of the
handle base are made from (`_manager.handle_base`): one list of events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._lifecycle import NO_DEFAULT, EventSpec
from ._machine import CompiledEngine, compile_source, indent
from ._states import MAX_REASON_CHARS, FailureKind, FailureReason, Role, State, bounded_message
from ._status import state_name

__all__ = ["handle_class", "new_reason", "FastPathHost", "progress_lines", "signature"]


class FastPathHost(Protocol):
    """What the generated methods use of their manager (`TransferManager` has it).

    Declared here so that this module, which the manager imports, needs
    nothing from the manager's module.
    """

    role: Role
    _lock: threading.Lock
    _clock: Callable[[], float]
    _observers: tuple[Any, ...]
    # Whether anyone observes each event (updated in place by the manager's `_watch`).
    _watching: dict[str, bool]

    def _log_failure(self, handle: Any, reason: FailureReason, /) -> None: ...


H = TypeVar("H", bound=type)

_new_object = object.__new__
# attrs' frozen slotted class: its fields are slot descriptors we may set once.
_FIELDS: dict[str, Any] = dict(FailureReason.__dict__)
_set_kind = _FIELDS["kind"].__set__
_set_message = _FIELDS["message"].__set__
_set_state = _FIELDS["state"].__set__
_set_from_peer = _FIELDS["from_peer"].__set__


def new_reason(kind: FailureKind, message: str, state: State | None, from_peer: bool = False) -> FailureReason:
    """A `FailureReason` from fields already known valid, without attrs' validators.

    Half the cost of the validating constructor; only for values the
    manager has checked itself (a `FailureKind`, a `str`, a `KVPoll`, a bool).
    """
    reason: FailureReason = _new_object(FailureReason)
    _set_kind(reason, kind)
    # The one conversion the constructor makes: a message too long for the wire is cut.
    _set_message(reason, message if len(message) <= MAX_REASON_CHARS else bounded_message(message))
    _set_state(reason, state)
    _set_from_peer(reason, from_peer)
    return reason


class _Signature:
    """How one handle event method takes its arguments, for the generator."""

    def __init__(self, params: str, args: str, guard: str | None, before: tuple[str, ...], after: tuple[str, ...]):
        self.params = params  # after `room`, as in the def
        self.args = args  # after `room`, as passed to the generic method
        self.guard = guard  # arguments the fast path takes as they are
        self.before = before  # under the lock, before the step (state is known)
        self.after = after  # after the lock, when the step was applied


_PLAIN = _Signature("", "", None, (), ())
#: The methods every lifecycle's handle has: abort and fail (timeout is the manager's).
_FREE: dict[str, _Signature] = {
    "abort": _Signature(
        ', reason="aborted"',
        ", reason",
        "reason.__class__ is str",
        (
            "stats.aborts += 1",
            "cached = abort_reasons_{index}.get(reason)",
            "reason = cached if cached is not None else abort_reason(abort_reasons_{index}, reason, {state})",
        ),
        (
            "if info_enabled(INFO):",
            '    logger.info("kvfsm %s room %r aborted: %s", role_name, room.room, reason)',
        ),
    ),
    "fail": _Signature(
        ", reason",
        ", reason",
        "reason.__class__ is FailureReason",
        (
            "if reason.state is None:",
            "    reason = new_reason(reason.kind, reason.message, state, reason.from_peer)",
        ),
        ("log_failure(room, reason)",),
    ),
}


def signature(spec: EventSpec) -> _Signature:
    """How the handle method of a declared event takes its arguments (from its `EventArg`s)."""
    if not spec.args:
        return _PLAIN
    params = "".join(f", {a.name}" + ("" if a.default is NO_DEFAULT else f"={a.default!r}") for a in spec.args)
    args = "".join(f", {a.name}" for a in spec.args)
    guards = [
        f"{a.name}.__class__ is {a.kind.__name__}" + ("" if a.minimum is None else f" and {a.name} >= {a.minimum}")
        for a in spec.args
        if a.kind is not bool  # a bool is taken for its truth, as the generic method does
    ]
    return _Signature(params, args, " and ".join(guards) or None, (), ())


def progress_lines(spec: EventSpec) -> tuple[str, ...]:
    """What an internal event records on its room: bytes, a chunk, the last chunk's time."""
    names = {a.name for a in spec.args}
    lines = ["room.nbytes += nbytes"] if "nbytes" in names else []
    lines.append("room.chunks += 1")
    if "last" in names:
        lines += ["if last:", "    room.last_chunk_at = now"]
    return tuple(lines)


#: Distinct abort messages remembered per state: `FailureReason` is frozen,
#: so rooms aborted with the same text in the same state share one.
ABORT_REASONS_KEPT = 256


def abort_reason(cache: dict[str, FailureReason], message: str, state: State) -> FailureReason:
    """The reason of an abort with `message` in `state`, shared while the cache has room."""
    reason = new_reason(FailureKind.ABORTED, message, state)
    if len(cache) < ABORT_REASONS_KEPT:
        cache[message] = reason
    return reason


def _signatures(engine: CompiledEngine) -> dict[str, tuple[_Signature, tuple[str, ...]]]:
    """Every handle event method of the engine's lifecycle: its signature and (internal events) its progress."""
    lifecycle = engine.lifecycle
    out: dict[str, tuple[_Signature, tuple[str, ...]]] = {}
    for name, spec in lifecycle.event_specs.items():
        out[name] = (signature(spec), progress_lines(spec) if spec.internal else ())
    for name, sig in _FREE.items():
        out[name] = (sig, ())
    return out


def _method_source(event: str, engine: CompiledEngine, sig: _Signature, progress: tuple[str, ...]) -> list[str]:
    lines = [f"def {event}(room{sig.params}):"]
    if sig.guard is not None:
        lines += [f"    if not ({sig.guard}):", f"        return generic_{event}(room{sig.args})"]
    lines += [
        "    applied = False",
        "    acquire()",
        "    try:",
        "        now = clock()",
        f"        if now < deadlines.next_due and not watching[{event!r}]:",
        "            state = room.state",
    ]
    keyword = "if"
    for step in engine.rows[event]:
        if step is None:
            continue
        source = state_name(step.source)
        body = [line.format(index=step.source.value, state=source) for line in sig.before]
        body += progress if step.dest is None else step.lines
        lines += [
            f"            {keyword} state is {source}:",
            *indent(body, 4),
            "                applied = True",
        ]
        keyword = "elif"
    lines += ["    finally:", "        release()", "    if applied:", *indent(sig.after, 2)]
    lines += ["        return True", f"    return generic_{event}(room{sig.args})"]
    return lines


def handle_class(base: H, manager: FastPathHost, engine: CompiledEngine) -> H:
    """A subclass of `base` whose event methods run `engine`'s steps inline."""
    namespace: dict[str, Any] = engine.namespace
    logger = logging.getLogger("kvfsm")
    for state in engine.lifecycle.State:
        namespace[f"abort_reasons_{state.value}"] = {}
    namespace.update(
        acquire=manager._lock.acquire,
        release=manager._lock.release,
        clock=manager._clock,
        manager=manager,
        watching=manager._watching,
        new_reason=new_reason,
        FailureReason=FailureReason,
        ABORTED=FailureKind.ABORTED,
        logger=logger,
        info_enabled=logger.isEnabledFor,
        INFO=logging.INFO,
        abort_reason=abort_reason,
        role_name=manager.role.value,
        log_failure=manager._log_failure,
    )
    source: list[str] = []
    signatures = _signatures(engine)
    for event, (sig, progress) in signatures.items():
        namespace[f"generic_{event}"] = getattr(base, event)
        source += _method_source(event, engine, sig, progress)
    text = "\n".join(source) + "\n"
    exec(compile_source(text, f"<kvfsm fast path of {engine.machine.name}>"), namespace)
    methods = {event: namespace[event] for event in signatures}
    for event, method in methods.items():
        method.__doc__ = getattr(base, event).__doc__
        method.__qualname__ = f"{base.__name__}.{event}"
    cls = type(
        base.__name__, (base,), {"__slots__": (), "__module__": base.__module__, "_fast_source": text, **methods}
    )
    return cls  # type: ignore[return-value]
