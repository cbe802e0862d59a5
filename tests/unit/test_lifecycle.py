"""Lifecycles are values: the declaration is validated, immutable, and everything derives from it (issue 24)."""

from __future__ import annotations

import ast
import inspect
import pathlib
from typing import Any

import attrs
import pytest

import kvfsm
from kvfsm import EventSpec, KVPoll, Lifecycle, LifecycleError, StateSpec, TransferManager
from kvfsm._manager import handle_base
from kvfsm.compat import sglang
from kvfsm.lifecycles import KV_OFFLOAD_LIFECYCLE, SHIPPED, STAGED_KV_LIFECYCLE
from tests.helpers import FakeClock

KV = kvfsm.KV_LIFECYCLE


def _states(*extra: StateSpec) -> tuple[StateSpec, ...]:
    return (
        StateSpec("A", KVPoll.Bootstrapping, phase="a", timeout=5.0),
        StateSpec("Done", KVPoll.Success, terminal=True),
        StateSpec("Broken", KVPoll.Failed, terminal=True, failure=True),
        *extra,
    )


def test_the_kv_lifecycle_keeps_every_public_name() -> None:
    assert KV.State is KVPoll
    assert frozenset({KVPoll.Success, KVPoll.Failed}) == kvfsm.TERMINAL
    assert (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring) == kvfsm.NON_TERMINAL
    assert kvfsm.EVENTS == (
        "bootstrapped",
        "transfer_started",
        "chunk_done",
        "transfer_done",
        "fail",
        "timeout",
        "abort",
    )
    assert [(t.event, t.sources, t.dest) for t in kvfsm.TRANSITIONS][2] == ("chunk_done", (KVPoll.Transferring,), None)
    assert kvfsm.Timeouts is KV.Timeouts
    assert kvfsm.Timeouts() == kvfsm.Timeouts(bootstrap=300.0, waiting=300.0, transferring=None, drain=30.0)
    assert kvfsm.Timeouts(1.0, 2.0, 3.0, 4.0).phase_limits() == {"bootstrap": 1.0, "waiting": 2.0, "transferring": 3.0}
    assert repr(kvfsm.Timeouts()) == "Timeouts(bootstrap=300.0, waiting=300.0, transferring=None, drain=30.0)"


def test_the_type_checkers_view_of_timeouts_and_handles_agrees_with_the_declaration() -> None:
    # _lifecycle.Timeouts and TransferHandle's stubs exist for mypy only; they must match what is generated.
    fields = [field.name for field in attrs.fields(kvfsm.Timeouts)]
    assert fields == [*KV.phases, "drain"]
    source = inspect.getsource(kvfsm.TransferHandle)
    for name, spec in KV.event_specs.items():
        assert f"def {name}(self" in source, f"TransferHandle has no type stub for {name}"
        generated = inspect.signature(getattr(handle_base(KV), name))
        assert [p.name for p in generated.parameters.values()] == ["self", *(a.name for a in spec.args)]


