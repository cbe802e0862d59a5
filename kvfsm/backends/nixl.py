"""`NixlBackend`: KV pages over NIXL (UCX backend), between processes.

The lifecycle, control plane and abort protocol are `RemoteBackend`'s;
this module is only the engine: one `nixl_agent` per endpoint. Agent
metadata (`get_agent_metadata`) travels in the control plane's handshake
blob and the prefill loads it with `add_remote_agent`, so NIXL's own
listener thread and etcd are not needed.

A chunk's coalesced page runs become one NIXL transfer (one descriptor per
run and KV region): `initialize_xfer("WRITE", ...)`, `transfer`, then
`check_xfer_state` polled, "DONE"/"PROC"/"ERR" mapped to done/pending/
failed. NIXL's Python binding raises instead of answering "ERR" for some
states (`nixlRemoteDisconnectError` once the decode's process went away):
such a job is failed like an "ERR" one, its handle released (which asks
NIXL to cancel it), and only if that release fails too does the job say its
writes may still land; the writer then fails that job's room and nothing
else (issue 22, item 7). Completion travels on the control plane like every engine's
(DONE, with the aux bytes when both aux pools are host memory), so a room
reaches Success on the decode only after the prefill saw every write end
and checked its room (rule 14). With completion markers (on by default
here: `RemoteConfig.completion_markers=None` leaves it to the engine) the
prefill, at that same point, also sends the room's marker as a NIXL
notification (`send_notif`), which the decode's control thread reads where
it polls the agent anyway (`get_new_notifs`), so the room succeeds without
waiting for DONE's trip over ZeroMQ (`_markers` says what is checked). On abort, in-flight handles are released,
which asks NIXL to cancel; a handle NIXL cannot cancel yet is kept and
polled until it ends, and only then is the room reported drained.

Memory: CPU tensors register as "DRAM", CUDA ones as "VRAM".

NIXL's own progress thread is off by default (`progress_thread=True`
turns it on): it spins without pause (NIXL sets its delay to 0), which on
a small CPU box starves every other thread (measured here: one-page
writes went from about 0.1 ms to 10-25 ms). Without it the engine makes
progress whenever it is polled, and this backend polls: the writer lanes
with `check_xfer_state`, the decode's control thread with
`get_new_notifs` every 0.1 ms while a prefill may be writing into it.

UCX's InfiniBand modules are not loaded when the machine has no IB device
(`UCX_MODULES=^ib,rdmacm` unless set already): the libibverbs bundled
with the `nixl` wheel crashes the interpreter at exit otherwise, and
without a device they have nothing to do.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

from .._manager import TransferManager
from ._errors import BackendError
from .memory import MemoryRegion
from .remote import EngineAdapter, EngineJob, RemoteBackend, RemoteConfig, Write

__all__ = ["NixlBackend", "NixlEngine"]

logger = logging.getLogger("kvfsm.backends.nixl")


def _prepare_ucx_environment() -> None:
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")


def _import_nixl() -> tuple[Any, Any]:
    _prepare_ucx_environment()
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as exc:
        raise BackendError(
            "NixlBackend needs NIXL: pip install nixl (its CUDA-variant wheel, e.g. nixl-cu12, carries UCX); "
            f"import failed: {exc}"
        ) from exc
    return nixl_agent, nixl_agent_config


def _mem_type(region: MemoryRegion) -> tuple[str, int]:
    device = region.device
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return "VRAM", int(index or 0)
    return "DRAM", 0


class _XferJob(EngineJob):
    """One NIXL transfer handle, polled with `check_xfer_state`."""

    def __init__(self, engine: NixlEngine, handle: Any, detail: str) -> None:
        self._engine = engine
        self._handle = handle
        self._released = False
        self.detail = detail

    def poll(self) -> str:
        try:
            with self._engine.lock:
                state = self._engine.agent.check_xfer_state(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and its kin: a failed transfer
            self.detail = f"{self.detail}; check_xfer_state raised {type(exc).__name__}: {exc}"
            logger.debug("NIXL check_xfer_state raised for %s: %s", self.detail, exc)
            if not self.cancel():
                # NIXL kept the handle: it cannot say the transfer stopped.
                self.may_still_land = True
            return "failed"
        if state == "DONE":
            return "done"
        if state == "PROC":
            return "pending"
        return "failed"

    def cancel(self) -> bool:
        # Releasing an active transfer asks NIXL to cancel it; if it cannot,
        # NIXL raises and keeps the handle, and we keep polling it.
        try:
            self.release()
        except Exception as exc:
            logger.debug("NIXL could not cancel a transfer yet (%s); waiting for it", exc)
            return False
        return True

    def release(self) -> None:
        if self._released:
            return
        with self._engine.lock:
            self._engine.agent.release_xfer_handle(self._handle)
        self._released = True


class NixlEngine(EngineAdapter):
    """A `nixl_agent` with the UCX backend behind the `EngineAdapter` interface."""

    name = "nixl"
    receiver_progress = True
    notifies = True

    def __init__(
        self, *, agent_name: str | None = None, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False
    ) -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = agent_name or f"kvfsm-{uuid.uuid4().hex[:12]}"
        try:
            self.agent = nixl_agent(
                self.agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
            )
        except Exception as exc:
            raise BackendError(f"NIXL agent {self.agent_name!r} with backends {list(backends)} failed: {exc}") from exc
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise BackendError(f"NIXL has no {', '.join(missing)} backend here (plugins: {self.agent.plugin_list})")
        # The agent runs without NIXL's own thread-safety mode: every call goes through this lock.
        self.lock = threading.Lock()
        self._registered: list[Any] = []
        # Remote agents loaded: name -> (their metadata, sessions using them).
        self._peers: dict[str, tuple[bytes, int]] = {}
        self._mem_type = "DRAM"
        self._device = 0

    def register(self, regions: list[MemoryRegion]) -> None:
        by_type: dict[tuple[str, int], list[tuple[int, int, int, str]]] = {}
        for region in regions:
            mem, device = _mem_type(region)
            by_type.setdefault((mem, device), []).append((region.ptr, region.nbytes, device, ""))
            self._mem_type, self._device = mem, device
        with self.lock:
            for (mem, _device), descs in by_type.items():
                self._registered.append(self.agent.register_memory(descs, mem))

    def register_host(self, regions: list[MemoryRegion]) -> None:
        # DRAM, whatever the pools are in: the memory type of KV writes stays the pools'.
        with self.lock:
            self._registered.append(self.agent.register_memory([(r.ptr, r.nbytes, 0, "") for r in regions], "DRAM"))

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        with self.lock:
            metadata = self.agent.get_agent_metadata()
        return {"agent": self.agent_name, "mem": self._mem_type}, bytes(metadata)

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        """Load the peer's agent metadata; a second session of the same agent shares it.

        NIXL keys remote agents by name, so two sessions naming one agent
        share its entry (counted, unloaded with the last). A session naming
        an agent already loaded with other metadata is refused: it would
        otherwise direct its writes into that agent's memory.
        """
        if blob is None:
            raise BackendError("a NIXL peer must send its agent metadata in the handshake blob")
        claimed = session.get("agent")
        mem = session.get("mem", "DRAM")
        with self.lock:
            if isinstance(claimed, str) and claimed in self._peers:
                loaded, count = self._peers[claimed]
                if loaded != blob:
                    raise BackendError(f"NIXL agent {claimed!r} is loaded already, with other metadata")
                self._peers[claimed] = (loaded, count + 1)
                return (claimed, mem)
            name = self.agent.add_remote_agent(blob)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if claimed not in (None, name):
                self._remove(name)
                raise BackendError(f"NIXL peer says it is agent {claimed!r} but its metadata names {name!r}")
            self._peers[name] = (bytes(blob), 1)
        return (name, mem)

    def remove_peer(self, target: Any) -> None:
        name = target[0]
        with self.lock:
            loaded, count = self._peers.get(name, (b"", 1))
            if count > 1:
                self._peers[name] = (loaded, count - 1)
                return
            self._peers.pop(name, None)
            self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            logger.debug("NIXL remove_remote_agent(%s) failed: %s", name, exc)

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        name, remote_mem = target
        return self._transfer(name, writes, (self._mem_type, self._device), (remote_mem, 0))

    def submit_host(self, target: Any, writes: list[Write]) -> EngineJob:
        return self._transfer(target[0], writes, ("DRAM", 0), ("DRAM", 0))

    def _transfer(self, name: str, writes: list[Write], local: tuple[str, int], remote: tuple[str, int]) -> EngineJob:
        detail = f"{len(writes)} descriptors, {sum(w[2] for w in writes)} bytes to {name}"
        with self.lock:
            mine = self.agent.get_xfer_descs([(w[0], w[2], local[1]) for w in writes], local[0])
            theirs = self.agent.get_xfer_descs([(w[1], w[2], remote[1]) for w in writes], remote[0])
            handle = self.agent.initialize_xfer("WRITE", mine, theirs, name, b"")
            state = self.agent.transfer(handle)
            if state == "ERR":
                self.agent.release_xfer_handle(handle)
                raise BackendError(f"NIXL transfer() of {detail} returned ERR")
        return _XferJob(self, handle, detail)

    def progress(self) -> list[tuple[str, bytes]]:
        # Reading notifications progresses the agent; what they say is the decode's to check.
        try:
            with self.lock:
                notes = self.agent.get_new_notifs()
        except Exception as exc:  # a peer's disconnect surfaces here too: nothing of ours to fail
            logger.debug("NIXL get_new_notifs raised %s: %s", type(exc).__name__, exc)
            return []
        if not notes:
            return []
        return [
            (agent.decode(errors="replace") if isinstance(agent, bytes) else str(agent), bytes(message))
            for agent, messages in notes.items()
            for message in messages
        ]

    def notify(self, target: Any, message: bytes) -> None:
        # UCX sends the notification on the endpoint the room's writes went by, after them. With
        # no progress thread nothing else moves it out once the room's jobs ended: progress once
        # here (a short message leaves then); one still queued goes at the next poll, and the
        # room's DONE completes it meanwhile.
        with self.lock:
            self.agent.send_notif(target[0], message)
            self.agent.get_new_notifs()

    def close(self) -> None:
        with self.lock:
            for descs in self._registered:
                try:
                    self.agent.deregister_memory(descs)
                except Exception as exc:
                    logger.debug("NIXL deregister_memory failed: %s", exc)
            self._registered.clear()


class NixlBackend(RemoteBackend):
    """Prefill or decode endpoint moving KV pages with NIXL over UCX.

    `NixlBackend(manager, config=RemoteConfig(...), agent_name=None, backends=("UCX",),
    progress_thread=False)`.
    """

    name = "nixl"

    def __init__(
        self,
        manager: TransferManager,
        config: RemoteConfig | None = None,
        *,
        agent_name: str | None = None,
        backends: tuple[str, ...] = ("UCX",),
        progress_thread: bool = False,
    ) -> None:
        self._engine_options: dict[str, Any] = {
            "agent_name": agent_name,
            "backends": tuple(backends),
            "progress_thread": progress_thread,
        }
        super().__init__(manager, config)

    def _make_engine(self) -> EngineAdapter:
        return NixlEngine(**self._engine_options)
