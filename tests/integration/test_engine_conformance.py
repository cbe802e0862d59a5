"""The conformance kit over a real cross-process engine: Mooncake, both endpoints in this process.

`MooncakeBackend` is run exactly as a third-party adapter would be (see
docs/guides/conformance-kit.md): a sender and a receiver endpoint on
127.0.0.1, talking over the real ZeroMQ control plane and moving bytes
with Mooncake Transfer Engine over loopback TCP.

Two things are particular to a real engine:

* Destroying a Mooncake `TransferEngine` takes about a second, so one
  engine per role and its pools live for the whole module (registered
  once, zeroed at the start of every example); each example still builds
  fresh backends, control planes and managers around them.
* `settle()` must prove that nothing the pair started is still moving:
  every control message either side sent has been handled by the other,
  and the prefill's writer thread has no room with work left. It checks
  both twice around a round trip through the writer's command queue, and
  gives up with an error after `SETTLE_LIMIT` seconds.

NIXL is not covered here: importing it into the pytest process makes the
interpreter crash at exit (tests/integration/test_engines.py drives it in
child processes instead), and the kit needs both endpoints and its manual
clock in one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings

from kvfsm import TransferManager
from kvfsm.testing import BackendConformance, BackendPair

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
torch = pytest.importorskip("torch", reason="torch is needed for the KV pools")
pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine (mooncake-transfer-engine-non-cuda) is missing")

from kvfsm.backends._remote_engine import EngineAdapter, EngineJob, Write  # noqa: E402
from kvfsm.backends.base import KVPools, MemoryRegion  # noqa: E402
from kvfsm.backends.mooncake import MooncakeBackend, MooncakeEngine  # noqa: E402
from kvfsm.backends.remote import RemoteConfig  # noqa: E402

PAGES = 8
LAYERS = 2
WORDS_PER_PAGE = 4
SETTLE_LIMIT = 20.0
#: How long one question to the writer thread waits for its answer.
SYNC_WAIT = 0.005
# Heartbeats never fall due within a run (the first goes out before any peer is watched):
# the kit's steps never wait, and settle() counts every message.
CONFIG = RemoteConfig(heartbeat_interval=3600.0)


class KeptEngine(EngineAdapter):
    """A Mooncake engine and its registered pools that outlive one example's backends."""

    name = "mooncake"
    notifies_receiver = False

    def __init__(self) -> None:
        self.inner = MooncakeEngine()
        self.tensors = [torch.zeros(LAYERS, PAGES, WORDS_PER_PAGE, dtype=torch.int64) for _ in range(2)]
        self.pools = KVPools.from_tensors(*self.tensors)
        self.inner.register([*self.pools.kv, *self.pools.aux])

    def register(self, regions: list[MemoryRegion]) -> None:
        return  # registered once, at creation

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return self.inner.session()

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return self.inner.add_peer(session, blob)

    def submit(self, target: Any, writes: list[Write], notify: bytes | None) -> EngineJob:
        return self.inner.submit(target, writes, notify)

    def close(self) -> None:
        return  # kept for the next example

    def write(self, page: int, token: int) -> None:
        for tensor in self.tensors:
            tensor[:, page] = token

    def read(self, page: int) -> int:
        values = torch.cat([tensor[:, page].reshape(-1) for tensor in self.tensors]).unique()
        return int(values[0]) if values.numel() == 1 else -2  # -2: a torn page


_ENGINES: dict[str, KeptEngine] = {}


def kept_engine(role: str) -> KeptEngine:
    if role not in _ENGINES:
        _ENGINES[role] = KeptEngine()
    engine = _ENGINES[role]
    for tensor in engine.tensors:
        tensor.zero_()  # no token of an earlier example may pass for a write of this one
    return engine


class SettlingMooncakeBackend(MooncakeBackend):
    """`MooncakeBackend` on a kept engine, counting the control messages it has handled."""

    def __init__(self, manager: TransferManager, engine: KeptEngine) -> None:
        self.kept = engine
        self.handled = 0
        super().__init__(manager, CONFIG)
        receive: Callable[[list[bytes]], None] = self.control._receive

        def counting(frames: list[bytes]) -> None:
            try:
                receive(frames)
            finally:
                self.handled += 1

        # Counted after the handler returned: whatever it queued for the writer is queued by then.
        setattr(self.control, "_receive", counting)  # noqa: B010

    def _make_engine(self) -> EngineAdapter:
        return self.kept

    def _command(self, command: str, payload: Any, active: dict[str, Any]) -> None:
        if command == "sync":
            # Commands are handled in order: everything queued before this one has been taken up.
            if not active:
                payload.set()
            return
        super()._command(command, payload, active)

    def writer_idle(self) -> bool:
        """True when the writer took up every command queued so far and had no room with work left.

        False when it still had work at that moment (or is slow to answer): ask again.
        """
        done = threading.Event()
        self._work.put(("sync", done))
        return done.wait(SYNC_WAIT)


def settle_pair(sending: SettlingMooncakeBackend, receiving: SettlingMooncakeBackend) -> None:
    """Block until every message sent was handled and the writer is idle, twice in a row with no change."""

    def counts() -> tuple[int, int, int, int]:
        return (sending.control.stats.sent, receiving.handled, receiving.control.stats.sent, sending.handled)

    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        before = counts()
        idle = sending.writer_idle()
        after = counts()
        if idle and before == after and before[0] == before[1] and before[2] == before[3]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the Mooncake pair did not settle in {SETTLE_LIMIT}s: writer idle {idle}, {after}")
        time.sleep(0.0005)


class MooncakeConformance(BackendConformance):
    max_pages_per_request = 4

    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        source, destination = kept_engine("sender"), kept_engine("receiver")
        sending = SettlingMooncakeBackend(sender, source)
        receiving = SettlingMooncakeBackend(receiver, destination)
        sending.register_pools(source.pools)
        receiving.register_pools(destination.pools)
        return BackendPair(
            sender=sending,
            receiver=receiving,
            peer=sending.address,
            write_source=source.write,
            read_destination=destination.read,
            write_destination=destination.write,
            settle=lambda: settle_pair(sending, receiving),
        )


# Each step waits for loopback round trips: a modest budget whatever the profile.
TestMooncakeBackend = MooncakeConformance.TestCase
TestMooncakeBackend.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
