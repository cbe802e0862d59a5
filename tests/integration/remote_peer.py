"""One kvfsm endpoint in its own process, driven step by step over a pipe.

The two-process engine tests start a prefill peer and a decode peer with
`PeerProcess(engine, role)` and call methods on them (`open`, `bootstrap`,
`expect`, `send`, `abort`, `wait`, `read`, ...); each call runs in the child
and returns plain data. The child never lets the interpreter run its exit
handlers (NIXL's bundled libraries can crash there), and the parent can
`kill()` it to play a crashed process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tests.pipe_child import PipeChild, build_or_exit, exit_child, serve

if TYPE_CHECKING:
    from kvfsm.backends.remote import RemoteBackend

PAGES = 32
PAGE_FLOATS = 1024  # 4 KiB per page per region
LAYERS = 2
AUX_SLOTS = 8
AUX_BYTES = 64
CALL_TIMEOUT = 30.0


def engine_missing(engine: str) -> str | None:
    """Why `engine` cannot be imported here, or None when it can (checked in a child: NIXL's exit)."""
    code = {
        "mooncake": "from mooncake.engine import TransferEngine",
        "nixl": "import os; os.environ.setdefault('UCX_MODULES', '^ib,rdmacm'); from nixl._api import nixl_agent",
    }[engine]
    import subprocess

    probe = subprocess.run(
        [sys.executable, "-c", f"import zmq, torch; {code}; import os; os._exit(0)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode == 0:
        return None
    return f"{engine} cannot be imported here: {probe.stderr.strip().splitlines()[-1:] or probe.returncode}"


class _EngineHook:
    """Wraps a real engine's `submit` so the test decides when its jobs are reported done or failed."""

    def __init__(self, engine: Any) -> None:
        self.hold = False
        self.fail_next = False
        inner_submit = engine.submit
        hook = self

        class Reported:
            def __init__(self, job: Any, fail: bool) -> None:
                self.job, self.fail, self.detail, self.may_still_land = job, fail, job.detail, False

            def poll(self) -> str:
                status = self.job.poll()
                if status == "pending" or hook.hold:
                    return "pending"
                return "failed" if self.fail else status

            def cancel(self) -> bool:
                return False

            def release(self) -> None:
                self.job.release()

        def submit(target: Any, writes: Any) -> Any:
            fail, hook.fail_next = hook.fail_next, False
            return Reported(inner_submit(target, writes), fail)

        engine.submit = submit


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PeerProcess(PipeChild):
    """A child process running one endpoint; methods are remote calls."""

    def __init__(
        self,
        engine: str,
        role: str,
        heartbeat: float = 0.1,
        misses: int = 3,
        drain: float = 5.0,
        markers: bool = False,
    ) -> None:
        super().__init__(_child_main, (engine, role, heartbeat, misses, drain, markers), f"{role} peer")
        self._address: str | None = None

    @property
    def address(self) -> str:
        """The endpoint's control address (the first call waits for the child to be ready)."""
        if self._address is None:
            self._address = str(self._call("address", timeout=120.0))
        return self._address

    def _call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return super()._call(name, *args, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kw: self._call(name, *args, **kw)


# -- the child ---------------------------------------------------------------------------


def _child_main(
    conn: Connection, engine: str, role: str, heartbeat: float, misses: int, drain: float, markers: bool
) -> None:
    logging.basicConfig(level=logging.ERROR, format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    endpoint = build_or_exit(conn, lambda: _Endpoint(engine, role, heartbeat, misses, drain, markers))
    serve(conn, endpoint)
    exit_child(endpoint.backend.close)


class _Endpoint:
    def __init__(self, engine: str, role: str, heartbeat: float, misses: int, drain: float, markers: bool) -> None:
        import torch

        import kvfsm
        from kvfsm.backends import get_backend
        from kvfsm.backends.base import KVPools
        from kvfsm.backends.remote import RemoteBackend, RemoteConfig

        self.kvfsm = kvfsm
        self.torch = torch
        timeouts = kvfsm.Timeouts(bootstrap=30.0, waiting=30.0, transferring=30.0, drain=drain)
        self.manager = kvfsm.TransferManager(role, timeouts=timeouts)
        self.manager.start_reaper(0.05)
        generator = torch.Generator().manual_seed(1234 if role == "sender" else 99)
        self.k = torch.randn(LAYERS, PAGES, PAGE_FLOATS, generator=generator)
        self.v = torch.randn(LAYERS, PAGES, PAGE_FLOATS, generator=generator)
        self.aux = torch.randint(0, 255, (AUX_SLOTS, AUX_BYTES), dtype=torch.uint8, generator=generator)
        config = RemoteConfig(heartbeat_interval=heartbeat, heartbeat_misses=misses, completion_markers=markers)
        backend_class = get_backend(engine)
        assert issubclass(backend_class, RemoteBackend)
        self.backend: RemoteBackend = backend_class(self.manager, config)
        self.backend.register_pools(KVPools.from_tensors(self.k, self.v, self.aux))
        self.handles: dict[Any, Any] = {}

    def address(self) -> str:
        return str(self.backend.address)

    def open(self, room: Any) -> str:
        self.handles[room] = self.manager.open(room)
        return str(self.handles[room].state.name)

    def bootstrap(self, room: Any, peer: str) -> str:
        handle = self.handles[room]
        self.backend.bootstrap(handle, peer)
        return str(handle.state.name)

    def expect(self, room: Any, pages: list[int], aux: int | None) -> str:
        self.backend.expect(self.handles[room], pages, aux)
        return str(self.handles[room].state.name)

    def send(self, room: Any, pages: list[int], last: bool, aux: int | None) -> str:
        self.backend.send(self.handles[room], pages, last=last, aux_index=aux)
        return str(self.handles[room].state.name)

    def abort(self, room: Any, reason: str = "test abort") -> dict[str, Any]:
        handle = self.handles[room]
        acks = self.backend.remote_stats.abort_acks_received
        handle.abort(reason)
        # Read at once, gate first: if it is open, it was the peer's ABORT_ACK (counted
        # before the gate opens) or nothing had been sent; `acked` tells which.
        safe = handle.release_safe
        return {
            "state": handle.state.name,
            "release_safe": safe,
            "acked": self.backend.remote_stats.abort_acks_received > acks,
        }

    def info(self, room: Any) -> dict[str, Any]:
        handle = self.handles[room]
        reason = handle.reason
        return {
            "state": handle.state.name,
            "status": self.manager.status(room).name,
            "kind": reason.kind.value if reason else None,
            "from_peer": reason.from_peer if reason else None,
            "message": reason.message if reason else None,
            "release_safe": handle.release_safe,
            "pages": handle.pages_state.value,
            "quarantined": self.manager.stats.quarantined,
            "nbytes": handle.nbytes,
            "chunks": handle.chunks,
        }

    def fence(self, room: Any, why: str) -> dict[str, Any]:
        """The engine's word that the room's peer is gone (a proof that no write can land)."""
        self.handles[room].fenced(why)
        return self.info(room)

    def wait(self, room: Any, states: list[str], timeout: float) -> dict[str, Any]:
        """Wait until the room is in one of `states`; returns info plus the seconds waited."""
        start = time.monotonic()
        handle = self.handles[room]
        while handle.state.name not in states and time.monotonic() - start < timeout:
            time.sleep(0.002)
        return {**self.info(room), "waited": time.monotonic() - start}

    def wait_safe(self, room: Any, timeout: float) -> dict[str, Any]:
        start = time.monotonic()
        handle = self.handles[room]
        while not handle.release_safe and time.monotonic() - start < timeout:
            time.sleep(0.002)
        return {**self.info(room), "waited": time.monotonic() - start}

    def close(self, room: Any) -> None:
        self.manager.close(room)
        del self.handles[room]

    def read(self, pages: list[int], aux: int | None) -> tuple[bytes, bytes, bytes]:
        torch = self.torch
        index = torch.tensor(pages, dtype=torch.long)
        k = self.k.index_select(1, index).contiguous().numpy().tobytes()
        v = self.v.index_select(1, index).contiguous().numpy().tobytes()
        a = self.aux[aux].numpy().tobytes() if aux is not None else b""
        return k, v, a

    def stats(self) -> dict[str, Any]:
        control = self.backend.control.stats
        remote = self.backend.remote_stats
        return {
            "control": {
                k: getattr(control, k)
                for k in (
                    "received",
                    "malformed",
                    "bad_version",
                    "unknown_type",
                    "oversized",
                    "unauthenticated",
                    "handler_errors",
                    "peers_lost",
                    "heartbeats_sent",
                    "sessions_evicted",
                )
            },
            "dropped": control.dropped,
            "stale_messages": remote.stale_messages,
            "jobs_submitted": remote.jobs_submitted,
            "marker_completions": remote.marker_completions,
            "markers_written": remote.markers_written,
            "notifications_dropped": remote.notifications_dropped,
            "peers_lost": remote.peers_lost,
            "late_events": self.manager.stats.late_events,
            "control_running": self.backend.control.running,
            "sessions": len(self.backend.sessions),
            "channels": self.backend.control.open_channels,
            "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": _rss_mb(),
        }

    def send_raw(self, addr: str, frames: list[bytes], copies: int = 1) -> None:
        for _ in range(copies):
            self.backend.control.send_raw(addr, frames)

    def send_message(self, addr: str, kind: str, fields: dict[str, Any], copies: int = 1) -> None:
        """A well-formed frame of `kind` from no session of the receiver's (a forged sid and secret)."""
        from kvfsm.backends import codec

        frames = codec.encode(kind, {"sid": "0" * 16, "key": "f" * 32, **fields})
        self.send_raw(addr, frames, copies)

    def forge_hellos(self, addr: str, count: int) -> None:
        """`count` HELLOs, each naming another reply address (nothing listens there)."""
        from kvfsm.backends import codec

        fields, blob = self.backend.endpoint._session_fields()
        for i in range(count):
            hello = {
                "addr": f"tcp://127.0.0.1:{20000 + i % 40000}",
                "reply_sid": f"{i:016x}",
                "reply_key": "f" * 32,
                "role": "receiver",
                "engine": self.backend.name,
                "session": fields,
            }
            self.backend.control.send_raw(addr, codec.encode("HELLO", hello, blob))

    def decode_generation(self, room: Any) -> int:
        """The wire generation of a decode room (to forge frames naming it)."""
        from kvfsm.backends._remote_receiver import DecodeEndpoint

        endpoint = self.backend.endpoint
        assert isinstance(endpoint, DecodeEndpoint)
        record = endpoint._recv_by_handle[(room, self.handles[room].generation)]
        return int(record.gen)

    # -- a hand on the engine's reports (the bytes still move through the real engine) ----------

    def hold_writes(self) -> None:
        """Report every write as still in flight, until `release_writes()`."""
        self._engine_hook().hold = True

    def release_writes(self) -> None:
        self._engine_hook().hold = False

    def fail_next_write(self) -> None:
        """Report the next write submitted as failed (its bytes may or may not have moved)."""
        self._engine_hook().fail_next = True

    def slow_observers(self, seconds: float) -> None:
        """A subscriber that takes `seconds` per notice: notices then queue behind it, as on a busy box."""
        self.manager.subscribe(lambda change: time.sleep(seconds))

    def _engine_hook(self) -> _EngineHook:
        hook = getattr(self, "_hook", None)
        if hook is None:
            hook = self._hook = _EngineHook(self.backend.engine)
        return hook

    def write_pages(self, pages: list[int], value: float) -> None:
        for tensor in (self.k, self.v):
            tensor[:, pages] = value
