"""SGLang's real scheduler queues behave the same with kvfsm's fake trio as with SGLang's own.

Each scenario runs twice on SGLang 0.5.23's queue code (tests/sglang/_queues.py):
once with `get_kv_class(TransferBackend.FAKE, ...)` answering SGLang's
`FakeKVManager`/`FakeKVSender`/`FakeKVReceiver`, once answering kvfsm's (the
migration guide's patch). What the queues did to every request (popped,
failed, streamed with which finish reason, KV released, metadata slots
taken and freed, aborts through `Scheduler.abort_request`) is logged, and
the two logs must be equal, as must the queues' final contents. Each
scenario also states what SGLang itself does, so the comparison cannot pass
with both sides broken the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest

from tests.sglang._sglang import sglang_or_skip

sglang_or_skip()

from tests.sglang import _queues as q  # noqa: E402

Log = list[tuple[Any, ...]]
Scenario = Callable[[Any], None]


@pytest.fixture(scope="module")
def group() -> Any:
    return q.gloo_group()


@pytest.fixture(autouse=True)
def context() -> Iterator[None]:
    with q.sglang_context():
        yield


def _manager(classes: dict[Any, Any], mode: Any) -> Any:
    return classes[q.KVClassType.MANAGER](q.kv_args(), mode, mock.MagicMock(), False)


def run_prefill(
    implementation: str, scenario: Scenario, group: Any, *, page_size: int = 1, slots: int = 4, pp_size: int = 1
) -> tuple[Log, Any]:
    log: Log = []
    classes = q.fake_trio(implementation)
    with q.patched_sglang(log, {q.TransferBackend.FAKE: classes}):
        manager = _manager(classes, q.utils.DisaggregationMode.PREFILL)
        world = q.PrefillWorld(manager=manager, log=log, group=group, page_size=page_size, slots=slots, pp_size=pp_size)
        try:
            scenario(world)
            return log, world.snapshot()
        finally:
            getattr(manager, "shutdown", lambda: None)()


def run_decode(
    implementation: str,
    scenario: Scenario,
    group: Any,
    *,
    page_size: int = 1,
    slots: int = 4,
    deferred_release: bool = False,
    manager: Any = None,
    pp_size: int = 1,
) -> tuple[Log, Any]:
    log: Log = []
    classes = q.fake_trio(implementation)
    with q.patched_sglang(log, {q.TransferBackend.FAKE: classes}):
        own = manager is None
        if own:
            manager = _manager(classes, q.utils.DisaggregationMode.DECODE)
        world = q.DecodeWorld(
            manager=manager,
            log=log,
            group=group,
            page_size=page_size,
            slots=slots,
            deferred_release=deferred_release,
            pp_size=pp_size,
        )
        try:
            scenario(world)
            return log, world.snapshot()
        finally:
            if own:
                getattr(manager, "shutdown", lambda: None)()


def same_on_both(run: Callable[..., tuple[Log, Any]], scenario: Scenario, group: Any, **kwargs: Any) -> Log:
    theirs = run("sglang", scenario, group, **kwargs)
    ours = run("kvfsm", scenario, group, **kwargs)
    assert ours == theirs
    return theirs[0]


# -- prefill: PrefillBootstrapQueue, waiting queue, send_kv_chunk, inflight queue ---------------------------


def prefill_happy(world: Any) -> None:
    world.add("r1", 6, 11)
    world.pop_bootstrapped()
    world.forward("r1")
    world.process_inflight()


def prefill_chunked(world: Any) -> None:
    world.add("r1", 11, 12)
    world.pop_bootstrapped()
    world.forward("r1", chunk_ends=(3, 7))  # page size 2: 2 and 6 tokens sent, the rest last
    world.process_inflight()


def prefill_zero_page_last_chunk(world: Any) -> None:
    world.add("r1", 8, 13)
    world.pop_bootstrapped()
    world.forward("r1", chunk_ends=(8,))  # every page already sent: the last chunk carries 0 pages
    world.process_inflight()


def prefill_room_none(world: Any) -> None:
    world.add("r1", 5, None)
    world.pop_bootstrapped()
    world.forward("r1")
    world.process_inflight()


def prefill_shared_room(world: Any) -> None:
    world.add("r1", 5, 14)
    world.add("r2", 6, 14)
    world.pop_bootstrapped()
    world.forward("r1")
    world.forward("r2")
    world.process_inflight()


def prefill_abort_in_bootstrap_queue_twice(world: Any) -> None:
    world.add("r1", 5, 15)
    world.add("r2", 5, 16)
    world.host.abort("r1")
    world.host.abort("r1")
    world.pop_bootstrapped()
    world.forward("r2")
    world.process_inflight()


def prefill_abort_in_waiting_queue(world: Any) -> None:
    world.add("r1", 5, 17)
    world.pop_bootstrapped()
    world.host.abort("r1")
    world.host.abort("r1")
    world.resolve_waiting()


def prefill_abort_in_inflight_queue_twice(world: Any) -> None:
    world.add("r1", 5, 18)
    world.add("r2", 5, 19)
    world.pop_bootstrapped()
    world.forward("r1")
    world.forward("r2")
    world.host.abort("r1")
    world.host.abort("r1")
    world.process_inflight()
    world.process_inflight()


def prefill_abort_waiting_for_a_metadata_slot(world: Any) -> None:
    world.add("r1", 5, 20)
    world.add("r2", 5, 21)
    world.pop_bootstrapped()  # one slot: r1 takes it, r2 waits in the bootstrap queue
    world.pop_bootstrapped()
    world.host.abort("r2")
    world.pop_bootstrapped()
    world.forward("r1")
    world.process_inflight()


def prefill_waiting_timeout(world: Any) -> None:
    world.add("r1", 5, 22)
    world.add("r2", 5, 23)
    world.pop_bootstrapped()
    world.resolve_waiting()  # the first poll after init() starts the fake's waiting deadline
    world.forward("r2")  # r2 is sent in time; r1 never is
    time.sleep(1.2)
    world.resolve_waiting()
    world.process_inflight()


def prefill_pp_consensus(world: Any) -> None:
    world.add("r1", 5, 24)
    world.add("r2", 5, 25)
    world.host.abort("r2")
    world.pop_bootstrapped()  # pp_size 2: polls through poll_pp_consensus, sent on to PP rank 1
    world.forward("r1")
    world.process_inflight()


PREFILL: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "happy path": (prefill_happy, {}),
    "chunked prefill": (prefill_chunked, {"page_size": 2}),
    "zero-page last chunk": (prefill_zero_page_last_chunk, {"page_size": 2}),
    "bootstrap_room=None": (prefill_room_none, {}),
    "two requests share a room": (prefill_shared_room, {}),
    "abort in the bootstrap queue, twice": (prefill_abort_in_bootstrap_queue_twice, {}),
    "abort in the waiting queue, twice": (prefill_abort_in_waiting_queue, {}),
    "abort in the inflight queue, twice": (prefill_abort_in_inflight_queue_twice, {}),
    "abort while waiting for a metadata slot": (prefill_abort_waiting_for_a_metadata_slot, {"slots": 1}),
    "waiting timeout": (prefill_waiting_timeout, {}),
    "pp consensus": (prefill_pp_consensus, {"pp_size": 2}),
}

#: What SGLang's own fakes do, in a few words per scenario (checked on the common log).
PREFILL_EXPECTED: dict[str, list[tuple[Any, ...]]] = {
    "happy path": [("inflight-done", "r1", "FINISH_LENGTH"), ("slot-", 0)],
    "chunked prefill": [("inflight-done", "r1", "FINISH_LENGTH"), ("release", "r1")],
    "zero-page last chunk": [("inflight-done", "r1", "FINISH_LENGTH")],
    "bootstrap_room=None": [("inflight-done", "r1", "FINISH_LENGTH")],
    "two requests share a room": [("inflight-done", "r1", "FINISH_LENGTH"), ("inflight-done", "r2", "FINISH_LENGTH")],
    "abort in the bootstrap queue, twice": [
        ("stream", (("r1", "FINISH_ABORT"),)),
        ("inflight-done", "r2", "FINISH_LENGTH"),
    ],
    "abort in the waiting queue, twice": [("abort-output", "r1"), ("slot-", 0)],
    "abort in the inflight queue, twice": [
        ("inflight-done", "r1", "FINISH_ABORT"),
        ("inflight-done", "r2", "FINISH_LENGTH"),
    ],
    "abort while waiting for a metadata slot": [
        ("stream", (("r2", "FINISH_ABORT"),)),
        ("inflight-done", "r1", "FINISH_LENGTH"),
    ],
    "waiting timeout": [("stream", (("r1", "FINISH_ABORT"),)), ("inflight-done", "r2", "FINISH_LENGTH")],
    "pp consensus": [("stream", (("r2", "FINISH_ABORT"),)), ("inflight-done", "r1", "FINISH_LENGTH")],
}


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_queues(name: str, group: Any) -> None:
    scenario, options = PREFILL[name]
    timeout = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1"} if name == "waiting timeout" else {}
    with mock.patch.dict(os.environ, timeout):
        log = same_on_both(run_prefill, scenario, group, **options)
    for event in PREFILL_EXPECTED[name]:
        assert event in log, (event, log)


# -- decode: DecodePreallocQueue and DecodeTransferQueue --------------------------------------------------


def decode_happy(world: Any) -> None:
    world.add("d1", 6, 31)
    world.pop_preallocated()
    world.pop_transferred()


def decode_room_none(world: Any) -> None:
    world.add("d1", 6, None)
    world.pop_preallocated()
    world.pop_transferred()


def decode_shared_room(world: Any) -> None:
    world.add("d1", 6, 32)
    world.add("d2", 4, 32)
    world.pop_preallocated()
    world.pop_transferred()


def decode_abort_in_prealloc_queue_twice(world: Any) -> None:
    world.add("d1", 6, 33)
    world.add("d2", 6, 34)
    world.host.abort("d1")
    world.host.abort("d1")
    world.pop_preallocated()
    world.pop_transferred()


def decode_abort_waiting_for_a_metadata_slot(world: Any) -> None:
    world.add("d1", 6, 35)
    world.add("d2", 6, 36)
    world.pop_preallocated()  # one slot: d1 takes it, d2 waits
    world.host.abort("d2")
    world.pop_preallocated()
    world.pop_transferred()


def decode_abort_in_transfer_queue_twice(world: Any) -> None:
    world.add("d1", 6, 37)
    world.add("d2", 6, 38)
    world.pop_preallocated()
    world.host.abort("d1")
    world.host.abort("d1")
    world.pop_transferred()
    world.pop_transferred()


def decode_waiting_timeout(world: Any) -> None:
    # Waiting for KV space is not a stalled transfer: no deadline on the fake receiver.
    world.add("d1", 6, 39)
    world.add("d2", 6, 40)
    world.pop_preallocated()
    time.sleep(1.2)
    world.pop_transferred()
    world.pop_preallocated()
    world.pop_transferred()


def decode_abort_in_hicache_restore_window(world: Any) -> None:
    world.host.enable_decode_hicache = True
    world.add("d1", 6, 41)
    world.add("d2", 6, 42)
    world.pop_preallocated()
    for rid in ("d1", "d2"):
        world.decode_req(rid).hicache_restore_status = q.HiCacheRestoreResult.PENDING
    world.pop_transferred()  # both received: Success, but gated as Transferring while the restore runs
    world.host.abort("d1")
    world.pop_transferred()
    for decode_req in world.transfer.queue:
        decode_req.hicache_restore_status = q.HiCacheRestoreResult.READY
    world.pop_transferred()


def decode_deferred_release(world: Any) -> None:
    # A warmup request on a Mooncake deployment: fake receivers, the real backend's manager (deferred release on).
    world.add("d1", 6, 43)
    world.add("d2", 6, 44)
    world.pop_preallocated()
    world.host.abort("d1")
    world.pop_transferred()
    world.pop_transferred()


def decode_pp_consensus(world: Any) -> None:
    world.add("d1", 6, 45)
    world.add("d2", 6, 46)
    world.pop_preallocated(pp_good_rids=["d1", "d2"], pp_bad_rids=[])
    world.pop_transferred()
    world.add("d3", 6, 47)
    world.pop_preallocated(pp_good_rids=[], pp_bad_rids=["d3"])


class MooncakeLikeManager:
    """The flags and deferred-release calls of SGLang's MooncakeKVManager that decode reads."""

    enable_deferred_decode_kv_release = True
    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(self) -> None:
        self.prefill_info_table: dict[str, Any] = {}
        self.kv_args = q.kv_args()

    def is_abort_release_safe(self, bootstrap_room: Any, required_acks: int) -> bool:
        return required_acks == 0

    def clear_deferred_abort_state(self, bootstrap_room: Any) -> None:
        pass


