"""The compiled engine's generated code: what it shares, and what it must not."""

from __future__ import annotations

import kvfsm
from kvfsm import FailureKind, FailureReason, KVPoll, TransferManager
from kvfsm._fastpath import ABORT_REASONS_KEPT, new_reason
from kvfsm._machine import CompiledEngine, build_machine
from kvfsm._manager import handle_base
from kvfsm._status import StatusTable


def test_unvalidated_reason_equals_the_validated_one() -> None:
    fast = new_reason(FailureKind.PEER_LOST, "gone", KVPoll.Transferring, True)
    slow = FailureReason(FailureKind.PEER_LOST, "gone", KVPoll.Transferring, True)
    assert fast == slow
    assert hash(fast) == hash(slow)
    assert str(fast) == str(slow)


def test_rooms_aborted_alike_share_one_frozen_reason_and_the_cache_is_bounded() -> None:
    manager = TransferManager("sender")
    alike = [manager.open(room) for room in range(3)]
    for handle in alike:
        handle.abort("client went away")
    assert alike[0].reason is alike[1].reason is alike[2].reason
    distinct = [manager.open(room) for room in range(100, 100 + ABORT_REASONS_KEPT + 50)]
    for handle in distinct:
        handle.abort(f"reason {handle.room}")
    for handle in distinct:  # every room keeps its own message, cached or not
        assert handle.reason == FailureReason(FailureKind.ABORTED, f"reason {handle.room}", KVPoll.Bootstrapping)
    engine = manager._engine
    assert isinstance(engine, CompiledEngine)
    cache = engine.namespace[f"abort_reasons_{KVPoll.Bootstrapping.value}"]
    assert len(cache) == ABORT_REASONS_KEPT


def test_generated_handles_are_transfer_handles_with_documented_methods() -> None:
    handle = TransferManager("receiver").open(1)
    assert isinstance(handle, kvfsm.TransferHandle)
    assert type(handle).__name__ == "TransferHandle"
    # The lifecycle's handle class (its event methods generated from the event specs), and the fast path's subclass.
    base = handle_base(kvfsm.KV_LIFECYCLE)
    assert type(handle).__mro__[1] is base
    assert type(handle).bootstrapped.__doc__ == base.bootstrapped.__doc__
    assert (
        base.bootstrapped.__doc__
        == "Handshake done: the peer is known and both sides hold each other's metadata: Bootstrapping -> WaitingForInput."
    )
    assert TransferManager("receiver", engine="transitions").open(1).__class__ is base


def test_managers_do_not_share_generated_code() -> None:
    first, second = TransferManager("sender"), TransferManager("sender")
    one, other = type(first.open(1)), type(second.open(1))
    assert one is not other
    assert one.bootstrapped.__code__ is not other.bootstrapped.__code__
    assert one.bootstrapped.__code__.co_code == other.bootstrapped.__code__.co_code


def test_a_phase_without_deadline_has_no_deadline_code() -> None:
    manager = TransferManager("sender", timeouts=kvfsm.Timeouts(bootstrap=None, waiting=5.0, transferring=None))
    source: str = type(manager.open(1))._fast_source  # type: ignore[attr-defined]
    assert "deadline_queue_1" not in source
    assert "deadline_queue_2" in source
    assert "deadline_queue_3" not in source


class _Record:
    """The fields the hooks touch, without a manager around them."""

    def __init__(self, table: StatusTable, room: int) -> None:
        self.room = room
        self.state = KVPoll.Transferring
        self.reason: FailureReason | None = None
        self.entered_at = self.opened_at = 0.0
        self.transfer_started_at: float | None = 0.0
        self.finished_at: float | None = None
        self._table = table


def test_a_callback_without_inline_lines_still_runs_in_its_place() -> None:
    machine = build_machine("sender")
    seen: list[tuple[KVPoll, KVPoll | None]] = []

    def watch(room: _Record, now: float, reason: FailureReason | None) -> None:
        seen.append((room.state, room._table.status.get(room.room)))

    machine.get_state("Success").on_enter.append(watch)
    table = StatusTable(kvfsm.Timeouts())
    engine = CompiledEngine(machine, table)
    record = _Record(table, 7)
    table.live[KVPoll.Transferring] += 1
    step = engine.rows["transfer_done"][KVPoll.Transferring]
    assert step is not None
    step.run(record, 5.0, None)  # type: ignore[arg-type]
    # After the status hook (registered first), with the state already changed.
    assert seen == [(KVPoll.Success, KVPoll.Success)]
    assert "callback_0(room, now, reason)" in engine.source
