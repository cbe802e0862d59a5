"""Drive a room into any state through the public API (shared by the suites)."""

from __future__ import annotations

from kvfsm import FailureKind, FailureReason, KVPoll, TransferHandle, TransferManager

#: Events that move a fresh room to each state, in order.
PATH_TO: dict[KVPoll, tuple[str, ...]] = {
    KVPoll.Bootstrapping: (),
    KVPoll.WaitingForInput: ("bootstrapped",),
    KVPoll.Transferring: ("bootstrapped", "transfer_started"),
    KVPoll.Success: ("bootstrapped", "transfer_started", "transfer_done"),
    KVPoll.Failed: ("abort",),
}


def fire(handle: TransferHandle, event: str) -> bool:
    """Send `event` to `handle` with sensible arguments."""
    if event == "chunk_done":
        return handle.chunk_done(1024)
    if event == "fail":
        return handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, "test failure"))
    if event == "abort":
        return handle.abort("test abort")
    method = getattr(handle, event)
    result: bool = method()
    return result


def open_in(manager: TransferManager, room: int | str, state: KVPoll) -> TransferHandle:
    handle = manager.open(room)
    for event in PATH_TO[state]:
        assert fire(handle, event), f"could not drive room {room!r} to {state.name} with {event}"
    assert handle.state is state
    return handle
