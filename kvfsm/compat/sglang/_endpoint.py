"""`KVSender` and `KVReceiver`: one request's view of its kvfsm room.

SGLang's scheduler holds a sender per prefill request and a receiver per
decode request and asks them everything about the transfer: `poll()` (every
scheduler iteration, then MIN-all-reduced across ranks), `conclude_state`,
`failure_exception()`, `abort()`, `clear()`. Here each endpoint holds its
room's handle and answers from the machine:

* `poll()` reads the room (deadlines enforced); `conclude_state` is derived
  from it (None until terminal) and cannot be assigned; `abort()` is the
  machine's abort event, so when it returns the manager already says
  `Failed`. A subclass that overrides `abort` and forgets `super().abort()`
  still aborts the room: the override is wrapped at class creation.
* The room is the transfer's record; the endpoint is the request's view of
  it (DESIGN.md, "Compat semantics"), itself a small declared machine
  (`REQUEST_VIEW`, one `Table` like every other of kvfsm): it follows the
  room until the scheduler aborts a request whose transfer already
  reached Success (a decode HiCache restore still pending, say), or reads
  another rank's failure over it; from then on the endpoint answers
  `Failed` and `failure_exception()` says why, while the room stays
  `Success`: its bytes did land, its pages follow the release rules.
  `_step_view` is the one writer of the view.
* Decode's deferred release asks the receiver `abort_notified`,
  `ensure_abort_notified(force_arm=...)`, `bootstrap_infos` and
  `is_abort_release_safe()`; kvfsm's backends tell the prefill of every
  failed room themselves and open the room's release gate when its writes
  drained, so these read that gate.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from ... import _errors
from ..._errors import UnknownRoom
from ..._manager import TransferHandle
from ..._rows import Row, Table
from ..._states import FailureKind, FailureReason, KVPoll
from ._manager import KVManager
from ._rooms import Orphanage
from ._types import ABORT_MESSAGE, PROPAGATED_MESSAGE, KVTransferDestination, KVTransferError, KVTransferMetric

__all__ = ["KVSender", "KVReceiver", "RequestView", "REQUEST_VIEW"]

logger = logging.getLogger("kvfsm.compat.sglang")


class RequestView(str, enum.Enum):
    """Where a request stands over its room: following it, or concluded Failed over its Success."""

    FOLLOWS_ROOM = "follows_room"
    FAILED_OVER_SUCCESS = "failed_over_success"


_V = RequestView
REQUEST_VIEW = Table(
    "sglang-request",
    RequestView,
    (
        Row(
            "aborted_after_success",
            (_V.FOLLOWS_ROOM,),
            _V.FAILED_OVER_SUCCESS,
            (),
            "the scheduler aborted the request after its room reached Success: the request answers Failed",
        ),
        Row(
            "peer_failed_after_success",
            (_V.FOLLOWS_ROOM,),
            _V.FAILED_OVER_SUCCESS,
            (),
            "failure_exception() after another rank failed, over this rank's Success: the request answers Failed",
        ),
    ),
    "An SGLang request's view of its room: the room is the transfer's record, the view what poll() answers.",
)


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
        try:
            return override(self, *args, **kwargs)
        finally:
            self._after_abort()

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
    #: The request's view of its room (`REQUEST_VIEW`), and why it concluded Failed over a Success.
    _view: RequestView
    _view_reason: FailureReason | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        override = cls.__dict__.get("abort")
        if override is not None and not getattr(override, "__kvfsm_synced__", False):
            setattr(cls, "abort", _synced_abort(override))  # noqa: B010 - assigning a method is the point

    def _bind(self, handle: TransferHandle, orphans: Orphanage) -> None:
        self.handle = handle
        self._closed_reason = None
        self._view = RequestView.FOLLOWS_ROOM
        self._view_reason = None
        self._close_room = orphans.close
        # A request the scheduler drops without clear() must not pin its room.
        # (A finalizer keeps itself alive until it runs: no reference to hold.)
        finalizer = weakref.finalize(self, orphans.adopt, handle)
        finalizer.atexit = False

    def _step_view(self, input: str, reason: FailureReason) -> None:
        """Step the request's view by `input` (a row of `REQUEST_VIEW`); the view's one writer.

        Only over a room in a success state: a room that failed is the
        request's answer already. A second step is refused by the table
        (the first reason stands).
        """
        handle = self.handle
        if handle.state not in handle.lifecycle.successes:
            return
        allowed, dest = REQUEST_VIEW.step(self._view, input)
        if allowed:
            assert isinstance(dest, RequestView)
            self._view = dest
            self._view_reason = reason

    # -- reads --------------------------------------------------------------------

    @property
    def conclude_state(self) -> KVPoll | None:
        """The final state once the request concluded, else None (read-only, from the machines)."""
        if self._view is RequestView.FAILED_OVER_SUCCESS:
            return KVPoll.Failed
        handle = self.handle
        return handle.status if handle.is_terminal else None

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
        """What the request reports (the room's `KVPoll`), after enforcing due deadlines. Never raises for a cleared room."""
        if self._view is RequestView.FAILED_OVER_SUCCESS:
            return KVPoll.Failed
        handle = self.handle
        if not handle.closed:
            with contextlib.suppress(UnknownRoom):  # cleared by another thread meanwhile
                handle.poll()  # enforces due deadlines
        return handle.status

    def poll_pp_consensus(self) -> KVPoll:
        """SGLang's poll for pipeline-parallel prefill: each PP rank's room is its own, so `poll()`."""
        return self.poll()

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
        `is_from_another_rank` is true; if its room had already succeeded,
        the room keeps its Success and this request answers Failed from now
        on, as after an abort (which it reports, if that is what happened).
        """
        handle = self.handle
        if not handle.is_terminal:
            handle.fail(FailureReason(FailureKind.PEER_FAILED, PROPAGATED_MESSAGE, from_peer=True))
        if self._view is RequestView.FAILED_OVER_SUCCESS:
            reason: FailureReason | None = self._view_reason
        elif handle.state is handle.lifecycle.failure:
            reason = handle.reason if not handle.closed else self._closed_reason
        else:
            reason = FailureReason(FailureKind.PEER_FAILED, PROPAGATED_MESSAGE, handle.state, from_peer=True)
            self._step_view("peer_failed_after_success", reason)
        self._after_failure_exception()
        raise KVTransferError(self.bootstrap_room, reason, self.failure_text(reason))

    def failure_text(self, reason: FailureReason | None) -> str | None:
        """The text SGLang's backend would give for `reason` (None: kvfsm's own wording)."""
        return None

    def _after_failure_exception(self) -> None:
        """What happens to the room once the scheduler has read its failure (subclasses decide)."""

    # -- writes ---------------------------------------------------------------------

    def abort(self) -> None:
        """Abort the transfer: when this returns, the manager's status is `Failed`.

        On a room that already reached Success, the room stays Success and
        this request's `poll()` answers `Failed` from now on.
        """
        self._abort_room()
        self.on_abort()
        self._after_abort()

    def on_abort(self) -> None:
        """Backend side effects of an abort (tell the peer, ...); the room is already Failed."""

    def _after_abort(self) -> None:
        """Bookkeeping after any abort, even one a subclass overrode without `super()`."""

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
        self._step_view("aborted_after_success", FailureReason(FailureKind.ABORTED, ABORT_MESSAGE, handle.state))

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
        reason = self.handle.reason
        why = f": {reason}" if reason is not None else ""
        return f"<{type(self).__name__} room={self.bootstrap_room!r} {self.handle.state.name}{why}>"


def _aux_slot(backend: Any, aux_index: int | None) -> int | None:
    """SGLang always names a metadata slot; a backend with no aux region registered moves none."""
    pools = backend.pools
    if pools is None or pools.num_aux_slots == 0:
        return None
    return aux_index


class KVSender(_Endpoint):
    """SGLang's prefill-side sender for one request, on a kvfsm room.

    Constructed as SGLang 0.5.23's scheduler does: `KVSender(mgr,
    bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)`.
    Older SGLang releases passed `dest_tp_ranks` and `pp_rank` positionally
    after the room; that form is still accepted.

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
        req_has_disagg_prefill_dp_rank: Any = False,
        *legacy: Any,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int = 0,
        **kwargs: Any,
    ) -> None:
        if isinstance(req_has_disagg_prefill_dp_rank, (list, tuple)):
            # (mgr, addr, room, dest_tp_ranks, pp_rank[, req_has_disagg_prefill_dp_rank]) of older SGLang.
            dest_tp_ranks = list(req_has_disagg_prefill_dp_rank)
            pp_rank = legacy[0] if legacy else pp_rank
            req_has_disagg_prefill_dp_rank = legacy[1] if len(legacy) > 1 else False
        elif legacy:
            raise TypeError(
                f"{type(self).__name__}() takes (mgr, bootstrap_addr, bootstrap_room, "
                f"req_has_disagg_prefill_dp_rank); got {len(legacy)} more positional arguments"
            )
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
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Send one chunk of pages; the last one is the chunk that reaches `num_kv_indices`.

        The scheduler sends a zero-page last chunk even when the chunks
        before it already covered every page (`should_send_kv_chunk(0,
        True)`); the transfer was concluded by then, so it is a no-op.
        (`kwargs` takes what other SGLang versions pass: `token_position_offset`,
        `indices_event`.)
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

    def get_max_transfer_tokens(self) -> int | None:
        """No limit on the tokens of one `send()` (SGLang's DCP pack buffer has one; kvfsm has none)."""
        return None

    def mark_prefill_complete(self) -> None:
        """SGLang's `prefill_complete` decode allocation policy, which kvfsm does not implement.

        Raises `NotImplementedError`, as SGLang's base class does; run both
        roles with `--disaggregation-decode-allocation-policy early` (the
        default). The fake sender accepts it (a warmup request has no peer).
        """
        raise NotImplementedError(
            f"{type(self).__name__} (room {self.bootstrap_room!r}): the 'prefill_complete' decode allocation "
            "policy is not supported by kvfsm; use --disaggregation-decode-allocation-policy early"
        )

    def pop_decode_prefix_len(self) -> int:
        prefix_lengths = getattr(self.kv_mgr, "req_to_decode_prefix_len", None)
        if prefix_lengths is None:
            return 0
        return int(prefix_lengths.pop(self.bootstrap_room, 0))

    def _after_failure_exception(self) -> None:
        # SGLang's prefill never clears a failed sender itself: reading the
        # failure is where its room ends (as in SGLang's CommonKVSender).
        self.clear()


class KVReceiver(_Endpoint):
    """SGLang's decode-side receiver for one request, on a kvfsm room.

    Backend subclasses implement `init` (resolve the prefill peer, then
    `self.handle.bootstrapped()`) and `send_metadata`, and report progress
    as events on `self.handle` (or, while migrating, `kv_mgr.update_status`).
    `abort()` aborts the room first and then calls `on_abort()`, where a
    backend written as SGLang subclasses tells the prefill side.

    `bootstrap_infos` lists the prefill ranks that may write into this
    request's pages (one dict per rank: `{"peer": address}`), empty until
    `init()` found the prefill; `abort_notified` turns true once such a
    rank has been told (kvfsm's backends tell it of every failed room) and
    the release gate tracks its drain.
    """

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None, **kwargs: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.prefill_dp_rank: int | None = None
        self.bootstrap_infos: list[dict[str, Any]] = []
        self._open(mgr, bootstrap_room)

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        manager = _require_manager(mgr, KVReceiver)
        if bootstrap_room is None:
            raise TypeError("KVReceiver needs a bootstrap_room (only FakeKVReceiver may have none)")
        self._bind(manager.open_room(bootstrap_room), manager.orphans)

    @property
    def supports_host_destination(self) -> bool:
        """kvfsm receives into device pages only (SGLang's `--disaggregation-decode-host-receive-threshold`)."""
        return False

    def is_abort_release_safe(self) -> bool:
        """Whether every write into this request's pages has drained: the room's release gate."""
        return self.release_safe

    def init(self, prefill_dp_rank: int) -> None:
        """Start the handshake with the prefill peer through the manager's backend, if any.

        The peer is the first rank SGLang's `prefill_info_table` lists for
        `bootstrap_addr` (learned now if it was not yet). Subclasses written
        as SGLang backends extend this and fire `self.handle.bootstrapped()`
        (or `kv_mgr.update_status`) when done.
        """
        self.prefill_dp_rank = prefill_dp_rank
        manager = self.kv_mgr
        if not isinstance(manager, KVManager) or manager.backend is None:
            return
        peer = self._prefill_peer(manager)
        if peer is None:
            if not self.handle.is_terminal:
                self.handle.fail(
                    FailureReason(
                        FailureKind.BOOTSTRAP_ERROR,
                        f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}",
                    )
                )
            return
        self.bootstrap_infos = [{"peer": peer, "prefill_dp_rank": prefill_dp_rank}]
        self._through_backend(manager.backend.bootstrap, peer)

    def _prefill_peer(self, manager: KVManager) -> str | None:
        if not manager.try_ensure_parallel_info(self.bootstrap_addr):
            return None
        info = manager.prefill_info_table.get(self.bootstrap_addr)
        if info is None or not info.ranks:
            return None
        return info.ranks[0]

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination | str = KVTransferDestination.DEVICE,
        **kwargs: Any,
    ) -> None:
        """Tell the prefill side where to write, through the manager's backend (or a subclass's code)."""
        if destination not in (KVTransferDestination.DEVICE, KVTransferDestination.DEVICE.value):
            raise NotImplementedError(
                f"{type(self).__name__} (room {self.bootstrap_room!r}): host KV destinations are not supported"
            )
        backend = getattr(self.kv_mgr, "backend", None)
        if backend is not None:
            self._through_backend(backend.expect, kv_indices, _aux_slot(backend, aux_index))
            return
        raise NotImplementedError(
            f"{type(self).__name__}.send_metadata: give the KVManager a backend or implement send_metadata "
            f"(room {self.bootstrap_room!r})"
        )

    def _after_abort(self) -> None:
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Make sure the prefill ranks holding this request's pages learn it ended (SGLang: once).

        kvfsm's backends send the ABORT for every failed room themselves and
        track its drain in the room's release gate, so this only records
        that a peer was involved: `abort_notified` becomes true when some
        prefill rank was given this request (`bootstrap_infos`), and stays
        false otherwise (nothing to notify: the pages are free at once).
        `force_arm` (SGLang's partial-publish case) changes nothing here:
        the gate covers every rank that was told where to write.
        """
        if not self.abort_notified and self.bootstrap_infos:
            self.abort_notified = True
