"""kvfsm.compat.sglang: SGLang's interface, backed by the machine."""

from __future__ import annotations

import gc
import inspect
import threading
from collections.abc import Iterator

import pytest

import kvfsm
from kvfsm import FailureKind, KVPoll, StateChange, Timeouts
from kvfsm.compat import sglang
from tests.helpers import FakeClock

ADDR = "prefill-0:8998"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefill(clock: FakeClock) -> Iterator[sglang.KVManager]:
    with sglang.KVManager(sglang.KVArgs(), sglang.DisaggregationMode.PREFILL, clock=clock, reaper=False) as manager:
        yield manager


@pytest.fixture
def decode(clock: FakeClock) -> Iterator[sglang.KVManager]:
    with sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False) as manager:
        yield manager


def new_sender(manager: sglang.KVManager, room: int) -> sglang.KVSender:
    return sglang.KVSender(manager, ADDR, room, [0], 0)


def events_of(manager: sglang.KVManager) -> list[str]:
    seen: list[str] = []

    def observe(change: StateChange) -> None:
        seen.append(change.event)

    manager.transfer_manager.subscribe(observe)
    return seen


# -- SGLang's interface -------------------------------------------------------------------

SIGNATURES: dict[tuple[type, str], list[str]] = {
    (sglang.KVManager, "__init__"): ["self", "args", "disaggregation_mode", "server_args", "is_mla_backend"],
    # SGLang 0.5.23's order; older releases' dest_tp_ranks/pp_rank are still accepted positionally.
    (sglang.KVSender, "__init__"): [
        "self",
        "mgr",
        "bootstrap_addr",
        "bootstrap_room",
        "req_has_disagg_prefill_dp_rank",
    ],
    (sglang.KVSender, "init"): ["self", "num_kv_indices", "aux_index"],
    (sglang.KVSender, "send"): ["self", "kv_indices", "state_indices"],
    (sglang.KVSender, "should_send_kv_chunk"): ["self", "num_pages", "last_chunk"],
    (sglang.KVSender, "pop_decode_prefix_len"): ["self"],
    (sglang.KVReceiver, "__init__"): ["self", "mgr", "bootstrap_addr", "bootstrap_room"],
    (sglang.KVReceiver, "init"): ["self", "prefill_dp_rank"],
    (sglang.KVReceiver, "send_metadata"): ["self", "kv_indices", "aux_index", "state_indices", "decode_prefix_len"],
}


FAKES: dict[type, type] = {
    sglang.KVManager: sglang.FakeKVManager,
    sglang.KVSender: sglang.FakeKVSender,
    sglang.KVReceiver: sglang.FakeKVReceiver,
}


@pytest.mark.parametrize(("cls", "method"), list(SIGNATURES))
@pytest.mark.parametrize("fake", [False, True], ids=["kvfsm", "fake"])
def test_signatures_start_with_sglangs_parameters(cls: type, method: str, fake: bool) -> None:
    expected = SIGNATURES[(cls, method)]
    implementation = FAKES[cls] if fake else cls
    parameters = [p.name for p in inspect.signature(getattr(implementation, method)).parameters.values()]
    assert parameters[: len(expected)] == expected


@pytest.mark.parametrize(
    "method",
    ["poll", "abort", "failure_exception", "clear", "get_transfer_metric", "init", "send", "should_send_kv_chunk"],
)
def test_sender_has_every_method_the_scheduler_calls(method: str) -> None:
    assert callable(getattr(sglang.KVSender, method))
    assert callable(getattr(sglang.FakeKVSender, method))


def test_constructed_with_the_schedulers_keywords(prefill: sglang.KVManager, decode: sglang.KVManager) -> None:
    sender = sglang.KVSender(
        mgr=prefill,
        bootstrap_addr=ADDR,
        bootstrap_room=5,
        dest_tp_ranks=[0],
        pp_rank=0,
        req_has_disagg_prefill_dp_rank=False,
    )
    receiver = sglang.KVReceiver(mgr=decode, bootstrap_addr=ADDR, bootstrap_room=5, data_parallel_rank=0)
    assert (sender.bootstrap_room, sender.kv_mgr, sender.conclude_state) == (5, prefill, None)
    assert (receiver.require_staging, receiver.abort_notified, receiver.kv_mgr) == (False, False, decode)
    assert decode.enable_deferred_decode_kv_release is False
    assert int(sender.poll()) == int(receiver.poll()) == 1


