"""Both halves of the remote backend over a simulated network and engine, without threads.

`RemoteBackend` has two seams for this: `_make_transport` (here a
`SimTransport` that puts every frame into `SimNet.inflight` instead of a
socket) and `_start_threads` (here nothing: the test calls `receive`,
`housekeeping` and `pump` itself; `pump` runs one turn of every writer lane
of the prefill, one lane per decode session). Every other line that runs is the
production code. The engine is `SimEngine`: a write is a `SimJob` that
stays in flight until the test completes it (copying the bytes for real
with `ctypes.memmove` between torch tensors) or fails it, in any order.
`NotifyingSimEngine` also carries notifications, as NIXL does (`World(...,
notifying=True)`): they wait in `SimNet.notes` until the receiving decode
polls its engine.

The model-based test (tests/property/test_wire_model.py) and the
regression tests of the wire defects (tests/unit/test_wire_defects.py)
build on this.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import torch

import kvfsm
from kvfsm.backends._remote_receiver import DecodeEndpoint
from kvfsm.backends._remote_sender import PrefillEndpoint
from kvfsm.backends._transport import ControlStats
from kvfsm.backends.base import BackendError, KVPools, MemoryRegion
from kvfsm.backends.remote import EngineAdapter, EngineBusy, EngineJob, RemoteBackend, RemoteConfig, Write
from tests.helpers import FakeClock

PAGES = 8
PAGE_FLOATS = 4
AUX_SLOTS = 4
AUX_BYTES = 8
CONFIG = RemoteConfig(heartbeat_interval=1.0, heartbeat_misses=10, pending_ttl=100.0)
TIMEOUTS = kvfsm.Timeouts(bootstrap=60.0, waiting=60.0, transferring=60.0, drain=None)


class SimChannel:
    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.closed = False


class SimNet:
    """Frames in flight, as (destination address, frames); the test picks what arrives when."""

    def __init__(self) -> None:
        self.inflight: list[tuple[str, list[bytes]]] = []
        self.endpoints: dict[str, SimBackend] = {}
        self.delivered: list[tuple[str, list[bytes]]] = []
        # Engine notifications on their way, per receiving engine id: (sender's engine id, message).
        self.notes: dict[str, list[tuple[str, bytes]]] = {}

    def deliver(self, index: int) -> None:
        addr, frames = self.inflight.pop(index)
        self.delivered.append((addr, frames))
        endpoint = self.endpoints.get(addr)
        if endpoint is not None and not endpoint._closed:
            endpoint.receive(frames)

    def deliver_all(self) -> None:
        while self.inflight:
            self.deliver(0)


class SimTransport:
    def __init__(self, net: SimNet, address: str) -> None:
        self.net = net
        self.address = address
        self.stats = ControlStats()

    def connect(self, addr: str) -> SimChannel:
        return SimChannel(addr)

    def send(self, channel: SimChannel, frames: list[bytes]) -> bool:
        if channel.closed:
            return False
        self.net.inflight.append((channel.addr, list(frames)))
        self.stats.sent += 1
        return True

    def close_channel(self, channel: SimChannel, *, flush: bool = False) -> None:
        channel.closed = True  # what was sent on it is in `SimNet.inflight` already

    def wake(self) -> None:
        return  # the test runs housekeeping itself


class SimJob(EngineJob):
    """Writes that land only when the test says so."""

    def __init__(self, engine: SimEngine, writes: list[Write]) -> None:
        self.engine = engine
        self.writes = writes
        self.status = "pending"
        self.detail = f"{len(writes)} sim writes"

    def complete(self) -> None:
        for src, dst, length in self.writes:
            ctypes.memmove(dst, src, length)
        self.status = "done"
        self.engine.inflight.remove(self)

    def fail(self) -> None:
        self.status = "failed"
        self.engine.inflight.remove(self)

    def poll(self) -> str:
        return self.status

    def destinations(self) -> Iterator[tuple[int, int]]:
        for _src, dst, length in self.writes:
            yield dst, dst + length


class SimEngine(EngineAdapter):
    """Jobs the test completes or fails; `refuse` submits answered busy, `broken` makes every submit fail."""

    name = "sim"

    def __init__(self) -> None:
        self.inflight: list[SimJob] = []
        self.submitted: list[Write] = []
        self.refuse = 0
        self.broken: str | None = None
        # Once: take only this many writes of the next submit, then answer busy (Mooncake's way).
        self.take_part: int | None = None

    def register(self, regions: list[MemoryRegion]) -> None:
        return

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return {}, None

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return "peer"

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        if self.broken is not None:
            raise BackendError(self.broken)
        if self.refuse:
            self.refuse -= 1
            raise EngineBusy("sim engine: queue full")
        if self.take_part is not None and self.take_part < len(writes):
            part, self.take_part = writes[: self.take_part], None
            self.submitted.extend(part)
            partial = SimJob(self, part)
            self.inflight.append(partial)
            raise EngineBusy("sim engine: queue full after part", partial, len(part))
        self.submitted.extend(writes)
        job = SimJob(self, writes)
        self.inflight.append(job)
        return job


class NotifyingSimEngine(SimEngine):
    """A `SimEngine` that carries notifications and must be polled on the receiving side (as NIXL)."""

    receiver_progress = True
    notifies = True

    def __init__(self, net: SimNet, engine_id: str) -> None:
        super().__init__()
        self.net = net
        self.engine_id = engine_id
        self.notified: list[tuple[str, bytes]] = []

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return {"agent": self.engine_id}, None

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return (session.get("agent"),)

    def notify(self, target: Any, message: bytes) -> None:
        if self.broken is not None:
            raise BackendError(self.broken)
        self.notified.append((target[0], message))
        self.net.notes.setdefault(target[0], []).append((self.engine_id, message))

    def progress(self) -> list[tuple[str, bytes]]:
        return self.net.notes.pop(self.engine_id, [])


class SimBackend(RemoteBackend):
    name = "sim"

    def __init__(
        self,
        manager: kvfsm.TransferManager,
        net: SimNet,
        address: str,
        config: RemoteConfig = CONFIG,
        notifying: bool = False,
    ):
        self._net = net
        self._sim_address = address
        self._notifying = notifying
        self.deferred: list[kvfsm.StateChange] = []
        super().__init__(manager, config)
        net.endpoints[address] = self

    def _make_engine(self) -> EngineAdapter:
        return NotifyingSimEngine(self._net, f"engine-{self._sim_address}") if self._notifying else SimEngine()

    def _make_transport(self) -> Any:
        return SimTransport(self._net, self._sim_address)

    def _start_threads(self) -> None:
        return

    #: When set, the manager's notices reach this backend only at `deliver_notices()`, as when
    #: another thread is busy delivering them (the stop of a failed room then comes late).
    defer_notices = False

    def _observe(self, change: kvfsm.StateChange) -> None:
        if self.defer_notices:
            self.deferred.append(change)
        else:
            super()._observe(change)

    def deliver_notices(self) -> None:
        while self.deferred:
            super()._observe(self.deferred.pop(0))

    @property
    def sim_engine(self) -> SimEngine:
        assert isinstance(self.engine, SimEngine)
        return self.engine

    @property
    def prefill(self) -> PrefillEndpoint:
        """The prefill half (a prefill's endpoint)."""
        assert isinstance(self.endpoint, PrefillEndpoint)
        return self.endpoint

    @property
    def decode(self) -> DecodeEndpoint:
        """The decode half (a decode's endpoint)."""
        assert isinstance(self.endpoint, DecodeEndpoint)
        return self.endpoint

    def commands_queued(self) -> int:
        """Commands the prefill's lanes have not taken up yet."""
        if not isinstance(self.endpoint, PrefillEndpoint):
            return 0
        return sum(lane.commands.qsize() for lane in self.endpoint.lanes)

    def active_claims(self) -> list[Any]:
        """The claims the prefill's lanes poll (writes in flight, stopped, or a chunk to complete)."""
        if not isinstance(self.endpoint, PrefillEndpoint):
            return []
        return [claim for lane in self.endpoint.lanes for claim in lane.active.values()]


class Pools:
    """One endpoint's KV and aux tensors (one layer: K and V regions)."""

    def __init__(self) -> None:
        self.k = torch.zeros(PAGES, PAGE_FLOATS)
        self.v = torch.zeros(PAGES, PAGE_FLOATS)
        self.aux = torch.zeros(AUX_SLOTS, AUX_BYTES, dtype=torch.uint8)

    def kv_pools(self) -> KVPools:
        return KVPools.from_tensors([self.k], [self.v], self.aux)

    def page_ranges(self, pages: list[int]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for tensor in (self.k, self.v):
            size = tensor.element_size() * PAGE_FLOATS
            out.extend((tensor.data_ptr() + p * size, tensor.data_ptr() + (p + 1) * size) for p in pages)
        return out


class World:
    """One prefill and two decode endpoints on one simulated network and one clock."""

    def __init__(self, config: RemoteConfig = CONFIG, decodes: int = 2, notifying: bool = False) -> None:
        #: `settle()` lets decodes read their commit markers before it delivers frames.
        self.markers_first = False
        self.clock = FakeClock()
        self.net = SimNet()
        self.prefill_manager = kvfsm.TransferManager("sender", timeouts=TIMEOUTS, clock=self.clock)
        self.prefill_pools = Pools()
        self.prefill = SimBackend(self.prefill_manager, self.net, "sim://prefill", config, notifying)
        self.prefill.register_pools(self.prefill_pools.kv_pools())
        self.decode_managers = [
            kvfsm.TransferManager("receiver", timeouts=TIMEOUTS, clock=self.clock) for _ in range(decodes)
        ]
        self.decode_pools = [Pools() for _ in range(decodes)]
        self.decodes = [
            SimBackend(manager, self.net, f"sim://decode{i}", config, notifying)
            for i, manager in enumerate(self.decode_managers)
        ]
        for backend, pools in zip(self.decodes, self.decode_pools, strict=True):
            backend.register_pools(pools.kv_pools())

    def open_pair(self, room: int, pages: list[int]) -> tuple[kvfsm.TransferHandle, kvfsm.TransferHandle]:
        """A bootstrapped room of the first decode that expects `pages` (aux slot `room % AUX_SLOTS`)."""
        prefill = self.prefill_manager.open(room)
        decode = self.decode_managers[0].open(room)
        self.prefill.bootstrap(prefill, "sim://prefill")
        self.decodes[0].bootstrap(decode, "sim://prefill")
        self.settle()
        self.decodes[0].expect(decode, pages, aux_index=room % AUX_SLOTS)
        self.settle()
        return prefill, decode

    @property
    def endpoints(self) -> list[SimBackend]:
        return [self.prefill, *self.decodes]

    def housekeeping(self) -> None:
        for endpoint in self.endpoints:
            if not endpoint._closed:
                endpoint.housekeeping(self.clock())
        for manager in (self.prefill_manager, *self.decode_managers):
            manager.check_deadlines()

    def pump(self) -> None:
        if not self.prefill._closed:
            self.prefill.pump()

    def quiet_network(self, rounds: int = 3) -> None:
        """Every frame in flight arrives, in order, and the writer takes them up; writes stay where they are."""
        for _ in range(rounds):
            for endpoint in self.endpoints:
                endpoint.deliver_notices()
            self.pump()
            self.net.deliver_all()
        self.pump()

    def settle(self, rounds: int = 50) -> None:
        """Deliver everything (notices too), complete every write, pump, until nothing moves."""
        for _ in range(rounds):
            for endpoint in self.endpoints:
                endpoint.deliver_notices()
            before = (len(self.net.inflight), len(self.prefill.sim_engine.inflight), self.prefill.commands_queued())
            self.pump()
            for job in list(self.prefill.sim_engine.inflight):
                job.complete()
            self.pump()
            if self.markers_first:
                # The commit markers those completions sent land, and the decodes read them, before DONE arrives.
                for job in list(self.prefill.sim_engine.inflight):
                    job.complete()
                for decode in self.decodes:
                    if not decode._closed:
                        decode.housekeeping(self.clock())
            self.net.deliver_all()
            self.pump()
            after = (len(self.net.inflight), len(self.prefill.sim_engine.inflight), self.prefill.commands_queued())
            if before == after == (0, 0, 0):
                return
