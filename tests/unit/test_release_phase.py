"""The release phase through the adapters and both compat layers (issue 24; issue 22 items 5 and 6).

Each test here failed on the starting code (7ddfcf8): pages were released
on the drain-deadline timer, a cleared SGLang receiver's room answered
"release-safe" while its write was in flight, and an older generation's
failure could miss the adapter's `_stop`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
from collections import Counter
from collections.abc import Hashable
from typing import Any

import pytest

import kvfsm
from kvfsm import FailureKind, KVPoll, PagesState, TransferHandle, TransferManager
from kvfsm.backends import FakeBackend
from kvfsm.compat import sglang
from tests.helpers import FakeClock

ADDR = "prefill-0:8998"


class InFlightBackend(FakeBackend):
    """The decode's write starts and never drains by itself: the prefill vanished mid-write."""

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        handle.transfer_started()

    def _stop(self, handle: TransferHandle) -> None:
        return  # no proof: nothing says the peer's write stopped


# -- issue 22 item 5: the gate holds whatever the order of calls ------------------------------


@pytest.mark.parametrize("how", ["clear", "drop"])
def test_sglang_release_gate_holds_after_abort_then_clear_or_drop(how: str) -> None:
    clock = FakeClock()
    with sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False, backend=InFlightBackend) as kv_mgr:
        receiver = sglang.KVReceiver(kv_mgr, ADDR, 41)
        receiver.init(0)
        receiver.send_metadata([1, 2, 3], None)
        handle = receiver.handle
        assert handle.state is KVPoll.Transferring
        receiver.abort()
        if how == "clear":
            receiver.clear()
        else:
            del receiver
            gc.collect()
        assert not kv_mgr.is_abort_release_safe(41, 1), "the gate opened while the prefill's write is in flight"
        clock.advance(31.0)  # past the drain deadline: quarantined, still not safe
        assert not kv_mgr.is_abort_release_safe(41, 1)
        assert handle.closed and handle.pages_state is PagesState.QUARANTINED
        assert kv_mgr.transfer_manager.stats.quarantined == 1
        handle.writes_drained()  # the proof arrives, after the clear
        assert kv_mgr.is_abort_release_safe(41, 1)
        assert kv_mgr.transfer_manager.stats.quarantined == 0


def test_sglang_operator_override_is_explicit_and_counted() -> None:
    clock = FakeClock()
    with sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False, backend=InFlightBackend) as kv_mgr:
        receiver = sglang.KVReceiver(kv_mgr, ADDR, 42)
        receiver.init(0)
        receiver.send_metadata([4], None)
        receiver.abort()
        receiver.clear()
        manager = kv_mgr.transfer_manager
        with pytest.raises(kvfsm.NotQuarantined, match="room 42"):
            manager.release_quarantined(42, "too early: still draining")
        clock.advance(31.0)
        assert [h.room for h in manager.quarantined()] == [42]
        assert manager.release_quarantined(42, "host of the prefill rebooted") == 1
        assert kv_mgr.is_abort_release_safe(42, 1) and manager.stats.quarantine_overrides == 1


def test_sglang_opt_in_timer_release() -> None:
    clock = FakeClock()
    with sglang.KVManager(
        sglang.KVArgs(), "decode", clock=clock, reaper=False, backend=InFlightBackend, on_drain_deadline="release"
    ) as kv_mgr:
        receiver = sglang.KVReceiver(kv_mgr, ADDR, 43)
        receiver.init(0)
        receiver.send_metadata([4], None)
        receiver.abort()
        receiver.clear()
        assert not kv_mgr.is_abort_release_safe(43, 1)
        clock.advance(31.0)
        assert kv_mgr.is_abort_release_safe(43, 1)
        assert kv_mgr.transfer_manager.stats.drain_deadline_releases == 1


def test_sglang_request_view_is_declared_and_reports_failed_over_success() -> None:
    with sglang.KVManager(sglang.KVArgs(), "decode", reaper=False, backend=FakeBackend) as kv_mgr:
        receiver = sglang.KVReceiver(kv_mgr, ADDR, 44)
        receiver.init(0)
        receiver.send_metadata([1], None)
        assert receiver.poll() is KVPoll.Success
        receiver.abort()
        assert receiver.poll() is KVPoll.Failed and receiver.handle.state is KVPoll.Success
        assert receiver._view is sglang.RequestView.FAILED_OVER_SUCCESS
        assert sglang.REQUEST_VIEW.row(receiver._view, "aborted_after_success") is None  # the first reason stands
        with pytest.raises(sglang.KVTransferError, match=r"(?i)abort"):
            receiver.failure_exception()
        receiver.clear()


# -- issue 22 item 6: exactly one stop per failed room, whatever the order --------------------


class CountingBackend(FakeBackend):
    def __init__(self, manager: TransferManager) -> None:
        super().__init__(manager)
        self.stops: Counter[tuple[Hashable, int]] = Counter()
        self._count = threading.Lock()

    def _stop(self, handle: TransferHandle) -> None:
        with self._count:
            self.stops[handle.room, handle.generation] += 1
        super()._stop(handle)


