"""The scheduler-facing surface of SGLang 0.5.23, on kvfsm's classes (no SGLang needed).

The names below are every method and attribute that SGLang 0.5.23's
`disaggregation/prefill.py`, `decode.py`, `decode_hicache_mixin.py`,
`utils.py`, `role_switch.py` and `managers/scheduler.py` call or read on a
manager, sender or receiver (the migration guide lists them with their call
sites). tests/sglang drives SGLang's real queues over them; here each one
exists (never an AttributeError) and behaves as SGLang's scheduler relies on.
"""

from __future__ import annotations

import http.server
import inspect
import json
import os
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

from kvfsm import FailureKind, KVPoll
from kvfsm.backends.fake import FakeBackend
from kvfsm.compat import sglang
from tests.helpers import FakeClock

ADDR = "prefill-0:8998"

MANAGER_SURFACE = [
    "kv_args",
    "register_to_bootstrap",
    "enable_deferred_decode_kv_release",
    "supports_deferred_decode_kv_release",
    "supports_host_destination",
    "supports_role_switch",
    "teardown",
    "should_verify_kv_checksum",
    "is_abort_release_safe",
    "clear_deferred_abort_state",
    "prefill_info_table",
    "try_ensure_parallel_info",
    "_ensure_prefill_recompute_executor",
    "submit_prefill_recompute",
    "req_to_decode_prefix_len",
    "transfer_infos",
    "is_dummy_cp_rank",
    "enable_staging",
]
SENDER_SURFACE = [
    "init",
    "send",
    "poll",
    "poll_pp_consensus",
    "abort",
    "clear",
    "failure_exception",
    "get_transfer_metric",
    "get_max_transfer_tokens",
    "should_send_kv_chunk",
    "pop_decode_prefix_len",
    "mark_prefill_complete",
    "kv_mgr",
    "bootstrap_room",
    "conclude_state",
]
RECEIVER_SURFACE = [
    "init",
    "send_metadata",
    "poll",
    "abort",
    "clear",
    "failure_exception",
    "ensure_abort_notified",
    "is_abort_release_safe",
    "supports_host_destination",
    "bootstrap_infos",
    "abort_notified",
    "require_staging",
    "conclude_state",
    "kv_mgr",
    "bootstrap_room",
    "bootstrap_addr",
]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prefill(clock: FakeClock) -> Iterator[sglang.KVManager]:
    with sglang.KVManager(sglang.KVArgs(), "prefill", clock=clock, reaper=False) as manager:
        yield manager


@pytest.fixture
def decode(clock: FakeClock) -> Iterator[sglang.KVManager]:
    with sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False, backend=FakeBackend) as manager:
        yield manager


@pytest.mark.parametrize("fake", [False, True], ids=["kvfsm", "fake"])
def test_every_name_the_scheduler_reads_exists(fake: bool, decode: sglang.KVManager) -> None:
    manager_class = sglang.FakeKVManager if fake else sglang.KVManager
    with manager_class(sglang.KVArgs(), "prefill", reaper=False) as prefill:
        sender = (sglang.FakeKVSender if fake else sglang.KVSender)(prefill, ADDR, 1)
        receiver = (sglang.FakeKVReceiver if fake else sglang.KVReceiver)(decode, ADDR, 1)
        missing = [name for name in MANAGER_SURFACE if not hasattr(prefill, name)]
        missing += [f"sender.{name}" for name in SENDER_SURFACE if not hasattr(sender, name)]
        missing += [f"receiver.{name}" for name in RECEIVER_SURFACE if not hasattr(receiver, name)]
        assert missing == []
        sender.clear()
        receiver.clear()


def test_signatures_are_sglang_0_5_23s() -> None:
    def names(function: Any) -> list[str]:
        return [p.name for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]

    assert names(sglang.KVSender.send)[:4] == ["self", "kv_indices", "state_indices", "num_kv_tokens"]
    assert names(sglang.KVReceiver.send_metadata)[:6] == [
        "self",
        "kv_indices",
        "aux_index",
        "state_indices",
        "decode_prefix_len",
        "destination",
    ]
    assert names(sglang.KVReceiver.ensure_abort_notified) == ["self", "force_arm"]
    assert names(sglang.KVManager.is_abort_release_safe) == ["self", "bootstrap_room", "required_acks"]