def test_kvpoll_values_are_sglangs() -> None:
    assert sglang.KVPoll is kvfsm.KVPoll
    assert [(s.name, int(s)) for s in sglang.KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


def test_mode_must_be_prefill_or_decode() -> None:
    with pytest.raises(ValueError, match="Unsupported DisaggregationMode"):
        sglang.KVManager(sglang.KVArgs(), sglang.DisaggregationMode.NULL, reaper=False)
    fake = sglang.FakeKVManager(sglang.KVArgs(), sglang.DisaggregationMode.NULL, reaper=False)
    assert fake.role is kvfsm.Role.SENDER


def test_should_send_kv_chunk_sends_a_zero_page_last_chunk(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 1)
    assert [sender.should_send_kv_chunk(n, last) for n, last in [(0, False), (0, True), (3, False)]] == [
        False,
        True,
        True,
    ]


def test_pop_decode_prefix_len(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 1)
    prefill.req_to_decode_prefix_len[1] = 7
    assert (sender.pop_decode_prefix_len(), sender.pop_decode_prefix_len()) == (7, 0)


def test_timeouts_default_to_sglangs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang.BOOTSTRAP_TIMEOUT_ENV, "12")
    monkeypatch.setenv(sglang.WAITING_TIMEOUT_ENV, "34.5")
    manager = sglang.KVManager(sglang.KVArgs(), "prefill", reaper=False)
    assert manager.transfer_manager.timeouts == Timeouts(bootstrap=12, waiting=34.5, transferring=None)
    monkeypatch.setenv(sglang.WAITING_TIMEOUT_ENV, "soon")
    with pytest.raises(kvfsm.ConfigError, match="SGLANG_DISAGGREGATION_WAITING_TIMEOUT"):
        sglang.KVManager(sglang.KVArgs(), "prefill", reaper=False)


# -- abort, conclude_state, failure_exception ---------------------------------------------


def test_abort_is_synchronous_and_records_the_reason(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 3)
    prefill.update_status(3, KVPoll.WaitingForInput)
    sender.abort()
    assert prefill.check_status(3) is KVPoll.Failed
    assert sender.conclude_state is KVPoll.Failed
    with pytest.raises(sglang.KVTransferError) as caught:
        sender.failure_exception()
    error = caught.value
    assert isinstance(error, kvfsm.KVTransferError)
    assert error.reason is not None
    assert error.reason.kind is FailureKind.ABORTED
    assert (error.bootstrap_room, error.failure_reason, error.is_from_another_rank) == (
        3,
        "Aborted by AbortReq.",
        False,
    )
    assert error.reason.state is KVPoll.WaitingForInput


def test_a_failed_endpoints_repr_says_why(prefill: sglang.KVManager) -> None:
    """What a failed assertion or a log line shows of an endpoint names its reason, not only `Failed`."""
    sender = new_sender(prefill, 4)
    assert repr(sender) == "<KVSender room=4 Bootstrapping>"
    sender.abort()
    assert repr(sender) == "<KVSender room=4 Failed: ABORTED in Bootstrapping: Aborted by AbortReq.>"


def test_abort_twice_fires_one_event(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 3)
    seen = events_of(prefill)
    sender.abort()
    sender.abort()
    assert seen == ["abort"]
    assert prefill.transfer_manager.stats.aborts == 1


def test_conclude_state_is_derived_and_read_only(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 4)
    assert sender.conclude_state is None
    with pytest.raises(AttributeError, match=r"derived from the room's state machine.*abort\(\)"):
        sender.conclude_state = KVPoll.Failed
    assert sender.poll() is KVPoll.Bootstrapping
    for status in (KVPoll.WaitingForInput, KVPoll.Transferring):
        prefill.update_status(4, status)
        assert sender.conclude_state is None
    prefill.update_status(4, KVPoll.Success)
    assert sender.conclude_state is KVPoll.Success


def test_overridden_abort_runs_after_the_machine_aborted(prefill: sglang.KVManager) -> None:
    seen_in_override: list[KVPoll] = []

    class TracingSender(sglang.KVSender):
        def abort(self) -> None:
            seen_in_override.append(self.kv_mgr.check_status(self.bootstrap_room))

    class ChainingSender(sglang.KVSender):
        def abort(self) -> None:
            super().abort()
            seen_in_override.append(self.poll())

    TracingSender(prefill, ADDR, 1, [0], 0).abort()
    ChainingSender(prefill, ADDR, 2, [0], 0).abort()
    assert seen_in_override == [KVPoll.Failed, KVPoll.Failed]
    assert prefill.transfer_manager.stats.aborts == 2
    assert prefill.transfer_manager.stats.late_events == 0