def test_every_failed_room_gets_exactly_one_stop_under_reopen_races() -> None:
    # 8 threads open rooms on a FakeBackend with reused ids; the reaper times them out;
    # another thread closes each Failed room at once. On the starting code 3-5 % of the
    # failed rooms never got `_stop` (a later generation overwrote `_rooms[room]`).
    manager = TransferManager("receiver", timeouts=kvfsm.Timeouts(bootstrap=None, waiting=0.002, drain=None))
    backend = CountingBackend(manager)
    bootstrapped: set[tuple[Hashable, int]] = set()
    failed: set[tuple[Hashable, int]] = set()
    record = threading.Lock()
    done = threading.Event()

    def observe(change: kvfsm.StateChange) -> None:
        if change.dest is KVPoll.Failed:
            with record:
                failed.add((change.room, change.generation))

    manager.subscribe(observe, events=("timeout", "fail", "abort"))
    manager.start_reaper(0.001)

    def opener(worker: int) -> None:
        ids = itertools.cycle(range(worker * 4, worker * 4 + 4))
        for _ in range(300):
            room = next(ids)
            while True:  # the same id again as soon as its previous generation was closed
                try:
                    handle = manager.open(room)
                    break
                except kvfsm.DuplicateRoom:
                    time.sleep(0.0001)
            backend.bootstrap(handle, backend.address)
            with record:
                bootstrapped.add((handle.room, handle.generation))

    def closer() -> None:
        while not done.is_set():
            for handle in list(manager):
                if handle.state is KVPoll.Failed and not handle.closed:
                    with contextlib.suppress(kvfsm.UnknownRoom):
                        manager.close(handle.room)

    threads = [threading.Thread(target=opener, args=(i,)) for i in range(8)]
    closing = threading.Thread(target=closer)
    closing.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    manager.stop_reaper()
    manager.check_deadlines()  # what the reaper had not reached yet
    done.set()
    closing.join()
    for handle in list(manager):
        manager.close(handle.room)
    backend.close()
    missed = sorted(key for key in failed & bootstrapped if backend.stops[key] == 0)
    twice = sorted(key for key, n in backend.stops.items() if n > 1)
    assert len(failed & bootstrapped) > 100
    assert missed == [] and twice == []


# -- the vLLM connector: drain_timeout quarantines -------------------------------------------


def _vllm_pair(**extra: Any) -> Any:
    pytest.importorskip("torch", reason="the worker half moves torch tensors")
    from tests.vllm.local_pair import Clock, Pair

    clock = Clock()
    return Pair(clock, **extra), clock


@pytest.mark.parametrize("policy", ["quarantine", "release"])
def test_vllm_a_load_whose_prefill_vanished_mid_write_keeps_its_blocks_quarantined(policy: str) -> None:
    from kvfsm.compat.vllm._plan import AbortSpec, RecvSpec, SendSpec, StepPlan

    pair, clock = _vllm_pair(on_drain_deadline=policy)
    try:
        room = f"{pair.engine}/r"
        pair.prefill.start(StepPlan(send=[SendSpec("r", room, (5,))]))
        pair.decode.start(StepPlan(recv=[RecvSpec("d-r", room, pair.source("r", (5,)), (1,))]))
        pair.decode.poll()
        assert pair.decode.receiver is not None
        pair.decode.receiver._stop = lambda handle: None  # the peer vanished: no proof
        pair.decode.start(StepPlan(abort=[AbortSpec("d-r", "client went away")]))
        assert pair.decode.poll() == (set(), set(), set())  # draining: the blocks stay held
        clock.now += pair.config.drain_timeout + 1
        decode = pair.decode.decode
        assert decode is not None
        if policy == "release":  # the opt-in: freed on the timer, as kvfsm did before
            assert pair.decode.poll() == (set(), {"d-r"}, {"d-r"}) and decode.stats.drain_deadline_releases == 1
            return
        assert pair.decode.poll() == (set(), set(), set()), "blocks reported free on the drain timer"
        assert decode.stats.quarantined == 1 and decode.stats.quarantined_bytes > 0
        report = pair.decode.report()  # vLLM's connector stats: the gauge shows the one quarantined block
        assert report is not None and report["quarantined_pages"] == [1]
        (handle,) = decode.quarantined()
        handle.fenced("the prefill engine's process is gone")
        assert pair.decode.poll() == (set(), {"d-r"}, {"d-r"}) and pair.decode.take_load_errors() == {1}
        assert decode.stats.quarantined == 0 and decode.stats.fences == 1
        report = pair.decode.report()
        assert report is not None and report["quarantined_pages"] == [0]
    finally:
        pair.close()


def test_vllm_on_drain_deadline_is_validated() -> None:
    from kvfsm.compat.vllm._config import ConnectorConfig

    assert ConnectorConfig.from_extra({}).on_drain_deadline == "quarantine"
    with pytest.raises(kvfsm.ConfigError, match="on_drain_deadline"):
        ConnectorConfig.from_extra({"on_drain_deadline": "sometimes"})


def test_a_failed_fake_room_is_released_at_once_and_fail_kinds_stay_counted() -> None:
    manager = TransferManager("sender")
    backend = FakeBackend(manager)
    handle = manager.open(1)
    backend.bootstrap(handle, backend.address)
    handle.fail(kvfsm.FailureReason(FailureKind.PEER_LOST, "gone"))
    assert handle.release_safe and manager.stats.quarantines == 0
