"""`RemoteBackend` with a scripted engine: statuses the real engines rarely show on demand.

Both endpoints live in this process and talk over the real ZeroMQ control
plane on 127.0.0.1; the engine is a stand-in whose jobs report whatever
the test scripts (pending, Mooncake's non-sticky TIMEOUT, failure, a
failure that does not prove the writes stopped) and copy bytes with
`ctypes.memmove` when they report done.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
torch = pytest.importorskip("torch", reason="torch is needed for the KV pools")

import kvfsm  # noqa: E402
from kvfsm.backends.base import KVPools, MemoryRegion  # noqa: E402
from kvfsm.backends.remote import (  # noqa: E402
    EngineAdapter,
    EngineJob,
    RemoteBackend,
    RemoteConfig,
    Write,
)
from tests.helpers import until  # noqa: E402

WAIT = 5.0


class ScriptedJob(EngineJob):
    def __init__(self, writes: list[Write], script: deque[str]) -> None:
        self.writes = writes
        self.script = script
        self.copied = False
        self.released = False
        self.cancellable = False
        self.detail = f"{len(writes)} writes"

    def poll(self) -> str:
        status = self.script.popleft() if self.script else "done"
        if status == "done" and not self.copied:
            for src, dst, length in self.writes:
                ctypes.memmove(dst, src, length)
            self.copied = True
        if status == "undrained":
            self.may_still_land = True
            return "failed"
        return status

    def cancel(self) -> bool:
        return self.cancellable

    def release(self) -> None:
        self.released = True


class ScriptedEngine(EngineAdapter):
    name = "scripted"

    def __init__(self) -> None:
        self.scripts: deque[deque[str]] = deque()
        self.jobs: list[ScriptedJob] = []
        self.lock = threading.Lock()

    def register(self, regions: list[MemoryRegion]) -> None:
        return

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return {}, None

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return "peer"

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        with self.lock:
            script = self.scripts.popleft() if self.scripts else deque()
            job = ScriptedJob(writes, script)
            self.jobs.append(job)
        return job


class ScriptedBackend(RemoteBackend):
    name = "scripted"

    def __init__(self, manager: kvfsm.TransferManager, timeout_fails: bool = False, markers: bool = True) -> None:
        self.timeout_is_failure = timeout_fails
        super().__init__(manager, RemoteConfig(heartbeat_interval=0.1, heartbeat_misses=3, completion_markers=markers))

    def _make_engine(self) -> EngineAdapter:
        return ScriptedEngine()

    def _timeout_fails(self) -> bool:
        return self.timeout_is_failure


class Pair:
    def __init__(self, timeout_fails: bool = False, drain: float = 30.0, markers: bool = True) -> None:
        timeouts = kvfsm.Timeouts(drain=drain)
        self.sender = kvfsm.TransferManager("sender", timeouts=timeouts)
        self.receiver = kvfsm.TransferManager("receiver", timeouts=timeouts)
        self.pools = {
            role: (torch.zeros(2, 16, 256), torch.zeros(2, 16, 256), torch.zeros(4, 32, dtype=torch.uint8))
            for role in ("sender", "receiver")
        }
        for k, v, aux in [self.pools["sender"]]:
            k.normal_()
            v.normal_()
            aux.fill_(9)
        self.send_backend = ScriptedBackend(self.sender, timeout_fails, markers)
        self.recv_backend = ScriptedBackend(self.receiver, markers=markers)
        self.send_backend.register_pools(KVPools.from_tensors(*self.pools["sender"]))
        self.recv_backend.register_pools(KVPools.from_tensors(*self.pools["receiver"]))

    @property
    def engine(self) -> ScriptedEngine:
        engine = self.send_backend.engine
        assert isinstance(engine, ScriptedEngine)
        return engine

    def connect(
        self, room: int, dst: list[int], aux: int | None = None
    ) -> tuple[kvfsm.TransferHandle, kvfsm.TransferHandle]:
        send, recv = self.sender.open(room), self.receiver.open(room)
        self.send_backend.bootstrap(send, self.send_backend.address)
        self.recv_backend.bootstrap(recv, self.send_backend.address)
        assert wait_for(lambda: recv.state is kvfsm.KVPoll.WaitingForInput)
        self.recv_backend.expect(recv, dst, aux)
        assert wait_for(lambda: send.state is kvfsm.KVPoll.WaitingForInput)
        return send, recv

    def close(self) -> None:
        self.send_backend.close()
        self.recv_backend.close()


wait_for = functools.partial(until, timeout=WAIT)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


@pytest.mark.parametrize("markers", [True, False], ids=["commit-marker", "done-only"])
def test_pages_land_in_order_and_the_aux_slot_last(markers: bool) -> None:
    pair = Pair(markers=markers)
    try:
        send, recv = pair.connect(1, [3, 4, 9], aux=1)
        pair.send_backend.send(send, [0, 1], last=False)
        pair.send_backend.send(send, [2], last=True, aux_index=2)
        assert wait_for(lambda: recv.is_terminal)
        assert (send.state, recv.state) == (kvfsm.KVPoll.Success, kvfsm.KVPoll.Success)
        sk, sv, saux = pair.pools["sender"]
        rk, rv, raux = pair.pools["receiver"]
        assert torch.equal(rk[:, [3, 4, 9]], sk[:, [0, 1, 2]])
        assert torch.equal(rv[:, [3, 4, 9]], sv[:, [0, 1, 2]])
        assert torch.equal(raux[1], saux[2])
        # 4 regions (k0, v0, k1, v1). Chunk 1: pages 0,1 -> 3,4 coalesce into one run per
        # region; chunk 2: page 2 -> 9, one run per region.
        jobs = pair.engine.jobs
        assert [w[2] for w in jobs[0].writes] == [2 * 1024] * 4
        if markers:
            # The aux slot goes by the engine in the last chunk's own job (host memory like the
            # pages, on both sides: one job carries both), and the commit marker (24 bytes into
            # the decode's marker slot) only after every other write ended.
            assert wait_for(lambda: len(jobs) == 3 and jobs[2].copied)
            assert [len(job.writes) for job in jobs] == [4, 5, 1]
            assert jobs[1].writes[4][2] == 32  # the aux slot (32 bytes here)
            assert jobs[2].writes[0][2] == 24
            assert all(job.copied for job in jobs)
        else:
            # The aux slot (host memory on both sides) travels inside DONE: no engine write for it.
            assert [len(job.writes) for job in jobs] == [4, 4]
        assert recv.nbytes == send.nbytes == 3 * 4 * 1024
    finally:
        pair.close()


def test_mooncake_style_timeout_is_not_a_failure_by_default(pair: Pair) -> None:
    send, recv = pair.connect(2, [0, 1])
    pair.engine.scripts.append(deque(["pending", "timeout", "timeout", "pending", "done"]))
    pair.send_backend.send(send, [0, 1], last=True)
    assert wait_for(lambda: recv.is_terminal)
    assert recv.state is kvfsm.KVPoll.Success
    assert pair.send_backend.remote_stats.engine_timeouts == 2


def test_timeout_fails_the_room_when_asked_but_drain_waits_for_the_write() -> None:
    pair = Pair(timeout_fails=True)
    try:
        send, recv = pair.connect(3, [0, 1])
        script = deque(["timeout"] + ["pending"] * 100000)
        pair.engine.scripts.append(script)
        pair.send_backend.send(send, [0, 1], last=True)
        assert wait_for(lambda: send.is_terminal)
        assert send.reason is not None
        assert send.reason.kind is kvfsm.FailureKind.TRANSFER_ERROR
        assert "TIMEOUT" in send.reason.message
        assert wait_for(lambda: recv.state is kvfsm.KVPoll.Failed)
        assert recv.reason is not None
        assert recv.reason.kind is kvfsm.FailureKind.PEER_FAILED
        time.sleep(0.1)
        # The write may still land: neither side is release-safe yet.
        assert not send.release_safe
        assert not recv.release_safe
        script.clear()  # the write ends
        assert wait_for(lambda: recv.release_safe), "ABORT_ACK after the write ended opens the decode's gate"
        assert send.release_safe
    finally:
        pair.close()


def test_failure_that_may_still_land_never_acks() -> None:
    pair = Pair(drain=0.3)
    try:
        send, recv = pair.connect(4, [0, 1])
        pair.engine.scripts.append(deque(["undrained"]))
        pair.send_backend.send(send, [0, 1], last=True)
        assert wait_for(lambda: recv.is_terminal)
        assert recv.state is kvfsm.KVPoll.Failed
        time.sleep(0.1)
        assert pair.send_backend.remote_stats.abort_acks_sent == 0
        assert not recv.release_safe
        # No proof ever comes: the drain deadline quarantines the pages, it does not release them (issue 24).
        assert wait_for(lambda: not recv.release_safe and recv.pages_state is kvfsm.PagesState.QUARANTINED)
        assert pair.receiver.stats.quarantined == 1 and pair.receiver.stats.drain_deadline_releases == 0
        assert pair.receiver.release_quarantined(recv.room, "test: the scripted write never lands") == 1
        assert recv.release_safe
    finally:
        pair.close()


def test_decode_abort_mid_transfer_waits_for_the_write_then_acks(pair: Pair) -> None:
    send, recv = pair.connect(5, [0, 1, 2, 3])
    script = deque(["pending"] * 100000)
    pair.engine.scripts.append(script)
    pair.send_backend.send(send, [0, 1], last=False)
    assert wait_for(lambda: len(pair.engine.jobs) == 1)
    recv.abort("client went away")
    assert recv.state is kvfsm.KVPoll.Failed
    assert wait_for(lambda: send.state is kvfsm.KVPoll.Failed)
    assert send.reason is not None
    assert send.reason.from_peer
    time.sleep(0.1)
    assert not recv.release_safe, "the prefill's write is still in flight"
    script.clear()
    assert wait_for(lambda: recv.release_safe)
    assert pair.send_backend.remote_stats.abort_acks_sent == 1
    # Nothing more is issued for the aborted room.
    pair.send_backend.send(send, [2, 3], last=True)
    time.sleep(0.05)
    assert len(pair.engine.jobs) == 1


def test_a_peer_failure_reported_elsewhere_still_tells_the_prefill(pair: Pair) -> None:
    """`from_peer` may come from another rank (SGLang's all-reduce), not from this prefill: ABORT it anyway."""
    send, recv = pair.connect(6, [0, 1])
    other_rank = kvfsm.FailureReason(kvfsm.FailureKind.PEER_FAILED, "another decode rank failed", from_peer=True)
    assert recv.fail(other_rank)
    assert wait_for(lambda: send.state is kvfsm.KVPoll.Failed), "the prefill must learn of it"
    assert wait_for(lambda: recv.release_safe), "its ABORT_ACK opens the decode's gate"
    assert pair.recv_backend.remote_stats.aborts_sent == 1
    # The prefill failed from the decode's ABORT: it does not echo one back.
    assert pair.send_backend.remote_stats.aborts_sent == 0


def test_a_prefill_failure_reported_elsewhere_still_tells_the_decode(pair: Pair) -> None:
    send, recv = pair.connect(7, [0, 1])
    other_rank = kvfsm.FailureReason(kvfsm.FailureKind.PEER_FAILED, "another prefill rank failed", from_peer=True)
    assert send.fail(other_rank)
    assert wait_for(lambda: recv.state is kvfsm.KVPoll.Failed), "the decode must learn of it"
    assert wait_for(lambda: recv.release_safe)
    assert pair.send_backend.remote_stats.aborts_sent == 1
    assert pair.recv_backend.remote_stats.aborts_sent == 0


def test_duplicate_room_from_another_decode_transfer_is_refused(pair: Pair) -> None:
    send, recv = pair.connect(6, [0])
    other = kvfsm.TransferManager("receiver")
    other_backend = ScriptedBackend(other)
    try:
        other_backend.register_pools(KVPools.from_tensors(*pair.pools["receiver"]))
        dup = other.open(6)
        other_backend.bootstrap(dup, pair.send_backend.address)
        assert wait_for(lambda: dup.state is kvfsm.KVPoll.WaitingForInput)
        other_backend.expect(dup, [5], None)
        assert wait_for(lambda: dup.is_terminal)
        assert dup.reason is not None
        assert dup.reason.kind is kvfsm.FailureKind.BOOTSTRAP_ERROR
        assert "is in use by another transfer" in dup.reason.message
        # The live room was not touched.
        assert send.state is kvfsm.KVPoll.WaitingForInput
        assert recv.state is kvfsm.KVPoll.WaitingForInput
    finally:
        other_backend.close()


def test_prefill_closing_fails_its_rooms_and_the_decode_learns_why(pair: Pair) -> None:
    _send, recv = pair.connect(7, [0])
    pair.send_backend.close()
    assert wait_for(lambda: recv.is_terminal)
    assert recv.reason is not None
    assert recv.reason.kind is kvfsm.FailureKind.PEER_FAILED
    assert recv.reason.from_peer


def test_prefill_that_says_bye_fails_the_other_decode_rooms_with_peer_lost(pair: Pair) -> None:
    # A decode room the prefill has not opened yet: only the BYE can tell the decode.
    recv = pair.receiver.open(9)
    pair.recv_backend.bootstrap(recv, pair.send_backend.address)
    assert wait_for(lambda: recv.state is kvfsm.KVPoll.WaitingForInput)
    pair.recv_backend.expect(recv, [2], None)
    # The prefill says BYE to the sessions it holds as up. The decode's confirming frame
    # may still be queued when it is asked to close (it was, once, on a loaded machine:
    # the room then failed only after the heartbeat window, without a BYE), so the story
    # starts from the state it is about, instead of racing it.
    assert wait_for(lambda: len(pair.send_backend.sessions.up()) == 1)
    pair.send_backend.close()
    assert wait_for(lambda: recv.is_terminal)
    assert recv.reason is not None
    assert recv.reason.kind is kvfsm.FailureKind.PEER_LOST
    assert "BYE" in recv.reason.message


def test_close_stops_every_thread_it_started() -> None:
    before = {t.name for t in threading.enumerate()}
    pair = Pair()
    send, recv = pair.connect(8, [0])
    pair.send_backend.send(send, [0], last=True)
    assert wait_for(lambda: recv.is_terminal)
    pair.close()
    assert wait_for(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("kvfsm-scripted") and t.name not in before]
    )
    assert not pair.send_backend.control.running
    assert not pair.recv_backend.control.running


def test_abort_releases_a_cancellable_transfer_at_once(pair: Pair) -> None:
    # NIXL-style: releasing an in-flight handle cancels it; nothing is waited for.
    send, recv = pair.connect(10, [0, 1])
    pair.engine.scripts.append(deque(["pending"] * 100000))
    pair.send_backend.send(send, [0, 1], last=True)
    assert wait_for(lambda: len(pair.engine.jobs) == 1)
    job = pair.engine.jobs[0]
    job.cancellable = True
    recv.abort("client went away")
    assert wait_for(lambda: recv.release_safe), "the ACK follows the cancel without waiting for the write"
    assert job.released
    assert not job.copied
    assert send.release_safe
