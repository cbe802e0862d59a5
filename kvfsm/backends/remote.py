"""`RemoteBackend`: the cross-process lifecycle every engine shares, over the declared wire protocol.

`RemoteBackend` is the one place where the cross-process lifecycle lives,
so Mooncake and NIXL cannot drift apart (SGLang's copy-pasted `abort()`,
DESIGN.md bug 2). An engine plugs in below it as an `EngineAdapter`: it
registers memory, describes its session, and submits and polls writes.
Above it, the adapter only emits events on handles (DESIGN.md rule 1).

The protocol is declared in `kvfsm.backends.wire` (messages, per-room wire
states and their tables). A backend holds one endpoint half, picked once by
its role and never branched on again: `DecodeEndpoint` (`_remote_receiver`)
or `PrefillEndpoint` (`_remote_sender`, whose writer lanes live in
`_remote_writer`), both built on the session layer of `_remote_endpoint`.
This module puts the half together with its IO: the ZeroMQ transport of
`kvfsm.backends.control` (imported only when an endpoint starts, so that
everything else here runs without pyzmq), its thread, and the threads of
the prefill's lanes (one per decode session).

    decode                                    prefill
    bootstrap(h, prefill_addr)
      HELLO (session id+secret, pools)  ----> session (half-open)
                                        <---- HELLO_ACK (its id+secret, pools)
      HEARTBEAT (confirms)              ----> session up; its lane opens the engine peer
                                        <---- HEARTBEAT (the session is up on the decode too)
      h.bootstrapped()
    expect(h, pages, aux)
      ROOM (room, gen, pages, aux)      ----> claim bound to bootstrap(h): h.bootstrapped()
                                              send(h, chunk) ... send(h, last=True)
                                              engine writes, in that decode's lane
                                        <---- CHUNK (middle chunks), DONE (+ aux bytes)
      transfer_started, chunk_done, transfer_done

Failure and abort, from either side: the failing side sends ABORT; the
prefill stops issuing writes, waits until the engine ended every write of
that claim, then sends ABORT_ACK; only then is the decode's room
release-safe (or when its drain deadline passes). A session silent for the
heartbeat window (or that said BYE) fails every room that depends on it
with `PEER_LOST` (`BOOTSTRAP_ERROR` if it never answered the handshake).

Tests replace the IO: `_make_transport` and `_start_threads` are the seams
the model-based test (tests/property/test_wire_model.py) overrides to run
both halves over a simulated network, calling `receive`, `housekeeping`
and `pump` itself.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, ClassVar

from .._manager import TransferHandle, TransferManager
from .._states import Role
from ._errors import BackendError
from ._remote_endpoint import RemoteConfig, RemoteEndpoint, RemoteStats, Transport
from ._remote_engine import EngineAdapter, EngineBusy, EngineJob, PartialSubmit, Write, coalesce_runs
from ._remote_receiver import DecodeEndpoint
from ._remote_sender import PrefillEndpoint
from ._sessions import SessionTable
from .base import KVBackend, KVPools

__all__ = [
    "RemoteConfig",
    "RemoteStats",
    "RemoteBackend",
    "EngineAdapter",
    "EngineBusy",
    "EngineJob",
    "PartialSubmit",
    "Write",
    "coalesce_runs",
]

logger = logging.getLogger("kvfsm.backends.remote")

#: The longest the control thread goes without housekeeping (a quarter of the heartbeat interval
#: below that): heartbeats, liveness and expiries need no finer grain, and every endpoint idles at
#: this rate (measured: 32 idle endpoints at a 0.05 s tick took 0.11 s of CPU per second).
_MOST_TICK = 0.25


class RemoteBackend(KVBackend):
    """A `KVBackend` whose peer is another process; subclasses pick the engine (`_make_engine`).

    `endpoint` is its half: a `DecodeEndpoint` for a receiver's manager, a
    `PrefillEndpoint` for a sender's.
    """

    endpoint: RemoteEndpoint
    #: The halves a backend holds, by role; a subclass may extend them (the SGLang trio's unequal TP).
    decode_endpoint: ClassVar[type[DecodeEndpoint]] = DecodeEndpoint
    prefill_endpoint: ClassVar[type[PrefillEndpoint]] = PrefillEndpoint

    def __init__(self, manager: TransferManager, config: RemoteConfig | None = None) -> None:
        if config is None:
            config = RemoteConfig()
        if not isinstance(config, RemoteConfig):
            raise TypeError(f"config must be a RemoteConfig; got {type(config).__name__}: {config!r}")
        self.config = config
        self.engine = self._make_engine()
        super().__init__(manager)
        half: type[DecodeEndpoint] | type[PrefillEndpoint] = (
            self.decode_endpoint if self.role is Role.RECEIVER else self.prefill_endpoint
        )
        self.endpoint = half(self, config, self.engine)
        self.endpoint.transport = self.transport = self._make_transport()
        self._start_threads()

    @abc.abstractmethod
    def _make_engine(self) -> EngineAdapter:
        """Create and initialise the engine (raise `BackendError` if it cannot run here)."""

    def _timeout_fails(self) -> bool:
        return False

    def _make_transport(self) -> Transport:
        # Imported here, not at the top: everything above the transport is sans-IO, so the
        # wire model and the halves run (and their tests collect) without pyzmq.
        try:
            from .control import ControlPlane
        except ModuleNotFoundError as exc:
            # Chained, not `from None`: a tool that names the missing module reads it from the cause.
            raise BackendError(
                f"{type(self).__name__} needs pyzmq for its control plane: pip install 'kvfsm[engines]' ({exc})"
            ) from exc  # the cause names the module, for whoever reports missing dependencies
        return ControlPlane(
            on_frames=self.endpoint.admit,
            on_housekeeping=self.endpoint.housekeeping,
            host=self.config.host,
            port=self.config.port,
            tick=min(_MOST_TICK, self.config.heartbeat_interval / 4),
            name=f"kvfsm-{self.name}-{self.role.value}",
        )

    def _start_threads(self) -> None:
        from .control import ControlPlane

        assert isinstance(self.transport, ControlPlane)
        if isinstance(self.endpoint, PrefillEndpoint):
            self.endpoint.threaded = True
        self.transport.start()

    # -- what tests and tools read ------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def control(self) -> Any:
        """The transport (kept under its old name: tests and tools read `control.stats`)."""
        return self.transport

    @property
    def remote_stats(self) -> RemoteStats:
        return self.endpoint.remote_stats

    @property
    def sessions(self) -> SessionTable:
        return self.endpoint.sessions

    def receive(self, frames: list[bytes]) -> None:
        """One message, as if the transport delivered it (tests play the network with it)."""
        self.endpoint.receive(frames)

    def housekeeping(self, now: float | None = None) -> float:
        return self.endpoint.housekeeping(now)

    def pump(self) -> bool:
        """One turn of every writer lane of a prefill (tests drive it; threads do in production)."""
        endpoint = self.endpoint
        return endpoint.pump() if isinstance(endpoint, PrefillEndpoint) else False

    # -- KVBackend: every call goes to the one half this backend holds --------------------------

    def _register_pools(self, pools: KVPools) -> None:
        self.engine.register([*pools.kv, *pools.aux])
        markers = self.endpoint.markers
        if markers is not None:
            self.engine.register_host([markers.region])

    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        self.endpoint.bootstrap(handle, peer)

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        endpoint = self.endpoint
        if not isinstance(endpoint, DecodeEndpoint):  # base.expect() already refused the wrong role
            raise BackendError(f"{type(self).__name__} ({self.role.value}) cannot receive")
        endpoint.expect(handle, pages, aux_index)

    def _send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        endpoint = self.endpoint
        if not isinstance(endpoint, PrefillEndpoint):  # base.send() already refused the wrong role
            raise BackendError(f"{type(self).__name__} ({self.role.value}) cannot send")
        endpoint.send(handle, pages, last, aux_index)

    def _expected_pages(self, handle: TransferHandle) -> int | None:
        endpoint = self.endpoint
        return endpoint.expected_pages(handle) if isinstance(endpoint, PrefillEndpoint) else None

    def _stop(self, handle: TransferHandle) -> None:
        self.endpoint.stop(handle)

    def _forget(self, handle: TransferHandle) -> None:
        self.endpoint.forget(handle)

    def _shutdown(self) -> None:
        self.endpoint.say_bye()
        self.endpoint.shutdown()
        stop = getattr(self.transport, "stop", None)
        if stop is not None:
            stop()
        self.engine.close()
