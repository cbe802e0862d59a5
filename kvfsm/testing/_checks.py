"""The rule checks both conformance kits run after every step.

Each function checks one rule of DESIGN.md against live handles (one
writer, terminal states absorb, structured failures, deadlines); the kits
(`lifecycle_kit`, `backend_kit`) decide when to call them.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import KVTransferError, UnknownRoom
from .._manager import TransferHandle, TransferManager
from .._states import FailureKind, FailureReason, State
from .strategies import ManualClock


class RoomLedger:
    """What the kit remembers per handle: the first terminal state it saw."""

    def __init__(self) -> None:
        self.final: dict[int, tuple[TransferHandle, State]] = {}

    def observe(self, handle: TransferHandle) -> None:
        state = handle.state
        seen = self.final.get(id(handle))
        if seen is None:
            if state in handle.lifecycle.terminal:
                self.final[id(handle)] = (handle, state)
            return
        assert state is seen[1], (
            f"rule 2 broken: room {handle.room!r} (gen {handle.generation}) ended {seen[1].name} but is now {state.name}"
        )


def check_agreement(manager: TransferManager, handles: list[TransferHandle]) -> None:
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
            reported = handle.lifecycle.reports[before]
            assert table is reported, (
                f"rule 1 broken: room {handle.room!r} handle says {before.name} (reports {reported.name}), "
                f"table says {table.name}"
            )


def check_failure(handle: TransferHandle) -> None:
    """Rule 8: a Failed room has a structured reason and raises it."""
    lifecycle = handle.lifecycle
    if handle.closed or handle.state is not lifecycle.failure:
        return
    reason = handle.reason
    assert isinstance(reason, FailureReason), f"room {handle.room!r} is Failed without a FailureReason"
    assert reason.state in lifecycle.non_terminal, (
        f"room {handle.room!r}: reason.state {reason.state!r} is not where it failed"
    )
    raised = raised_by(handle.failure_exception)
    assert isinstance(raised, KVTransferError), f"failure_exception() of room {handle.room!r} raised {raised!r}"
    assert (raised.room, raised.reason) == (handle.room, reason)


def raised_by(call: Callable[[], object]) -> BaseException | None:
    """The exception `call()` raised, or None."""
    try:
        call()
    except Exception as error:
        return error
    return None


def check_deadlines(manager: TransferManager, clock: ManualClock, handles: list[TransferHandle]) -> None:
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
            assert reason.state in manager.lifecycle.non_terminal
            assert "deadline" in reason.message, f"a timeout must name the phase deadline; got {reason.message!r}"
        if state in manager.lifecycle.terminal:
            continue
        limit = manager.timeouts.for_state(state)
        if limit is not None:
            assert now < handle.entered_at + limit, (
                f"rule 7 broken: room {handle.room!r} is {state.name} since t={handle.entered_at} "
                f"with a {limit}s deadline, and it is t={now}"
            )
