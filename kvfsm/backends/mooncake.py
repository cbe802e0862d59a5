"""`MooncakeBackend`: KV pages over Mooncake Transfer Engine, between processes.

The lifecycle, control plane and abort protocol are `RemoteBackend`'s;
this module is only the engine: `mooncake.engine.TransferEngine` with
`P2PHANDSHAKE` metadata (no etcd: peers exchange their RPC endpoint
"host:port" over the control plane) and TCP transport on loopback, RDMA by
configuration (`protocol="rdma"`, `device_name="mlx5_0,..."`).

Two ways to write a chunk's coalesced page runs (`mode`):

* `"poll"` (default): one `transfer_submit_write` per run, each polled
  with `transfer_check_status` (1 done, 0 pending, -1 failed, -2 TIMEOUT).
  Nothing blocks, and Mooncake's TIMEOUT is seen as what it is: derived
  when read once a slice is older than `MC_SLICE_TIMEOUT`, not sticky, the
  write goes on and may still complete. So a TIMEOUT never ends a job
  here: it is counted (`remote_stats.engine_timeouts`) and the job stays
  in flight, which keeps the drain report truthful; the lifecycle's
  `transferring` deadline fails the room if it must. `timeout_fails=True`
  fails the room on the first TIMEOUT instead (still waiting for the
  write to end before reporting drained).
* `"batch"`: one `batch_transfer_sync_write` per chunk on a small thread
  pool (as SGLang does). Fewer calls (measured here over loopback TCP it
  was slower, though: about 7 ms against 0.7 ms for a one-page room,
  because each sync call waits out Mooncake's own polling), and the sync call folds TIMEOUT into
  failure and frees the batch while slices may still run, so a failed
  batch marks its room never-drained: no ABORT_ACK, the drain deadline
  decides when the decode may reuse the pages.

Memory is registered per region with `register_memory(ptr, nbytes)`.
Mooncake has no cancel: an aborted room's in-flight writes are waited for.

Opening a peer (issue 22, item 1). Mooncake's first write to a new peer
opens that peer's segment with a synchronous handshake, and its Python
binding holds one process-wide mutex while it does: every other submit of
the process, to any peer, waits for that handshake (up to the handshake
socket's 60 s receive timeout when the peer hangs). So `add_peer`, which
runs on the peer's own writer lane when its session is confirmed, first
probes the peer's handshake server (`send_probe`: no binding mutex, the
GIL released, so a hung peer holds up its own lane and nothing else, and
the lane's watchdog bounds it), and only once the peer answered opens its
segment with a zero-byte write, while the peer is known to be alive. Later
writes find the segment open and take the mutex only for a lookup. What
remains is the moment between the probe's answer and the open: a peer that
hangs exactly then still stalls every submit of the process for the
handshake's timeout. That is Mooncake's binding; kvfsm cannot reach below
it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._manager import TransferManager
from ._errors import BackendError
from .memory import MemoryRegion
from .remote import EngineAdapter, EngineBusy, EngineJob, PartialSubmit, RemoteBackend, RemoteConfig, Write

__all__ = ["MooncakeBackend", "MooncakeEngine"]

logger = logging.getLogger("kvfsm.backends.mooncake")

# transfer_submit_write returns batch_id_t (uint64): 0 when Mooncake did not take the submit
# (treated as busy: try later), -1 (2**64 - 1 as uint64) when the peer's segment cannot be opened.
_REFUSED_BATCH = 0
# Anything at or past this (or negative) is no batch: the submit failed.
_MAX_BATCH = (1 << 64) - 1
# Mooncake's per-peer TCP queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, 1024 by default) does not
# refuse the submits that overflow it: it accepts them and fails the writes later. Measured here,
# 4,096 writes of 16 KiB submitted at once to one peer: every submit accepted, 2,794 writes
# failed, 1,024 still unresolved after 10 s (2,048 at once all landed). So the budget is what
# keeps it from happening: stay at half of the queue.
_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_DEFAULT_QUEUE = 1024


#: How many 1 ms naps the zero-byte write that opens a peer's segment is waited for.
_OPEN_POLLS = 1000


def _first_region(session: dict[str, Any]) -> int | None:
    """The address of the peer's first KV region, from its session's pool layout, if it has one."""
    pools = session.get("pools")
    regions = pools.get("kv") if isinstance(pools, dict) else None
    if isinstance(regions, list) and regions and isinstance(regions[0], list) and regions[0]:
        address = regions[0][0]
        if isinstance(address, int) and not isinstance(address, bool):
            return address
    return None


def _per_peer_budget() -> int:
    try:
        queue = int(os.environ.get(_QUEUE_ENV, _DEFAULT_QUEUE))
    except ValueError:
        queue = _DEFAULT_QUEUE
    return max(1, queue // 2)


# transfer_check_status: 1 done, 0 pending, -1 failed, -2 timeout.
_DONE, _PENDING, _TIMEOUT = 1, 0, -2


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as exc:
        raise BackendError(
            "MooncakeBackend needs Mooncake Transfer Engine: pip install mooncake-transfer-engine-non-cuda "
            f"(CPU) or mooncake-transfer-engine (CUDA), and Debian libibverbs1 librdmacm1 libnuma1; import failed: {exc}"
        ) from exc
    return TransferEngine


class _PollJob(EngineJob):
    """Single-run batches from `transfer_submit_write`, polled without blocking."""

    def __init__(self, engine: MooncakeEngine, batches: list[int], detail: str) -> None:
        self._engine = engine
        self._pending = batches
        # Batches before this index ended (and were freed by Mooncake).
        self._next = 0
        self._failed = False
        self.detail = detail

    def poll(self) -> str:
        """Check the batches in submission order, up to the first one still running.

        Runs of one job go out on the same lanes one after the other and
        end in about that order, so the batches behind a running one are
        checked on a later poll: a poll costs one engine call per batch
        that ended, not one per batch in flight.
        """
        # One engine call per write of a 4 MiB room ends up here: the loop is kept to int compares.
        pending = self._pending
        check = self._engine.te.transfer_check_status
        index, end = self._next, len(pending)
        try:
            while index < end:
                # 1 and -1 free the batch inside Mooncake: never read it again.
                status = check(pending[index])
                if status != _DONE:
                    if status == _PENDING:
                        return "pending"
                    if status == _TIMEOUT:
                        return "timeout"  # it goes on and may still complete: ask again later
                    self._failed = True  # -1, or a status this adapter does not know
                index += 1
        finally:
            self._next = index
        return "failed" if self._failed else "done"


class _BatchJob(EngineJob):
    """One `batch_transfer_sync_write` of a chunk's runs, run on a pool thread."""

    def __init__(self, future: Future[int], detail: str) -> None:
        self._future = future
        self.detail = detail

    def poll(self) -> str:
        if not self._future.done():
            return "pending"
        try:
            ok = self._future.result() == 0
        except Exception as exc:  # the binding raised: treat as a failed batch
            logger.warning("mooncake batch write raised: %s", exc)
            ok = False
        if not ok:
            # The sync call also returns -1 on TIMEOUT after freeing a batch that may still run.
            self.may_still_land = True
            return "failed"
        return "done"