def test_a_lifecycle_is_immutable_and_not_a_second_list() -> None:
    with pytest.raises(AttributeError, match="immutable"):
        KV.initial = KVPoll.Success
    # One list: every declared event is a handle method, and nothing else is.
    for lifecycle in SHIPPED.values():
        methods = {n for n, v in vars(handle_base(lifecycle)).items() if callable(v) and not n.startswith("_")}
        assert methods == set(lifecycle.event_specs)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"states": _states(StateSpec("Also", KVPoll.Failed, terminal=True, failure=True))}, "exactly one state"),
        ({"states": _states(StateSpec("Z", KVPoll.Success))}, "must report Bootstrapping"),
        ({"states": _states(StateSpec("Z", KVPoll.Transferring, terminal=True))}, "must report Success"),
        ({"initial": "Nope"}, "initial state 'Nope' is not declared"),
        ({"events": (EventSpec("go", ("A",), "Broken"),)}, r"use fail\(reason\)"),
        ({"events": (EventSpec("abort", ("A",), "Done"),)}, "reserved"),
        ({"events": (EventSpec("state", ("A",), "Done"),)}, "reserved"),
        ({"events": (EventSpec("go", ("Done",), "A"),)}, "terminal states absorb"),
        ({"events": (EventSpec("go", ("A",), "Missing"),)}, "undeclared state"),
        ({"events": (EventSpec("tick", ("A",), None, (kvfsm.EventArg("n", int),)),)}, "progress arguments only"),
        (
            {
                "states": _states(StateSpec("B", KVPoll.WaitingForInput)),
                "events": (EventSpec("go", ("A",), "B"), EventSpec("end", ("A",), "Done")),
            },
            "no way forward",
        ),
        ({"states": _states(StateSpec("Lost", KVPoll.WaitingForInput))}, "cannot be reached"),
        (
            {
                "states": _states(StateSpec("B", KVPoll.Transferring)),
                "events": (
                    EventSpec("go", ("A",), "B"),
                    EventSpec("back", ("B",), "A"),
                    EventSpec("end", ("B",), "Done"),
                ),
            },
            "never report less",
        ),
        ({"states": _states(StateSpec("B", KVPoll.WaitingForInput, phase="drain"))}, "reserved"),
    ],
)
def test_a_bad_declaration_names_the_lifecycle_and_the_problem(kwargs: dict[str, Any], problem: str) -> None:
    declaration: dict[str, Any] = {
        "states": _states(),
        "events": (EventSpec("go", ("A",), "Done"),),
        "initial": "A",
        **kwargs,
    }
    with pytest.raises(LifecycleError, match=problem) as raised:
        Lifecycle("toy", **declaration)
    assert isinstance(raised.value, kvfsm.ConfigError) and isinstance(raised.value, ValueError)
    assert "lifecycle 'toy'" in str(raised.value)


def test_timeouts_must_be_the_lifecycles_own() -> None:
    with pytest.raises(TypeError, match="'kv-offload' lifecycle's Timeouts"):
        TransferManager("sender", lifecycle=KV_OFFLOAD_LIFECYCLE, timeouts=kvfsm.Timeouts())
    with pytest.raises(TypeError, match="unexpected keyword"):
        KV_OFFLOAD_LIFECYCLE.Timeouts(bootstrap=3.0)


def test_the_staged_lifecycle_reports_waiting_for_input_while_staging() -> None:
    clock = FakeClock()
    timeouts = STAGED_KV_LIFECYCLE.Timeouts(staging=2.0)
    manager = TransferManager("receiver", lifecycle=STAGED_KV_LIFECYCLE, timeouts=timeouts, clock=clock)
    handle: Any = manager.open(1)
    assert handle.bootstrapped() and handle.staging_started() and handle.chunk_staged(4096)
    staging = STAGED_KV_LIFECYCLE.State["Staging"]
    assert handle.state is staging and handle.status is KVPoll.WaitingForInput
    assert manager.status(1) is KVPoll.WaitingForInput  # what SGLang's MIN all-reduce sees
    assert manager.counts()[KVPoll.WaitingForInput] == 1 and manager.state_counts()[staging] == 1
    clock.advance(2.5)  # staging has a deadline of its own
    assert manager.status(1) is KVPoll.Failed
    assert handle.reason.kind is kvfsm.FailureKind.TIMEOUT and "staging deadline of 2s" in handle.reason.message
    # A room that needs no staging goes straight on: every backend drives it unchanged.
    direct: Any = manager.open(2)
    assert direct.bootstrapped() and direct.transfer_started() and direct.chunk_done(8, last=True)
    assert direct.transfer_done() and manager.status(2) is KVPoll.Success and direct.release_safe


def test_sglangs_endpoint_over_the_staged_lifecycle_sees_its_integers() -> None:
    with sglang.KVManager(sglang.KVArgs(), "decode", reaper=False, lifecycle=STAGED_KV_LIFECYCLE) as manager:
        receiver = sglang.KVReceiver(manager, "prefill-0:8998", 7)
        handle: Any = receiver.handle
        handle.bootstrapped()
        handle.staging_started()
        assert receiver.poll() is KVPoll.WaitingForInput and receiver.conclude_state is None
        # SGLang's legacy integer writes map onto the declared states, no arithmetic on KVPoll.
        assert manager.update_status(7, KVPoll.Transferring)
        assert handle.state is STAGED_KV_LIFECYCLE.State["Transferring"]
        assert manager.update_status(7, KVPoll.Success) and receiver.poll() is KVPoll.Success
        receiver.clear()


