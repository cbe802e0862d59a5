"""The backend adapter protocol: how a transfer engine plugs into kvfsm.

An adapter moves KV pages; the lifecycle core decides what that means for
each room. The split is strict:

* The core (`TransferManager` and its handles) owns every state. Only the
  machine's hooks write the status table.
* An adapter talks back **only** through events on the room's
  `TransferHandle`: `bootstrapped()`, `transfer_started()`,
  `chunk_done(nbytes, last)`, `transfer_done()`, `fail(FailureReason)`,
  and the release phase's proofs `writes_drained()` and `fenced(why)`. It never assigns a status and never aborts a room by
  itself (it reports `fail(...)` and the core decides).
* Abort lives once, in the core: `handle.abort()` (or `timeout`, or a
  `fail` from anywhere) moves the room to `Failed`. `KVBackend` subscribes
  to its manager and, for every room that enters `Failed`, calls the
  adapter's `_stop(handle)` exactly once. The adapter stops issuing writes
  for that room and calls `handle.writes_drained()` once none of its writes
  into the room's pages can still land (immediately if nothing was in
  flight), or `handle.fenced(why)` when the engine says the peer that
  could write is gone (its connection closed, its process gone, its next
  incarnation holds no writes). Either proof releases the room's pages;
  without one by the drain deadline they are quarantined, never freed on
  a timer (`_release.py`). Every room this endpoint bootstrapped gets
  exactly one `_stop` when it fails, whatever the order of fail, close and
  a reopening of the same id (rule 16): rooms are tracked per generation.
* Notices reach observers after the manager's lock is released, on
  whichever thread is dispatching, so `_stop` can run a little after the
  room failed. An adapter that fails a room itself calls
  `self._fail(handle, reason)`, which also stops the room's work before it
  returns, and it checks `handle.state` before committing a transfer.

One `KVBackend` instance is one endpoint: one role (its manager's) in one
process. A prefill endpoint and a decode endpoint find each other through
`address` strings (an in-process directory for `LocalBackend`, a ZeroMQ
bootstrap server for cross-process engines). The lifecycle of one room:

    receiver side (decode)                 sender side (prefill)
    h = manager.open(room)                 h = manager.open(room)
    backend.bootstrap(h, prefill_addr)     backend.bootstrap(h, prefill_addr)
      ... adapter: h.bootstrapped() on both once they rendezvous ...
    backend.expect(h, dst_pages, aux)      backend.send(h, pages_0)
                                           backend.send(h, pages_1)
                                           backend.send(h, [], last=True, aux_index=a)
      ... adapter on both: transfer_started, chunk_done xN, transfer_done ...

`send` is called once per chunk (chunked prefill); the call flagged
`last=True` ends the room's transfer and may carry zero pages. Pages map in
order: the k-th page sent lands in the k-th page the receiver expects. The
aux (metadata) slot is copied last, as the commit marker: the receiver
reports `transfer_done()` only after it landed and names the right room.

Public methods of `KVBackend` validate their input the same way for every
adapter (role, handle ownership, closed rooms, page lists) and then call
the adapter's `_bootstrap`, `_expect`, `_send`. The memory types they are
given (`MemoryRegion`, `KVPools`, `check_pages`) live in `memory.py` and
are re-exported here. Bad input raises
`TransferInputError` naming the room and what was wrong, and, when the room
is still open and live, fails it with `TRANSFER_ERROR` first, so the
scheduler sees the failure and nothing else is touched.

Adapters must not import heavy modules at import time of `kvfsm.backends`;
the registry in `kvfsm/backends/__init__.py` imports them by name on demand.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Hashable, Sequence
from types import TracebackType
from typing import Any, ClassVar, NoReturn

from .._manager import TransferHandle, TransferManager
from .._observe import StateChange
from .._states import FailureKind, FailureReason, KVPoll, Role
from ._errors import BackendError, TransferInputError
from .memory import KVPools, MemoryRegion, as_index_list, check_pages, is_index

__all__ = [
    "KVBackend",
    "KVPools",
    "MemoryRegion",
    "TransferInputError",
    "BackendError",
    "check_pages",
]

logger = logging.getLogger("kvfsm.backends")


# -- the adapter base ------------------------------------------------------------------


class KVBackend(abc.ABC):
    """Base of every adapter: one endpoint (one role) bound to one manager.

    Subclasses implement `address`, `_register_pools`, `_bootstrap`,
    `_expect` (receiver), `_send` (sender) and `_stop`, and may override
    `_expected_pages` (sender), `_forget` (room closed) and `_shutdown`. They emit events on handles and
    nothing else.
    """

    #: The registry name ("local", "fake", "mooncake", ...).
    name: ClassVar[str] = "?"

    def __init__(self, manager: TransferManager) -> None:
        if not isinstance(manager, TransferManager):
            raise TypeError(f"a backend needs a kvfsm.TransferManager; got {type(manager).__name__}: {manager!r}")
        self.manager = manager
        self.role: Role = manager.role
        self.pools: KVPools | None = None
        # The newest bootstrapped generation of each room id (what adapters look rooms up by),
        # and every generation not yet closed, so an older one's failure still stops it.
        self._rooms: dict[Hashable, TransferHandle] = {}
        self._known: dict[tuple[Hashable, int], TransferHandle] = {}
        self._rooms_lock = threading.Lock()
        self._stopped: set[tuple[Hashable, int]] = set()
        self._closed = False
        # Only what stops or forgets a room: the manager's common steps keep their fast path.
        self._unsubscribe = manager.subscribe(self._observe, events=("fail", "timeout", "abort", "close"))

    # -- what adapters implement ----------------------------------------------------------

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where a peer reaches this endpoint (what `bootstrap(peer=...)` takes)."""

    @abc.abstractmethod
    def _register_pools(self, pools: KVPools) -> None:
        """Register the endpoint's memory with the engine."""

    @abc.abstractmethod
    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        """Start the handshake for a room; emit `bootstrapped()` (or `fail`) when done."""

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        """Receiver: the room's destination pages and aux slot (validated)."""
        raise BackendError(f"{type(self).__name__} cannot receive")

    def _send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        """Sender: start the next chunk's writes (validated); must not block on the copy."""
        raise BackendError(f"{type(self).__name__} cannot send")

    def _expected_pages(self, handle: TransferHandle) -> int | None:
        """Sender: how many pages the receiver posted for this room, or None if not (yet) known."""
        return None

    @abc.abstractmethod
    def _stop(self, handle: TransferHandle) -> None:
        """The room entered Failed: stop its work, later call `handle.writes_drained()`.

        Called once per failed room, outside the manager's lock, possibly on
        another thread. Must not block on in-flight copies.
        """

    def _forget(self, handle: TransferHandle) -> None:
        """The room was closed: drop any per-room state. Default: nothing."""
        return

    def _shutdown(self) -> None:
        """Release the engine's resources (threads, sockets). Default: nothing."""
        return

    # -- the public surface --------------------------------------------------------------

    def register_pools(self, pools: KVPools) -> None:
        """Register this endpoint's KV pools (once, before any room)."""
        self._check_open()
        if not isinstance(pools, KVPools):
            raise TypeError(f"register_pools needs a KVPools; got {type(pools).__name__}: {pools!r}")
        if self.pools is not None:
            raise BackendError(f"{type(self).__name__} at {self.address}: pools are already registered")
        self._register_pools(pools)
        self.pools = pools

    def bootstrap(self, handle: TransferHandle, peer: str) -> None:
        """Start the handshake of `handle`'s room with the endpoint at `peer`."""
        self._check_handle(handle, "bootstrap")
        if not isinstance(peer, str):
            self._reject(handle, f"bootstrap peer must be an address string; got {type(peer).__name__}: {peer!r}")
        with self._rooms_lock:
            if self._known.get((handle.room, handle.generation)) is handle:
                duplicate = True
            else:
                duplicate = False
                self._rooms[handle.room] = handle
                self._known[handle.room, handle.generation] = handle
        if duplicate:
            self._reject(handle, "bootstrap() was already called for this room")
        if handle.state is KVPoll.Failed:
            # It failed before we knew it (its notice found no room here):
            # nothing was issued, so stopping it drains it at once.
            self._stop_once(handle)
            return
        self._bootstrap(handle, peer)

    def expect(self, handle: TransferHandle, pages: Sequence[int] | Any, aux_index: int | None = None) -> None:
        """Receiver: the pages (in order) and the aux slot this room's data lands in.

        Once per room: a second call on a live room is refused
        (`TransferInputError`, the room fails), whatever pages it names.
        """
        self._check_handle(handle, "expect", Role.RECEIVER)
        if handle.is_terminal:
            return
        if handle.state is KVPoll.Bootstrapping:
            self._reject(handle, "expect() before the room finished bootstrapping (poll for WaitingForInput first)")
        checked, aux = self._check_indices(handle, pages, aux_index, "destination pages")
        assert self.pools is not None
        handle.holds(len(checked) * self.pools.page_nbytes)  # what a quarantine of this room counts
        self._expect(handle, checked, aux)

    def send(
        self,
        handle: TransferHandle,
        pages: Sequence[int] | Any,
        *,
        last: bool = False,
        aux_index: int | None = None,
    ) -> None:
        """Sender: transfer the next chunk of source pages; `last=True` ends the room.

        A chunk may be empty (a zero-page last chunk). `aux_index` names the
        source aux slot copied as the commit marker; give it with the last
        chunk or any earlier one (the last one named counts). When the
        receiver posted an aux slot, its room succeeds only with that slot
        written: a last chunk when no chunk named a source slot is refused
        (`TransferInputError`, the room fails with `TRANSFER_ERROR`), and so
        is naming one for a receiver that posted none. On a room that
        already ended this does nothing.
        """
        self._check_handle(handle, "send", Role.SENDER)
        if handle.is_terminal:
            logger.debug("kvfsm send on room %r ignored: it is %s", handle.room, handle.state.name)
            return
        if handle.state is KVPoll.Bootstrapping:
            self._reject(handle, "send() before the room finished bootstrapping (poll for WaitingForInput first)")
        checked, aux = self._check_indices(handle, pages, aux_index, "source pages")
        assert self.pools is not None
        handle.holds(handle.pages_nbytes + len(checked) * self.pools.page_nbytes)
        self._send(handle, checked, bool(last), aux)

    def close(self) -> None:
        """Fail the rooms still in flight here, stop observing, release the engine. Idempotent.

        A room this endpoint was moving cannot progress once it is closed, so
        it fails now (`TRANSFER_ERROR`) instead of waiting for a deadline;
        its drain is reported as usual.
        """
        if self._closed:
            return
        with self._rooms_lock:
            live = [h for h in self._known.values() if not h.closed and not h.is_terminal]
        reason = FailureReason(FailureKind.TRANSFER_ERROR, f"the {self.name} backend at {self.address} was closed")
        for handle in live:
            self._fail(handle, reason)
        self._closed = True
        self._unsubscribe()
        self._shutdown()

    def __enter__(self) -> KVBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role.value} at {self.address} rooms={len(self._rooms)}>"

    # -- shared checks -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{type(self).__name__} ({self.role.value}) is closed")

    def _check_handle(self, handle: TransferHandle, method: str, role: Role | None = None) -> None:
        self._check_open()
        if not isinstance(handle, TransferHandle):
            raise TypeError(f"{method}() needs a TransferHandle; got {type(handle).__name__}: {handle!r}")
        if handle._manager is not self.manager:
            raise TransferInputError(
                handle.room, f"{method}(): this handle belongs to another manager than this {self.role.value} backend's"
            )
        if handle.closed:
            raise TransferInputError(handle.room, f"{method}() on a closed room")
        if role is not None and self.role is not role:
            self._reject(handle, f"{method}() is for a {role.value}; this backend is the {self.role.value}")
        if self.pools is None:
            self._reject(handle, f"{method}(): register_pools() was not called on this {self.role.value} backend")

    def _check_indices(
        self, handle: TransferHandle, pages: Any, aux_index: int | None, what: str
    ) -> tuple[list[int], int | None]:
        assert self.pools is not None
        try:
            checked = check_pages(
                handle.room,
                as_index_list(handle.room, pages, what),
                self.pools.num_pages,
                what,
                unique=self.role is Role.RECEIVER,
            )
            aux: int | None = None
            if aux_index is not None:
                if not is_index(aux_index):
                    raise TransferInputError(
                        handle.room,
                        f"aux_index must be an integer slot or None; got {type(aux_index).__name__}: {aux_index!r:.40}",
                    )
                if self.pools.num_aux_slots == 0:
                    raise TransferInputError(
                        handle.room, f"aux_index {aux_index} given but no aux region is registered"
                    )
                aux = check_pages(handle.room, [aux_index], self.pools.num_aux_slots, "aux_index")[0]
        except TransferInputError as exc:
            problem = exc.problem
        else:
            return checked, aux
        self._reject(handle, problem)

    def _reject(self, handle: TransferHandle, problem: str) -> NoReturn:
        """Fail the room (if live) with `problem` and raise `TransferInputError`."""
        if not handle.closed and not handle.is_terminal:
            handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, problem))
        raise TransferInputError(handle.room, problem)

    def expected_pages(self, handle: TransferHandle) -> int | None:
        """Sender: how many pages the receiver expects for this room, or None until it said.

        A sender holding more pages than the receiver needs (the receiver
        already had a prefix) sends its last `expected_pages(h)` pages.
        """
        self._check_handle(handle, "expected_pages", Role.SENDER)
        return self._expected_pages(handle)

    def handle_of(self, room: Hashable) -> TransferHandle | None:
        """The newest handle this backend knows for `room`, if bootstrapped and not closed."""
        return self._rooms.get(room)

    # -- the core's side: failures and closes reach the adapter -----------------------------

    def _fail(self, handle: TransferHandle, reason: FailureReason) -> bool:
        """Fail `handle` (an event, like any) and stop its work before returning.

        Use this, not `handle.fail`, when the adapter itself detects the
        failure: the manager's notice may be delivered later by another
        thread, and the adapter must not go on writing meanwhile.
        """
        changed = handle.fail(reason)
        if handle.state is KVPoll.Failed and self._known.get((handle.room, handle.generation)) is handle:
            self._stop_once(handle)
        return changed

    def _stop_once(self, handle: TransferHandle) -> None:
        key = (handle.room, handle.generation)
        with self._rooms_lock:
            if key in self._stopped:
                return
            self._stopped.add(key)
        self._stop(handle)

    def _observe(self, change: StateChange) -> None:
        # By (room, generation): a later generation bootstrapped meanwhile does not hide this one.
        key = (change.room, change.generation)
        if change.event == "close":
            with self._rooms_lock:
                handle = self._known.pop(key, None)
                if handle is None:
                    return
                if self._rooms.get(change.room) is handle:
                    del self._rooms[change.room]
            # A room closed before its Failed notice came (a reaper's timeout and a close racing)
            # still gets its stop; then it is forgotten.
            if handle.state is KVPoll.Failed:
                self._stop_once(handle)
            with self._rooms_lock:
                self._stopped.discard(key)
            self._forget(handle)
        elif change.dest is KVPoll.Failed:
            handle = self._known.get(key)
            if handle is not None:
                self._stop_once(handle)
