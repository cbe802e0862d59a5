"""SGLang's disaggregation classes, with kvfsm underneath.

SGLang's scheduler talks to a KV-transfer backend through five classes of
`sglang/srt/disaggregation/base/conn.py` (and `fake/conn.py`): a manager
per process, a sender per prefill request, a receiver per decode request,
and a fake pair for warmup requests. This module offers the same classes,
constructor arguments, methods and attributes, so a server swaps them in
without edits, but every status they report is a kvfsm room's state:

* `KVManager` wraps one `kvfsm.TransferManager` (a sender manager in
  prefill mode, a receiver manager in decode mode). Its `request_status`,
  `update_status`, `check_status` and `record_failure` keep the old
  dict-and-integers shape for backend code that has not migrated yet, but
  each write becomes lifecycle events (see `_legacy_status`), so a late
  `Success` never overwrites `Failed` and a cleared room never comes back.
* `KVSender` / `KVReceiver` hold their room's handle. `poll()` reads the
  machine; `conclude_state` is derived from it (None until terminal) and
  cannot be assigned; `abort()` is the machine's abort event, so when it
  returns the manager already says `Failed`. A subclass that overrides
  `abort` and forgets to call `super().abort()` still aborts the room: the
  override is wrapped at class creation (`__init_subclass__`).
* `FakeKVSender` / `FakeKVReceiver` reproduce SGLang's fake backend poll
  for poll, but each request is a room on a manager too (a separate one
  with the fake's deadlines), so warmup requests can be aborted, time out
  and are counted like any other.

Two deliberate differences from SGLang's fake backend, both rules of kvfsm:
an `abort()` after `poll()` already returned `Success` changes nothing
(terminal states absorb; SGLang flips it to `Failed`), and the fake
sender's waiting deadline is enforced by every event and by the reaper,
not only by `poll()` (so a `send()` that arrives after the deadline passed
no longer turns a timed-out request into a `Success`).

Nothing here imports sglang: the interface is matched from its source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from .. import _errors
from .._errors import ConfigError, DuplicateRoom, UnknownRoom
from .._manager import TransferHandle, TransferManager
from .._observe import StateChange
from .._states import TERMINAL, FailureKind, FailureReason, KVPoll, Role, RoomId, Timeouts
from ._legacy_status import FailureRecordsView, RequestStatusView, drive_to

if TYPE_CHECKING:
    from ..backends.base import KVBackend

__all__ = [
    "KVPoll",
    "KVArgs",
    "KVTransferMetric",
    "KVTransferError",
    "DisaggregationMode",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "FakeKVManager",
    "FakeKVSender",
    "FakeKVReceiver",
    "BOOTSTRAP_TIMEOUT_ENV",
    "WAITING_TIMEOUT_ENV",
]

logger = logging.getLogger("kvfsm.compat.sglang")

#: SGLang's environment knobs (seconds), read where SGLang reads them.
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
_DEFAULT_TIMEOUT_S = 300.0

#: The reason SGLang's scheduler-initiated abort records.
ABORT_MESSAGE = "Aborted by AbortReq."
#: What a rank reports when the all-reduce says Failed but its own room had not failed.
PROPAGATED_MESSAGE = "Failed due to an unknown reason from another rank"


class DisaggregationMode(enum.Enum):
    """SGLang's `DisaggregationMode`; any object whose `.value` is one of these works."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVArgs:
    """SGLang's `KVArgs`: a bag of attributes describing the KV buffers.

    Created empty and filled by attribute assignment, as SGLang does; the
    annotations list the attributes kvfsm's adapters read.
    """

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    ib_device: str
    gpu_id: int
    page_size: int
    pp_rank: int
    system_dp_rank: int

    def __init__(self, **attributes: Any) -> None:
        for name, value in attributes.items():
            setattr(self, name, value)


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's per-request transfer metric; None where a backend cannot tell."""

    transfer_latency_s: float | None = None
    alloc_latency_s: float | None = None
    transfer_total_bytes: int | None = None


