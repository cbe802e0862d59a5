"""Builds the `transitions` machine from a lifecycle, and the engines that run it.

A `Lifecycle` (`_lifecycle.py`) becomes one `transitions.Machine` per role
and lifecycle, with the hooks of `_status.py` as its on-enter/on-exit
callbacks (which hook runs on which state is derived from each state's
declaration, `_status.hooks_for`). That machine is the source of truth:
diagrams are drawn from it and the dispatch rows below are read from it,
never from the declaration directly.

Rooms are never registered with the machine (`add_model` is O(n) and
attaches ~20 methods to every model) and no machine is built per room
(~133 µs each). Two engines run the same machine on unregistered records,
over the same dispatch rows (`Engine`, their base: one list per event
indexed by state value, each cell a `Step` with the exit hooks, the
destination and the entry hooks):

* `CompiledEngine` (the default, for every lifecycle) generates one
  function per step from the hooks' source lines (see
  `_status.status_hook`), specialised for one manager's table: exit hooks,
  the state change and entry hooks in the order `transitions` runs them,
  with no call per hook and no lookup of the table. The manager pastes
  the same lines into its handles' event methods (`_fastpath.py`).
* `TransitionsEngine` calls `machine.events[name].trigger(record, ...)`:
  `transitions` itself runs the callbacks, and nothing is generated. It
  exists as the reference the compiled engine is proven equal to (see
  tests/property), and as a fallback should someone extend the machine
  with features the compiler refuses (conditions, prepare/after callbacks).

Both pass `(record, now, reason)` as the trigger arguments, so the hooks see
identical calls whichever engine runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import CodeType
from typing import Any

from transitions import Machine
from transitions.core import EventData

from . import _status
from ._lifecycle import KV_LIFECYCLE, Lifecycle
from ._states import FailureReason, Role, State
from ._status import Hook, RoomRecord, StatusTable, inline_lines, state_name

__all__ = [
    "build_machine",
    "lifecycle_machine",
    "Step",
    "StepRun",
    "Engine",
    "CompiledEngine",
    "TransitionsEngine",
    "ENGINES",
    "indent",
    "compile_source",
]

#: A compiled step: (room, now, reason) -> None, the hooks of one transition.
StepRun = Callable[[RoomRecord, float, FailureReason | None], None]


def build_machine(
    role: Role | str,
    *,
    lifecycle: Lifecycle = KV_LIFECYCLE,
    machine_cls: type[Machine] = Machine,
    **options: Any,
) -> Machine:
    """A fresh `transitions` machine of `lifecycle` for `role`.

    `machine_cls` lets the diagram code build a `GraphMachine` from the very
    same declaration; `options` are passed through (e.g. `graph_engine`).
    Auto transitions are always off: `to_Success()` would bypass every rule.
    """
    role = Role.coerce(role)
    if not isinstance(lifecycle, Lifecycle):
        raise TypeError(f"lifecycle must be a kvfsm.Lifecycle; got {type(lifecycle).__name__}: {lifecycle!r}")
    # Fresh dicts each time: transitions writes into the dicts it is given.
    states = []
    for state in lifecycle.State:
        enter, exit_ = _status.hooks_for(lifecycle, state)
        states.append({"name": state, "on_enter": list(enter), "on_exit": list(exit_)})
    transitions = [
        {
            "trigger": spec.event,
            "source": list(spec.sources),
            "dest": spec.dest,
            "before": [_status.record_failure] if spec.dest is lifecycle.failure else [],
        }
        for spec in lifecycle.transitions
    ]
    suffix = "" if lifecycle is KV_LIFECYCLE else f"-{lifecycle.name}"
    return machine_cls(
        model=None,
        states=states,
        transitions=transitions,
        initial=lifecycle.initial,
        auto_transitions=False,
        send_event=False,
        name=f"kvfsm-{role.value}{suffix}",
        **options,
    )


@functools.cache
def _shared_machine(role: Role, lifecycle: Lifecycle) -> Machine:
    return build_machine(role, lifecycle=lifecycle)


def lifecycle_machine(role: Role | str, lifecycle: Lifecycle = KV_LIFECYCLE) -> Machine:
    """The shared machine of `role` and `lifecycle`: built once, used by every room of every manager."""
    return _shared_machine(Role.coerce(role), lifecycle)


class Step:
    """What firing one event from one state does (a dispatch-table cell).

    `lines` is the step as source (exit hooks, state change, entry hooks,
    specialised for one table) and `run` that source compiled; both are
    empty for internal steps, which change no state and run no hook.
    """

    __slots__ = ("before_hooks", "dest", "enter_hooks", "event", "exit_hooks", "lines", "run", "source")

    def __init__(
        self,
        event: str,
        source: State,
        dest: State | None,
        exit_hooks: tuple[Hook, ...],
        enter_hooks: tuple[Hook, ...],
        before_hooks: tuple[Hook, ...] = (),
    ) -> None:
        self.event = event
        self.source = source
        self.dest = dest
        self.before_hooks = before_hooks
        self.exit_hooks = exit_hooks
        self.enter_hooks = enter_hooks
        self.lines: tuple[str, ...] = ()
        self.run: StepRun = _nothing

    def __repr__(self) -> str:
        dest = self.dest.name if self.dest is not None else "(internal)"
        return f"Step({self.event}: {self.source.name} -> {dest})"


def _nothing(room: RoomRecord, now: float, reason: FailureReason | None) -> None:
    """The run of an internal step: progress is the manager's, not a hook's."""


def _hooks(callbacks: list[Any]) -> tuple[Hook, ...]:
    """The machine's callbacks as direct calls (names are not resolved here)."""
    for callback in callbacks:
        if not callable(callback):
            raise NotImplementedError(f"the compiled engine calls callables only; got callback {callback!r}")
    return tuple(callbacks)


