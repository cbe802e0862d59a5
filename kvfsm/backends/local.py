"""`LocalBackend`: prefill and decode KV pools as torch tensors in one process.

The embedded default engine. Each endpoint registers its own pools (K and
V page buffers per layer, plus aux slots), as CPU or CUDA tensors. A
prefill (sender) endpoint and a decode (receiver) endpoint find each other
through a `LocalFabric`, an in-process directory of addresses, and pair up
per room (a `_Link`), exactly as two processes would through a bootstrap
server:

* receiver `bootstrap(h, sender_address)`: the room joins the sender's link
  table; the receiver is `bootstrapped()` at once (the sender is reachable).
* receiver `expect(h, pages, aux)`: the destination is known; the sender
  (once it bootstrapped the same room) becomes `bootstrapped()`.
* sender `send(h, pages, last=...)`: the chunk's destination pages are
  assigned in order and the chunk is queued; the sender's first chunk fires
  its `transfer_started()`. Chunks of one room run in order on the sender's
  worker threads (rooms in parallel); the receiver's `transfer_started()`
  fires when the first chunk starts landing. After each chunk both sides get
  `chunk_done(nbytes, last)`.
* After the last chunk the aux slot is copied and then the commit marker
  (room key and page count) is written into the receiver's marker slot: last,
  so it is never visible before the data. The receiver reads it back and
  reports `transfer_done()` only if it names its room; then the sender does.

Failures (abort, timeout, an injected or real error, bad input) reach this
module only through `_stop`, which the base class calls once per failed
room. The link is cancelled, the peer room is failed with `from_peer=True`,
and `writes_drained()` is reported on both handles once no chunk of the room
is being copied. With `Faults.linger_chunks` the worker "keeps writing
after abort" for that many queued chunks before it drains, to exercise the
release gate.

Bad input (pages out of range, mismatched page counts, pools of another
layout, a second `expect`, ...) raises `TransferInputError` naming the room,
fails the room, and touches no page: every check happens before any copy.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import ClassVar

import attrs
import torch

from .._manager import TransferHandle, TransferManager
from .._states import FailureKind, FailureReason, KVPoll, Role
from ._pagecopy import PageCopier, word_view
from .base import BackendError, KVBackend, KVPools, TransferInputError

__all__ = ["LocalBackend", "LocalFabric", "Faults", "DEFAULT_FABRIC", "room_key"]

logger = logging.getLogger("kvfsm.backends.local")


def room_key(room: Hashable) -> int:
    """The int64 a commit marker carries for `room` (ints as-is, strings hashed)."""
    if isinstance(room, int) and not isinstance(room, bool):
        return room % (1 << 63)
    digest = hashlib.blake2b(str(room).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 63)


def _rate(name: str) -> attrs.validators._ValidatorType[float]:  # type: ignore[name-defined]
    def check(_instance: object, _attribute: object, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"Faults.{name} must be a probability in [0, 1]; got {value!r}")

    return check


def _seconds(name: str) -> attrs.validators._ValidatorType[float]:  # type: ignore[name-defined]
    def check(_instance: object, _attribute: object, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
            raise ValueError(f"Faults.{name} must be a number of seconds >= 0; got {value!r}")

    return check


@attrs.frozen(slots=True)
class Faults:
    """Fault injection for `LocalBackend` (all off by default).

    `fail_rate`: probability that a chunk fails (after writing half its
    pages, as a real partial write would) with `TRANSFER_ERROR`.
    `delay_s`: real seconds each chunk waits before copying.
    `stall_rate`: probability that a room's chunks are never copied (its
    transfer hangs until a deadline or an abort fails it).
    `linger_chunks`: after the room failed, the worker still writes this many
    queued chunks before it reports writes drained ("a peer that keeps
    writing after abort"); `linger_s` is the extra wait before each of them.
    `corrupt_marker_rate`: probability that the commit marker names the
    wrong room (the receiver must then fail instead of succeeding).
    `seed` makes the draws reproducible.
    """

    fail_rate: float = attrs.field(default=0.0, validator=_rate("fail_rate"))
    delay_s: float = attrs.field(default=0.0, validator=_seconds("delay_s"))
    stall_rate: float = attrs.field(default=0.0, validator=_rate("stall_rate"))
    linger_chunks: int = 0
    linger_s: float = attrs.field(default=0.0, validator=_seconds("linger_s"))
    corrupt_marker_rate: float = attrs.field(default=0.0, validator=_rate("corrupt_marker_rate"))
    seed: int | None = None


NO_FAULTS = Faults()


class LocalFabric:
    """An in-process directory of local endpoints, by address."""

    def __init__(self) -> None:
        self._endpoints: dict[str, LocalBackend] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def attach(self, endpoint: LocalBackend) -> str:
        with self._lock:
            address = f"local://{endpoint.role.value}/{os.getpid()}/{next(self._ids)}"
            self._endpoints[address] = endpoint
        return address

    def detach(self, address: str) -> None:
        with self._lock:
            self._endpoints.pop(address, None)

    def lookup(self, address: str) -> LocalBackend | None:
        with self._lock:
            return self._endpoints.get(address)


#: The fabric endpoints join unless given another one.
DEFAULT_FABRIC = LocalFabric()


@attrs.define(slots=True, eq=False)
class _Chunk:
    index: int
    src: list[int]
    dst: list[int]
    last: bool
    src_aux: int | None


@attrs.define(slots=True, eq=False)
class _Link:
    """One room's pairing of a sender and a receiver (owned by the sender endpoint)."""

    room: Hashable
    sender_ep: LocalBackend
    lock: threading.Lock = attrs.Factory(threading.Lock)
    sender: TransferHandle | None = None
    receiver: TransferHandle | None = None
    receiver_ep: LocalBackend | None = None
    dst_pages: list[int] | None = None
    dst_aux: int | None = None
    # The source aux slot, named with whichever chunk named it (the last one named wins).
    src_aux: int | None = None
    marker: torch.Tensor | None = None
    copier: PageCopier | None = None
    offset: int = 0
    chunks: int = 0
    started: bool = False
    ended: bool = False
    queue: deque[_Chunk] = attrs.Factory(deque)
    scheduled: bool = False
    in_flight: int = 0
    stalled: bool = False
    cancelled: bool = False
    linger_left: int = 0
    drain_reported: bool = False
    forgotten: int = 0


class LocalBackend(KVBackend):
    """In-process torch transfers between a prefill and a decode endpoint.

    `workers` threads per sender endpoint copy chunks (one room's chunks in
    order, rooms in parallel). `faults` injects failures, delays, stalls and
    late writes (see `Faults`). `audit=True` counts, per receiver room, the
    copies that landed in its pages (`writes_landed`), so a harness can
    prove nothing was written after it released the pages.
    """

    name: ClassVar[str] = "local"

    def __init__(
        self,
        manager: TransferManager,
        *,
        fabric: LocalFabric | None = None,
        workers: int = 2,
        faults: Faults = NO_FAULTS,
        audit: bool = False,
        direct_bytes: int = 256 << 10,
        batch_bytes: int = 2 << 20,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1; got {workers!r}")
        if not isinstance(faults, Faults):
            raise TypeError(f"faults must be a kvfsm.backends.local.Faults; got {faults!r}")
        super().__init__(manager)
        self.fabric = DEFAULT_FABRIC if fabric is None else fabric
        self.faults = faults
        self._rng = random.Random(faults.seed)
        # Faults drawn or timed per chunk need chunks one at a time.
        self._per_chunk_faults = bool(faults.fail_rate or faults.delay_s)
        self._rng_lock = threading.Lock()
        self._direct_bytes = direct_bytes
        self._batch_bytes = batch_bytes
        self._lock = threading.Lock()
        self._links: dict[Hashable, _Link] = {}
        self._views: list[torch.Tensor] = []
        self._aux_views: list[torch.Tensor] = []
        self._markers: torch.Tensor | None = None
        # Weak keys: a closed receiver endpoint must not leave a copier behind
        # that a new endpoint could be mistaken for.
        self._copiers: weakref.WeakKeyDictionary[LocalBackend, PageCopier] = weakref.WeakKeyDictionary()
        self._audit: dict[tuple[Hashable, int], int] | None = {} if audit else None
        self._pool = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvfsm-local")
            if self.role is Role.SENDER
            else None
        )
        self._address = self.fabric.attach(self)

    @property
    def address(self) -> str:
        return self._address

    # -- registration -----------------------------------------------------------------

    def _register_pools(self, pools: KVPools) -> None:
        for region in (*pools.kv, *pools.aux):
            if region.tensor is None:
                raise BackendError(
                    f"LocalBackend needs tensors: region {region.name or hex(region.ptr)} was registered by address only"
                )
            if not isinstance(region.tensor, torch.Tensor):
                raise TypeError(
                    f"region {region.name or '?'}: expected a torch.Tensor, got {type(region.tensor).__name__}"
                )
        self._views = [word_view(region.tensor, region.num_pages) for region in pools.kv]
        self._aux_views = [word_view(region.tensor, region.num_pages) for region in pools.aux]
        if pools.aux:
            # One commit marker (room key, page count) per aux slot, on the KV device.
            self._markers = torch.full((pools.num_aux_slots, 2), -1, dtype=torch.int64, device=self._views[0].device)

    def _copier_for(self, receiver_ep: LocalBackend) -> PageCopier:
        with self._lock:
            copier = self._copiers.get(receiver_ep)
            if copier is None:
                copier = self._copiers[receiver_ep] = PageCopier(
                    list(zip(self._views, receiver_ep._views, strict=True)),
                    direct_bytes=self._direct_bytes,
                    batch_bytes=self._batch_bytes,
                )
            return copier

    # -- bootstrap -----------------------------------------------------------------------

    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        if self.role is Role.SENDER:
            self._bootstrap_sender(handle, peer)
        else:
            self._bootstrap_receiver(handle, peer)

    def _bootstrap_sender(self, handle: TransferHandle, peer: str) -> None:
        if peer and peer != self._address and self.fabric.lookup(peer) is None:
            self._reject(handle, f"bootstrap peer {peer!r} is not a local endpoint (this sender is {self._address})")
        problem: str | None = None
        ready = False
        link = self._live_link(handle.room)
        with link.lock:
            if link.sender is not None:
                problem = f"room is already bootstrapped on this sender (generation {link.sender.generation})"
            else:
                link.sender = handle
                ready = link.dst_pages is not None and not link.cancelled
                peer_failed = link.cancelled
        if problem is not None:
            self._reject(handle, problem)
        if peer_failed:
            handle.fail(
                FailureReason(FailureKind.PEER_FAILED, "the receiver of this room already failed", from_peer=True)
            )
            return
        receiver_ep = link.receiver_ep
        if receiver_ep is not None:
            self._check_layouts(link, receiver_ep)
        if ready and handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()

    def _bootstrap_receiver(self, handle: TransferHandle, peer: str) -> None:
        sender_ep = self.fabric.lookup(peer)
        if sender_ep is None or sender_ep.role is not Role.SENDER or sender_ep._closed:
            handle.fail(
                FailureReason(FailureKind.BOOTSTRAP_ERROR, f"no local sender endpoint at {peer!r}", from_peer=False)
            )
            return
        problem: str | None = None
        link = sender_ep._live_link(handle.room)
        with link.lock:
            if link.receiver is not None:
                problem = f"room already has a receiver on {peer} (generation {link.receiver.generation})"
            else:
                link.receiver = handle
                link.receiver_ep = self
        if problem is not None:
            self._reject(handle, problem)
        with self._lock:
            self._links[handle.room] = link
        if link.sender is not None and not sender_ep._check_layouts(link, self):
            return
        handle.bootstrapped()

    def _live_link(self, room: Hashable) -> _Link:
        """This sender endpoint's link for `room`; a new one if it has none or only a forgotten one.

        Either side may bootstrap first, so both create the link here, on the sender's table.
        """
        with self._lock:
            link = self._links.get(room)
            if link is None or link.forgotten:
                link = self._links[room] = _Link(room, self)
            return link

    def _check_layouts(self, link: _Link, receiver_ep: LocalBackend) -> bool:
        """Both pools must exchange pages; on a mismatch fail both rooms (BOOTSTRAP_ERROR)."""
        assert self.pools is not None
        assert receiver_ep.pools is not None
        mismatch = self.pools.layout_mismatch(receiver_ep.pools)
        if mismatch is None:
            return True
        problem = f"the sender's and the receiver's pools differ: {mismatch}"
        with link.lock:
            # Both sides get the real reason, not a "peer failed" echo of it.
            link.cancelled = True
        for handle in (link.sender, link.receiver):
            if handle is not None and not handle.closed and not handle.is_terminal:
                handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, problem))
        raise TransferInputError(link.room, problem)

    # -- receiver: destination ---------------------------------------------------------------

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        link = self._links.get(handle.room)
        if link is None or link.receiver is not handle:
            self._reject(handle, "expect() before bootstrap() on this receiver")
        problem: str | None = None
        with link.lock:
            if link.dst_pages is not None:
                problem = f"expect() was already called ({len(link.dst_pages)} pages)"
            else:
                if aux_index is not None and self._markers is not None:
                    marker = self._markers[aux_index]
                else:
                    marker = torch.empty(2, dtype=torch.int64, device=self._views[0].device)
                # Clear it first: a marker left by an earlier room in this slot must not pass.
                marker.fill_(-1)
                link.marker = marker
                link.dst_aux = aux_index
                link.dst_pages = pages
                sender = link.sender
                cancelled = link.cancelled
        if problem is not None:
            self._reject(handle, problem)
        if sender is not None and not cancelled:
            link.sender_ep._check_layouts(link, self)
            if sender.state is KVPoll.Bootstrapping:
                sender.bootstrapped()

    # -- sender: chunks ------------------------------------------------------------------------

    def _expected_pages(self, handle: TransferHandle) -> int | None:
        link = self._links.get(handle.room)
        if link is None or link.sender is not handle:
            return None
        with link.lock:
            return None if link.dst_pages is None else len(link.dst_pages)

    def _send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        link = self._links.get(handle.room)
        if link is None or link.sender is not handle:
            self._reject(handle, "send() before bootstrap() on this sender")
        problem: str | None = None
        first = False
        with link.lock:
            dst_pages = link.dst_pages
            # The aux slot may be named with any chunk; the commit marker goes with the last.
            named = aux_index if aux_index is not None else link.src_aux
            if link.ended:
                problem = "send() after the chunk flagged last=True"
            elif dst_pages is None or link.receiver_ep is None:
                problem = "send() before the receiver posted its destination pages"
            elif link.offset + len(pages) > len(dst_pages):
                problem = (
                    f"mismatched page counts: this chunk would send pages {link.offset}..{link.offset + len(pages) - 1} "
                    f"but the receiver expects {len(dst_pages)} pages"
                )
            elif last and link.offset + len(pages) != len(dst_pages):
                problem = (
                    f"mismatched page counts: the last chunk ends after {link.offset + len(pages)} pages "
                    f"but the receiver expects {len(dst_pages)}"
                )
            elif last and link.dst_aux is not None and named is None:
                problem = (
                    f"the receiver expects its commit marker in aux slot {link.dst_aux}, and no chunk named "
                    "a source aux slot (aux_index)"
                )
            elif last and link.dst_aux is None and named is not None:
                problem = f"aux_index {named} given but the receiver posted no aux slot"
            else:
                link.src_aux = named
                src_aux = named if last else None
                chunk = _Chunk(link.chunks, pages, dst_pages[link.offset : link.offset + len(pages)], last, src_aux)
                link.offset += len(pages)
                link.chunks += 1
                link.ended = last
                first = not link.started
                link.started = True
                if first and self.faults.stall_rate and self._draw() < self.faults.stall_rate:
                    link.stalled = True
                if link.copier is None:
                    link.copier = self._copier_for(link.receiver_ep)
                link.queue.append(chunk)
        if problem is not None:
            self._reject(handle, problem)
        if first:
            handle.transfer_started()
        self._schedule(link)

    def _draw(self) -> float:
        with self._rng_lock:
            return self._rng.random()

    def _schedule(self, link: _Link) -> None:
        with link.lock:
            if link.scheduled or link.stalled or not link.queue:
                return
            link.scheduled = True
        assert self._pool is not None
        try:
            self._pool.submit(self._work, link)
        except RuntimeError:  # the pool shut down: the room cannot progress
            with link.lock:
                link.scheduled = False
            if link.sender is not None:
                link.sender.fail(FailureReason(FailureKind.TRANSFER_ERROR, "the local backend was closed"))

    def _work(self, link: _Link) -> None:
        """Run a room's queued chunks in order until its queue is empty.

        Chunks count as in flight from the moment they are taken off the
        queue until their writes landed; their events are emitted after that,
        so a room that reads Success or drained never has a copy of its own
        running. Everything queued is taken at once (one copy call) unless
        faults act per chunk or the room is lingering after a failure.
        """
        while True:
            self._stop_if_failed(link)
            with link.lock:
                if link.cancelled and link.linger_left <= 0:
                    link.queue.clear()
                if not link.queue:
                    link.scheduled = False
                    drain = link.cancelled and not link.drain_reported
                    if drain:
                        link.drain_reported = True
                    break
                lingering = link.cancelled
                if lingering:
                    link.linger_left -= 1
                if lingering or self._per_chunk_faults:
                    chunks = [link.queue.popleft()]
                else:
                    chunks = list(link.queue)
                    link.queue.clear()
                link.in_flight += 1
            events: list[Callable[[], object]] = []
            try:
                events = self._run_chunks(link, chunks, lingering)
            except Exception as exc:  # a real copy error fails the room, it never kills the worker
                logger.exception("kvfsm local: chunk %d of room %r failed", chunks[0].index, link.room)
                failure = FailureReason(FailureKind.TRANSFER_ERROR, f"chunk {chunks[0].index}: {exc}")
                events = [partial(self._fail_sender, link, failure)]
            finally:
                with link.lock:
                    link.in_flight -= 1
            for emit in events:
                emit()
        if drain:
            self._report_drained(link)

    def _fail_sender(self, link: _Link, reason: FailureReason) -> None:
        if link.sender is not None:
            self._fail(link.sender, reason)

    def _stop_if_failed(self, link: _Link) -> None:
        """Cancel the link now if a side failed whose notice has not reached `_stop` yet."""
        if link.cancelled:
            return
        receiver_ep = link.receiver_ep
        for handle, endpoint in ((link.sender, self), (link.receiver, receiver_ep)):
            if handle is not None and endpoint is not None and handle.state is KVPoll.Failed:
                endpoint._stop_once(handle)
                return

    def _run_chunks(self, link: _Link, chunks: list[_Chunk], lingering: bool) -> list[Callable[[], object]]:
        """Copy queued chunks of one room as one batch; return the events to emit after.

        Chunks that were already queued together are copied in one
        `PageCopier` call (fewer kernel launches, runs across chunk borders
        merge); each still gets its own `chunk_done`, in order.
        """
        faults = self.faults
        if faults.delay_s:
            time.sleep(faults.delay_s)
        if lingering and faults.linger_s:
            time.sleep(faults.linger_s)
        sender, receiver = link.sender, link.receiver
        assert sender is not None
        assert receiver is not None
        assert link.copier is not None
        receiver_ep = link.receiver_ep
        assert receiver_ep is not None
        if not lingering and receiver.state is KVPoll.WaitingForInput:
            receiver.transfer_started()
        first = chunks[0]
        if faults.fail_rate and not lingering and self._draw() < faults.fail_rate:
            half = len(first.src) // 2
            link.copier.copy(first.src[:half], first.dst[:half])
            self._synchronize()
            receiver_ep._note_write(receiver)
            reason = FailureReason(FailureKind.TRANSFER_ERROR, f"injected failure in chunk {first.index}")
            return [partial(self._fail_sender, link, reason)]
        if len(chunks) == 1:
            link.copier.copy(first.src, first.dst)
        else:
            link.copier.copy(
                [page for chunk in chunks for page in chunk.src], [page for chunk in chunks for page in chunk.dst]
            )
        final = chunks[-1]
        if final.last:
            self._commit(link, final)
        self._synchronize()
        receiver_ep._note_write(receiver)
        page_nbytes = link.copier.page_nbytes
        events: list[Callable[[], object]] = []
        for chunk in chunks:
            nbytes = len(chunk.src) * page_nbytes
            events.append(partial(sender.chunk_done, nbytes, last=chunk.last))
            events.append(partial(receiver.chunk_done, nbytes, last=chunk.last))
        if final.last and not lingering:
            problem = receiver_ep._check_marker(link)
            if problem is not None:
                failure = FailureReason(FailureKind.TRANSFER_ERROR, problem)
                events.append(partial(receiver_ep._fail, receiver, failure))
            else:
                events.append(receiver.transfer_done)
                events.append(sender.transfer_done)
        return events

    def _commit(self, link: _Link, chunk: _Chunk) -> None:
        """Copy the aux slot, then write the commit marker: always the last write."""
        receiver_ep = link.receiver_ep
        assert receiver_ep is not None
        assert link.marker is not None
        assert link.dst_pages is not None
        if chunk.src_aux is not None and link.dst_aux is not None:
            for src_view, dst_view in zip(self._aux_views, receiver_ep._aux_views, strict=True):
                dst_view[link.dst_aux].copy_(src_view[chunk.src_aux])
        key = room_key(link.room)
        if self.faults.corrupt_marker_rate and self._draw() < self.faults.corrupt_marker_rate:
            key = (key + 1) % (1 << 63)
        link.marker.copy_(torch.tensor([key, len(link.dst_pages)], dtype=torch.int64))

    def _synchronize(self) -> None:
        if self._views and self._views[0].is_cuda:
            torch.cuda.current_stream(self._views[0].device).synchronize()

    # -- receiver-side checks and audit ----------------------------------------------------------

    def _check_marker(self, link: _Link) -> str | None:
        assert link.marker is not None
        assert link.dst_pages is not None
        found = link.marker.tolist()
        expected = [room_key(link.room), len(link.dst_pages)]
        if found != expected:
            return f"commit marker names room key {found[0]} with {found[1]} pages; expected {expected[0]} with {expected[1]}"
        return None

    def _note_write(self, handle: TransferHandle) -> None:
        audit = self._audit
        if audit is not None:
            key = (handle.room, handle.generation)
            with self._lock:
                audit[key] = audit.get(key, 0) + 1

    def writes_landed(self, handle: TransferHandle) -> int:
        """Receiver with `audit=True`: how many copies landed in this room's pages so far."""
        if self._audit is None:
            raise BackendError("writes_landed() needs LocalBackend(..., audit=True)")
        with self._lock:
            return self._audit.get((handle.room, handle.generation), 0)

    def audited_rooms(self) -> list[tuple[Hashable, int]]:
        """Receiver with `audit=True`: (room, generation) of open rooms that got writes.

        Closing a room drops its entry, so an entry for a closed room means a
        copy landed in its pages after it was closed.
        """
        if self._audit is None:
            raise BackendError("audited_rooms() needs LocalBackend(..., audit=True)")
        with self._lock:
            return list(self._audit)

    def in_flight(self, handle: TransferHandle) -> int:
        """Chunks of this room being copied right now (0 when idle)."""
        link = self._links.get(handle.room)
        if link is None:
            return 0
        with link.lock:
            return link.in_flight

    # -- failure and close ------------------------------------------------------------------------

    def _stop(self, handle: TransferHandle) -> None:
        link = self._links.get(handle.room)
        if link is None or (link.sender is not handle and link.receiver is not handle):
            handle.writes_drained()
            return
        with link.lock:
            first = not link.cancelled
            if first:
                link.cancelled = True
                link.linger_left = link.sender_ep.faults.linger_chunks
            idle = not link.scheduled and link.in_flight == 0
            report_all = idle and not link.drain_reported
            if idle:
                link.queue.clear()
                link.drain_reported = True
        if first:
            peer = link.receiver if handle is link.sender else link.sender
            if peer is not None and not peer.closed and not peer.is_terminal:
                cause = handle.reason
                aborted = cause is not None and cause.kind is FailureKind.ABORTED
                side = "sender" if handle is link.sender else "receiver"
                peer.fail(
                    FailureReason(
                        FailureKind.ABORTED if aborted else FailureKind.PEER_FAILED,
                        f"the {side} failed: {cause}",
                        from_peer=True,
                    )
                )
        if report_all:
            self._report_drained(link)
        elif idle:
            # Drained was already reported, maybe before this side failed: repeat it for this side.
            handle.writes_drained()

    def _report_drained(self, link: _Link) -> None:
        for handle in (link.sender, link.receiver):
            if handle is not None and not handle.closed:
                handle.writes_drained()

    def _forget(self, handle: TransferHandle) -> None:
        if self._audit is not None:
            with self._lock:
                self._audit.pop((handle.room, handle.generation), None)
        link = self._links.get(handle.room)
        if link is None or (link.sender is not handle and link.receiver is not handle):
            return
        with self._lock:
            if self._links.get(handle.room) is link:
                del self._links[handle.room]
        sender_ep = link.sender_ep
        with link.lock:
            link.forgotten += 1
            attached = (link.sender is not None) + (link.receiver is not None)
            done = link.forgotten >= attached
        if done and sender_ep is not self:
            with sender_ep._lock:
                if sender_ep._links.get(handle.room) is link:
                    del sender_ep._links[handle.room]

    def _shutdown(self) -> None:
        self.fabric.detach(self._address)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