def test_copied_conclude_state_assignment_fails_loudly_but_the_room_is_aborted(prefill: sglang.KVManager) -> None:
    class OldStyleSender(sglang.KVSender):
        def abort(self) -> None:
            self.conclude_state = KVPoll.Failed

    sender = OldStyleSender(prefill, ADDR, 1, [0], 0)
    with pytest.raises(AttributeError, match="cannot be assigned"):
        sender.abort()
    assert prefill.check_status(1) is KVPoll.Failed


def test_failure_exception_on_a_rank_whose_room_had_not_failed(prefill: sglang.KVManager) -> None:
    """The all-reduce said Failed because another rank failed: this rank fails too, marked from_peer."""
    sender = new_sender(prefill, 6)
    prefill.update_status(6, KVPoll.Transferring)
    with pytest.raises(sglang.KVTransferError) as caught:
        sender.failure_exception()
    assert caught.value.is_from_another_rank
    assert sender.poll() is KVPoll.Failed
    # As SGLang's CommonKVSender: reading the failure ends the prefill room (its scheduler never clears it).
    assert 6 not in prefill.transfer_manager
    failure = caught.value.reason
    assert failure is not None
    assert failure.kind is FailureKind.PEER_FAILED
    assert failure.from_peer


def test_failure_exception_after_clear_keeps_the_reason(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 6)
    prefill.record_failure(6, "decode went away", kind=FailureKind.PEER_LOST)
    prefill.update_status(6, KVPoll.Failed)
    sender.clear()
    with pytest.raises(sglang.KVTransferError, match="decode went away") as caught:
        sender.failure_exception()
    assert caught.value.reason is not None
    assert caught.value.reason.kind is FailureKind.PEER_LOST


# -- the legacy status surface -------------------------------------------------------------


def test_success_written_over_waiting_passes_through_transferring(prefill: sglang.KVManager, clock: FakeClock) -> None:
    sender = new_sender(prefill, 8)
    seen = events_of(prefill)
    prefill.update_status(8, KVPoll.WaitingForInput)
    clock.advance(2.0)
    assert prefill.update_status(8, KVPoll.Success)
    assert seen == ["bootstrapped", "transfer_started", "transfer_done"]
    assert sender.poll() is KVPoll.Success
    metric = sender.get_transfer_metric()
    assert metric.transfer_latency_s == 0.0
    assert metric.transfer_total_bytes is None


def test_backward_writes_are_no_ops_as_max_made_them(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 8)
    prefill.update_status(8, KVPoll.Transferring)
    seen = events_of(prefill)
    assert not prefill.update_status(8, KVPoll.WaitingForInput)
    assert not prefill.update_status(8, KVPoll.Bootstrapping)
    assert seen == []
    assert prefill.check_status(8) is KVPoll.Transferring
    assert prefill.late_updates == 0
    assert sender.poll() is KVPoll.Transferring


def test_late_success_is_counted(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 9)
    prefill.update_status(9, KVPoll.Failed)
    assert not prefill.update_status(9, KVPoll.Success)
    assert prefill.late_updates == 1
    assert prefill.transfer_manager.stats.late_events == 1
    failure = prefill.transfer_manager.failure(9)
    assert failure is not None
    assert failure.message == "update_status(Failed) with no recorded reason"
    assert sender.poll() is KVPoll.Failed


def test_failed_after_success_is_refused(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 9)
    prefill.update_status(9, KVPoll.Success)
    prefill.record_failure(9, "too late")
    assert not prefill.update_status(9, KVPoll.Failed)
    assert prefill.check_status(9) is KVPoll.Success
    assert 9 not in prefill.failure_records
    assert sender.conclude_state is KVPoll.Success


def test_update_for_a_cleared_room_is_counted_and_check_status_says_why(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 10)
    sender.clear()
    assert not prefill.update_status(10, KVPoll.Success)
    assert not prefill.update_status(10, KVPoll.Failed)
    assert prefill.late_updates == 2
    with pytest.raises(KeyError) as caught:
        prefill.check_status(10)
    assert isinstance(caught.value, kvfsm.UnknownRoom)
    assert "closed" in str(caught.value)


def test_bootstrapping_written_for_a_new_room_opens_it(prefill: sglang.KVManager) -> None:
    """SGLang's constructors open rooms this way; a dummy CP rank starts at WaitingForInput."""
    assert prefill.update_status(20, KVPoll.Bootstrapping)
    assert prefill.update_status(21, KVPoll.WaitingForInput)
    assert not prefill.update_status(22, KVPoll.Failed)
    assert dict(prefill.request_status) == {20: KVPoll.Bootstrapping, 21: KVPoll.WaitingForInput}