class KVTransferError(_errors.KVTransferError):
    """`kvfsm.KVTransferError` with the attribute names SGLang's code reads.

    `bootstrap_room`, `failure_reason` (a str) and `is_from_another_rank`
    are SGLang's; `room` and `reason` (the structured `FailureReason`) are
    kvfsm's. It is an `Exception`, so `except Exception` in the scheduler
    catches it as before.
    """

    @property
    def bootstrap_room(self) -> RoomId:
        return self.room

    @property
    def failure_reason(self) -> str:
        if self.reason is None:
            return "no reason recorded"
        return self.reason.message or str(self.reason)


def _timeout_from_env(name: str, default: float = _DEFAULT_TIMEOUT_S) -> float:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds; got {text!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds; got {text!r}")
    return value


def _role_of(disaggregation_mode: object) -> Role | None:
    value = getattr(disaggregation_mode, "value", disaggregation_mode)
    if value == DisaggregationMode.PREFILL.value:
        return Role.SENDER
    if value == DisaggregationMode.DECODE.value:
        return Role.RECEIVER
    return None


def _drain_failed_fakes(manager: TransferManager) -> Callable[[StateChange], None]:
    """An observer that opens the release gate of failed fake rooms at once.

    Fake transfers write nothing, so nothing can still be landing in their
    pages; without this a failed warmup request would hold its pages until
    the drain deadline.
    """
    ref = weakref.ref(manager)

    def observe(change: StateChange) -> None:
        target = ref()
        if target is None or change.dest is not KVPoll.Failed:
            return
        try:
            handle = target.get(change.room)
        except UnknownRoom:
            return
        if handle.generation == change.generation:
            handle.writes_drained()

    return observe


class _Orphanage:
    """Rooms whose sender or receiver was garbage-collected without `clear()`.

    The scheduler drops requests without clearing them on some paths. A
    finalizer may run in any thread at any allocation, even one made while
    a manager's lock is held, so it must not close the room itself: it only
    appends the handle here (atomic, lock-free), and the manager closes
    orphans at its next safe point (opening a room, a status write or read).
    """

    def __init__(self, close: Callable[[TransferHandle], None]) -> None:
        self.close = close
        self._queue: deque[TransferHandle] = deque()

    def adopt(self, handle: TransferHandle) -> None:
        self._queue.append(handle)

    def close_all(self) -> int:
        closed = 0
        while True:
            try:
                handle = self._queue.popleft()
            except IndexError:
                return closed
            if not handle.closed:
                with contextlib.suppress(UnknownRoom):
                    self.close(handle)
                closed += 1


class _FakeRooms:
    """The managers fake requests live on, one per (role, waiting deadline).

    SGLang's fake classes are often paired with a real backend's manager,
    and read their timeout from the environment per request, so they cannot
    share that manager's rooms or deadlines. Rooms get private ids: warmup
    requests may share a bootstrap room, and a fake receiver may have none.
    """

    def __init__(self, clock: Callable[[], float], reaper: bool) -> None:
        self._clock = clock
        self._reaper = reaper
        self._lock = threading.Lock()
        self._managers: dict[tuple[Role, float | None], TransferManager] = {}
        self._ids = itertools.count(1)
        self.orphans = _Orphanage(TransferHandle.close)

    def open(self, role: Role, waiting: float | None, bootstrap_room: object) -> TransferHandle:
        self.orphans.close_all()
        key = (role, waiting)
        with self._lock:
            manager = self._managers.get(key)
            if manager is None:
                manager = TransferManager(
                    role,
                    timeouts=Timeouts(bootstrap=None, waiting=waiting, transferring=None),
                    clock=self._clock,
                    remember_closed=0,
                )
                manager.subscribe(_drain_failed_fakes(manager))
                if self._reaper:
                    manager.start_reaper()
                self._managers[key] = manager
            room_id = f"fake:{bootstrap_room}:{next(self._ids)}"
        return manager.open(room_id)

    def managers(self) -> list[TransferManager]:
        with self._lock:
            return list(self._managers.values())

    def stop(self) -> None:
        for manager in self.managers():
            manager.stop_reaper()


_shared_fake_rooms: _FakeRooms | None = None
_shared_fake_rooms_lock = threading.Lock()


def _fake_rooms_for(mgr: object) -> _FakeRooms:
    """The fake rooms of a kvfsm manager, or the process-wide ones for any other manager."""
    if isinstance(mgr, KVManager):
        return mgr.fake_rooms
    global _shared_fake_rooms
    with _shared_fake_rooms_lock:
        if _shared_fake_rooms is None:
            _shared_fake_rooms = _FakeRooms(time.monotonic, reaper=True)
        return _shared_fake_rooms


class KVManager:
    """SGLang's `KVManager` over one `kvfsm.TransferManager`.

    Constructed like SGLang's: `KVManager(kv_args, disaggregation_mode,
    server_args, is_mla_backend)`. Prefill mode manages sender rooms,
    decode mode receiver rooms (`transfer_manager`). The keyword-only
    arguments are kvfsm's: phase `timeouts` (default: SGLang's environment
    knobs, 300 s each for bootstrap and waiting), an injectable `clock`,
    `strict` mode, and whether to start the deadline `reaper` thread (on by
    default: SGLang stops polling some queues, and a deadline must fire
    anyway), and `remember_closed`, how many closed room ids are kept so
    that late legacy writes for them are refused. `backend` builds the data-plane adapter from the manager's
    `TransferManager` (for instance `kvfsm.backends.FakeBackend`, or a
    function that builds a `LocalBackend` and registers its pools): with
    one, `KVSender` and `KVReceiver` move data through it; without one they
    are bases for a backend written as SGLang subclasses. `peer_address`
    maps SGLang's `bootstrap_addr` ("host:port" of the prefill server) to
    the backend's address of that endpoint.

    The legacy status surface (`request_status`, `update_status`,
    `check_status`, `record_failure`, `failure_records`, `failure_lock`)
    lets backend code migrate one call at a time; see `_legacy_status`.
    `late_updates` counts legacy writes that were refused because their
    room was terminal or closed.
    """

    #: Read by SGLang's scheduler on abort; kvfsm's release gate replaces it.
    enable_deferred_decode_kv_release: ClassVar[bool] = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any = None,
        is_mla_backend: bool | None = False,
        *,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = False,
        reaper: bool = True,
        remember_closed: int = 65536,
        backend: Callable[[TransferManager], KVBackend] | None = None,
        peer_address: Callable[[str], str] | None = None,
    ) -> None:
        role = self._role_for(disaggregation_mode)
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.role = role
        if timeouts is None:
            timeouts = Timeouts(
                bootstrap=_timeout_from_env(BOOTSTRAP_TIMEOUT_ENV),
                waiting=_timeout_from_env(WAITING_TIMEOUT_ENV),
                transferring=None,
            )
        self.transfer_manager = TransferManager(role, timeouts=timeouts, clock=clock, strict=strict)
        self.fake_rooms = _FakeRooms(clock, reaper)
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.request_status = RequestStatusView(self)
        self.failure_records = FailureRecordsView(self)
        self.failure_lock = threading.Lock()
        self.late_updates = 0
        self._lock = threading.RLock()
        self._pending_failures: dict[RoomId, FailureReason] = {}
        self._closed: OrderedDict[RoomId, None] = OrderedDict()
        self._remember_closed = remember_closed
        self.orphans = _Orphanage(self.close_handle)
        #: The data-plane adapter (`kvfsm.backends`), built on this manager's rooms.
        self.backend: KVBackend | None = backend(self.transfer_manager) if backend is not None else None
        self._peer_address = peer_address
        if reaper:
            self.transfer_manager.start_reaper()

    @classmethod
    def _role_for(cls, disaggregation_mode: object) -> Role:
        role = _role_of(disaggregation_mode)
        if role is None:
            raise ConfigError(
                f"Unsupported DisaggregationMode: {cls.__name__} runs in prefill (sender) or decode "
                f"(receiver) mode; got {disaggregation_mode!r}"
            )
        return role

    def register_to_bootstrap(self) -> None:
        """Announce this prefill server to the bootstrap server (backends override)."""

    # -- rooms ------------------------------------------------------------------

    def open_room(self, bootstrap_room: RoomId) -> TransferHandle:
        """Open a room for a new request and return its handle.

        A room id still open in a terminal state belongs to a finished
        request nobody cleared; it is closed and reopened as a new
        generation (so the old request's late events cannot reach the new
        one). A room still in flight raises `kvfsm.DuplicateRoom`.
        """
        self.collect_orphans()
        with self._lock:
            return self._open_locked(bootstrap_room)

    def collect_orphans(self) -> int:
        """Close the rooms of senders/receivers garbage-collected without `clear()`; how many."""
        return self.orphans.close_all()

    def _open_locked(self, room: RoomId) -> TransferHandle:
        manager = self.transfer_manager
        try:
            handle = manager.open(room)
        except DuplicateRoom as duplicate:
            if duplicate.state not in TERMINAL:
                raise
            logger.debug("kvfsm room %r reopened: its previous request ended %s uncleared", room, duplicate.state.name)
            self._forget(manager.get(room))
            handle = manager.open(room)
        self._closed.pop(room, None)
        return handle

    def handle(self, bootstrap_room: RoomId) -> TransferHandle:
        """The open room's kvfsm handle, for backend code that emits events directly."""
        return self.transfer_manager.get(bootstrap_room)

    def close_room(self, bootstrap_room: RoomId) -> KVPoll | None:
        """Close the room (aborting it if still in flight); its final state, or None if not open."""
        with self._lock:
            handle = self._open_handle(bootstrap_room)
            return None if handle is None else self._forget(handle)

    def close_handle(self, handle: TransferHandle) -> None:
        """Close this generation of a room, if it is still open (idempotent)."""
        with self._lock:
            if not handle.closed:
                self._forget(handle)

    def _forget(self, handle: TransferHandle) -> KVPoll:
        try:
            handle.close()
        except UnknownRoom:  # closed by another thread meanwhile
            return handle.state
        room = handle.room
        self._pending_failures.pop(room, None)
        if isinstance(room, int):
            self.req_to_decode_prefix_len.pop(room, None)
        if self._remember_closed:
            self._closed[room] = None
            self._closed.move_to_end(room)
            if len(self._closed) > self._remember_closed:
                self._closed.popitem(last=False)
        return handle.state

    def _open_handle(self, room: RoomId) -> TransferHandle | None:
        try:
            return self.transfer_manager.get(room)
        except UnknownRoom:
            return None

    def open_rooms(self) -> list[RoomId]:
        return [handle.room for handle in self.transfer_manager]

    # -- the legacy status surface ------------------------------------------------

    def check_status(self, bootstrap_room: RoomId) -> KVPoll:
        """The room's status; `kvfsm.UnknownRoom` (a `KeyError`) naming why if not open."""
        self.collect_orphans()
        return self.transfer_manager.status(bootstrap_room)

    def update_status(self, bootstrap_room: RoomId, status: KVPoll | int) -> bool:
        """Apply an integer status write as lifecycle events; True if the room is now there.

        `Bootstrapping` (or any status) for a room never seen opens it, as
        SGLang's constructors do. A write for a room this manager closed is
        refused and counted (no resurrection); so is a write that would move
        a terminal room (no late `Success` over `Failed`). `Failed` becomes a
        `fail` event carrying the message of the last `record_failure`.
        """
        target = KVPoll(status)
        room = bootstrap_room
        self.collect_orphans()
        with self._lock:
            manager = self.transfer_manager
            if room not in manager:
                if target is KVPoll.Failed or (room in self._closed and target is not KVPoll.Bootstrapping):
                    if room in self._closed:
                        self.late_updates += 1
                        logger.debug("kvfsm update_status(%r, %s) ignored: the room was closed", room, target.name)
                    return False
                handle = self._open_locked(room)
            else:
                handle = manager.get(room)
            state = handle.state
            if state in TERMINAL and state is not target:
                self.late_updates += 1
                logger.debug("kvfsm update_status(%r, %s) ignored: the room is %s", room, target.name, state.name)
            if target is KVPoll.Failed:
                reason = self._pending_failures.pop(room, None) or FailureReason(
                    FailureKind.TRANSFER_ERROR, "update_status(Failed) with no recorded reason"
                )
                if state is not KVPoll.Failed:
                    handle.fail(reason)
                return handle.state is KVPoll.Failed
            return drive_to(handle, target)

    def record_failure(
        self,
        bootstrap_room: RoomId,
        failure_reason: str,
        kind: FailureKind = FailureKind.TRANSFER_ERROR,
        from_peer: bool = False,
    ) -> None:
        """Remember why the room is about to fail; the next `update_status(Failed)` carries it.

        `kind` and `from_peer` are kvfsm's additions (SGLang only has the
        message). Ignored for a room that is not open or already terminal:
        the first failure's reason stands, and nothing outlives the room.
        """
        reason = FailureReason(kind, str(failure_reason), from_peer=from_peer)
        with self._lock:
            handle = self._open_handle(bootstrap_room)
            if handle is None or handle.is_terminal:
                logger.debug(
                    "kvfsm record_failure(%r) ignored: the room is not open or already terminal", bootstrap_room
                )
                return
            self._pending_failures[bootstrap_room] = reason

    def failure_message(self, bootstrap_room: RoomId) -> str | None:
        """The failed room's reason as text (or the pending `record_failure` message)."""
        with self._lock:
            handle = self._open_handle(bootstrap_room)
            if handle is None:
                return None
            if handle.reason is not None:
                return handle.reason.message or str(handle.reason)
            pending = self._pending_failures.get(bootstrap_room)
            return pending.message if pending is not None else None

    # -- lifetime ---------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the reaper threads (this manager's and its fake rooms') and close the backend."""
        self.transfer_manager.stop_reaper()
        self.fake_rooms.stop()
        if self.backend is not None:
            self.backend.close()

    def peer_address(self, bootstrap_addr: str) -> str:
        """The backend address of the prefill endpoint SGLang names `bootstrap_addr`.

        Identity unless the manager was given a `peer_address` function
        (an in-process `LocalBackend` has addresses of its own).
        """
        if self._peer_address is not None:
            return self._peer_address(bootstrap_addr)
        return bootstrap_addr

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role.value} {self.transfer_manager!r}>"