def test_the_offload_lifecycle_runs_on_both_engines_with_its_own_phases() -> None:
    for engine in ("compiled", "transitions"):
        clock = FakeClock()
        manager = TransferManager("sender", lifecycle=KV_OFFLOAD_LIFECYCLE, clock=clock, engine=engine)
        assert manager.timeouts == KV_OFFLOAD_LIFECYCLE.Timeouts(queued=30.0, writing=60.0, drain=30.0)
        ok: Any = manager.open("blocks-1")
        assert ok.write_started() and ok.chunk_written(1 << 20) and ok.chunk_written(1 << 20, last=True)
        assert ok.stored() and ok.state.name == "Stored" and ok.status is KVPoll.Success and ok.release_safe
        assert ok.nbytes == 2 << 20 and ok.transfer_latency == 0.0
        stuck: Any = manager.open("blocks-2")
        clock.advance(31.0)
        assert manager.check_deadlines() == ["blocks-2"]
        assert "queued deadline" in stuck.reason.message and not stuck.release_safe
        late: Any = manager.open("blocks-3")
        assert late.stored() is False and late.reason.kind is kvfsm.FailureKind.INVALID_EVENT
        assert manager.stats.final_states == {
            KV_OFFLOAD_LIFECYCLE.State["Stored"]: 1,
            KV_OFFLOAD_LIFECYCLE.State["Failed"]: 2,
        }
        assert not hasattr(ok, "bootstrapped")  # the KV events are not an offload's


def test_lifecycle_by_name_for_the_cli() -> None:
    from kvfsm._lifecycle import lifecycle_by_name

    assert lifecycle_by_name("kvfsm.lifecycles:KV_OFFLOAD_LIFECYCLE") is KV_OFFLOAD_LIFECYCLE
    with pytest.raises(kvfsm.ConfigError, match=r"not a kvfsm\.Lifecycle"):
        lifecycle_by_name("kvfsm.lifecycles:SHIPPED")


# -- no lifecycle state outside a declared machine ----------------------------------------------

#: Attributes that say where a room, its pages or a request stand; and flags that used to.
PROTECTED = {"state", "pages_state", "_view", "_view_reason", "_drain", "_failed_over_success"}
#: The only code allowed to assign them: the engines' state change, the request view's step,
#: and objects that are not rooms (their own records, named here with why).
ALLOWED = {
    ("kvfsm/_machine.py", "_trigger_initial"),  # the reference engine's initial state
    ("kvfsm/compat/sglang/_endpoint.py", "_bind"),  # the request view's initial state
    ("kvfsm/compat/sglang/_endpoint.py", "_step_view"),  # the request view's one writer
    ("kvfsm/metrics.py", "__call__"),  # metrics' own mirror of each room (_Room), fed by notices
    ("kvfsm/metrics.py", "__init__"),
}
#: Files whose `.state` is not a room's: an exception's record of the state it names, a peer
#: session's handshake, and the bench's hand-written baselines (outside the machine by design).
ALLOWED_FILES = {"kvfsm/_errors.py", "kvfsm/backends/_sessions.py", "kvfsm/tools/_baselines.py"}


def _writes(path: pathlib.Path) -> list[tuple[str, str, int]]:
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)) and child.value is not None:
                targets = [child.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in PROTECTED:
                    found.append((target.attr, function, getattr(child, "lineno", 0)))
            if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "setattr":
                args = child.args
                if len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value in PROTECTED:
                    found.append((str(args[1].value), function, getattr(child, "lineno", 0)))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_code_outside_the_generated_hooks_writes_where_a_room_stands() -> None:
    """Room state and the pages' release phase are written only by `_status`'s hook lines (strings
    compiled into the engines) and `pages_step`; a request's view only by its declared step."""
    root = pathlib.Path(kvfsm.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        relative = f"kvfsm/{path.relative_to(root)}"
        for attr, function, line in _writes(path):
            if relative == "kvfsm/_status.py" and function == "pages_step":
                continue
            if (relative in ALLOWED_FILES and attr == "state") or relative == "kvfsm/tools/_baselines.py":
                continue
            if (relative, function) not in ALLOWED or attr in {"_drain", "_failed_over_success"}:
                offenders.append(f"{relative}:{line} {function}() writes .{attr}")
    assert offenders == []


def test_the_old_flags_are_gone() -> None:
    assert "_drain" not in kvfsm.TransferHandle.__slots__
    receiver_attrs = inspect.getsource(sglang.KVReceiver) + inspect.getsource(sglang.KVSender.__mro__[1])
    assert "_failed_over_success" not in receiver_attrs