def _compile(machine: Machine, lifecycle: Lifecycle) -> dict[str, list[Step | None]]:
    """Read the machine's events into rows indexed by source state value."""
    State = lifecycle.State
    rows: dict[str, list[Step | None]] = {}
    for name, event in machine.events.items():
        row: list[Step | None] = [None] * len(State)
        for source_name, candidates in event.transitions.items():
            transition = candidates[0]
            if (
                len(candidates) > 1
                or transition.conditions
                or transition.prepare
                or transition.after
                or machine.before_state_change
                or machine.after_state_change
            ):
                raise NotImplementedError(
                    f"the compiled engine runs unconditional transitions only; event {name!r} from "
                    f"{source_name} has guards, prepare or after callbacks: use engine='transitions'"
                )
            source = State[source_name]
            if transition.dest is None:
                row[source] = Step(name, source, None, (), ())
            else:
                dest = State[transition.dest]
                row[source] = Step(
                    name,
                    source,
                    dest,
                    _hooks(machine.get_state(source_name).on_exit),
                    _hooks(machine.get_state(dest).on_enter),
                    _hooks(transition.before),
                )
        rows[name] = row
    missing = set(lifecycle.events) - rows.keys()
    if missing:  # pragma: no cover - guards against a machine built from another table
        raise ValueError(f"machine lacks events {sorted(missing)}")
    return rows


def indent(lines: list[str] | tuple[str, ...], depth: int) -> list[str]:
    """`lines` indented by `depth` levels of four spaces."""
    pad = "    " * depth
    return [pad + line for line in lines]


def compile_source(source: str, filename: str) -> CodeType:
    """Generated source as code private to one manager.

    Compiled once per distinct source, then copied: CPython specialises
    each instruction to the globals it last saw, and the generated
    functions' globals are their manager's names, so two managers sharing
    one code object would keep undoing each other's specialisations (28 %
    slower per lifecycle when two managers of one role interleave).
    """
    return _private_copy(_compile_once(source, filename))


@functools.lru_cache(maxsize=64)
def _compile_once(source: str, filename: str) -> CodeType:
    return compile(source, filename, "exec")


def _private_copy(code: CodeType) -> CodeType:
    consts = tuple(_private_copy(c) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_consts=consts)


class Engine:
    """What both engines share: the machine, its table, and the dispatch rows read from the machine.

    The manager decides from `rows` whether an event applies (it needs the
    allowed events for its errors before anything runs); the engine runs
    the step: `enter_initial` at open, `fire` for a transition, `retire`
    at close, `hold_pages` (with `enter_initial`) the release phase's start.
    """

    name = "?"

    def __init__(self, machine: Machine, table: StatusTable) -> None:
        self.machine = machine
        self.table = table
        self.lifecycle: Lifecycle = table.lifecycle
        self.rows = _compile(machine, self.lifecycle)
        self._initial_hooks = _hooks(machine.get_state(self.lifecycle.initial).on_enter)
        #: Puts a new room in the initial state (its pages held); each engine sets its own.
        self._enter_initial: StepRun = _nothing
        #: Forgets a closed terminal room (`_status.retire`).
        self.retire: StepRun = _status.retire

    def enter_initial(self, room: RoomRecord, now: float) -> None:
        self._enter_initial(room, now, None)

    def fire(self, room: RoomRecord, step: Step, now: float, reason: FailureReason | None) -> None:
        raise NotImplementedError  # pragma: no cover - each engine has its own