class FakeKVManager(KVManager):
    """SGLang's `FakeKVManager`: any mode is accepted (its rooms are fake anyway)."""

    @classmethod
    def _role_for(cls, disaggregation_mode: object) -> Role:
        return _role_of(disaggregation_mode) or Role.SENDER


def _require_manager(mgr: object, endpoint: type) -> KVManager:
    if not isinstance(mgr, KVManager):
        raise TypeError(
            f"{endpoint.__name__} needs a kvfsm.compat.sglang.KVManager (its rooms live there); "
            f"got {type(mgr).__name__}. Fake{endpoint.__name__} works with any manager."
        )
    return mgr


def _synced_abort(override: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subclass's `abort` so the room is aborted before its body runs."""

    @functools.wraps(override)
    def abort(self: _Endpoint, *args: Any, **kwargs: Any) -> Any:
        self._abort_room()
        return override(self, *args, **kwargs)

    abort.__kvfsm_synced__ = True  # type: ignore[attr-defined]
    return abort


class _Endpoint:
    """What senders and receivers share: one room's handle and the scheduler-facing reads.

    Subclasses may override `abort` freely: `__init_subclass__` wraps the
    override so the machine's abort event fires first. The sync with the
    manager cannot be forgotten, because the status the scheduler polls is
    written by the machine and nowhere else.
    """

    kv_mgr: Any
    bootstrap_room: Any
    handle: TransferHandle
    _closed_reason: FailureReason | None
    _close_room: Callable[[TransferHandle], None]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        override = cls.__dict__.get("abort")
        if override is not None and not getattr(override, "__kvfsm_synced__", False):
            setattr(cls, "abort", _synced_abort(override))  # noqa: B010 - assigning a method is the point

    def _bind(self, handle: TransferHandle, orphans: _Orphanage) -> None:
        self.handle = handle
        self._closed_reason = None
        self._close_room = orphans.close
        # A request the scheduler drops without clear() must not pin its room.
        # (A finalizer keeps itself alive until it runs: no reference to hold.)
        finalizer = weakref.finalize(self, orphans.adopt, handle)
        finalizer.atexit = False

    # -- reads --------------------------------------------------------------------

    @property
    def conclude_state(self) -> KVPoll | None:
        """The final state once the room is terminal, else None (read-only, from the machine)."""
        state = self.handle.state
        return state if state in TERMINAL else None

    @conclude_state.setter
    def conclude_state(self, value: object) -> None:
        raise AttributeError(
            f"{type(self).__name__}.conclude_state is derived from the room's state machine and cannot be "
            f"assigned (got {value!r}); call abort() or emit an event on .handle instead"
        )

    @property
    def release_safe(self) -> bool:
        """Whether the server may free this request's KV pages now (kvfsm's release gate)."""
        return self.handle.release_safe

    def poll(self) -> KVPoll:
        """The room's state, after enforcing due deadlines. Never raises for a cleared room."""
        handle = self.handle
        if not handle.closed:
            try:
                return handle.poll()
            except UnknownRoom:  # cleared by another thread meanwhile
                pass
        return handle.state

    def get_transfer_metric(self) -> KVTransferMetric:
        handle = self.handle
        return KVTransferMetric(
            transfer_latency_s=handle.transfer_latency,
            transfer_total_bytes=handle.nbytes if handle.chunks else None,
        )

    def failure_exception(self) -> NoReturn:
        """Raise `KVTransferError` with the recorded reason.

        As in SGLang's Mooncake backend, a rank asked this while its own
        room had not failed (the all-reduce said another rank failed) fails
        its room now with a reason marked `from_peer`, and the error's
        `is_from_another_rank` is true.
        """
        handle = self.handle
        if not handle.is_terminal:
            handle.fail(FailureReason(FailureKind.PEER_FAILED, PROPAGATED_MESSAGE, from_peer=True))
        if handle.state is KVPoll.Failed:
            reason = handle.reason if not handle.closed else self._closed_reason
        else:
            reason = FailureReason(FailureKind.PEER_FAILED, PROPAGATED_MESSAGE, handle.state, from_peer=True)
        raise KVTransferError(self.bootstrap_room, reason)

    # -- writes ---------------------------------------------------------------------

    def abort(self) -> None:
        """Abort the transfer: when this returns, the manager's status is `Failed`."""
        self._abort_room()
        self.on_abort()

    def on_abort(self) -> None:
        """Backend side effects of an abort (tell the peer, ...); the room is already Failed."""

    def _through_backend(self, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Call the adapter for this room; a refusal that failed the room is not the scheduler's crash.

        SGLang's scheduler does not expect `send` or a constructor to raise.
        An adapter that rejects its input fails the room first (with a
        reason naming the problem), so the next `poll()` reports `Failed`
        and `failure_exception()` explains why; only an error that left the
        room live propagates.
        """
        try:
            call(self.handle, *args, **kwargs)
        except _errors.KVFSMError as error:
            if not self.handle.is_terminal:
                raise
            logger.warning("kvfsm room %r: the backend refused %s: %s", self.bootstrap_room, call.__name__, error)

    def _abort_room(self) -> None:
        handle = self.handle
        if not handle.is_terminal:
            handle.abort(ABORT_MESSAGE)

    def clear(self) -> None:
        """Close the room (aborting it if still in flight). `poll()` keeps returning its final state."""
        handle = self.handle
        if handle.closed:
            return
        if not handle.is_terminal:
            handle.abort(f"cleared while {handle.state.name}")
        self._closed_reason = handle.reason
        self._close_room(handle)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} room={self.bootstrap_room!r} {self.handle.state.name}>"


def _aux_slot(backend: KVBackend, aux_index: int | None) -> int | None:
    """SGLang always names a metadata slot; a backend with no aux region registered moves none."""
    pools = backend.pools
    if pools is None or pools.num_aux_slots == 0:
        return None
    return aux_index


class KVSender(_Endpoint):
    """SGLang's prefill-side sender for one request, on a kvfsm room.

    Backend subclasses implement `send_chunk` (and whatever makes the
    handshake happen) and report progress as events on `self.handle`
    (`bootstrapped`, `transfer_started`, `chunk_done`, `transfer_done`,
    `fail`), or, while migrating, through `kv_mgr.update_status`.
    """

    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int = 0,
        req_has_disagg_prefill_dp_rank: bool = False,
        **kwargs: Any,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_server_url = bootstrap_addr
        self.dest_tp_ranks = list(dest_tp_ranks or [])
        self.pp_rank = pp_rank
        self.req_has_disagg_prefill_dp_rank = bool(req_has_disagg_prefill_dp_rank)
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.curr_idx = 0
        self.last_chunk_sent = False
        self._open(mgr, bootstrap_room)

    def _open(self, mgr: Any, bootstrap_room: int) -> None:
        """Open and bind this request's room; the fake pair overrides it to use rooms of its own."""
        manager = _require_manager(mgr, KVSender)
        self._bind(manager.open_room(bootstrap_room), manager.orphans)
        if manager.backend is not None:
            self._through_backend(manager.backend.bootstrap, manager.peer_address(self.bootstrap_addr))

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The number of KV pages this request will send, and its metadata slot."""
        self.num_kv_indices = num_kv_indices
        self.aux_index = aux_index

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        token_position_offset: int = 0,
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Send one chunk of pages; the last one is the chunk that reaches `num_kv_indices`.

        The scheduler sends a zero-page last chunk even when the chunks
        before it already covered every page (`should_send_kv_chunk(0,
        True)`); the transfer was concluded by then, so it is a no-op.
        """
        count = len(kv_indices)
        if count == 0 and self.last_chunk_sent:
            return
        index_slice = slice(self.curr_idx, self.curr_idx + count)
        self.curr_idx += count
        is_last = self.num_kv_indices is not None and self.curr_idx >= self.num_kv_indices
        self.last_chunk_sent = self.last_chunk_sent or is_last
        self.send_chunk(kv_indices, index_slice, is_last, state_indices)

    def send_chunk(self, kv_indices: Any, index_slice: slice, is_last: bool, state_indices: list[Any] | None) -> None:
        """Move one chunk through the manager's backend (or a subclass's own code)."""
        backend = getattr(self.kv_mgr, "backend", None)
        if backend is not None:
            aux_index = _aux_slot(backend, self.aux_index) if is_last else None
            self._through_backend(backend.send, kv_indices, last=is_last, aux_index=aux_index)
            return
        raise NotImplementedError(
            f"{type(self).__name__}.send_chunk: give the KVManager a backend or implement send_chunk "
            f"(room {self.bootstrap_room!r}, pages {index_slice.start}..{index_slice.stop}, last={is_last})"
        )

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A zero-page last chunk is still sent: it is what concludes the transfer."""
        return num_pages > 0 or last_chunk

    def pop_decode_prefix_len(self) -> int:
        prefix_lengths = getattr(self.kv_mgr, "req_to_decode_prefix_len", None)
        if prefix_lengths is None:
            return 0
        return int(prefix_lengths.pop(self.bootstrap_room, 0))


class KVReceiver(_Endpoint):
    """SGLang's decode-side receiver for one request, on a kvfsm room.

    Backend subclasses implement `init` (resolve the prefill peer, then
    `self.handle.bootstrapped()`) and `send_metadata`, and report progress
    as events on `self.handle` (or, while migrating, `kv_mgr.update_status`).
    `abort()` aborts the room first and then calls `on_abort()`, where a
    backend tells the prefill side (`abort_notified`).
    """

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None, **kwargs: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.prefill_dp_rank: int | None = None
        self._open(mgr, bootstrap_room)

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        manager = _require_manager(mgr, KVReceiver)
        if bootstrap_room is None:
            raise TypeError("KVReceiver needs a bootstrap_room (only FakeKVReceiver may have none)")
        self._bind(manager.open_room(bootstrap_room), manager.orphans)

    def init(self, prefill_dp_rank: int) -> None:
        """Start the handshake with the prefill peer through the manager's backend, if any.

        Subclasses written as SGLang backends extend this and fire
        `self.handle.bootstrapped()` (or `kv_mgr.update_status`) when done.
        """
        self.prefill_dp_rank = prefill_dp_rank
        manager = self.kv_mgr
        if isinstance(manager, KVManager) and manager.backend is not None:
            self._through_backend(manager.backend.bootstrap, manager.peer_address(self.bootstrap_addr))

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Tell the prefill side where to write, through the manager's backend (or a subclass's code)."""
        backend = getattr(self.kv_mgr, "backend", None)
        if backend is not None:
            self._through_backend(backend.expect, kv_indices, _aux_slot(backend, aux_index))
            return
        raise NotImplementedError(
            f"{type(self).__name__}.send_metadata: give the KVManager a backend or implement send_metadata "
            f"(room {self.bootstrap_room!r})"
        )


class FakeKVSender(KVSender):
    """SGLang's warmup sender: no data moves, but the request is a kvfsm room.

    Poll for poll as SGLang's `FakeKVSender`: `WaitingForInput` until a
    `send()`, then `Success` on the next poll; `Failed` after `abort()`; and
    once `init()` was called, the waiting deadline
    (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) starts at the first
    poll after it. Its room leaves `Bootstrapping` at that poll (the fake
    has no handshake, so `poll()` reports the instantly finished handshake
    as `WaitingForInput` before), and moves through `Transferring` on
    `send()` and to `Success` on the next poll.
    """

    def _open(self, mgr: Any, bootstrap_room: int) -> None:
        """Set SGLang's fake attributes and open a fake room (the constructor is `KVSender`'s)."""
        self.has_sent = False
        self.inited = False
        # Per request, from the environment, as SGLang does: a fake sender is
        # often paired with a real backend's manager.
        self.waiting_timeout = _timeout_from_env(WAITING_TIMEOUT_ENV)
        fake_rooms = _fake_rooms_for(mgr)
        handle = fake_rooms.open(Role.SENDER, self.waiting_timeout, bootstrap_room)
        self._bind(handle, fake_rooms.orphans)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        self.inited = True

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        token_position_offset: int = 0,
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.has_sent = True
        self.curr_idx += len(kv_indices)
        handle = self.handle
        if handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        handle.chunk_done(0)

    def poll(self) -> KVPoll:
        state = super().poll()
        handle = self.handle
        if state is KVPoll.Bootstrapping:
            if self.inited and not handle.closed:
                # The first poll after init() starts the waiting deadline.
                handle.bootstrapped()
                return handle.state
            return KVPoll.WaitingForInput
        if state is KVPoll.Transferring:
            handle.transfer_done()
            return handle.state
        return state

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()


class FakeKVReceiver(KVReceiver):
    """SGLang's warmup receiver: no data moves, but the request is a kvfsm room.

    Poll for poll as SGLang's `FakeKVReceiver`: `Bootstrapping` until
    `init()`, then `WaitingForInput` (no deadline, by design: waiting for KV
    space is not a stalled transfer) until `send_metadata()` has also been
    called, then `Success`; `Failed` after `abort()`.
    """

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        """Set SGLang's fake attributes and open a fake room (the constructor is `KVReceiver`'s)."""
        self.bootstrap_done = False
        self.has_sent_metadata = False
        fake_rooms = _fake_rooms_for(mgr)
        handle = fake_rooms.open(Role.RECEIVER, None, bootstrap_room)
        self._bind(handle, fake_rooms.orphans)

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = prefill_dp_rank
        self.bootstrap_done = True
        handle = self.handle
        if handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()
        if self.has_sent_metadata and handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.has_sent_metadata = True
        handle = self.handle
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()

    def poll(self) -> KVPoll:
        state = super().poll()
        if state is KVPoll.Transferring:
            self.handle.transfer_done()
            return self.handle.state
        return state

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()
