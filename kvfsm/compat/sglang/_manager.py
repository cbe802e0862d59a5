"""`KVManager`: SGLang's per-process transfer manager, over one `kvfsm.TransferManager`.

SGLang's scheduler builds one manager per process (`get_kv_class(backend,
KVClassType.MANAGER)(kv_args, mode, server_args, is_mla_backend)`) and reads
flags and tables off it: whether decode defers the release of an aborted
request's pages, the prefill servers it knows (`prefill_info_table`,
`try_ensure_parallel_info`), whether the backend supports a runtime role
switch (`supports_role_switch`, `teardown`). This module answers all of
them, with SGLang 0.5.23's names and semantics, while every room lives on a
kvfsm manager: the legacy status surface (`request_status`,
`update_status`, ...) turns integer writes into lifecycle events
(`_legacy_status`), and the deferred-release questions
(`is_abort_release_safe`) are answered by kvfsm's release gate.

SGLang's `bootstrap_room` is any int its client chose, 2**64 and beyond
included; every method maps it with `kvfsm.compat._room_ids.fit_room_id`
(itself when it fits 64 bits, a string naming it when not), on both sides
of a transfer alike, so no constructor or hook raises on a client's id.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ..._errors import ConfigError, DuplicateRoom, UnknownRoom
from ..._lifecycle import KV_LIFECYCLE, Lifecycle, PhaseTimeouts
from ..._manager import TransferHandle, TransferManager
from ..._states import FailureKind, FailureReason, KVPoll, Role, RoomId
from .._room_ids import fit_room_id
from ._legacy_status import FailureRecordsView, RequestStatusView, drive_to
from ._rooms import FakeRooms, Orphanage
from ._types import (
    BOOTSTRAP_TIMEOUT_ENV,
    DEFERRED_RELEASE_ENV,
    WAITING_TIMEOUT_ENV,
    PrefillServerInfo,
    flag_from_env,
    role_of,
    timeout_from_env,
)

if TYPE_CHECKING:
    from ...backends.base import KVBackend

__all__ = ["KVManager"]

logger = logging.getLogger("kvfsm.compat.sglang")

#: Threads of the executor that re-runs retracted requests' prefill (SGLang's default is 16).
RECOMPUTE_WORKERS = 4


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
    the backend's address of that endpoint. `lifecycle` is the rooms'
    declared lifecycle (`kvfsm.lifecycles.STAGED_KV_LIFECYCLE` adds a
    staging phase that SGLang sees as WaitingForInput);
    `on_drain_deadline` what the drain deadline does to pages still
    waiting for proof ("quarantine", or the unsafe opt-in "release").

    The legacy status surface (`request_status`, `update_status`,
    `check_status`, `record_failure`, `failure_records`, `failure_lock`)
    lets backend code migrate one call at a time; see `_legacy_status`.
    `late_updates` counts legacy writes that were refused because their
    room was terminal or closed.

    What SGLang 0.5.23's scheduler reads besides (see the migration guide
    for the full list of call sites):

    * deferred release: `supports_deferred_decode_kv_release` is true with a
      backend (kvfsm's release gate tracks every backend's drain), and
      `enable_deferred_decode_kv_release` is that and SGLang's knob
      `SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE` (default on).
      `is_abort_release_safe(room, required_acks)` is the room's release
      gate, `clear_deferred_abort_state(room)` has nothing to forget.
    * prefill servers (decode): `prefill_info_table` maps a
      `bootstrap_addr` to its `PrefillServerInfo`, filled by
      `try_ensure_parallel_info(addr)` through `fetch_prefill_info` (a
      one-rank prefill at `peer_address(addr)` unless a backend knows
      better); `submit_prefill_recompute` re-runs a retracted request's
      prefill over HTTP on `_ensure_prefill_recompute_executor()`.
    * role switch: `supports_role_switch` and `teardown()`.
    * `supports_host_destination` (False: kvfsm moves device pages only),
      `should_verify_kv_checksum(addr)` (True), `is_dummy_cp_rank` (False).
    """

    #: Whether the backend can prove an aborted request's writes drained (instances with a backend: True).
    supports_deferred_decode_kv_release: bool = False
    #: Decode KV destinations in host memory are not supported.
    supports_host_destination: ClassVar[bool] = False
    #: `teardown()` releases every transfer resource, so SGLang may switch this instance's role.
    supports_role_switch: ClassVar[bool] = True
    #: kvfsm has no SGLang context-parallel dummy ranks.
    is_dummy_cp_rank: ClassVar[bool] = False
    #: SGLang's heterogeneous-TP staging buffer is not used.
    enable_staging: ClassVar[bool] = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any = None,
        is_mla_backend: bool | None = False,
        *,
        timeouts: PhaseTimeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = False,
        reaper: bool = True,
        remember_closed: int = 65536,
        backend: Callable[[TransferManager], KVBackend] | None = None,
        peer_address: Callable[[str], str] | None = None,
        lifecycle: Lifecycle = KV_LIFECYCLE,
        on_drain_deadline: str = "quarantine",
    ) -> None:
        role = self._role_for(disaggregation_mode)
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.role = role
        if timeouts is None:
            timeouts = lifecycle.Timeouts(
                **{
                    phase: timeout_from_env(env)
                    for phase, env in (("bootstrap", BOOTSTRAP_TIMEOUT_ENV), ("waiting", WAITING_TIMEOUT_ENV))
                    if phase in lifecycle.phases
                }
            )
        self.transfer_manager = TransferManager(
            role,
            lifecycle=lifecycle,
            timeouts=timeouts,
            clock=clock,
            strict=strict,
            on_drain_deadline=on_drain_deadline,
        )
        self.fake_rooms = FakeRooms(clock, reaper)
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.request_status = RequestStatusView(self)
        self.failure_records = FailureRecordsView(self)
        self.failure_lock = threading.Lock()
        self.late_updates = 0
        self._lock = threading.RLock()
        self._pending_failures: dict[RoomId, FailureReason] = {}
        self._closed: OrderedDict[RoomId, None] = OrderedDict()
        self._remember_closed = remember_closed
        self.orphans = Orphanage(self.close_handle)
        #: The data-plane adapter (`kvfsm.backends`), built on this manager's rooms.
        self.backend: KVBackend | None = backend(self.transfer_manager) if backend is not None else None
        self._peer_address = peer_address
        self.supports_deferred_decode_kv_release = self.backend is not None
        self.enable_deferred_decode_kv_release = (
            flag_from_env(DEFERRED_RELEASE_ENV, True) and self.supports_deferred_decode_kv_release
        )
        #: Decode: what is known of each prefill server, by SGLang's `bootstrap_addr`.
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        #: Prefill: SGLang's per-room transfer bookkeeping; kvfsm keeps it in the rooms (always empty).
        self.transfer_infos: dict[RoomId, Any] = {}
        self._recompute_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._recompute_lock = threading.Lock()
        if reaper:
            self.transfer_manager.start_reaper()

    @classmethod
    def _role_for(cls, disaggregation_mode: object) -> Role:
        role = role_of(disaggregation_mode)
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
        """Close the rooms of senders/receivers garbage-collected without `clear()`; how many.

        Fake (warmup) endpoints made with this manager count too: their
        rooms live on `fake_rooms`.
        """
        return self.orphans.close_all() + self.fake_rooms.orphans.close_all()

    def _open_locked(self, room: RoomId) -> TransferHandle:
        room = fit_room_id(room)
        manager = self.transfer_manager
        try:
            handle = manager.open(room)
        except DuplicateRoom as duplicate:
            if duplicate.state not in manager.lifecycle.terminal:
                raise
            logger.debug("kvfsm room %r reopened: its previous request ended %s uncleared", room, duplicate.state.name)
            self._forget(manager.get(room))
            handle = manager.open(room)
        self._closed.pop(room, None)
        return handle

    def handle(self, bootstrap_room: RoomId) -> TransferHandle:
        """The open room's kvfsm handle, for backend code that emits events directly."""
        return self.transfer_manager.get(fit_room_id(bootstrap_room))

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
            return self.transfer_manager.get(fit_room_id(room))
        except UnknownRoom:
            return None

    def open_rooms(self) -> list[RoomId]:
        return [handle.room for handle in self.transfer_manager]

    # -- the legacy status surface ------------------------------------------------

    def check_status(self, bootstrap_room: RoomId) -> KVPoll:
        """The room's status; `kvfsm.UnknownRoom` (a `KeyError`) naming why if not open."""
        self.collect_orphans()
        return self.transfer_manager.status(fit_room_id(bootstrap_room))

    def update_status(self, bootstrap_room: RoomId, status: KVPoll | int) -> bool:
        """Apply an integer status write as lifecycle events; True if the room is now there.

        `Bootstrapping` (or any status) for a room never seen opens it, as
        SGLang's constructors do. A write for a room this manager closed is
        refused and counted (no resurrection); so is a write that would move
        a terminal room (no late `Success` over `Failed`). `Failed` becomes a
        `fail` event carrying the message of the last `record_failure`.
        """
        target = KVPoll(status)
        room = fit_room_id(bootstrap_room)
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
            lifecycle = manager.lifecycle
            state = handle.state
            if state in lifecycle.terminal and lifecycle.reports[state] is not target:
                self.late_updates += 1
                logger.debug("kvfsm update_status(%r, %s) ignored: the room is %s", room, target.name, state.name)
            if target is KVPoll.Failed:
                reason = self._pending_failures.pop(room, None) or FailureReason(
                    FailureKind.TRANSFER_ERROR, "update_status(Failed) with no recorded reason"
                )
                if state is not lifecycle.failure:
                    handle.fail(reason)
                return handle.state is lifecycle.failure
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
            self._pending_failures[fit_room_id(bootstrap_room)] = reason

    def failure_message(self, bootstrap_room: RoomId) -> str | None:
        """The failed room's reason as text (or the pending `record_failure` message)."""
        with self._lock:
            handle = self._open_handle(bootstrap_room)
            if handle is None:
                return None
            if handle.reason is not None:
                return handle.reason.message or str(handle.reason)
            pending = self._pending_failures.get(fit_room_id(bootstrap_room))
            return pending.message if pending is not None else None

    # -- deferred release (decode) ---------------------------------------------

    def is_abort_release_safe(self, bootstrap_room: RoomId, required_acks: int = 0) -> bool:
        """Whether the pages of an aborted request may be reused: the room's release phase.

        SGLang counts ABORT_ACKs (`required_acks` of them); kvfsm's backends
        prove the drain to the room itself (after the prefill's ABORT_ACK,
        or when nothing was in flight, or a fence). Without proof by the
        drain deadline the pages are quarantined: never safe until a proof
        comes or an operator releases them (`transfer_manager.
        release_quarantined`). The answer is the same whatever order
        SGLang calls things in: a room cleared (`clear()`, or a dropped
        receiver) before its write drained still holds its pages. Only a
        room id no generation of which holds pages here is safe.
        """
        self.collect_orphans()
        return not self.transfer_manager.holds_pages(fit_room_id(bootstrap_room))

    def clear_deferred_abort_state(self, bootstrap_room: RoomId) -> None:
        """SGLang forgets the room's ACK tracker here; kvfsm's gate lives in the room (closed by `clear()`)."""

    # -- prefill servers (decode) -----------------------------------------------

    def fetch_prefill_info(self, bootstrap_addr: str) -> PrefillServerInfo | None:
        """What the prefill server at `bootstrap_addr` is, or None if it cannot be reached yet.

        The default is a one-rank prefill whose endpoint is
        `peer_address(bootstrap_addr)`; backends with a bootstrap server
        (the Mooncake trio) ask it.
        """
        return PrefillServerInfo(ranks=[self.peer_address(bootstrap_addr)])

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One non-blocking attempt to learn the prefill server's layout; True once it is known."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = self.fetch_prefill_info(bootstrap_addr)
        if info is None:
            return False
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The shared executor for prefill look-ups and rebootstrap calls (created on first use)."""
        with self._recompute_lock:
            if self._recompute_executor is None:
                self._recompute_executor = concurrent.futures.ThreadPoolExecutor(
                    RECOMPUTE_WORKERS, thread_name_prefix="kvfsm-sglang-recompute"
                )
            return self._recompute_executor

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """Ask the request's prefill server to recompute a retracted request's KV (`POST /generate`).

        As SGLang does: only the leader rank (engine rank 0, PP rank 0)
        posts; the URL is the `bootstrap_addr` host and the prefill's
        `prefill_http_port`; any failure fails the request's room, so the
        scheduler's normal failure path streams the abort.
        """
        if getattr(self.kv_args, "engine_rank", 0) or getattr(self.kv_args, "pp_rank", 0):
            return
        addr = str(getattr(kv_receiver, "bootstrap_addr", ""))
        info = self.prefill_info_table.get(addr)
        host = addr.rsplit(":", 1)[0]
        if info is None or info.prefill_http_port is None or not host:
            self._fail_recompute(
                kv_receiver,
                f"PD retract rebootstrap could not resolve the prefill /generate URL from bootstrap info of {addr!r}",
            )
            return
        url = f"http://{host}:{info.prefill_http_port}/generate"
        self._ensure_prefill_recompute_executor().submit(self._post_recompute, kv_receiver, url, payload)

    def _post_recompute(self, kv_receiver: Any, url: str, payload: dict[str, Any]) -> None:
        rid = payload.get("rid")
        request = urllib.request.Request(
            url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        timeout = getattr(self.transfer_manager.timeouts, "waiting", None) or 300.0
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                return
        except urllib.error.HTTPError as error:
            message = f"PD retract rebootstrap /generate failed for rid={rid} (status={error.code})"
        except (OSError, ValueError) as error:
            message = f"PD retract rebootstrap /generate request errored for rid={rid}: {error}"
        logger.error("kvfsm %s", message)
        self._fail_recompute(kv_receiver, message)

    @staticmethod
    def _fail_recompute(kv_receiver: Any, message: str) -> None:
        handle = getattr(kv_receiver, "handle", None)
        if isinstance(handle, TransferHandle):
            if not handle.closed and not handle.is_terminal:
                handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, message))
            return
        kv_receiver.abort()

    # -- what else the scheduler asks ---------------------------------------------

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """Whether the prefill's KV checksum covers the bytes this rank receives (always, here)."""
        return True

    def teardown(self) -> None:
        """Release every transfer resource for a runtime role switch (SGLang frees the KV pool itself).

        Rooms still in flight (SGLang only switches an idle instance, so
        normally none) are aborted first, so nothing waits on them.
        """
        reason = f"the {self.role.value} KV manager was torn down (PD role switch)"
        for handle in self.transfer_manager:
            if not handle.is_terminal and not handle.closed:
                handle.abort(reason)
        self.fake_rooms.fail_live(reason)
        self.shutdown()

    # -- lifetime ---------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the reaper threads (this manager's and its fake rooms') and close the backend."""
        self.transfer_manager.stop_reaper()
        self.fake_rooms.stop()
        with self._recompute_lock:
            executor, self._recompute_executor = self._recompute_executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
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