class CompiledEngine(Engine):
    """Runs the machine's hooks as code generated from the machine's callbacks.

    One engine per manager: the generated code is specialised for that
    manager's `StatusTable` (its dicts and deadlines are bound by name in
    `namespace`, which the manager's fast path shares).
    """

    name = "compiled"

    def __init__(self, machine: Machine, table: StatusTable) -> None:
        super().__init__(machine, table)
        initial = self.lifecycle.initial
        self.namespace: dict[str, Any] = table.inline_names()
        self._callback_names: dict[Hook, str] = {}
        self.initial_lines = tuple(
            ["room.state = " + state_name(initial)]
            + inline_lines(_status.hold_pages, initial, table)
            + [line for hook in self._initial_hooks for line in self._hook_lines(hook, initial)]
        )
        source = ["def enter_initial(room, now, reason):", *indent(self.initial_lines, 1)]
        # The state argument only matters to ARM/DISARM lines, which retire has none of.
        source += ["def retire(room, now, reason):", *indent(self._hook_lines(_status.retire, initial), 1)]
        for row in self.rows.values():
            for step in row:
                if step is None or step.dest is None:
                    continue
                # The order transitions runs them in: before, exit, state change, enter.
                lines = [line for hook in step.before_hooks for line in self._hook_lines(hook, step.source)]
                lines += [line for hook in step.exit_hooks for line in self._hook_lines(hook, step.source)]
                lines.append("room.state = " + state_name(step.dest))
                lines += [line for hook in step.enter_hooks for line in self._hook_lines(hook, step.dest)]
                step.lines = tuple(lines)
                source += [f"def {step.event}_from_{step.source.name}(room, now, reason):", *indent(lines, 1)]
        self.source = "\n".join(source) + "\n"
        exec(compile_source(self.source, f"<kvfsm compiled steps of {machine.name}>"), self.namespace)
        for row in self.rows.values():
            for step in row:
                if step is not None and step.dest is not None:
                    step.run = self.namespace[f"{step.event}_from_{step.source.name}"]
        self._enter_initial = self.namespace["enter_initial"]
        # `_status.retire`, compiled.
        self.retire = self.namespace["retire"]

    def _hook_lines(self, hook: Hook, state: State) -> list[str]:
        """A hook's source lines, or a plain call for a callback without them.

        A callback someone added to the machine (not made by `status_hook`) still runs,
        in its place in the order, just not pasted in. Names follow the order
        callbacks are met, so managers of one machine generate the same source.
        """
        if getattr(hook, "__kvfsm_inline__", None) is not None:
            return inline_lines(hook, state, self.table)
        name = self._callback_names.get(hook)
        if name is None:
            name = self._callback_names[hook] = f"callback_{len(self._callback_names)}"
            self.namespace[name] = hook
        return [f"{name}(room, now, reason)"]

    def fire(self, room: RoomRecord, step: Step, now: float, reason: FailureReason | None) -> None:
        step.run(room, now, reason)


class TransitionsEngine(Engine):
    """Lets `transitions` itself run every event (the reference engine).

    Validity is still decided from the dispatch rows (the manager needs the
    allowed events for its errors before anything runs); the state change
    and every callback are `transitions`' own: `machine.events[e].trigger`
    on the unregistered record, with the record, the clock reading and the
    reason as arguments. It generates no code: the hooks run as the
    callables `status_hook` made from their lines.
    """

    name = "transitions"

    def __init__(self, machine: Machine, table: StatusTable) -> None:
        super().__init__(machine, table)
        self._enter_initial = self._trigger_initial

    def _trigger_initial(self, room: RoomRecord, now: float, reason: FailureReason | None) -> None:
        machine = self.machine
        initial = self.lifecycle.initial
        state = machine.get_state(initial)
        room.state = initial  # type: ignore[assignment]  # a lifecycle state (see TransferHandle.state)
        _status.hold_pages(room, now, None)
        state.enter(EventData(state, None, machine, room, args=(room, now, None), kwargs={}))

    def fire(self, room: RoomRecord, step: Step, now: float, reason: FailureReason | None) -> None:
        if not self.machine.events[step.event].trigger(room, room, now, reason):  # pragma: no cover
            raise AssertionError(f"transitions refused {step!r} for room {room.room!r}")


ENGINES: dict[str, type[Engine]] = {"compiled": CompiledEngine, "transitions": TransitionsEngine}