class MooncakeEngine(EngineAdapter):
    """A Mooncake `TransferEngine` (P2P handshake) behind the `EngineAdapter` interface."""

    name = "mooncake"

    def __init__(
        self,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        mode: str = "poll",
        batch_threads: int = 4,
    ) -> None:
        if mode not in ("poll", "batch"):
            raise BackendError(f"MooncakeBackend mode must be 'poll' or 'batch'; got {mode!r}")
        engine_class = _import_engine()
        self.te = engine_class()
        rc = self.te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise BackendError(
                f"Mooncake TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) returned {rc} (see Mooncake's log on stderr)"
            )
        self.hostname = hostname
        self.mode = mode
        self.max_writes_in_flight = _per_peer_budget()
        self.rpc_session = f"{hostname}:{self.te.get_rpc_port()}"
        self._registered: list[int] = []
        self._pool = ThreadPoolExecutor(batch_threads, thread_name_prefix="kvfsm-mooncake") if mode == "batch" else None
        self._lock = threading.Lock()

    def register(self, regions: list[MemoryRegion]) -> None:
        for region in regions:
            rc = self.te.register_memory(region.ptr, region.nbytes)
            if rc != 0:
                raise BackendError(
                    f"Mooncake register_memory of {region.name or hex(region.ptr)} ({region.nbytes} bytes) returned {rc}"
                )
            self._registered.append(region.ptr)

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return {"session": self.rpc_session}, None

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        """The peer's segment name, its segment opened while the peer is known to answer (see above)."""
        target = session.get("session")
        if not isinstance(target, str) or ":" not in target:
            raise BackendError(f"a Mooncake peer session must be 'host:port'; got {target!r}")
        rc = self.te.send_probe(target)
        if rc != 0:
            raise BackendError(f"Mooncake peer {target} did not answer a probe of its handshake server (returned {rc})")
        destination = _first_region(session)
        if self._registered and destination is not None:
            self._open(target, self._registered[0], destination)
        return target

    def _open(self, target: str, source: int, destination: int) -> None:
        """Open the peer's segment with a write of zero bytes (nothing lands), and wait for it to end."""
        batch = self.te.transfer_submit_write(target, source, destination, 0)
        if not _REFUSED_BATCH < batch < _MAX_BATCH:
            raise BackendError(f"Mooncake could not open the segment of {target} (returned {batch})")
        for _ in range(_OPEN_POLLS):
            status = self.te.transfer_check_status(batch)
            if status in (1, -1):
                if status == -1:
                    raise BackendError(f"Mooncake's zero-byte write that opens {target}'s segment failed")
                return
            time.sleep(0.001)
        # Still running: leave it; the segment is open, and the batch ends with the peer's next write.

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        detail = f"{len(writes)} runs, {sum(w[2] for w in writes)} bytes to {target}"
        if self._pool is not None:
            srcs = [w[0] for w in writes]
            dsts = [w[1] for w in writes]
            lens = [w[2] for w in writes]
            return _BatchJob(self._pool.submit(self.te.batch_transfer_sync_write, target, srcs, dsts, lens), detail)
        batches: list[int] = []
        submit, taken = self.te.transfer_submit_write, batches.append
        for src, dst, length in writes:
            batch = submit(target, src, dst, length)
            if not _REFUSED_BATCH < batch < _MAX_BATCH:
                # Earlier runs of this job are in flight: hand them back so they are waited for.
                done = _PollJob(self, batches, detail) if batches else None
                if batch == _REFUSED_BATCH:
                    raise EngineBusy(f"Mooncake did not take a write to {target} (batch id 0)", done, len(batches))
                if done is not None:
                    raise PartialSubmit(
                        done, f"transfer_submit_write to {target} failed after {len(batches)} runs", len(batches)
                    )
                raise BackendError(f"Mooncake transfer_submit_write to {target} failed (returned {batch})")
            taken(batch)
        return _PollJob(self, batches, detail)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for ptr in self._registered:
            self.te.unregister_memory(ptr)
        self._registered.clear()


class MooncakeBackend(RemoteBackend):
    """Prefill or decode endpoint moving KV pages with Mooncake Transfer Engine.

    `MooncakeBackend(manager, config=RemoteConfig(...), protocol="tcp",
    hostname="127.0.0.1", device_name="", mode="poll", timeout_fails=False)`.
    """

    name = "mooncake"

    def __init__(
        self,
        manager: TransferManager,
        config: RemoteConfig | None = None,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        mode: str = "poll",
        timeout_fails: bool = False,
    ) -> None:
        self._engine_options: dict[str, Any] = {
            "hostname": hostname,
            "protocol": protocol,
            "device_name": device_name,
            "metadata_server": metadata_server,
            "mode": mode,
        }
        self._timeout_is_failure = bool(timeout_fails)
        super().__init__(manager, config)

    def _make_engine(self) -> EngineAdapter:
        return MooncakeEngine(**self._engine_options)

    def _timeout_fails(self) -> bool:
        return self._timeout_is_failure