DECODE: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "happy path": (decode_happy, {}),
    "bootstrap_room=None": (decode_room_none, {}),
    "two requests share a room": (decode_shared_room, {}),
    "abort in the prealloc queue, twice": (decode_abort_in_prealloc_queue_twice, {}),
    "abort while waiting for a metadata slot": (decode_abort_waiting_for_a_metadata_slot, {"slots": 1}),
    "abort in the transfer queue, twice": (decode_abort_in_transfer_queue_twice, {}),
    "waiting timeout": (decode_waiting_timeout, {"slots": 1}),
    "abort in the HiCache restore window": (decode_abort_in_hicache_restore_window, {}),
    "deferred release": (decode_deferred_release, {"deferred_release": True, "manager": MooncakeLikeManager()}),
    "pp consensus": (decode_pp_consensus, {"pp_size": 2}),
}

DECODE_EXPECTED: dict[str, list[tuple[Any, ...]]] = {
    "happy path": [("transferred", "d1", 1), ("slot-", 0)],
    "bootstrap_room=None": [("transferred", "d1", 1)],
    "two requests share a room": [("transferred", "d1", 1), ("transferred", "d2", 1)],
    "abort in the prealloc queue, twice": [("prealloc-failed", "d1", "FINISH_ABORT"), ("transferred", "d2", 1)],
    "abort while waiting for a metadata slot": [("prealloc-failed", "d2", "FINISH_ABORT"), ("transferred", "d1", 1)],
    "abort in the transfer queue, twice": [
        ("stream", (("d1", "FINISH_ABORT"),)),
        ("release", "d1"),
        ("transferred", "d2", 1),
    ],
    "waiting timeout": [("transferred", "d1", 1), ("transferred", "d2", 1)],
    "abort in the HiCache restore window": [
        ("stream", (("d1", "FINISH_ABORT"),)),
        ("release", "d1"),
        ("transferred", "d2", 1),
    ],
    "deferred release": [("stream", (("d1", "FINISH_ABORT"),)), ("release", "d1"), ("transferred", "d2", 1)],
    "pp consensus": [("transferred", "d1", 1), ("prealloc-failed", "d3", "FINISH_ABORT")],
}