def test_request_status_view(prefill: sglang.KVManager) -> None:
    senders = [new_sender(prefill, 1), new_sender(prefill, 2)]
    view = prefill.request_status
    view[2] = KVPoll.WaitingForInput
    assert (len(view), view[1], view.get(2), view.get(3)) == (2, KVPoll.Bootstrapping, KVPoll.WaitingForInput, None)
    assert view.pop(1, None) is KVPoll.Failed  # closing a live room aborts it
    assert view.pop(1, None) is None
    del view[2]
    with pytest.raises(KeyError):
        del view[2]
    with pytest.raises(KeyError):
        view.pop(2)
    assert list(view) == []
    assert [sender.poll() for sender in senders] == [KVPoll.Failed, KVPoll.Failed]


def test_failure_records_view(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 1)
    prefill.failure_records[1] = "disk on fire"
    assert prefill.check_status(1) is KVPoll.Bootstrapping  # recording alone changes nothing
    with prefill.failure_lock:
        assert prefill.failure_records.pop(1, None) == "disk on fire"
    prefill.update_status(1, KVPoll.Failed)
    assert prefill.failure_records[1] == "disk on fire"
    assert list(prefill.failure_records) == [1]
    prefill.close_room(1)
    assert prefill.failure_records.pop(1, None) is None
    with pytest.raises(KeyError):
        prefill.failure_records.pop(1)
    prefill.record_failure(99, "never opened")
    assert len(prefill.failure_records) == 0
    assert sender.poll() is KVPoll.Failed


# -- rooms ----------------------------------------------------------------------------------


def test_reusing_a_finished_uncleared_room_starts_a_new_generation(prefill: sglang.KVManager) -> None:
    old = new_sender(prefill, 30)
    prefill.update_status(30, KVPoll.Success)
    new = new_sender(prefill, 30)
    assert (old.poll(), new.poll()) == (KVPoll.Success, KVPoll.Bootstrapping)
    old.handle.abort("stale")  # the old request's late event
    assert new.poll() is KVPoll.Bootstrapping
    old.clear()  # clearing the old request leaves the new one alone
    assert prefill.check_status(30) is KVPoll.Bootstrapping


def test_a_live_room_cannot_be_opened_twice(prefill: sglang.KVManager) -> None:
    first = new_sender(prefill, 31)
    with pytest.raises(kvfsm.DuplicateRoom):
        new_sender(prefill, 31)
    assert first.poll() is KVPoll.Bootstrapping


def test_dropping_a_sender_without_clear_closes_its_room(prefill: sglang.KVManager) -> None:
    sender = new_sender(prefill, 32)
    handle = sender.handle
    del sender
    gc.collect()
    closed_by_the_finalizer = handle.closed
    assert not closed_by_the_finalizer  # a finalizer never takes the manager's lock itself
    assert prefill.collect_orphans() == 1
    assert handle.closed
    assert handle.state is KVPoll.Failed
    assert 32 not in prefill.request_status


@pytest.mark.parametrize("endpoint", ["sender", "receiver"])
def test_dropping_a_fake_endpoint_without_clear_closes_its_room(
    prefill: sglang.KVManager, decode: sglang.KVManager, endpoint: str
) -> None:
    """Issue 11 item 12: collect_orphans() also closes dropped warmup requests' rooms.

    On the old code the fake rooms' orphans were closed only when the next
    fake request opened: `collect_orphans()` returned 0 and the room stayed
    open (a live, never-aborted warmup room per dropped request).
    """
    dropped: sglang.FakeKVSender | sglang.FakeKVReceiver
    if endpoint == "sender":
        manager = prefill
        dropped = sglang.FakeKVSender(prefill, "2.2.2.2:8998", 7)
        dropped.init(1, 0)
    else:
        manager = decode
        dropped = sglang.FakeKVReceiver(decode, "2.2.2.2:8998", None)
        dropped.init(0)
    kept = sglang.FakeKVReceiver(decode, "2.2.2.2:8998", 7)  # a live fake request must stay open
    handle = dropped.handle
    del dropped
    gc.collect()
    closed_by_the_finalizer = handle.closed
    assert not closed_by_the_finalizer  # the finalizer only queues it
    assert manager.fake_rooms.live() == (2 if manager is decode else 1)
    assert manager.collect_orphans() == 1
    assert handle.closed
    assert handle.state is KVPoll.Failed  # closed in flight: aborted, so nothing waits on it
    assert kept.poll() is KVPoll.Bootstrapping
    assert decode.fake_rooms.live() == 1
    assert prefill.fake_rooms.live() == 0
    assert manager.collect_orphans() == 0


