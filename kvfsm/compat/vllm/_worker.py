"""The worker half: every transfer one kvfsm room, its bytes moved by a kvfsm backend.

A vLLM worker runs one tensor-parallel rank. Its connector registers the
rank's KV cache (one region per layer, page = one vLLM block) with a kvfsm
backend and, each step, starts what the scheduler half planned and reports
what ended. Per request, in kvfsm terms:

prefill (sender room, opened when vLLM finished the request and holds its blocks)
    Bootstrapping     held for the decode; deadline `hold_timeout`, and the lease (`_leases`:
                      the scheduler half tells us when it expired, `StepPlan.expire`)
    WaitingForInput   the decode posted its destination blocks; we send our
                      last `expected_pages` blocks (it may cache a prefix)
    Transferring      the backend writes into the decode's blocks
    Success / Failed  reported as `finished_sending` once release-safe

decode (receiver room, opened when vLLM parked the request for its KV)
    Bootstrapping     handshake with the prefill rank (`bootstrap_timeout`)
    WaitingForInput   blocks posted (`expect`); waiting for bytes (`waiting_timeout`)
    Transferring      bytes landing (`transfer_timeout`)
    Success           reported as `finished_recving`
    Failed            reported as `finished_recving` and `failed_recving`, its
                      blocks as load errors, once release-safe: after the
                      prefill proved its writes stopped (ABORT_ACK) or was
                      fenced; without proof by `drain_timeout` its blocks are
                      quarantined (still held, counted), never freed on the
                      timer unless `on_drain_deadline: "release"` (DESIGN.md
                      rules 6 and 13)

Unequal tensor parallelism moves one page per block and KV head
(`kv_pools_by_head`): a decode rank merges the heads of several prefill
ranks (one room each) or loads its slice of one prefill rank's heads
(that rank holds them in slice rooms once told, `StepPlan.slices`).

A hybrid KV cache moves each KV cache group in a room of its own
(`_params.group_room`), each with that group's blocks; a request is
reported once every one of its rooms ended and is release-safe, and its
load failed if any of them failed. A group the decode needs none of (its
prefix cache had it) is released on the prefill at once.

Each room is reported exactly once, then closed; an abort for a room that
is gone is counted (`stats.late_aborts`) and ignored. Deadlines are the
managers' (one FIFO per phase, enforced on every poll), so an expired hold
is reclaimed whatever order the requests came in (vllm #58222), and a
decode whose prefill died or failed to post a write gets its blocks back
within the deadlines (vllm #46283, PR #50754).

Imports torch (through the backends) but not vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..._errors import ConfigError, DuplicateRoom, KVFSMError
from ..._manager import TransferHandle, TransferManager
from ..._states import FailureKind, FailureReason, KVPoll, Role
from ...backends import get_backend
from ...backends.base import BackendError, KVBackend, KVPools, MemoryRegion, TransferInputError
from ...backends.local import LocalBackend
from ...backends.remote import RemoteBackend, RemoteConfig
from ._config import ConnectorConfig
from ._params import RemoteSource, group_room, slice_room
from ._plan import AbortSpec, RecvSpec, SendSpec, StepPlan
from ._stats import TransferStats, quarantined_pages_of

__all__ = ["WorkerHalf", "WorkerStats", "kv_pools", "local_prefill_address"]

logger = logging.getLogger("kvfsm.compat.vllm")

# Prefill ranks of this process on the local backend, by (engine id, rank): how an
# in-process decode finds them (a remote backend uses the params' host and port).
_LOCAL_PREFILLS: dict[tuple[str, int], str] = {}
_LOCAL_LOCK = threading.Lock()


def local_prefill_address(engine_id: str, tp_rank: int) -> str | None:
    """The local-backend address of a prefill rank in this process, if one registered."""
    with _LOCAL_LOCK:
        return _LOCAL_PREFILLS.get((engine_id, tp_rank))


def _storage_region(name: str, tensors: list[Any], num_blocks: int) -> MemoryRegion:
    """A Mamba layer's state tensors (views into one buffer, block-major) as that buffer's region."""
    import torch

    first = tensors[0]
    storage = first.untyped_storage()
    nbytes = int(storage.nbytes())
    if nbytes % num_blocks:
        raise ConfigError(
            f"KV cache of layer {name!r}: its buffer holds {nbytes} bytes, not a whole number of {num_blocks} blocks"
        )
    for tensor in tensors:
        if tensor.untyped_storage().data_ptr() != storage.data_ptr() or tensor.shape[0] != num_blocks:
            raise ConfigError(
                f"KV cache of layer {name!r}: its state tensors must be [num_blocks={num_blocks}, ...] views "
                "of one buffer"
            )
    page = nbytes // num_blocks
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (num_blocks, page), (page, 1))
    return MemoryRegion.of_tensor(raw, name)


def kv_pools(kv_caches: Mapping[str, Any], num_blocks: int) -> KVPools:
    """vLLM's per-layer KV cache tensors as kvfsm pools: one page per vLLM block.

    A layer's tensor is `[num_blocks, ...]` (K and V packed per block) or
    `[2, num_blocks, ...]` (K and V apart: two regions); a Mamba layer's is
    a list of state tensors, views into one block-major buffer (one region,
    the buffer). Every block's bytes must be one contiguous run. Layers that
    share memory (the layers of a hybrid KV cache's groups share vLLM's KV
    cache tensors) register it once: one page index then moves a block of
    whichever group owns that block id.
    """
    if not kv_caches:
        raise ConfigError("register_kv_caches got no KV cache tensors")
    regions: list[MemoryRegion] = []
    seen: set[tuple[int, int]] = set()
    for name in sorted(kv_caches):
        value = kv_caches[name]
        if isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(f"KV cache of layer {name!r} is an empty list")
            candidates = [_storage_region(name, list(value), num_blocks)]
        else:
            tensor = value
            shape = tuple(tensor.shape)
            if shape and shape[0] == num_blocks:
                views = [(name, tensor)]
            elif len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
                views = [(f"{name}.k", tensor[0]), (f"{name}.v", tensor[1])]
            else:
                raise ConfigError(
                    f"KV cache of layer {name!r} has shape {shape}: expected [num_blocks={num_blocks}, ...] "
                    f"or [2, num_blocks={num_blocks}, ...]"
                )
            candidates = []
            for label, view in views:
                if not view.is_contiguous():
                    raise ConfigError(
                        f"KV cache of layer {label!r} is not block-contiguous (shape {tuple(view.shape)}, strides "
                        f"{tuple(view.stride())}): the kvfsm connector needs each block's bytes in one run, "
                        "as the layer-outermost layouts (LBHNC, LBNHC) give"
                    )
                candidates.append(MemoryRegion.of_tensor(view, label))
        for region in candidates:
            key = (region.ptr, region.nbytes)
            if key in seen:
                continue
            seen.add(key)
            regions.append(region)
    _refuse_overlaps(regions)
    return KVPools(regions)


def kv_pools_by_head(kv_caches: Mapping[str, Any], num_blocks: int, heads: int) -> KVPools | None:
    """The same memory with one page per block and KV head, if every layer is head-major; else None.

    A head-major block (`[num_blocks, heads, ...]`, or K and V apart as
    `[2, num_blocks, heads, ...]`: vLLM's LBHNC layout, the CPU backend's)
    holds each head's bytes in one run, so page `block * heads + h` is head
    `h` of `block`. Consecutive heads of consecutive blocks are consecutive
    pages: a transfer of whole blocks still coalesces into one run per block
    range, and a decode of a smaller TP size merges several prefill ranks'
    heads into its blocks (`WorkerHalf._sources`). Shapes alone cannot tell
    a heads axis from a K/V axis of the same size: the caller asks only for
    a layout vLLM declared head-major (`KVFSMConnector.register_kv_caches`).
    """
    views: list[tuple[str, Any]] = []
    for name in sorted(kv_caches):
        tensor = kv_caches[name]
        if isinstance(tensor, (list, tuple)):
            return None
        shape = tuple(tensor.shape)
        if len(shape) >= 3 and shape[0] == num_blocks and shape[1] == heads:
            views.append((name, tensor))
        elif len(shape) >= 4 and shape[0] == 2 and shape[1] == num_blocks and shape[2] == heads:
            views += [(f"{name}.k", tensor[0]), (f"{name}.v", tensor[1])]
        else:
            return None
    if any(not view.is_contiguous() for _, view in views):
        return None
    split = {name: view.reshape(num_blocks * heads, *view.shape[2:]) for name, view in views}
    return kv_pools(split, num_blocks * heads)


def _refuse_overlaps(regions: list[MemoryRegion]) -> None:
    ordered = sorted(regions, key=lambda r: r.ptr)
    for before, after in itertools.pairwise(ordered):
        if before.ptr + before.nbytes > after.ptr:
            raise ConfigError(
                f"KV cache regions {before.name!r} and {after.name!r} overlap without being the same "
                "memory: layers sharing a KV cache tensor must view it the same way (block-major)"
            )


@attrs.define(slots=True)
class WorkerStats:
    """Counters of one worker half since it started (the managers count states and failures)."""

    sent: int = 0
    loaded: int = 0
    #: Blocks moved by the sends and loads that succeeded.
    blocks_sent: int = 0
    blocks_loaded: int = 0
    failed_sends: int = 0
    failed_loads: int = 0
    releases: int = 0
    late_aborts: int = 0


@attrs.define(slots=True, eq=False)
class _Part:
    """One room of a request's transfer: one KV cache group's blocks."""

    handle: TransferHandle
    blocks: tuple[int, ...]
    #: Decode: the pages to post (a block's page, or its heads' pages from this prefill rank).
    pages: list[int] | None = None
    #: Decode: the receiver backend of the prefill rank this room loads from.
    backend: KVBackend | None = None
    #: Prefill: the send was issued. Decode: the destination blocks were posted.
    started: bool = False
    #: Prefill: the blocks the send moves (the decode's cached prefix is not sent).
    sent_blocks: int = 0
    #: Prefill: the heads this room sends of each block (all, or one decode rank's slice).
    head_first: int = 0
    head_count: int | None = None


@attrs.define(slots=True, eq=False)
class _Transfer:
    """A request's rooms on this rank (one per KV cache group it moves)."""

    parts: list[_Part]

    @property
    def blocks(self) -> set[int]:
        return {block for part in self.parts for block in part.blocks}

    def ended(self) -> bool:
        """Every room terminal and release-safe."""
        return all(p.handle.is_terminal and p.handle.release_safe for p in self.parts)

    def succeeded(self) -> bool:
        return all(p.handle.state is KVPoll.Success for p in self.parts)

    def reason(self) -> Any:
        return next((p.handle.reason for p in self.parts if p.handle.reason is not None), None)

    def close(self) -> None:
        for part in self.parts:
            part.handle.close()