#: Events SGLang's fakes never produce in a scenario (the bug each one would be).
DECODE_NEVER: dict[str, list[tuple[Any, ...]]] = {
    "abort in the HiCache restore window": [("transferred", "d1", 1)],
    "deferred release": [("transferred", "d1", 1)],
}


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_queues(name: str, group: Any) -> None:
    scenario, options = DECODE[name]
    timeout = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1"} if name == "waiting timeout" else {}
    with mock.patch.dict(os.environ, timeout):
        log = same_on_both(run_decode, scenario, group, **options)
    for event in DECODE_EXPECTED[name]:
        assert event in log, (event, log)
    for event in DECODE_NEVER.get(name, []):
        assert event not in log, (event, log)
    streamed = [event for event in log if event[0] == "stream"]
    assert len(streamed) == len(set(streamed)), f"a request was streamed twice: {streamed}"


# -- the one documented difference ------------------------------------------------------------------------


def prefill_late_send(world: Any) -> None:
    world.add("r1", 5, 26)
    world.pop_bootstrapped()
    world.resolve_waiting()  # the fake's waiting deadline starts
    time.sleep(1.2)
    world.forward("r1")  # the last chunk only arrives after the deadline passed
    world.process_inflight()


def test_a_send_after_the_waiting_deadline_no_longer_revives_the_request(group: Any) -> None:
    """The migration guide's difference: kvfsm enforces the deadline on every event, not only in poll().

    SGLang's fake turns a request that timed out unpolled into a Success
    when its chunk finally comes; kvfsm's room failed at the deadline, so
    the request fails (its KV is released, its slot freed) either way.
    """
    with mock.patch.dict(os.environ, {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1"}):
        theirs, _ = run_prefill("sglang", prefill_late_send, group)
        ours, ours_queues = run_prefill("kvfsm", prefill_late_send, group)
    assert ("inflight-done", "r1", "FINISH_LENGTH") in theirs
    assert ("inflight-done", "r1", "FINISH_ABORT") in ours
    resources = ("slot+", "slot-", "release", "bootstrapped", "forwarded")
    assert [e for e in ours if e[0] in resources] == [e for e in theirs if e[0] in resources]
    assert ours_queues == ([], [], [], 4)