def test_the_older_positional_sender_form_is_still_accepted(prefill: sglang.KVManager) -> None:
    sender = sglang.KVSender(prefill, ADDR, 2, [0, 1], 3, True)
    assert (sender.dest_tp_ranks, sender.pp_rank, sender.req_has_disagg_prefill_dp_rank) == ([0, 1], 3, True)
    with pytest.raises(TypeError, match="positional"):
        sglang.KVSender(prefill, ADDR, 3, False, 1, 2)


# -- sender ---------------------------------------------------------------------------------


def test_sender_answers_the_prefill_scheduler(prefill: sglang.KVManager) -> None:
    sender = sglang.KVSender(prefill, ADDR, 4)
    assert sender.get_max_transfer_tokens() is None
    assert sender.poll_pp_consensus() is sender.poll() is KVPoll.Bootstrapping
    with pytest.raises(NotImplementedError, match="prefill_complete"):
        sender.mark_prefill_complete()
    fake = sglang.FakeKVSender(prefill, ADDR, 4)
    fake.mark_prefill_complete()  # a warmup request has no peer to tell
    assert fake.poll() is KVPoll.WaitingForInput


def test_reading_a_senders_failure_ends_its_room(prefill: sglang.KVManager) -> None:
    """SGLang's prefill never clears a failed sender: failure_exception() is where its room ends."""
    sender = sglang.KVSender(prefill, ADDR, 5)
    sender.abort()
    with pytest.raises(sglang.KVTransferError, match=r"KVTransferError\(bootstrap_room=5\).*Aborted by AbortReq"):
        sender.failure_exception()
    assert 5 not in prefill.transfer_manager
    assert sender.poll() is KVPoll.Failed


# -- receiver and deferred release ----------------------------------------------------------


def test_abort_after_success_fails_the_request_and_keeps_the_room(decode: sglang.KVManager) -> None:
    """DESIGN.md's compat semantics: the HiCache restore window (decode Success, scheduler still waiting)."""
    receiver = sglang.KVReceiver(decode, ADDR, 6)
    decode.update_status(6, KVPoll.Success)
    assert receiver.poll() is KVPoll.Success
    receiver.abort()
    receiver.abort()
    assert (receiver.poll(), receiver.conclude_state) == (KVPoll.Failed, KVPoll.Failed)
    assert decode.check_status(6) is KVPoll.Success
    assert receiver.release_safe and receiver.is_abort_release_safe()
    with pytest.raises(sglang.KVTransferError) as caught:
        receiver.failure_exception()
    assert caught.value.reason is not None
    assert caught.value.reason.kind is FailureKind.ABORTED
    assert not caught.value.is_from_another_rank
    assert decode.transfer_manager.stats.aborts == 0


def test_a_receiver_with_a_peer_is_abort_notified(decode: sglang.KVManager) -> None:
    receiver = sglang.KVReceiver(decode, ADDR, 7)
    receiver.ensure_abort_notified(force_arm=True)
    notified_before_init = receiver.abort_notified
    assert not notified_before_init  # init() has not found the prefill: nobody to tell
    receiver.init(0)
    assert receiver.bootstrap_infos == [{"peer": ADDR, "prefill_dp_rank": 0}]
    assert decode.prefill_info_table[ADDR].ranks == [ADDR]
    receiver.abort()
    assert receiver.abort_notified
    assert decode.is_abort_release_safe(7, required_acks=1) is receiver.release_safe
    assert decode.is_abort_release_safe(99, required_acks=3)  # never given pages here: nothing can land


def test_fake_receivers_are_never_abort_notified(decode: sglang.KVManager) -> None:
    receiver = sglang.FakeKVReceiver(decode, "2.2.2.2:8998", None)
    receiver.init(0)
    receiver.abort()
    receiver.ensure_abort_notified(force_arm=True)
    assert not receiver.abort_notified
    assert receiver.bootstrap_infos == []
    assert receiver.release_safe  # nothing was ever written: released at once


def test_deferred_release_follows_sglangs_knob(clock: FakeClock) -> None:
    with sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False) as bare:
        assert not bare.enable_deferred_decode_kv_release  # no backend: nothing tracks the drain
    for value, expected in (("1", True), ("0", False), ("false", False)):
        with (
            mock.patch.dict(os.environ, {sglang.DEFERRED_RELEASE_ENV: value}),
            sglang.KVManager(sglang.KVArgs(), "decode", reaper=False, backend=FakeBackend) as manager,
        ):
            assert manager.enable_deferred_decode_kv_release is expected
            assert manager.supports_deferred_decode_kv_release