class WorkerHalf:
    """One worker rank's connector: backends, rooms, and what to report each step."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        tp_rank: int,
        num_blocks: int,
        producer: bool,
        consumer: bool,
        clock: Callable[[], float] = time.monotonic,
        port: int | None = None,
        tp_size: int = 1,
        kv_heads: int | None = None,
    ) -> None:
        """`port`: the first control port of this engine's prefill ranks (rank r on `port + r`);
        default `config.port` (a data-parallel rank's own offset, see `_connector`). `tp_size`:
        this engine's. `kv_heads`: KV heads per rank of a single full-attention KV cache group
        (None otherwise): a head-major layout then moves one page per head, so a decode can
        merge the heads of several prefill ranks."""
        self.config = config
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.port = config.port if port is None else port
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        #: KV heads per page once registered (None: one page per block).
        self.page_heads: int | None = None
        self._clock = clock
        self._pools: KVPools | None = None
        self._more_receivers: dict[int, tuple[KVBackend, TransferManager]] = {}
        policy = config.on_drain_deadline
        self.prefill = (
            TransferManager(Role.SENDER, timeouts=config.prefill_timeouts, clock=clock, on_drain_deadline=policy)
            if producer
            else None
        )
        self.decode = (
            TransferManager(Role.RECEIVER, timeouts=config.decode_timeouts, clock=clock, on_drain_deadline=policy)
            if consumer
            else None
        )
        self.sender: KVBackend | None = None
        self.receiver: KVBackend | None = None
        self.stats = WorkerStats()
        #: What vLLM's metrics get (`report`): per room, since the last report.
        self.transfer_stats = TransferStats()
        self._sending: dict[str, _Transfer] = {}
        self._receiving: dict[str, _Transfer] = {}
        self._releasing: list[TransferHandle] = []
        # Reported at the next poll without a room: nothing was or will be sent for them.
        self._refused_sends: set[str] = set()
        self._refused_loads: set[str] = set()
        self._load_errors: set[int] = set()

    # -- set-up ------------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any]) -> KVPools:
        """`register_kv_caches`: start the backends on this rank's KV cache."""
        if self.sender is not None or self.receiver is not None:
            raise ConfigError("register_kv_caches was called twice")
        pools = kv_pools(kv_caches, self.num_blocks)
        if self.kv_heads is not None:
            by_head = kv_pools_by_head(kv_caches, self.num_blocks, self.kv_heads)
            if by_head is not None:
                pools, self.page_heads = by_head, self.kv_heads
        self._pools = pools
        if self.prefill is not None:
            self.sender = self._backend(self.prefill, self.port + self.tp_rank)
            self.sender.register_pools(pools)
            if isinstance(self.sender, LocalBackend):
                with _LOCAL_LOCK:
                    _LOCAL_PREFILLS[(self.engine_id, self.tp_rank)] = self.sender.address
        if self.decode is not None:
            self.receiver = self._backend(self.decode, 0)
            self.receiver.register_pools(pools)
        return pools

    def _backend(self, manager: TransferManager, port: int) -> KVBackend:
        try:
            return self._make_backend(manager, port)
        except BackendError as exc:
            if self.config.backend != "mooncake":
                raise
            # The connector's default: say which install brings it.
            raise BackendError(
                f"{exc}. With vLLM, pip install 'kvfsm[vllm]' installs what the kvfsm connector's default "
                "backend needs (or set kv_connector_extra_config['backend'])"
            ) from exc

    def _make_backend(self, manager: TransferManager, port: int) -> KVBackend:
        cls = get_backend(self.config.backend)
        options = dict(self.config.backend_options)
        if issubclass(cls, RemoteBackend):
            remote = RemoteConfig(
                host=self.config.host,
                port=port,
                heartbeat_interval=self.config.heartbeat_interval,
                heartbeat_misses=self.config.heartbeat_misses,
                shared_key=self.config.shared_key,
            )
            return cls(manager, remote, **options)
        return cls(manager, **options)

    def shutdown(self) -> None:
        """Close the backends: rooms still in flight fail (their peers are told)."""
        if isinstance(self.sender, LocalBackend):
            with _LOCAL_LOCK:
                if _LOCAL_PREFILLS.get((self.engine_id, self.tp_rank)) == self.sender.address:
                    del _LOCAL_PREFILLS[(self.engine_id, self.tp_rank)]
        more = [backend for backend, _ in self._more_receivers.values()]
        for backend in (*more, self.receiver, self.sender):
            if backend is not None:
                backend.close()

    # -- this step's plan (start_load_kv) -------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Open and bootstrap this step's rooms; give up the loads vLLM aborted.

        Never raises on what a request carries (its ids, its params): such a
        request fails alone, reported like any failed load or send, and the
        hook goes on with the others (vLLM stops its engine core on an
        exception from a connector hook).
        """
        for recv in plan.recv:
            try:
                self._start_recv(recv)
            except KVFSMError as exc:
                self._refuse_load(recv, f"could not start its load: {exc}")
        for send in plan.send:
            try:
                self._start_send(send)
            except KVFSMError as exc:
                logger.error("kvfsm: request %s is not held: %s", send.request_id, exc)
                self._refused_sends.add(send.request_id)
        for abort in plan.abort:
            self._abort(abort)
        for request_id in plan.expire:
            self._expire(request_id)
        for request_id, count in plan.slices:
            self._slice(request_id, count)

    def _refuse_load(self, spec: RecvSpec, why: str) -> None:
        if spec.release_only:
            return
        logger.error("kvfsm: request %s fails its load: %s", spec.request_id, why)
        self._refused_loads.add(spec.request_id)
        self._load_errors.update(b for group in spec.blocks for b in group)

    def _start_send(self, spec: SendSpec) -> None:
        if self.prefill is None or self.sender is None:
            # vLLM's scheduler follows the request's params, not the engine's role (as NIXL's does).
            logger.error(
                "kvfsm: request %s asks for a remote decode but this engine is not a KV producer "
                "(kv_role kv_producer or kv_both): its blocks are freed, its decode's load will fail",
                spec.request_id,
            )
            self._refused_sends.add(spec.request_id)
            return
        parts: list[_Part] = []
        for group, blocks in enumerate(spec.blocks):
            if not blocks:
                continue
            room = group_room(spec.room, group)
            try:
                handle = self.prefill.open(room)
            except DuplicateRoom:
                # Another live request maps to this room (the same engine and request id again, or two
                # long ids with one digest): this one is refused whole, reported at once so vLLM frees
                # its blocks; the groups opened for it so far were never bootstrapped and just close.
                logger.error(
                    "kvfsm: room %s is already held on this prefill; request %s not held", room, spec.request_id
                )
                for part in parts:
                    part.handle.close()
                self._refused_sends.add(spec.request_id)
                return
            parts.append(_Part(handle, blocks))
        if not parts:
            self._refused_sends.add(spec.request_id)
            return
        for part in parts:
            self._bootstrap(self.sender, part.handle, self.sender.address)
        self._sending[spec.request_id] = _Transfer(parts)

    def _sources(self, source: RemoteSource) -> list[tuple[int, int, int]] | str:
        """The prefill ranks this rank loads from: (rank, first local head, heads) each; else the problem.

        Equal TP: rank r from rank r, every head. A prefill of k times this
        decode's TP size: this rank's heads come from k prefill ranks, each
        rank's heads into their slice of this rank's blocks (per-head pages,
        `kv_pools`). A prefill of 1/k of it: every head from rank r / k,
        which holds them in slice `r mod k` of k (`_slice`, `slice_room`).
        """
        remote, local = source.tp_size, self.tp_size
        if remote == local:
            return [(self.tp_rank, 0, self.page_heads or 0)]
        heads = self.page_heads
        if heads is not None and remote < local and local % remote == 0:
            # This rank's heads are a slice of one prefill rank's: that rank holds them in slice rooms.
            return [(self.tp_rank // (local // remote), 0, heads)]
        if heads is None:
            return (
                f"the prefill runs TP {remote} and this decode TP {local}: its heads can be merged only "
                "from a head-major KV cache layout (LBHNC) of one full-attention group"
            )
        if remote % local or heads % (remote // local):
            return (
                f"the prefill runs TP {remote} and this decode TP {local} with {heads} KV heads per rank: "
                "a decode merges the heads of a whole number of prefill ranks"
            )
        k = remote // local
        per = heads // k
        return [(self.tp_rank * k + j, j * per, per) for j in range(k)]

    def _releases(self, source: RemoteSource) -> list[tuple[int, int, int]]:
        """The prefill ranks this rank tells to free a request's blocks: those `p % tp_size == rank`.

        Every prefill rank is told by exactly one decode rank, whatever the two
        TP sizes (a decode that cannot load from this prefill still frees it).
        """
        return [(rank, 0, 0) for rank in range(self.tp_rank, source.tp_size, self.tp_size)]

    def _pages(self, blocks: tuple[int, ...], first: int, count: int) -> list[int]:
        """The page list of `blocks`: one page per block, or per head (heads `first`..`first + count`)."""
        heads = self.page_heads
        if heads is None:
            return list(blocks)
        return [block * heads + first + h for block in blocks for h in range(count)]

    def _start_recv(self, spec: RecvSpec) -> None:
        if self.decode is None or self.receiver is None:
            logger.error(
                "kvfsm: request %s asks for a remote prefill but this engine is not a KV consumer "
                "(kv_role kv_consumer or kv_both): it is not loaded",
                spec.request_id,
            )
            if not spec.release_only:
                self._refused_loads.add(spec.request_id)
                self._load_errors.update(b for group in spec.blocks for b in group)
            return
        problem = spec.problem
        sources: list[tuple[int, int, int]] = []
        remote: tuple[tuple[int, ...], ...] = ()
        if problem is None:
            assert spec.source is not None
            remote = spec.source.block_ids
            found = self._releases(spec.source) if spec.release_only else self._sources(spec.source)
            if isinstance(found, str):
                problem = found
            else:
                sources = found
        wanted = () if spec.release_only else spec.blocks
        if problem is None:
            for group, blocks in enumerate(wanted):
                if blocks and (group >= len(remote) or not remote[group]):
                    problem = f"the prefill holds no blocks of KV cache group {group}, this decode needs {len(blocks)}"
        all_blocks = tuple(b for g in wanted for b in g)
        parts: list[_Part] = []
        if problem is None:
            assert spec.source is not None
            for index, (rank, first, count) in enumerate(sources):
                address = self._prefill_address(spec.source, rank)
                if address is None:
                    problem = f"no prefill rank {rank} of engine {spec.source.engine_id!r} in this process"
                    break
                receiver, manager = self._receiver(index)
                for group in range(max(len(remote), len(wanted))):
                    held = remote[group] if group < len(remote) else ()
                    mine = wanted[group] if group < len(wanted) else ()
                    if not held:
                        continue  # nothing held there for this group: no room
                    room = group_room(spec.room, group)
                    if spec.source.tp_size < self.tp_size and not spec.release_only:
                        split = self.tp_size // spec.source.tp_size
                        room = slice_room(room, self.tp_rank % split, split)
                    try:
                        handle = manager.open(room)
                    except DuplicateRoom:
                        logger.error(
                            "kvfsm: room %s is already loading here; request %s fails its load", room, spec.request_id
                        )
                        problem = f"room {room!r} is already loading here"
                        break
                    if mine:
                        parts.append(_Part(handle, mine, pages=self._pages(mine, first, count), backend=receiver))
                    else:
                        self.stats.releases += 1
                        self.transfer_stats.count("releases")
                        self._releasing.append(handle)
                    self._bootstrap(receiver, handle, address)
                if problem is not None:
                    break
        if spec.release_only:
            if problem is not None:
                logger.warning(
                    "kvfsm: request %s: cannot tell its prefill to free its blocks: %s", spec.request_id, problem
                )
            return
        if problem is not None:
            for part in parts:
                part.handle.abort(problem)
            # A room that never reaches a backend carries the reason (nothing can land in its blocks):
            # the scheduler's own for bad params, else one beside the transfer's.
            failed: TransferHandle | None = None
            with contextlib.suppress(DuplicateRoom):
                failed = self.decode.open(spec.room if spec.problem else f"!{spec.room}")
            if failed is not None:
                failed.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, problem))
                failed.writes_drained()
                parts.append(_Part(failed, all_blocks))
            elif not parts:
                self._refused_loads.add(spec.request_id)
                self._load_errors.update(all_blocks)
                return
        if parts:
            self._receiving[spec.request_id] = _Transfer(parts)
        else:
            # Nothing to load in any group (cannot happen for a parked load; be safe): report it loaded.
            self._refused_loads.add(spec.request_id)

    def _receiver(self, index: int) -> tuple[KVBackend, TransferManager]:
        """The receiver backend (and its manager) of this rank's `index`-th prefill rank of a request.

        One room id per transfer, so the rooms of one transfer from several
        prefill ranks need one manager each: made on first use, on the same KV memory.
        """
        assert self.receiver is not None and self.decode is not None
        if index == 0:
            return self.receiver, self.decode
        if index not in self._more_receivers:
            assert self._pools is not None
            manager = TransferManager(Role.RECEIVER, timeouts=self.config.decode_timeouts, clock=self._clock)
            backend = self._backend(manager, 0)
            backend.register_pools(self._pools)
            self._more_receivers[index] = (backend, manager)
        return self._more_receivers[index]

    def _prefill_address(self, source: RemoteSource, rank: int) -> str | None:
        if isinstance(self.receiver, LocalBackend):
            return local_prefill_address(source.engine_id, rank)
        return f"tcp://{source.host}:{source.port + rank}"

    @staticmethod
    def _bootstrap(backend: KVBackend, handle: TransferHandle, address: str) -> None:
        try:
            backend.bootstrap(handle, address)
        except TransferInputError as exc:
            logger.error("kvfsm: room %s refused by the %s backend: %s", handle.room, backend.name, exc)
            if backend.handle_of(handle.room) is not handle:
                handle.writes_drained()  # the backend never took it: nothing was issued

    def _abort(self, spec: AbortSpec) -> None:
        recv = self._receiving.get(spec.request_id)
        if recv is None:
            self.stats.late_aborts += 1
            logger.debug("kvfsm: abort of request %s after its load ended: ignored", spec.request_id)
            return
        for part in recv.parts:
            part.handle.abort(spec.reason)

    def _expire(self, request_id: str) -> None:
        """The hold's lease expired: free its rooms no decode claimed yet (a claimed one goes on)."""
        transfer = self._sending.get(request_id)
        if transfer is None:
            return
        for part in transfer.parts:
            if part.handle.state is KVPoll.Bootstrapping:
                part.handle.fail(FailureReason(FailureKind.TIMEOUT, "lease expired: the decode stopped renewing it"))

    def _slice(self, request_id: str, count: int) -> None:
        """A decode of `count` times this TP size loads the request: hold its heads in `count` slices.

        Each decode rank claims the slice of this rank's heads it holds
        (`_params.slice_room`); the whole-block rooms, which no decode will
        claim now, are retired (closed once release-safe).
        """
        transfer = self._sending.get(request_id)
        heads = self.page_heads
        if transfer is None or self.prefill is None or self.sender is None:
            return
        if heads is None or heads % count:
            logger.error(
                "kvfsm: request %s: a decode of %d times this TP size cannot load %s KV heads per rank in slices",
                request_id,
                count,
                heads,
            )
            return
        per = heads // count
        parts: list[_Part] = []
        for part in transfer.parts:
            if part.head_count is not None or part.handle.state is not KVPoll.Bootstrapping:
                parts.append(part)  # already a slice, or claimed: it goes on
                continue
            part.handle.abort(f"held in {count} slices of its heads instead, for a decode of a larger TP size")
            self._releasing.append(part.handle)
            for index in range(count):
                try:
                    handle = self.prefill.open(slice_room(str(part.handle.room), index, count))
                except DuplicateRoom:
                    continue
                parts.append(_Part(handle, part.blocks, head_first=index * per, head_count=per))
                self._bootstrap(self.sender, handle, self.sender.address)
        transfer.parts = parts

    # -- each step's report (get_finished) -------------------------------------------------------

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """Drive the rooms one step; (finished_sending, finished_recving, failed_recving), each once."""
        sending = self._poll_sends()
        recving, failed = self._poll_loads()
        self._poll_releases()
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        """Blocks of the loads reported failed since the last call (`get_block_ids_with_load_errors`)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _poll_sends(self) -> set[str]:
        done, self._refused_sends = self._refused_sends, set()
        for request_id, transfer in list(self._sending.items()):
            for part in transfer.parts:
                if part.handle.poll() is KVPoll.WaitingForInput and not part.started:
                    self._send(part)
            if not transfer.ended():
                continue
            for part in transfer.parts:
                self.transfer_stats.room_ended(part.handle)
            if transfer.succeeded():
                self.stats.sent += 1
                self.stats.blocks_sent += sum(p.sent_blocks for p in transfer.parts)
            else:
                self.stats.failed_sends += 1
            transfer.close()
            del self._sending[request_id]
            done.add(request_id)
        return done

    def _send(self, part: _Part) -> None:
        assert self.sender is not None
        handle = part.handle
        wanted = self.sender.expected_pages(handle)
        if wanted is None:
            return
        part.started = True
        held = len(part.blocks)
        heads = part.head_count or self.page_heads or 1
        blocks = wanted // heads
        if wanted % heads or blocks > held:
            handle.fail(
                FailureReason(
                    FailureKind.TRANSFER_ERROR,
                    f"the decode expects {wanted} pages; this prefill holds {held} blocks of {heads} page(s)",
                )
            )
            return
        part.sent_blocks = blocks
        try:
            self.sender.send(handle, self._pages(part.blocks[held - blocks :], part.head_first, heads), last=True)
        except TransferInputError as exc:  # the backend failed the room with this reason
            logger.error("kvfsm: sending room %s failed: %s", handle.room, exc)

    def _poll_loads(self) -> tuple[set[str], set[str]]:
        done, failed = set(self._refused_loads), set(self._refused_loads)
        self._refused_loads.clear()
        for request_id, transfer in list(self._receiving.items()):
            for part in transfer.parts:
                handle = part.handle
                if handle.poll() is KVPoll.WaitingForInput and not part.started:
                    part.started = True
                    backend = part.backend or self.receiver
                    assert backend is not None
                    try:
                        backend.expect(handle, part.pages if part.pages is not None else list(part.blocks))
                    except TransferInputError as exc:
                        logger.error("kvfsm: loading room %s failed: %s", handle.room, exc)
            if not transfer.ended():
                if any(p.handle.state is KVPoll.Failed for p in transfer.parts):
                    # One group failed: the load fails whatever the others do, so stop them now.
                    for part in transfer.parts:
                        part.handle.abort("another KV cache group of this load failed")
                continue
            for part in transfer.parts:
                self.transfer_stats.room_ended(part.handle)
            if transfer.succeeded():
                self.stats.loaded += 1
                self.stats.blocks_loaded += len(transfer.blocks)
            else:
                self.stats.failed_loads += 1
                failed.add(request_id)
                self._load_errors.update(transfer.blocks)
                logger.warning("kvfsm: request %s failed to load its KV: %s", request_id, transfer.reason())
            transfer.close()
            del self._receiving[request_id]
            done.add(request_id)
        return done, failed

    def stopped_loads(self) -> dict[str, str]:
        """Loads that failed and are held until their rooms are release-safe: request id -> why.

        Said every step until vLLM hears of them (`build_connector_worker_meta`),
        so the scheduler stops counting them as running loads.
        """
        return {
            request_id: str(transfer.reason())
            for request_id, transfer in self._receiving.items()
            if any(part.handle.state is KVPoll.Failed for part in transfer.parts)
        }

    def _poll_releases(self) -> None:
        still = []
        for handle in self._releasing:
            if handle.poll() is KVPoll.WaitingForInput:
                # The prefill answered the handshake: tell it its blocks are not needed.
                handle.abort("the decode needs none of these blocks")
            if handle.is_terminal and handle.release_safe:
                handle.close()
            else:
                still.append(handle)
        self._releasing = still

    def report(self) -> dict[str, Any] | None:
        """This rank's figures for vLLM's connector stats since the last report (`_stats` payload)."""
        self.transfer_stats.sample("quarantined_pages", self._quarantined_pages())
        return self.transfer_stats.take()

    def _quarantined_pages(self) -> int | None:
        page_nbytes = 0 if self._pools is None else self._pools.page_nbytes
        counts = [quarantined_pages_of(m, page_nbytes) for m in (self.prefill, self.decode) if m is not None]
        known = [c for c in counts if c is not None]
        return sum(known) if known else None

    @property
    def busy(self) -> bool:
        """Rooms still open on this rank."""
        return bool(self._sending or self._receiving or self._releasing)
