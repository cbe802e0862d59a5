"""Builds the `transitions` machine from the table, and the engines that run it.

The declaration in `_table.py` becomes one `transitions.Machine` per role,
with the hooks of `_status.py` as its on-enter/on-exit callbacks. That
machine is the source of truth: diagrams are drawn from it and the
dispatch table below is compiled from it, never from the table directly.

Rooms are never registered with the machine (`add_model` is O(n) and
attaches ~20 methods to every model) and no machine is built per room
(~133 µs each). Two engines run the same machine on unregistered records:

* `CompiledEngine` (the default) reads the machine's events once into a
  list per event indexed by `KVPoll` value: each cell holds the exit hooks,
  the destination and the entry hooks. Firing is a list index and a few
  direct calls (about 20x cheaper than going through `transitions`).
* `TransitionsEngine` calls `machine.events[name].trigger(record, ...)`:
  `transitions` itself runs the callbacks. It exists as the reference the
  compiled engine is proven equal to (see tests/property), and as a
  fallback should someone extend the machine with features the compiler
  refuses (conditions, before/after callbacks).

Both pass `(record, now, reason)` as the trigger arguments, so the hooks see
identical calls whichever engine runs them.
"""

from __future__ import annotations

import functools
from typing import Any

from transitions import Machine
from transitions.core import EventData

from . import _status
from ._states import NON_TERMINAL, FailureReason, KVPoll, Role
from ._status import Hook, RoomRecord
from ._table import EVENTS, INITIAL, TRANSITIONS

__all__ = ["build_machine", "lifecycle_machine", "Step", "CompiledEngine", "TransitionsEngine", "ENGINES"]

_ENTER_HOOKS: dict[KVPoll, tuple[Hook, ...]] = {
    KVPoll.Bootstrapping: (_status.enter_phase,),
    KVPoll.WaitingForInput: (_status.enter_phase,),
    KVPoll.Transferring: (_status.enter_transferring,),
    KVPoll.Success: (_status.enter_success,),
    KVPoll.Failed: (_status.enter_failed,),
}
_EXIT_HOOKS: dict[KVPoll, tuple[Hook, ...]] = {state: (_status.exit_phase,) for state in NON_TERMINAL}


def build_machine(role: Role | str, *, machine_cls: type[Machine] = Machine, **options: Any) -> Machine:
    """A fresh `transitions` machine of the lifecycle for `role`.

    `machine_cls` lets the diagram code build a `GraphMachine` from the very
    same declaration; `options` are passed through (e.g. `graph_engine`).
    Auto transitions are always off: `to_Success()` would bypass every rule.
    """
    role = Role.coerce(role)
    # Fresh dicts each time: transitions writes into the dicts it is given.
    states = [
        {
            "name": state,
            "on_enter": list(_ENTER_HOOKS[state]),
            "on_exit": list(_EXIT_HOOKS.get(state, ())),
        }
        for state in KVPoll
    ]
    transitions = [{"trigger": spec.event, "source": list(spec.sources), "dest": spec.dest} for spec in TRANSITIONS]
    return machine_cls(
        model=None,
        states=states,
        transitions=transitions,
        initial=INITIAL,
        auto_transitions=False,
        send_event=False,
        name=f"kvfsm-{role.value}",
        **options,
    )


@functools.cache
def lifecycle_machine(role: Role) -> Machine:
    """The shared machine of `role`: built once, used by every room of every manager."""
    return build_machine(role)


class Step:
    """What firing one event from one state does (a dispatch-table cell)."""

    __slots__ = ("dest", "enter_hooks", "event", "exit_hooks", "source")

    def __init__(
        self,
        event: str,
        source: KVPoll,
        dest: KVPoll | None,
        exit_hooks: tuple[Hook, ...],
        enter_hooks: tuple[Hook, ...],
    ) -> None:
        self.event = event
        self.source = source
        self.dest = dest
        self.exit_hooks = exit_hooks
        self.enter_hooks = enter_hooks

    def __repr__(self) -> str:
        dest = self.dest.name if self.dest is not None else "(internal)"
        return f"Step({self.event}: {self.source.name} -> {dest})"


def _hooks(callbacks: list[Any]) -> tuple[Hook, ...]:
    """The machine's callbacks as direct calls (names are not resolved here)."""
    for callback in callbacks:
        if not callable(callback):
            raise NotImplementedError(f"the compiled engine calls callables only; got callback {callback!r}")
    return tuple(callbacks)


def _compile(machine: Machine) -> dict[str, list[Step | None]]:
    """Read the machine's events into rows indexed by source state value."""
    rows: dict[str, list[Step | None]] = {}
    for name, event in machine.events.items():
        row: list[Step | None] = [None] * len(KVPoll)
        for source_name, candidates in event.transitions.items():
            transition = candidates[0]
            if (
                len(candidates) > 1
                or transition.conditions
                or transition.prepare
                or transition.before
                or transition.after
            ):
                raise NotImplementedError(
                    f"the compiled engine runs unconditional transitions only; event {name!r} from "
                    f"{source_name} has guards or callbacks: use engine='transitions'"
                )
            source = KVPoll[source_name]
            if transition.dest is None:
                row[source] = Step(name, source, None, (), ())
            else:
                dest = KVPoll[transition.dest]
                row[source] = Step(
                    name,
                    source,
                    dest,
                    _hooks(machine.get_state(source_name).on_exit),
                    _hooks(machine.get_state(dest).on_enter),
                )
        rows[name] = row
    missing = set(EVENTS) - rows.keys()
    if missing:  # pragma: no cover - guards against a machine built from another table
        raise ValueError(f"machine lacks events {sorted(missing)}")
    return rows


class CompiledEngine:
    """Runs the machine's hooks from a table compiled out of the machine."""

    name = "compiled"

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.rows = _compile(machine)
        self._initial_hooks = _hooks(machine.get_state(INITIAL).on_enter)

    def enter_initial(self, room: RoomRecord, now: float) -> None:
        for hook in self._initial_hooks:
            hook(room, now, None)

    def fire(self, room: RoomRecord, step: Step, now: float, reason: FailureReason | None) -> None:
        for hook in step.exit_hooks:
            hook(room, now, reason)
        dest = step.dest
        if dest is not None:
            room.state = dest
            for hook in step.enter_hooks:
                hook(room, now, reason)


class TransitionsEngine(CompiledEngine):
    """Lets `transitions` itself run every event (the reference engine).

    Validity is still decided from the compiled rows (the manager needs the
    allowed events for its errors before anything runs); the state change
    and its callbacks are `transitions`' own.
    """

    name = "transitions"

    def enter_initial(self, room: RoomRecord, now: float) -> None:
        machine = self.machine
        state = machine.get_state(INITIAL)
        state.enter(EventData(state, None, machine, room, args=(room, now, None), kwargs={}))

    def fire(self, room: RoomRecord, step: Step, now: float, reason: FailureReason | None) -> None:
        if not self.machine.events[step.event].trigger(room, room, now, reason):  # pragma: no cover
            raise AssertionError(f"transitions refused {step!r} for room {room.room!r}")


ENGINES: dict[str, type[CompiledEngine]] = {"compiled": CompiledEngine, "transitions": TransitionsEngine}
