"""`RemoteBackend`: the cross-process lifecycle every engine shares, over the declared wire protocol.

`RemoteBackend` is the one place where the cross-process lifecycle lives,
so Mooncake and NIXL cannot drift apart (SGLang's copy-pasted `abort()`,
DESIGN.md bug 2). An engine plugs in below it as an `EngineAdapter`: it
registers memory, describes its session, and submits and polls writes.
Above it, the adapter only emits events on handles (DESIGN.md rule 1).

The protocol is declared in `kvfsm.backends.wire` (messages, per-room wire
states and their tables); the halves that drive it live in
`_remote_receiver` (decode), `_remote_sender` and `_remote_writer`
(prefill), on top of `_remote_endpoint` (sessions, frames in and out).
This module puts them together with their IO: the ZeroMQ transport of
`kvfsm.backends.control` (imported only when an endpoint starts, so that
everything else here runs without pyzmq), its thread, and the prefill's
writer thread.

    decode                                    prefill
    bootstrap(h, prefill_addr)
      HELLO (session id+secret, pools)  ----> session (half-open), engine peer
                                        <---- HELLO_ACK (its id+secret, pools)
      h.bootstrapped()  [HEARTBEAT confirms the session]
    expect(h, pages, aux)
      ROOM (room, gen, pages, aux)      ----> claim bound to bootstrap(h): h.bootstrapped()
                                              send(h, chunk) ... send(h, last=True)
                                              engine writes, polled by the writer
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

import logging
import threading

from .._manager import TransferHandle, TransferManager
from .._states import Role
from . import codec
from ._errors import BackendError
from ._remote_endpoint import Fire, RemoteConfig, RemoteStats, Transport
from ._remote_engine import EngineAdapter, EngineBusy, EngineJob, PartialSubmit, Write, coalesce_runs
from ._remote_receiver import ReceiverSide
from ._remote_sender import SenderSide
from ._sessions import Session, SessionState, SessionTable

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


class RemoteBackend(SenderSide, ReceiverSide):
    """A `KVBackend` whose peer is another process; subclasses pick the engine (`_make_engine`)."""

    def __init__(self, manager: TransferManager, config: RemoteConfig | None = None) -> None:
        if config is None:
            config = RemoteConfig()
        if not isinstance(config, RemoteConfig):
            raise TypeError(f"config must be a RemoteConfig; got {type(config).__name__}: {config!r}")
        self.config = config
        self.engine = self._make_engine()
        self.remote_stats = RemoteStats()
        self._lock = threading.Lock()
        self._next_heartbeat = 0.0
        self._init_receiver()
        self._init_sender()
        super().__init__(manager)
        self.sessions = SessionTable(
            manager._clock,
            window=config.peer_window,
            max_sessions=config.max_sessions,
            max_half_open=config.max_half_open,
        )
        self.transport = self._make_transport()
        self._start_threads()

    def _make_transport(self) -> Transport:
        # Imported here, not at the top: everything above the transport is sans-IO, so the
        # wire model and the halves run (and their tests collect) without pyzmq.
        try:
            from .control import ControlPlane
        except ModuleNotFoundError as exc:
            raise BackendError(
                f"{type(self).__name__} needs pyzmq for its control plane: pip install 'kvfsm[engines]' ({exc})"
            ) from exc  # the cause names the module, for whoever reports missing dependencies
        return ControlPlane(
            on_frames=self.receive,
            on_housekeeping=self.housekeeping,
            host=self.config.host,
            port=self.config.port,
            tick=min(0.05, self.config.heartbeat_interval / 4),
            name=f"kvfsm-{self.name}-{self.role.value}",
        )

    def _start_threads(self) -> None:
        from .control import ControlPlane

        assert isinstance(self.transport, ControlPlane)
        self.transport.start()
        if self.role is Role.SENDER:
            self._start_writer()

    # -- KVBackend: each call goes to the half the role picks ---------------------------------

    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        if self.role is Role.RECEIVER:
            self._bootstrap_receiver(handle, peer)
        else:
            self._bootstrap_sender(handle)

    def _stop(self, handle: TransferHandle) -> None:
        if self.role is Role.RECEIVER:
            self._stop_receiver(handle)
        else:
            self._stop_sender(handle)

    def _forget(self, handle: TransferHandle) -> None:
        if self.role is Role.RECEIVER:
            self._forget_receiver(handle)
        else:
            self._forget_sender(handle)

    def _on_hello(self, frame: codec.Frame) -> None:
        # receive() hands HELLO only to the role that takes it (the prefill).
        self._on_hello_sender(frame)

    def _on_frame(self, session: Session, frame: codec.Frame, fire: Fire) -> None:
        if self.role is Role.RECEIVER:
            self._on_frame_receiver(session, frame, fire)
        else:
            self._on_frame_sender(session, frame, fire)

    def _session_lost(self, session: Session, was: SessionState, why: str, fire: Fire) -> None:
        if self.role is Role.RECEIVER:
            self._session_lost_receiver(session, was, why, fire)
        else:
            self._session_lost_sender(session, was, why, fire)

    def _confirmed(self, session: Session) -> bool:
        return self._confirmed_sender(session) if self.role is Role.SENDER else True

    def _expire(self, now: float, fire: Fire) -> None:
        if self.role is Role.SENDER:
            self._expire_sender(now, fire)

    def _poll_engine(self, now: float) -> float | None:
        return self._poll_engine_receiver() if self.role is Role.RECEIVER else None

    def _shutdown(self) -> None:
        self._say_bye()
        self._stop_writer()
        stop = getattr(self.transport, "stop", None)
        if stop is not None:
            stop()
        self.engine.close()
