"""The scheduler half: the requests whose KV blocks the connector holds, as kvfsm rooms.

vLLM's scheduler frees a request's blocks when the connector says so:
`request_finished` returning True on a prefill ("I hold them until
`finished_sending`"), and, on a decode, a request parked in
`WAITING_FOR_REMOTE_KVS` until `finished_recving`. vLLM keeps that
promise in a handful of sets and dicts (`_reqs_need_recv`,
`_reqs_need_send`, `_reqs_in_batch`, `_reqs_not_processed`, ...), and its
scheduler asserts that every notice names a request it still holds (a late
`finished_sending` for a freed request crashed the engine: PR #25067).

Here each such request is one room of a `TransferManager`, keyed by the
vLLM request id, one manager per side (the prefill's held requests, the
decode's loads). Request ids come from vLLM's clients, of any length: an
id that is no room id is mapped to one (`kvfsm.compat._room_ids`), and
should two live ids map to one room each still gets a room of its own
(these rooms never leave the process), so no hook raises on an id:

    Bootstrapping     held or parked; the worker has not been told yet
    WaitingForInput   `build_connector_meta` handed it to the workers
    Success           the workers' notice came: sent (prefill) or loaded (decode)
    Failed            the decode request finished first (abort: the workers are
                      told) or its load failed

A notice closes the room. A second notice for it, one for a request
that never had a room, or one from before the hand-off (no worker knew of
the request yet, so it cannot be a genuine report) is dropped from the
output before vLLM's scheduler sees it, counted (`stats.absorbed_notices`)
and logged, never raised. The decode's abort goes through the machine
(`handle.abort`), so a notice arriving after it is a late event that cannot
turn the room back into a success.

Block ids are kept per KV cache group (`_params.Blocks`). A hybrid KV
cache's groups are clipped to what a transfer moves, as vLLM's
NixlConnector clips them (`GroupShape`): a sliding-window group keeps its
in-window tail, a Mamba group its one state-bearing block. A request from
a prefill of another tensor-parallel size that this engine's workers
cannot slice or merge (`_tp_problem`) is computed locally, and the prefill
is told at once to free its blocks (counted in `stats.refused_tp`): its
blocks are never left to a deadline. A decode's lease renewals carry its
TP size; a prefill of a smaller one then holds each request's heads in
slices, one per decode rank it serves (`StepPlan.slices`).

A prefill's hold is also a lease (`_leases`): the decode's half renews it
for each request it intends to load, the prefill's half expires the
leases nobody renewed, on a manager's deadlines, once per step, and tells
the workers to free those holds (`StepPlan.expire`) unless a decode
already claimed them.

Nothing here waits: the deadlines that bound how long blocks stay held run
on the workers' rooms (`_worker.py`), where the bytes move, and on the
lease book. This module
imports neither vLLM nor torch; `_connector.py` feeds it plain values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import attrs

from ..._errors import ConfigError, DuplicateRoom, UnknownRoom
from ..._lifecycle import Timeouts
from ..._manager import TransferHandle, TransferManager
from ..._states import FailureKind, FailureReason, KVPoll, Role, RoomId
from .._room_ids import fit_text
from ._config import ConnectorConfig
from ._leases import LeaseBook, LeaseRenewer, Renewals, renew_all
from ._params import Blocks, RemoteSource, as_groups, parse_source, prefill_params, room_id
from ._stats import TransferStats

__all__ = ["AbortSpec", "GroupShape", "RecvSpec", "SchedulerHalf", "SchedulerStats", "SendSpec", "StepPlan"]

logger = logging.getLogger("kvfsm.compat.vllm")

#: Scheduler rooms never time out: only the workers know whether bytes may still land.
_NO_DEADLINES = Timeouts(bootstrap=None, waiting=None, transferring=None, drain=None)


@attrs.frozen(slots=True)
class GroupShape:
    """Which of a KV cache group's blocks a transfer moves.

    `kind` "full": every block; "window": a sliding-window group, its last
    `keep` blocks (the window, plus one for a window that is not aligned
    with the blocks); "state": a Mamba group, its one state-bearing block
    (`keep`: the speculative scratch blocks after it, dropped).
    """

    kind: str = "full"
    keep: int = 0

    def clip(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        if not blocks:
            return blocks
        if self.kind == "window" and self.keep:
            return blocks[-self.keep :]
        if self.kind == "state":
            scratch = min(self.keep, len(blocks) - 1)
            return (blocks[: len(blocks) - scratch])[-1:]
        return blocks


FULL = (GroupShape(),)


def _clip(shapes: tuple[GroupShape, ...], blocks: Blocks) -> Blocks:
    if len(blocks) != len(shapes):
        return blocks
    return tuple(shape.clip(group) for shape, group in zip(shapes, blocks, strict=True))


@attrs.frozen(slots=True)
class RecvSpec:
    """Decode worker: load `blocks` (per KV cache group) from `source`, or only tell it to free (`release_only`).

    `problem` set: the request cannot load (bad params); the worker fails it at once.
    """

    request_id: str
    room: str
    source: RemoteSource | None
    blocks: Blocks = attrs.field(converter=as_groups)
    problem: str | None = None
    release_only: bool = False


@attrs.frozen(slots=True)
class SendSpec:
    """Prefill worker: hold `blocks` (per KV cache group) for the decode that will claim `room`."""

    request_id: str
    room: str
    blocks: Blocks = attrs.field(converter=as_groups)


@attrs.frozen(slots=True)
class AbortSpec:
    """Decode worker: the request finished before its KV arrived; give the load up."""

    request_id: str
    reason: str


@attrs.define(slots=True)
class StepPlan:
    """What the workers must start this step (the connector metadata's payload)."""

    recv: list[RecvSpec] = attrs.Factory(list)
    send: list[SendSpec] = attrs.Factory(list)
    abort: list[AbortSpec] = attrs.Factory(list)
    #: Prefill: held requests whose lease expired (free them unless a decode claimed them).
    expire: list[str] = attrs.Factory(list)
    #: Prefill: (request, k): a decode of k times this TP size loads it; hold its heads in k slices.
    slices: list[tuple[str, int]] = attrs.Factory(list)

    def __bool__(self) -> bool:
        return bool(self.recv or self.send or self.abort or self.expire or self.slices)


@attrs.define(slots=True)
class SchedulerStats:
    """Counters of the scheduler half since it started."""

    holds: int = 0
    loads: int = 0
    releases: int = 0
    aborted_loads: int = 0
    #: Loads the workers said failed and wait for proof of drain (no longer counted as running).
    stopped_loads: int = 0
    deferred_lookups: int = 0
    invalid_params: int = 0
    absorbed_notices: int = 0
    #: Loads from a prefill of another TP size these workers cannot map: computed locally, prefill told.
    refused_tp: int = 0
    #: Prefill holds whose lease expired (no renewal from their decode).
    expired_leases: int = 0


@attrs.define(slots=True, eq=False)
class _Load:
    handle: TransferHandle
    room: str
    blocks: frozenset[int]


class SchedulerHalf:
    """The scheduler side of the connector, fed plain values by the vLLM facade."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        tp_size: int,
        port: int | None = None,
        groups: tuple[GroupShape, ...] = FULL,
        unequal_tp: str | None = "this connector maps prefill and decode ranks one to one",
        prefill_backoff: int = 0,
        renewals: Renewals | None = None,
        clock: Callable[[], float] = time.monotonic,
        total_kv_heads: int | None = None,
    ) -> None:
        """`port`: what the prefill's params name (this DP rank's first port; default `config.port`).
        `groups`: one `GroupShape` per KV cache group. `unequal_tp`: why a prefill of
        another TP size cannot be loaded from, or None when the workers merge heads
        (from a prefill of a whole multiple of this TP size, `total_kv_heads` KV
        heads in all, none replicated).
        `prefill_backoff`: trailing prompt tokens a decode recomputes itself (Mamba's
        last state, as NIXL's `_prefill_backoff`), so they are not loaded. `renewals`:
        what carries leases (`_leases.LeaseChannel`); None, or `config.lease_duration`
        null: no leases (holds last `hold_timeout`). `clock`: the leases' clock."""
        self.config = config
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.port = config.port if port is None else port
        self.groups = groups
        self.unequal_tp = unequal_tp
        self.total_kv_heads = total_kv_heads
        self.prefill_backoff = prefill_backoff
        lease = config.lease_duration if renewals is not None else None
        self.renewals = renewals
        self.leases = LeaseBook(lease, clock) if lease is not None else None
        self.renewer = (
            LeaseRenewer(lease, clock, renewals, tp_size) if lease is not None and renewals is not None else None
        )
        #: Held requests already sliced for a decode of a larger TP size.
        self._sliced: set[str] = set()
        self._listening: bool | None = None
        self.prefill = TransferManager(Role.SENDER, timeouts=_NO_DEADLINES)
        self.decode = TransferManager(Role.RECEIVER, timeouts=_NO_DEADLINES)
        self.stats = SchedulerStats()
        #: What vLLM's metrics get from this half (`report`).
        self.transfer_stats = TransferStats()
        self._held: dict[str, TransferHandle] = {}
        self._loads: dict[str, _Load] = {}
        # Transfer rooms of the loads still open: a second load of the same prefill request waits.
        self._sources: set[str] = set()
        self._plan = StepPlan()
        # Rooms planned this step: handed to the workers by the next `build`.
        self._handoff: list[TransferHandle] = []
        # The request id each open scheduler room belongs to (an id mapped onto a taken room gets another).
        self._owners: dict[RoomId, str] = {}

    def _open(self, manager: TransferManager, request_id: str) -> TransferHandle | None:
        """A room for `request_id`; None when the request has one open already (vLLM called twice)."""
        room: RoomId = fit_text(request_id)
        salt = 0
        while True:
            try:
                handle = manager.open(room)
            except DuplicateRoom:
                if self._owners.get(room) == request_id:
                    return None
                # Another live request's id maps here too: these rooms stay in this process, so this
                # one simply takes a room of its own.
                salt += 1
                room = fit_text(f"~{salt}~{request_id}")
                continue
            self._owners[room] = request_id
            return handle

    def _close(self, manager: TransferManager, handle: TransferHandle) -> None:
        self._owners.pop(handle.room, None)
        manager.close(handle.room)

    # -- decode: matching and allocation ---------------------------------------------------

    def new_request(self, request_id: str, params: Mapping[str, Any] | None) -> None:
        """`on_new_request`: a request this decode intends to load starts renewing its prefill's lease."""
        if self.renewer is None or not params or not params.get("do_remote_prefill"):
            return
        source = parse_source(params, groups=len(self.groups))
        if isinstance(source, RemoteSource):
            self.renewer.intend(
                request_id, source.host, source.port + source.tp_size, source.engine_id, source.request_id
            )

    def _stop_renewing(self, request_id: str) -> None:
        if self.renewer is not None:
            self.renewer.drop(request_id)

    def matched_tokens(
        self, params: Mapping[str, Any] | None, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """`get_num_new_matched_tokens`: the prompt tokens to load from the prefill, loaded async.

        Side-effect free apart from a counter. `None` asks vLLM to ask again
        later: an earlier load of the same prefill request is still open, or
        `max_inflight_loads` loads are running.
        """
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        source = parse_source(params, groups=len(self.groups))
        if isinstance(source, str) or self._tp_problem(source) is not None:
            return 0, False
        loadable = num_prompt_tokens
        if self.prefill_backoff and num_prompt_tokens > self.prefill_backoff:
            loadable -= self.prefill_backoff
        count = loadable - num_computed_tokens
        if count <= 0:
            return 0, False
        limit = self.config.max_inflight_loads
        if source.room in self._sources or (limit is not None and self._running_loads() >= limit):
            self.stats.deferred_lookups += 1
            return None, False
        return count, True

    def _running_loads(self) -> int:
        """Loads that may still transfer: a failed one whose blocks wait for proof of drain is not.

        Read from the decode table's live counts (its every open room is a
        load), so it costs the same with thousands of quarantined loads.
        """
        counts = self.decode.counts()
        return len(self.decode) - counts[KVPoll.Success] - counts[KVPoll.Failed]

    def _tp_problem(self, source: RemoteSource) -> str | None:
        remote, local = source.tp_size, self.tp_size
        if remote == local:
            return None
        why = self.unequal_tp
        if why is None and remote < local:
            if local % remote:
                why = "a prefill rank's heads are split over a whole number of decode ranks"
            elif self.renewer is None:
                why = (
                    "a prefill rank splits its heads for a decode of a larger TP size once the decode's "
                    "lease renewals announce it, and leases are off here"
                )
            elif self.total_kv_heads is not None and self.total_kv_heads < local:
                why = f"the model's {self.total_kv_heads} KV heads are replicated over {local} decode ranks"
        elif why is None and remote % local:
            why = "a decode merges the heads of a whole number of prefill ranks"
        elif why is None and self.total_kv_heads is not None and self.total_kv_heads < remote:
            why = f"the model's {self.total_kv_heads} KV heads are replicated over {remote} prefill ranks"
        if why is None:
            return None
        return f"the prefill runs tensor parallel size {remote} and this decode {local}: {why}"

    def after_alloc(
        self,
        request_id: str,
        params: MutableMapping[str, Any] | None,
        unhashed_blocks: Sequence[int] | Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """`update_state_after_alloc`: park the load (or tell the prefill its blocks are not needed).

        `unhashed_blocks`: the blocks vLLM allocated for the load, per KV
        cache group (or one flat list). Only the first call for a request
        acts (vLLM may call twice); it flips `do_remote_prefill` off in the
        request's params, as NIXL does.
        """
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            self._stop_renewing(request_id)  # nothing to load: the prefill is told to free its blocks
        blocks = _clip(self.groups, as_groups(unhashed_blocks))
        source = parse_source(params, groups=len(self.groups))
        if isinstance(source, RemoteSource) and (problem := self._tp_problem(source)) is not None:
            self.stats.refused_tp += 1
            self.transfer_stats.count("refused_tp")
            logger.warning(
                "kvfsm: request %s: %s; computing it locally, the prefill frees its blocks now", request_id, problem
            )
            self._release(request_id, source)
            return
        if isinstance(source, str):
            self.stats.invalid_params += 1
            logger.warning("kvfsm: request %s: unusable kv_transfer_params, not loading: %s", request_id, source)
            if num_external_tokens > 0:
                # vLLM parked it for a load anyway: the load must still end (failed), or it waits forever.
                self._park(request_id, f"!{request_id}", None, blocks, problem=source)
            return
        if num_external_tokens <= 0:
            self._release(request_id, source)
            return
        problem = None
        if source.room in self._sources:
            problem = f"room {source.room!r} is already being loaded by another request of this decode"
        self._park(request_id, source.room, source, blocks, problem=problem)

    def _park(
        self,
        request_id: str,
        room: str,
        source: RemoteSource | None,
        blocks: Blocks,
        *,
        problem: str | None,
    ) -> None:
        handle = self._open(self.decode, request_id)
        if handle is None:
            logger.error("kvfsm: request %s is already loading; vLLM parked it twice", request_id)
            return
        self.stats.loads += 1
        self._loads[request_id] = _Load(handle, room, frozenset(b for group in blocks for b in group))
        self._handoff.append(handle)
        if problem is None:
            self._sources.add(room)
        self._plan.recv.append(RecvSpec(request_id, room, source, blocks, problem=problem))

    def _release(self, request_id: str, source: RemoteSource) -> None:
        if any(source.block_ids):
            self.stats.releases += 1
            self._plan.recv.append(RecvSpec(request_id, source.room, source, (), release_only=True))

    # -- both: a request finished ------------------------------------------------------------

    def request_finished(
        self,
        request_id: str,
        params: MutableMapping[str, Any] | None,
        *,
        finished_ok: bool,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished`: (hold the blocks?, params for the decode). `block_ids` per group, or flat."""
        if not params:
            return False, None
        if params.get("do_remote_decode"):
            return self._prefill_finished(request_id, finished_ok, _clip(self.groups, as_groups(block_ids)))
        self._decode_finished(request_id, params)
        return False, None

    def _prefill_finished(
        self, request_id: str, finished_ok: bool, block_ids: Blocks
    ) -> tuple[bool, dict[str, Any] | None]:
        if not finished_ok:
            # Aborted or failed: no decode will come for it, vLLM frees the blocks now.
            return False, None
        room = room_id(self.engine_id, request_id)
        self._ensure_listening()
        params = prefill_params(
            engine_id=self.engine_id,
            request_id=request_id,
            host=self.config.host,
            port=self.port,
            block_ids=block_ids,
            tp_size=self.tp_size,
        )
        if not any(block_ids):
            return False, params
        handle = self._open(self.prefill, request_id)
        if handle is None:
            logger.error("kvfsm: request %s finished twice while its blocks are held; not holding again", request_id)
            return False, None
        self.stats.holds += 1
        self._held[request_id] = handle
        if self.leases is not None:
            self.leases.grant(request_id)
        self._handoff.append(handle)
        self._plan.send.append(SendSpec(request_id, room, block_ids))
        return True, params

    def _ensure_listening(self) -> None:
        """Open the lease port at the first hold (a decode renews only what a hold told it about)."""
        if self._listening is not None or self.leases is None:
            return
        listen = getattr(self.renewals, "listen", None)
        try:
            if listen is not None:
                listen(self.config.host, self.port + self.tp_size)
            self._listening = True
        except ConfigError as exc:
            self._listening = False
            self.leases = None
            logger.error(
                "kvfsm: %s. Holds on this engine are not leased: they last hold_timeout (%s s)",
                exc,
                self.config.hold_timeout,
            )

    def _decode_finished(self, request_id: str, params: MutableMapping[str, Any]) -> None:
        self._stop_renewing(request_id)
        if params.get("do_remote_prefill"):
            # Finished before vLLM allocated its blocks (an early abort): the prefill still holds them.
            params["do_remote_prefill"] = False
            source = parse_source(params, groups=len(self.groups))
            if isinstance(source, RemoteSource):
                self._release(request_id, source)
            return
        load = self._loads.get(request_id)
        if load is not None and load.handle.abort("the request finished before its KV arrived"):
            self.stats.aborted_loads += 1
            self._plan.abort.append(AbortSpec(request_id, "vLLM finished the request before its KV arrived"))

    # -- the step's metadata and the workers' notices ------------------------------------------

    def build(self) -> StepPlan:
        """`build_connector_meta`: hand this step's work to the workers (and keep the leases)."""
        self._keep_leases()
        plan, self._plan = self._plan, StepPlan()
        handed, self._handoff = self._handoff, []
        for handle in handed:
            if handle.state is KVPoll.Bootstrapping:
                handle.bootstrapped()
        return plan

    def _keep_leases(self) -> None:
        if self.renewer is not None:
            self.renewer.tick()
        if self.leases is None or self.renewals is None:
            return
        announced: dict[str, int] = {}
        renew_all(self.leases, self.engine_id, self.renewals.receive(), announced)
        for request_id, tp in announced.items():
            sliceable = tp > self.tp_size and tp % self.tp_size == 0
            if sliceable and request_id in self._held and request_id not in self._sliced:
                self._sliced.add(request_id)
                self._plan.slices.append((request_id, tp // self.tp_size))
        for request_id in self.leases.expired():
            if request_id not in self._held:
                continue
            self.stats.expired_leases += 1
            self.transfer_stats.count("expired_leases")
            logger.warning(
                "kvfsm: the lease of request %s expired (no renewal from its decode in %s s): "
                "its blocks are freed unless a decode already claimed them",
                request_id,
                self.leases.duration,
            )
            self._plan.expire.append(request_id)

    def loads_stopped(self, reasons: Mapping[str, str]) -> None:
        """The workers' word that these loads failed and wait for proof of drain (`KVFSMStoppedLoads`).

        Each room fails here, so it no longer counts against
        `max_inflight_loads`; the request stays held (its blocks too) until
        the workers report it finished, once drained. Idempotent: the workers
        repeat it every step until then.
        """
        for request_id, why in reasons.items():
            load = self._loads.get(request_id)
            if load is None or load.handle.state is KVPoll.Bootstrapping:
                continue
            if load.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, f"the workers stopped the load: {why}")):
                self.stats.stopped_loads += 1

    def notices(
        self,
        finished_sending: Iterable[str] | None,
        finished_recving: Iterable[str] | None,
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> tuple[set[str], set[str]]:
        """`update_connector_output`: the notices vLLM may act on (each held request once)."""
        failed = set(failed_recving)
        invalid = set(invalid_block_ids)
        recving: set[str] = set()
        for request_id in finished_recving or ():
            load = self._loads.get(request_id)
            if load is None or load.handle.state is KVPoll.Bootstrapping:
                self._absorb("finished_recving", request_id, self.decode)
                continue
            del self._loads[request_id]
            self._stop_renewing(request_id)
            handle = load.handle
            if request_id in failed or not invalid.isdisjoint(load.blocks):
                handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, "the workers reported a failed load"))
            else:
                handle.transfer_started()
                handle.transfer_done()
            if handle.state is KVPoll.Failed:
                # The workers report a load only once all its rooms are release-safe there: that is the
                # proof of drain for this mirror room, which would otherwise stay held after close.
                handle.writes_drained()
            self._close(self.decode, handle)
            self._sources.discard(load.room)
            recving.add(request_id)
        sending: set[str] = set()
        for request_id in finished_sending or ():
            held = self._held.get(request_id)
            if held is None or held.state is KVPoll.Bootstrapping:
                self._absorb("finished_sending", request_id, self.prefill)
                continue
            del self._held[request_id]
            self._sliced.discard(request_id)
            if self.leases is not None:
                self.leases.end(request_id)
            held.transfer_started()
            held.transfer_done()
            self._close(self.prefill, held)
            sending.add(request_id)
        return sending, recving

    def _absorb(self, kind: str, request_id: str, manager: TransferManager) -> None:
        self.stats.absorbed_notices += 1
        why = "the workers were not told of it yet: a notice from before its hand-off"
        try:
            manager.get(fit_text(request_id))
        except UnknownRoom as exc:  # says whether it was closed or never opened
            why = exc.detail
        logger.warning("kvfsm: %s for request %s dropped: %s", kind, request_id, why)

    def report(self) -> dict[str, Any] | None:
        """This half's figures for vLLM's connector stats since the last report (`_stats` payload)."""
        if self._held or self.stats.holds:
            self.transfer_stats.sample("holds", len(self._held))
        return self.transfer_stats.take()

    def shutdown(self) -> None:
        close = getattr(self.renewals, "close", None)
        if close is not None:
            close()

    @property
    def held(self) -> frozenset[str]:
        """Requests whose blocks the connector holds now (prefill holds and decode loads)."""
        return frozenset(self._held) | frozenset(self._loads)