def test_host_destinations_are_refused(decode: sglang.KVManager) -> None:
    receiver = sglang.KVReceiver(decode, ADDR, 8)
    assert receiver.supports_host_destination is False
    assert decode.supports_host_destination is False
    with pytest.raises(NotImplementedError, match="host KV destinations"):
        receiver.send_metadata([1], 0, None, 0, sglang.KVTransferDestination.HOST)


# -- manager: prefill servers, recompute, role switch -------------------------------------


class _Generate(http.server.BaseHTTPRequestHandler):
    status = 200
    received: list[Any] = []  # noqa: RUF012 - one class per test server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(type(self).status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def generate_server() -> Iterator[tuple[type[_Generate], int]]:
    handler = type("Generate", (_Generate,), {"received": [], "status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_recompute_without_a_known_prefill_fails_the_request(decode: sglang.KVManager) -> None:
    receiver = sglang.KVReceiver(decode, ADDR, 9)
    decode.submit_prefill_recompute(receiver, {"rid": "r9"})
    assert receiver.poll() is KVPoll.Failed
    failure = receiver.handle.failure
    assert failure is not None
    assert failure.kind is FailureKind.BOOTSTRAP_ERROR
    assert "could not resolve the prefill /generate URL" in failure.message


@pytest.mark.parametrize("status", [200, 500])
def test_recompute_posts_generate_to_the_prefill(
    decode: sglang.KVManager, generate_server: tuple[type[_Generate], int], status: int
) -> None:
    handler, port = generate_server
    handler.status = status
    addr = "127.0.0.1:8998"
    receiver = sglang.KVReceiver(decode, addr, 10)
    receiver.init(0)
    decode.prefill_info_table[addr].prefill_http_port = port
    decode.submit_prefill_recompute(receiver, {"rid": "r10", "text": "hi"})
    decode._ensure_prefill_recompute_executor().submit(lambda: None).result(timeout=10)
    executor = decode._ensure_prefill_recompute_executor()
    executor.shutdown(wait=True)
    assert handler.received == [("/generate", {"rid": "r10", "text": "hi"})]
    if status == 200:
        assert receiver.poll() is not KVPoll.Failed  # the prefill took it: the transfer goes on
    else:
        assert receiver.poll() is KVPoll.Failed
        failure = receiver.handle.failure
        assert failure is not None
        assert "status=500" in failure.message


def test_only_the_leader_rank_posts(generate_server: tuple[type[_Generate], int]) -> None:
    handler, _port = generate_server
    with sglang.KVManager(sglang.KVArgs(engine_rank=1), "decode", reaper=False, backend=FakeBackend) as follower:
        receiver = sglang.KVReceiver(follower, ADDR, 11)
        follower.submit_prefill_recompute(receiver, {"rid": "r11"})
        assert receiver.poll() is KVPoll.Bootstrapping
    assert handler.received == []


def test_teardown_releases_everything_for_a_role_switch() -> None:
    manager = sglang.KVManager(sglang.KVArgs(), "decode", backend=FakeBackend)
    assert manager.supports_role_switch
    receiver = sglang.KVReceiver(manager, ADDR, 12)
    warmup = sglang.FakeKVReceiver(manager, "2.2.2.2:8998", None)
    manager._ensure_prefill_recompute_executor()
    manager.teardown()
    assert receiver.poll() is KVPoll.Failed
    assert warmup.poll() is KVPoll.Failed
    assert not manager.transfer_manager.reaper_running
    assert manager.backend is not None and manager.backend._closed
    assert manager.should_verify_kv_checksum(ADDR)


def test_another_ranks_failure_after_success_fails_this_request_too(decode: sglang.KVManager) -> None:
    """The MIN all-reduce said Failed (another rank failed) although this rank's room succeeded."""
    receiver = sglang.KVReceiver(decode, ADDR, 13)
    decode.update_status(13, KVPoll.Success)
    with pytest.raises(sglang.KVTransferError) as caught:
        receiver.failure_exception()
    assert caught.value.is_from_another_rank
    assert (receiver.poll(), receiver.conclude_state) == (KVPoll.Failed, KVPoll.Failed)
    assert decode.check_status(13) is KVPoll.Success
    receiver.abort()  # a later abort keeps the first reason
    with pytest.raises(sglang.KVTransferError) as again:
        receiver.failure_exception()
    assert again.value.reason is caught.value.reason