def test_endpoints_need_a_kvfsm_manager() -> None:
    with pytest.raises(TypeError, match="KVManager"):
        sglang.KVSender(object(), ADDR, 1, [0], 0)


def test_without_a_backend_send_names_what_is_missing(prefill: sglang.KVManager, decode: sglang.KVManager) -> None:
    sender = new_sender(prefill, 1)
    sender.init(2, 0)
    with pytest.raises(NotImplementedError, match=r"room 1, pages 0\.\.2, last=True"):
        sender.send([4, 5])
    receiver = sglang.KVReceiver(decode, ADDR, 1)
    with pytest.raises(NotImplementedError, match="send_metadata"):
        receiver.send_metadata([1, 2])


# -- deadlines ------------------------------------------------------------------------------


def test_a_deadline_fails_the_room_though_nobody_polls(clock: FakeClock) -> None:
    """Bug 6: decode stops polling receivers that wait for input; their deadline must fire anyway."""
    with sglang.KVManager(
        sglang.KVArgs(), "decode", clock=clock, reaper=False, timeouts=Timeouts(bootstrap=None, waiting=30.0)
    ) as decode:
        receiver = sglang.KVReceiver(decode, ADDR, 40)
        decode.update_status(40, KVPoll.WaitingForInput)
        clock.advance(30.0)
        assert decode.transfer_manager.check_deadlines() == [40]  # what the reaper thread does
        # The decode scheduler keeps polling a queue only if some receiver's conclude_state is Failed.
        assert receiver.conclude_state is KVPoll.Failed
        failure = decode.transfer_manager.failure(40)
        assert failure is not None
        assert failure.kind is FailureKind.TIMEOUT


def test_the_reaper_runs_by_default() -> None:
    with sglang.KVManager(sglang.KVArgs(), "prefill") as manager:
        assert manager.transfer_manager.reaper_running
    assert not manager.transfer_manager.reaper_running


def test_legacy_writes_racing_aborts_never_break_a_room() -> None:
    """Transfer threads write statuses while the scheduler aborts: nothing out of order, nothing lost."""
    rooms = range(200)
    with sglang.KVManager(sglang.KVArgs(), "prefill", reaper=False) as manager:
        senders = [new_sender(manager, room) for room in rooms]
        start = threading.Barrier(3)

        def transfer_thread() -> None:
            start.wait()
            for room in rooms:
                manager.update_status(room, KVPoll.WaitingForInput)
                manager.update_status(room, KVPoll.Success)

        def scheduler_thread() -> None:
            start.wait()
            for sender in reversed(senders):
                sender.abort()

        threads = [threading.Thread(target=transfer_thread), threading.Thread(target=scheduler_thread)]
        for thread in threads:
            thread.start()
        start.wait()
        for thread in threads:
            thread.join()
        stats = manager.transfer_manager.stats
        assert stats.invalid_events == 0
        for sender in senders:
            # Every request was aborted: each answers Failed, whether its room failed or had already succeeded.
            assert sender.poll() is KVPoll.Failed
            assert manager.check_status(sender.bootstrap_room) is sender.handle.state
            assert sender.handle.state in (KVPoll.Success, KVPoll.Failed)
        failed = sum(1 for sender in senders if sender.handle.state is KVPoll.Failed)
        assert stats.aborts == failed


@pytest.mark.parametrize("reached", list(KVPoll), ids=lambda state: state.name)
@pytest.mark.parametrize("endpoint", ["sender", "receiver"])
def test_abort_in_every_state(
    prefill: sglang.KVManager, decode: sglang.KVManager, reached: KVPoll, endpoint: str
) -> None:
    manager = prefill if endpoint == "sender" else decode
    request: sglang.KVSender | sglang.KVReceiver = (
        new_sender(prefill, 50) if endpoint == "sender" else sglang.KVReceiver(decode, ADDR, 50)
    )
    manager.update_status(50, reached)
    assert request.poll() is reached
    request.abort()
    # The room is the transfer's record: a Success stays Success. The request is aborted: it answers Failed.
    room_state = reached if reached in kvfsm.TERMINAL else KVPoll.Failed
    assert manager.check_status(50) is room_state
    assert (request.poll(), request.conclude_state) == (KVPoll.Failed, KVPoll.Failed)
    if reached is KVPoll.Success:
        assert request.release_safe  # its bytes landed: nothing can still be writing
    failure = manager.transfer_manager.failure(50)
    if reached is KVPoll.Failed or reached is KVPoll.Success:
        assert manager.transfer_manager.stats.aborts == 0
    else:
        assert failure is not None
        assert (failure.kind, failure.state, failure.message) == (FailureKind.ABORTED, reached, "Aborted by AbortReq.")
