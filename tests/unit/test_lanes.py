"""The prefill's writer lanes (issue 22, item 1), over the real ZeroMQ control plane and a scripted engine.

An engine call that blocks (Mooncake's first write to a new peer is a
synchronous handshake) must hold up that decode's rooms and no one else's,
and must be bounded in time. On 7ddfcf8 one writer thread did every decode's
engine work: a submit that blocked for one decode stopped the writes of all.

The engine here blocks the submits to one decode until the test lets them
go; every other call returns at once and copies bytes for real.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
torch = pytest.importorskip("torch", reason="torch is needed for the KV pools")

import kvfsm  # noqa: E402
from kvfsm import FailureKind, KVPoll  # noqa: E402
from kvfsm.backends.base import KVPools, MemoryRegion  # noqa: E402
from kvfsm.backends.remote import EngineAdapter, EngineJob, RemoteBackend, RemoteConfig, Write  # noqa: E402
from tests.helpers import until  # noqa: E402

WAIT = 10.0


class CopiedJob(EngineJob):
    def __init__(self, writes: list[Write]) -> None:
        for src, dst, length in writes:
            ctypes.memmove(dst, src, length)
        self.detail = f"{len(writes)} writes"

    def poll(self) -> str:
        return "done"


class BlockingEngine(EngineAdapter):
    """Submits to the peer named `stuck` wait for `release`; the rest copy at once."""

    name = "blocking"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stuck: str | None = None
        self.blocked = threading.Event()
        self.returned = threading.Event()

    def register(self, regions: list[MemoryRegion]) -> None:
        return

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return {"who": f"decode-{id(self):x}"}, None

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return session["who"]

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        if target == self.stuck:
            self.blocked.set()
            self.release.wait(60.0)
            self.returned.set()
        return CopiedJob(writes)


class Backend(RemoteBackend):
    name = "blocking"

    def __init__(self, manager: kvfsm.TransferManager, config: RemoteConfig) -> None:
        super().__init__(manager, config)

    def _make_engine(self) -> EngineAdapter:
        return BlockingEngine()


def _pools() -> tuple[KVPools, Any]:
    k, v = torch.zeros(2, 8, 64), torch.zeros(2, 8, 64)
    return KVPools.from_tensors(k, v), (k, v)


wait_for = functools.partial(until, timeout=WAIT)


class Cluster:
    """One prefill and two decodes in this process, each with its own control plane on 127.0.0.1."""

    def __init__(self, config: RemoteConfig) -> None:
        timeouts = kvfsm.Timeouts(drain=None)
        self.prefill_manager = kvfsm.TransferManager("sender", timeouts=timeouts)
        self.prefill = Backend(self.prefill_manager, config)
        pools, (self.k, self.v) = _pools()
        self.k.normal_()
        self.v.normal_()
        self.prefill.register_pools(pools)
        self.decode_managers = [kvfsm.TransferManager("receiver", timeouts=timeouts) for _ in range(2)]
        self.decodes = [Backend(manager, config) for manager in self.decode_managers]
        self.decode_tensors = []
        for decode in self.decodes:
            pools, tensors = _pools()
            decode.register_pools(pools)
            self.decode_tensors.append(tensors)

    @property
    def engine(self) -> BlockingEngine:
        engine = self.prefill.engine
        assert isinstance(engine, BlockingEngine)
        return engine

    def target_of(self, index: int) -> str:
        return str(self.decodes[index].engine.session()[0]["who"])

    def connect(self, room: int, index: int, page: int) -> tuple[kvfsm.TransferHandle, kvfsm.TransferHandle]:
        send, recv = self.prefill_manager.open(room), self.decode_managers[index].open(room)
        self.prefill.bootstrap(send, self.prefill.address)
        self.decodes[index].bootstrap(recv, self.prefill.address)
        assert wait_for(lambda: recv.state is KVPoll.WaitingForInput), recv
        self.decodes[index].expect(recv, [page], None)
        assert wait_for(lambda: send.state is KVPoll.WaitingForInput), send
        return send, recv

    def close(self) -> None:
        self.engine.release.set()
        for backend in (*self.decodes, self.prefill):
            backend.close()


def _done(handle: kvfsm.TransferHandle) -> bool:
    return handle.state is KVPoll.Success


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(RemoteConfig(heartbeat_interval=0.1, heartbeat_misses=5, engine_call_timeout=1.0))
    yield cluster
    cluster.close()


def test_a_submit_that_blocks_for_one_decode_holds_up_no_other(cluster: Cluster) -> None:
    stuck_send, _stuck_recv = cluster.connect(1, 0, page=1)
    cluster.engine.stuck = cluster.target_of(0)
    cluster.prefill.send(stuck_send, [1], last=True)
    assert cluster.engine.blocked.wait(WAIT)
    rooms = [cluster.connect(10 + i, 1, page=i) for i in range(4)]
    for page, (send, _recv) in enumerate(rooms):
        cluster.prefill.send(send, [page], last=True)
    for send, recv in rooms:
        assert wait_for(functools.partial(_done, recv)), (recv, "waited for another decode's submit")
        assert send.state is KVPoll.Success
    assert not cluster.engine.returned.is_set(), "the blocked submit must still be blocked"


def test_an_engine_call_stuck_past_its_limit_loses_that_decode_only(cluster: Cluster) -> None:
    stuck_send, stuck_recv = cluster.connect(1, 0, page=1)
    other_send, other_recv = cluster.connect(2, 1, page=2)
    cluster.engine.stuck = cluster.target_of(0)
    cluster.prefill.send(stuck_send, [1], last=True)
    assert cluster.engine.blocked.wait(WAIT)
    # Past engine_call_timeout (1 s) the prefill gives that decode up, and tells it why.
    assert wait_for(lambda: stuck_send.state is KVPoll.Failed)
    reason = stuck_send.reason
    assert reason is not None and reason.kind is FailureKind.TRANSFER_ERROR and "has not returned" in reason.message
    assert cluster.prefill.remote_stats.engine_calls_stuck == 1
    assert wait_for(lambda: stuck_recv.state is KVPoll.Failed)
    # Its write is still out (the call never returned): nothing is released on either side.
    time.sleep(0.3)
    assert not stuck_send.release_safe and not stuck_recv.release_safe
    # The other decode never noticed.
    cluster.prefill.send(other_send, [2], last=True)
    assert wait_for(lambda: other_recv.state is KVPoll.Success)
    # The call returns: the prefill's pages are released then (its lane drained the write).
    cluster.engine.release.set()
    assert cluster.engine.returned.wait(WAIT)
    assert wait_for(lambda: stuck_send.release_safe)
