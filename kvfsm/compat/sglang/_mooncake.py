"""SGLang's Mooncake backend, rebuilt on `kvfsm.backends.MooncakeBackend`.

`get_kv_class(TransferBackend.MOONCAKE, ...)` can return these four classes
in place of SGLang's `MooncakeKVManager` / `MooncakeKVSender` /
`MooncakeKVReceiver` / `MooncakeKVBootstrapServer`; they take the arguments
SGLang's scheduler passes and answer what it reads, and the KV bytes move
through kvfsm's Mooncake adapter and wire protocol:

* `MooncakeKVBootstrapServer(host, port)` is the rendezvous (see
  `_bootstrap`): each prefill rank registers its kvfsm control-plane
  address there; decode asks it once per prefill server.
* `MooncakeKVManager(kv_args, mode, server_args, is_mla_backend)` builds one
  `MooncakeBackend` per process on its `TransferManager` and registers
  SGLang's buffers with it: the KV buffers (`kv_data_ptrs` /
  `kv_data_lens` / `kv_item_lens`: one page of a buffer is one item) and
  the metadata buffers (`aux_*`: one slot per request, copied last as the
  commit marker, which is what SGLang's decode checks before it commits a
  request). Prefill registers with the bootstrap server at construction,
  as SGLang's does; decode fills `prefill_info_table` from it
  (`try_ensure_parallel_info`).
* `MooncakeKVSender` / `MooncakeKVReceiver` are `KVSender` / `KVReceiver`
  over that backend: the receiver bootstraps with its prefill rank at
  `init(prefill_dp_rank)`, `send_metadata` gives the prefill its pages and
  metadata slot, the sender's `send` per chunk writes them.

Deferred release: the manager supports it (`enable_deferred_decode_kv_release`
follows SGLang's knob, on by default) and answers
`is_abort_release_safe(room)` from kvfsm's release phase: a failed decode
room becomes release-safe when the prefill's ABORT_ACK proves its writes
drained, at once when the prefill never had the pages, or on a fence; when
the drain deadline passes without proof (SGLang's
`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`, 30 s) its pages
are quarantined, not released (SGLang #38961: the timer is itself a
use-after-free window), until a proof or an operator's
`transfer_manager.release_quarantined(room, why)`. A prefill lost for the heartbeat window fails every room it had with
SGLang's reason ("Lost connection with prefill instance ...") and is
forgotten, so its next request asks the bootstrap server again.

Unequal attention TP (MHA/GQA; MLA only with a decode TP larger than the
prefill's): each rank sends its `TPLayout` (`_heads`) in its engine session,
and `SGLangMooncakeBackend` checks the peer's geometry at the handshake and
writes head slices, one write per token row of each page and KV buffer, as
SGLang's `send_kvcache_slice` does. One request then has a room per pair of
ranks that exchange KV:

* prefill TP > decode TP: a decode rank pulls from several prefill ranks.
  Its receiver keeps one room per prefill rank (the request's own, plus
  `sub_room(room, k)`), each claiming the prefill's room `room` with the
  request's pages and metadata slot: every prefill rank writes its heads,
  and the same metadata bytes, as each of SGLang's prefill ranks sends its
  aux.
* prefill TP < decode TP: several decode ranks pull from one prefill rank.
  Decode rank slot k > 0 claims the prefill's room `sub_room(room, k)`; the
  prefill's sender learns from the first claim how many decode ranks feed
  on it (`claim_peer`: the claimer's layout) and opens those rooms.

The request's state is the lowest of its rooms' (SGLang's MIN all-reduce,
within one rank); the first room to fail fails the others with its reason,
and the request's pages are release-safe only when every room's are.

Limits (the migration guide lists them): no pipeline or context parallel
prefill, attention TP sizes that divide each other and KV heads that
divide over the larger one (no replicated heads), no decode prefix reuse
(`decode_prefix_len` must be 0), no mamba/SWA state transfer, no host
destinations, no staging buffer.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

from ..._errors import ConfigError, KVFSMError
from ..._lifecycle import Timeouts
from ..._manager import TransferHandle, TransferManager
from ..._observe import StateChange
from ..._states import FailureKind, FailureReason, KVPoll, Role, RoomId
from ...backends._errors import BackendError
from ...backends._remote_endpoint import RemoteEndpoint
from ...backends._remote_receiver import DecodeEndpoint
from ...backends._remote_sender import PrefillEndpoint
from ...backends._remote_writer import Lane
from ...backends.memory import KVPools, MemoryRegion
from ...backends.mooncake import MooncakeBackend
from ...backends.remote import RemoteConfig, Write
from ._bootstrap import LAYOUT_FIELDS, KVBootstrapServer, fetch_prefill_ranks, register_prefill_rank
from ._endpoint import KVReceiver, KVSender, RequestView, _aux_slot, _Endpoint
from ._heads import SESSION_FIELD, Pairing, TPLayout, head_slices, pairing, sliced_writes, slicing_problem, sub_room
from ._manager import KVManager
from ._types import (
    ABORT_MESSAGE,
    BOOTSTRAP_TIMEOUT_ENV,
    WAITING_TIMEOUT_ENV,
    PrefillServerInfo,
    timeout_from_env,
)

__all__ = ["MooncakeKVManager", "MooncakeKVSender", "MooncakeKVReceiver", "MooncakeKVBootstrapServer"]

logger = logging.getLogger("kvfsm.compat.sglang")

#: SGLang's knobs this backend reads besides the phase timeouts.
DEFERRED_RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_MISSES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
#: How long prefill keeps trying to register with a bootstrap server that is still starting.
REGISTER_PATIENCE_S = 30.0
#: One attempt of decode's non-blocking look-up of a prefill server.
LOOKUP_TIMEOUT_S = 2.0
#: Requests whose extra rooms (unequal TP) a manager remembers for `is_abort_release_safe`.
_REMEMBER_EXTRA_ROOMS = 65536


class MooncakeKVBootstrapServer(KVBootstrapServer):
    """SGLang's `MooncakeKVBootstrapServer(host, port)`: kvfsm's rendezvous server (see `_bootstrap`)."""


def pools_of(kv_args: Any) -> KVPools:
    """SGLang's `KVArgs` buffers as kvfsm pools: KV pages (item = page) and metadata slots."""
    try:
        kv = [
            MemoryRegion(ptr=int(ptr), nbytes=int(length), page_nbytes=int(item), name=f"kv{index}")
            for index, (ptr, length, item) in enumerate(
                zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens, strict=True)
            )
        ]
        aux = [
            MemoryRegion(ptr=int(ptr), nbytes=int(length), page_nbytes=int(item), name=f"aux{index}")
            for index, (ptr, length, item) in enumerate(
                zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens, strict=True)
            )
        ]
        return KVPools(kv, aux)
    except (AttributeError, TypeError, ValueError) as error:
        raise ConfigError(
            "MooncakeKVManager needs SGLang's KVArgs buffers: kv_data_ptrs/kv_data_lens/kv_item_lens and "
            f"aux_data_ptrs/aux_data_lens/aux_item_lens of equal lengths; {error}"
        ) from error


def _int_attr(source: Any, name: str, default: int) -> int:
    value = getattr(source, name, None)
    return default if isinstance(value, bool) or not isinstance(value, int) else value


#: The handshake key every prefill and decode of one deployment share (`RemoteConfig.shared_key`):
#: SGLang's arguments have no place for it, so it comes from the environment.
SHARED_KEY_ENV = "KVFSM_SHARED_KEY"


def _heartbeat_config(host: str) -> RemoteConfig:
    """kvfsm's control-plane settings, with SGLang's heartbeat knobs where they are set."""
    defaults = RemoteConfig()
    interval = timeout_from_env(HEARTBEAT_INTERVAL_ENV, defaults.heartbeat_interval)
    misses = int(timeout_from_env(HEARTBEAT_MISSES_ENV, float(defaults.heartbeat_misses)))
    key = os.environ.get(SHARED_KEY_ENV) or None
    return RemoteConfig(host=host, heartbeat_interval=interval, heartbeat_misses=max(misses, 1), shared_key=key)


#: The bootstrap server's layout fields that are counts (anything else there is a string).
_COUNT_FIELDS = frozenset({"attn_tp_size", "attn_cp_size", "total_kv_heads", "dp_size", "pp_size", "page_size"})


def _layout_value(name: str, value: object) -> bool:
    """Whether the bootstrap server's `value` for `name` can be used (it is fed by the network: unauthenticated)."""
    if value is None:
        return False
    if name in _COUNT_FIELDS:
        return not isinstance(value, bool) and isinstance(value, int) and 0 < value <= 1 << 20
    if name == "prefill_http_port":
        return not isinstance(value, bool) and isinstance(value, int) and 0 < value < 65536
    return isinstance(value, str) and len(value) <= 256


def _layout_of(kv_args: Any, attn_tp_size: int, is_mla: bool) -> TPLayout:
    """This rank's `TPLayout`, from SGLang's KVArgs (`kv_head_num` and `total_kv_head_num` are set for MHA/GQA)."""
    engine_rank = _int_attr(kv_args, "engine_rank", 0)
    page_size = max(_int_attr(kv_args, "page_size", 1), 1)
    local, total = _int_attr(kv_args, "kv_head_num", 0), _int_attr(kv_args, "total_kv_head_num", 0)
    if is_mla or local < 1 or total < 1:
        return TPLayout(attn_tp_size, engine_rank % attn_tp_size, page_size)
    return TPLayout(attn_tp_size, engine_rank % attn_tp_size, page_size, total, local)


def _layout_fields(endpoint: RemoteEndpoint, fields: dict[str, Any]) -> dict[str, Any]:
    """An endpoint's engine session fields, with its rank's `TPLayout` added (what its peers pair by)."""
    host = endpoint.host
    assert isinstance(host, SGLangMooncakeBackend)
    return {**fields, SESSION_FIELD: host.tp_layout.fields()}


def _layout_problem(endpoint: RemoteEndpoint, pools: KVPools, session: dict[str, Any]) -> str | None:
    """The handshake's check between ranks of unequal attention TP (None: `pools` can exchange KV with ours)."""
    host = endpoint.host
    assert isinstance(host, SGLangMooncakeBackend) and endpoint.pools is not None
    peer = TPLayout.from_fields(session.get(SESSION_FIELD))
    mine = host.tp_layout
    if peer is None or peer.attn_tp_size == mine.attn_tp_size:
        return None
    if endpoint.role is Role.SENDER:
        return slicing_problem(mine, peer, endpoint.pools, pools)
    return slicing_problem(peer, mine, pools, endpoint.pools)


class SGLangPrefillEndpoint(PrefillEndpoint):
    """The prefill half: sends its rank's `TPLayout`, and writes head slices to a decode of another TP size."""

    def _session_fields(self) -> tuple[dict[str, Any], bytes | None]:
        fields, blob = super()._session_fields()
        return _layout_fields(self, fields), blob

    def _layout_mismatch(self, pools: KVPools, session: dict[str, Any]) -> str | None:
        peer = TPLayout.from_fields(session.get(SESSION_FIELD))
        if peer is None or self._mine.attn_tp_size == peer.attn_tp_size:
            return super()._layout_mismatch(pools, session)
        return _layout_problem(self, pools, session)

    def _kv_writes(self, lane: Lane, src: list[int], dst: list[int]) -> list[Write]:
        peer = TPLayout.from_fields(lane.peer_session.get(SESSION_FIELD))
        mine = self._mine
        if peer is None or peer.attn_tp_size == mine.attn_tp_size:
            return super()._kv_writes(lane, src, dst)
        pools, theirs = self.pools, lane.session.pools
        assert pools is not None and theirs is not None
        slices = head_slices(mine, peer, pools.kv, theirs.kv)
        return sliced_writes(pools.kv, theirs.kv, slices, mine.page_size, src, dst)

    @property
    def _mine(self) -> TPLayout:
        host = self.host
        assert isinstance(host, SGLangMooncakeBackend)
        return host.tp_layout


class SGLangDecodeEndpoint(DecodeEndpoint):
    """The decode half: sends its rank's `TPLayout`, checks a prefill's of another TP size, names wire rooms."""

    def _session_fields(self) -> tuple[dict[str, Any], bytes | None]:
        fields, blob = super()._session_fields()
        return _layout_fields(self, fields), blob

    def _layout_mismatch(self, pools: KVPools, session: dict[str, Any]) -> str | None:
        peer = TPLayout.from_fields(session.get(SESSION_FIELD))
        host = self.host
        assert isinstance(host, SGLangMooncakeBackend)
        if peer is None or host.tp_layout.attn_tp_size == peer.attn_tp_size:
            return super()._layout_mismatch(pools, session)
        return _layout_problem(self, pools, session)

    def _wire_room(self, handle: TransferHandle) -> Any:
        host = self.host
        assert isinstance(host, SGLangMooncakeBackend)
        return host.wire_rooms.get((handle.room, handle.generation), handle.room)


class SGLangMooncakeBackend(MooncakeBackend):
    """`MooncakeBackend` whose halves pair ranks of different attention TP sizes (head slices) and name wire rooms.

    Equal TP sizes (or a peer that sent no layout) pair page for page, as
    `MooncakeBackend` does. `wire_rooms` maps a decode room (room id,
    generation) to the prefill room id its claim names, for the rooms of a
    request split over several ranks (`_heads.sub_room`).
    """

    decode_endpoint = SGLangDecodeEndpoint
    prefill_endpoint = SGLangPrefillEndpoint

    def __init__(self, manager: TransferManager, config: RemoteConfig, layout: TPLayout, **engine: Any) -> None:
        self.tp_layout = layout
        self.wire_rooms: dict[tuple[RoomId, int], RoomId] = {}
        super().__init__(manager, config, **engine)

    def claim_peer(self, handle: TransferHandle) -> TPLayout | None:
        """The layout of the decode rank whose claim bound this prefill room (None: none yet, or it sent none)."""
        endpoint = self.endpoint
        if not isinstance(endpoint, PrefillEndpoint):
            return None
        fields = endpoint.claim_peer(handle)
        return None if fields is None else TPLayout.from_fields(fields.get(SESSION_FIELD))

    def _forget(self, handle: TransferHandle) -> None:
        super()._forget(handle)
        self.wire_rooms.pop((handle.room, handle.generation), None)


def _track_prefills(manager: MooncakeKVManager) -> Callable[[StateChange], None]:
    """An observer of the decode rooms: which prefill each belongs to, and which prefills were lost.

    A room that failed because its prefill was lost (or never answered)
    drops that prefill from `prefill_info_table`, so the next request asks
    the bootstrap server again; a closed room is forgotten (by generation:
    the room id may already be open again).
    """
    ref = weakref.ref(manager)

    def observe(change: StateChange) -> None:
        target = ref()
        if target is None:
            return
        entry = target.room_prefill.get(change.room)
        if entry is None or entry[0] != change.generation:
            return
        addr = entry[1]
        if change.event == "close":
            target.room_prefill.pop(change.room, None)
            return
        reason = change.reason
        lost = reason is not None and reason.kind in (FailureKind.PEER_LOST, FailureKind.BOOTSTRAP_ERROR)
        if change.dest is KVPoll.Failed and lost and target.prefill_info_table.pop(addr, None) is not None:
            logger.warning("kvfsm: lost prefill server %s; it will be looked up again", addr)

    return observe


class MooncakeKVManager(KVManager):
    """SGLang's `MooncakeKVManager`, on a kvfsm `MooncakeBackend`.

    Constructed as SGLang does: `(kv_args, disaggregation_mode, server_args,
    is_mla_backend)`. The keyword-only arguments are kvfsm's: `config`
    (`RemoteConfig`; default: listen on `hostname`, SGLang's heartbeat knobs
    where set), `hostname` (default: `server_args.host` when it is a
    concrete address, else 127.0.0.1), `protocol` ("rdma" when
    `kv_args.ib_device` names devices, else "tcp"), the bootstrap server
    (`bootstrap_host`/`bootstrap_port`, default `server_args.host` and
    `server_args.disaggregation_bootstrap_port`), and `KVManager`'s
    `timeouts`, `clock`, `strict`, `reaper`.
    """

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any = None,
        is_mla_backend: bool | None = False,
        *,
        config: RemoteConfig | None = None,
        hostname: str | None = None,
        protocol: str | None = None,
        bootstrap_host: str | None = None,
        bootstrap_port: int | None = None,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = False,
        reaper: bool = True,
    ) -> None:
        server_host = getattr(server_args, "host", None)
        default_host = (
            server_host if isinstance(server_host, str) and server_host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        )
        self.local_host: str = hostname or default_host
        self.bootstrap_host: str = bootstrap_host or default_host
        self.bootstrap_port = (
            bootstrap_port
            if bootstrap_port is not None
            else _int_attr(server_args, "disaggregation_bootstrap_port", 8998)
        )
        device = getattr(args, "ib_device", None) or ""
        self._engine_options: dict[str, Any] = {
            "hostname": self.local_host,
            "protocol": protocol or ("rdma" if device else "tcp"),
            "device_name": device,
        }
        self._config = config if config is not None else _heartbeat_config(self.local_host)
        self._pools = pools_of(args)
        if timeouts is None:
            timeouts = Timeouts(
                bootstrap=timeout_from_env(BOOTSTRAP_TIMEOUT_ENV),
                waiting=timeout_from_env(WAITING_TIMEOUT_ENV),
                transferring=None,
                drain=timeout_from_env(DEFERRED_RELEASE_TIMEOUT_ENV, 30.0),
            )
        #: Decode: (generation, `bootstrap_addr` of its prefill server) of each open room.
        self.room_prefill: dict[RoomId, tuple[int, str]] = {}
        self.tp_size = _int_attr(server_args, "tp_size", 1)
        self.dp_size = _int_attr(server_args, "dp_size", 1)
        self.pp_size = _int_attr(server_args, "pp_size", 1)
        self.tp_layout = _layout_of(args, self.attn_tp_size, bool(is_mla_backend))
        #: The extra rooms of requests split over several ranks (unequal TP), by the request's room; bounded.
        self.extra_rooms: OrderedDict[RoomId, tuple[RoomId, ...]] = OrderedDict()
        super().__init__(
            args,
            disaggregation_mode,
            server_args,
            is_mla_backend,
            timeouts=timeouts,
            clock=clock,
            strict=strict,
            reaper=reaper,
            backend=self._build_backend,
        )
        self.transfer_manager.subscribe(_track_prefills(self))
        if self.role is Role.SENDER:
            try:
                self.register_to_bootstrap()
            except BaseException:
                self.shutdown()
                raise

    def _build_backend(self, manager: TransferManager) -> MooncakeBackend:
        backend = SGLangMooncakeBackend(manager, self._config, self.tp_layout, **self._engine_options)
        try:
            backend.register_pools(self._pools)
        except BaseException:
            backend.close()
            raise
        return backend

    @property
    def attn_tp_size(self) -> int:
        """TP ranks per data-parallel replica (SGLang's attention TP, without DP attention it is the TP size)."""
        return max(self.tp_size // max(self.dp_size, 1), 1)

    @property
    def bootstrap_addr(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"

    def register_to_bootstrap(self) -> None:
        """Register this prefill rank's kvfsm address and the server's layout with the bootstrap server.

        Retried for `REGISTER_PATIENCE_S` while the server is still starting;
        raises `BackendError` naming the server if it never answers.
        """
        assert self.backend is not None
        server_args = self.server_args
        registration = {
            "address": self.backend.address,
            "dp_rank": _int_attr(self.kv_args, "system_dp_rank", 0) or 0,
            "tp_rank": _int_attr(self.kv_args, "engine_rank", 0),
            "pp_rank": _int_attr(self.kv_args, "pp_rank", 0),
            "attn_tp_size": self.attn_tp_size,
            "attn_cp_size": _int_attr(server_args, "attn_cp_size", 1),
            "total_kv_heads": self.tp_layout.total_kv_heads,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "page_size": _int_attr(self.kv_args, "page_size", 1),
            "kv_cache_dtype": getattr(self.kv_args, "kv_cache_dtype_str", None),
            "decode_allocation_policy": getattr(server_args, "disaggregation_decode_allocation_policy", "early"),
            "prefill_http_port": _int_attr(server_args, "port", 0) or None,
        }
        deadline = time.monotonic() + REGISTER_PATIENCE_S
        while True:
            try:
                register_prefill_rank(self.bootstrap_addr, registration, timeout=LOOKUP_TIMEOUT_S)
                return
            except (OSError, urllib.error.URLError) as error:
                if time.monotonic() >= deadline:
                    raise BackendError(
                        f"prefill rank could not register with the bootstrap server at {self.bootstrap_addr}: {error}"
                    ) from error
                time.sleep(0.2)

    def fetch_prefill_info(self, bootstrap_addr: str) -> PrefillServerInfo | None:
        """Ask the prefill server's bootstrap server for its layout and ranks (one short attempt)."""
        payload = fetch_prefill_ranks(bootstrap_addr, timeout=LOOKUP_TIMEOUT_S)
        if payload is None:
            return None
        found = payload.get("layout")
        layout: dict[str, Any] = found if isinstance(found, dict) else {}
        addresses: dict[tuple[int, int, int], str] = {}
        for entry in payload["ranks"]:
            if not isinstance(entry, dict):
                continue
            rank, address = entry.get("rank"), entry.get("address")
            if isinstance(rank, list) and len(rank) == 3 and all(isinstance(r, int) for r in rank):
                dp_rank, tp_rank, pp_rank = rank
                if isinstance(address, str):
                    addresses[(dp_rank, tp_rank, pp_rank)] = address
        if not addresses:
            return None
        fields = {name: layout[name] for name in LAYOUT_FIELDS if _layout_value(name, layout.get(name))}
        return PrefillServerInfo(
            **fields,
            follow_bootstrap_room=True,
            ranks=[addresses[key] for key in sorted(addresses)],
            addresses=addresses,
        )

    def prefill_ranks_for(self, bootstrap_addr: str, prefill_dp_rank: int) -> tuple[list[str], Pairing] | str:
        """(the addresses of the prefill ranks this decode rank pulls from, how it pairs with them), or why it cannot."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            return f"Prefill server with bootstrap_addr: {bootstrap_addr} is healthy before, but now it is down"
        if info.pp_size != 1:
            return f"kvfsm's Mooncake backend does not support a pipeline-parallel prefill (pp_size={info.pp_size})"
        if info.attn_cp_size != 1:
            return f"kvfsm's Mooncake backend does not support a context-parallel prefill (cp_size={info.attn_cp_size})"
        prefill_heads = info.total_kv_heads if info.total_kv_heads else None
        if info.attn_tp_size != self.attn_tp_size and prefill_heads is None and not self.tp_layout.mla:
            return (
                f"prefill server {bootstrap_addr} did not say how many KV heads it has: it cannot pair its attention "
                f"TP {info.attn_tp_size} with this decode's {self.attn_tp_size}"
            )
        plan = pairing(info.attn_tp_size, self.tp_layout, prefill_heads)
        if isinstance(plan, str):
            return plan
        addresses = []
        for tp_rank in plan.prefill_ranks:
            address = info.addresses.get((prefill_dp_rank, tp_rank, 0))
            if address is None:
                return f"prefill server {bootstrap_addr} has no rank dp={prefill_dp_rank} tp={tp_rank} registered"
            addresses.append(address)
        return addresses, plan

    def remember_extra_rooms(self, room: RoomId, extra: tuple[RoomId, ...]) -> None:
        """Note a request's extra rooms, so `is_abort_release_safe(room)` asks theirs too."""
        self.extra_rooms[room] = extra
        self.extra_rooms.move_to_end(room)
        while len(self.extra_rooms) > _REMEMBER_EXTRA_ROOMS:
            self.extra_rooms.popitem(last=False)

    def is_abort_release_safe(self, bootstrap_room: RoomId, required_acks: int = 0) -> bool:
        """The request's pages may be reused when every room it has (unequal TP: several) is release-safe."""
        if not super().is_abort_release_safe(bootstrap_room, required_acks):
            return False
        extra = self.extra_rooms.get(bootstrap_room, ())
        if all(super(MooncakeKVManager, self).is_abort_release_safe(room) for room in extra):
            self.extra_rooms.pop(bootstrap_room, None)
            return True
        return False


def _through(handle: TransferHandle, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Call the backend for an extra room; a refusal that failed the room is logged, not raised (as `_through_backend`)."""
    try:
        call(handle, *args, **kwargs)
    except KVFSMError as error:
        if not handle.is_terminal:
            raise
        logger.warning("kvfsm room %r: the backend refused %s: %s", handle.room, call.__name__, error)


class _ExtraRooms:
    """The rooms of one request beyond its own (unequal TP), and the request's state over all of them.

    SGLang MIN-all-reduces a request's poll across TP ranks; within one
    rank a request split over several rooms reads the same way: `Failed`
    if any room failed, `Success` once all did, else the least advanced.
    The first room to fail fails the others with its reason (so the peer of
    each learns it, and `failure_exception()` names the first cause).
    """

    def __init__(self, own: TransferHandle, manager: MooncakeKVManager) -> None:
        # The request's own room, not its endpoint: no reference cycle, so a dropped endpoint's
        # finalizer (its rooms go to the orphans) runs as soon as the scheduler lets go of it.
        self.own = own
        self.manager = manager
        self.handles: list[TransferHandle] = []

    def open(self, room: RoomId, endpoint: KVSender | KVReceiver) -> TransferHandle:
        handle = self.manager.open_room(room)
        self.handles.append(handle)
        # Dropped without clear(): the room goes to the manager's orphans, as the request's own does.
        finalizer = weakref.finalize(endpoint, self.manager.orphans.adopt, handle)
        finalizer.atexit = False
        self.manager.remember_extra_rooms(self.own.room, tuple(h.room for h in self.handles))
        return handle

    def all(self) -> list[TransferHandle]:
        return [self.own, *self.handles]

    def state(self, own: KVPoll) -> KVPoll:
        if not self.handles:
            return own
        return min([own, *(handle.status for handle in self.handles)])

    def propagate(self) -> FailureReason | None:
        """Fail the request's other rooms after the first one failed; the first failure's reason (None: none failed)."""
        if not self.handles:
            return None
        rooms = self.all()
        failed = next((handle for handle in rooms if handle.status is KVPoll.Failed), None)
        if failed is None:
            return None
        reason = failed.reason or FailureReason(FailureKind.ABORTED, f"room {failed.room!r} failed")
        for handle in rooms:
            if handle is failed or handle.closed or handle.is_terminal:
                continue
            if handle is self.own:
                handle.fail(FailureReason(reason.kind, reason.message, from_peer=reason.from_peer))
            else:
                handle.fail(
                    FailureReason(
                        reason.kind,
                        f"room {failed.room!r} of this request failed: {reason}",
                        from_peer=reason.from_peer,
                    )
                )
        return reason

    def abort(self, why: str) -> None:
        for handle in self.handles:
            if not handle.closed and not handle.is_terminal:
                handle.abort(why)

    def close(self) -> None:
        for handle in self.handles:
            if not handle.closed:
                if not handle.is_terminal:
                    handle.abort(f"cleared while {handle.state.name}")
                self.manager.close_handle(handle)

    @property
    def release_safe(self) -> bool:
        return all(handle.release_safe for handle in self.handles)


def _request_state(endpoint: _Endpoint, extra: _ExtraRooms, own: KVPoll) -> KVPoll:
    """The request's state over its rooms (see `_ExtraRooms`), its own room's poll being `own`.

    A request whose own room succeeded while another of its rooms failed
    answers Failed from then on, with that room's reason, as after another
    rank's failure.
    """
    failure = extra.propagate()
    if failure is not None:
        endpoint._step_view("peer_failed_after_success", failure)  # only if its own room succeeded
    if endpoint._view is RequestView.FAILED_OVER_SUCCESS:
        return KVPoll.Failed
    return extra.state(own)


class _SplitRequest(_Endpoint):
    """What a request split over several rooms (`_ExtraRooms`) does on abort, failure, clear and release."""

    _extra: _ExtraRooms

    def on_abort(self) -> None:
        self._extra.abort(ABORT_MESSAGE)

    def failure_exception(self) -> NoReturn:
        _request_state(self, self._extra, self.handle.status)
        super().failure_exception()

    def clear(self) -> None:
        self._extra.close()
        super().clear()

    @property
    def release_safe(self) -> bool:
        return self.handle.release_safe and self._extra.release_safe


class MooncakeKVSender(_SplitRequest, KVSender):
    """SGLang's `MooncakeKVSender`: a `KVSender` whose chunks `MooncakeBackend` writes.

    When the decode ranks outnumber this prefill rank's TP group (decode
    attention TP larger), the decode rank that claimed this room is slot 0
    of a fan-out: once it claimed, the sender opens a room per further slot
    (`_heads.sub_room`), which the other decode ranks claim, and sends
    every chunk into each.
    """

    _fanned: bool

    def _open(self, mgr: Any, bootstrap_room: int) -> None:
        if not isinstance(mgr, MooncakeKVManager):
            raise TypeError(f"MooncakeKVSender needs a MooncakeKVManager; got {type(mgr).__name__}")
        super()._open(mgr, bootstrap_room)
        self._extra = _ExtraRooms(self.handle, mgr)
        self._fanned = False

    def _fan_out(self) -> None:
        """Once a decode rank claimed this room: open the rooms of the other decode ranks this rank feeds."""
        if self._fanned or self.handle.status in (KVPoll.Bootstrapping, KVPoll.Failed) or self.handle.closed:
            return
        manager = self.kv_mgr
        backend = manager.backend
        if not isinstance(backend, SGLangMooncakeBackend):
            self._fanned = True
            return
        # Past Bootstrapping, the room's claim is bound (binding is what bootstrapped it): its decode is known.
        peer = backend.claim_peer(self.handle)
        self._fanned = True
        mine = manager.tp_layout
        if peer is None or peer.attn_tp_size <= mine.attn_tp_size:
            return
        ratio = peer.attn_tp_size // mine.attn_tp_size
        if peer.tp_rank % ratio:
            self.handle.fail(
                FailureReason(
                    FailureKind.BOOTSTRAP_ERROR,
                    f"decode rank {peer.tp_rank} of {peer.attn_tp_size} claimed room {self.bootstrap_room!r}; with "
                    f"this prefill's attention TP {mine.attn_tp_size} it must be claimed by slot 0 of {ratio} "
                    f"(decode ranks {mine.tp_rank * ratio}..{mine.tp_rank * ratio + ratio - 1})",
                )
            )
            return
        for slot in range(1, ratio):
            handle = self._extra.open(sub_room(self.bootstrap_room, slot), self)
            _through(handle, backend.bootstrap, manager.peer_address(self.bootstrap_addr))

    def poll(self) -> KVPoll:
        own = super().poll()
        if own is not KVPoll.Failed:
            self._fan_out()
        return _request_state(self, self._extra, own)

    def send_chunk(self, kv_indices: Any, index_slice: slice, is_last: bool, state_indices: list[Any] | None) -> None:
        if state_indices and any(indices is not None and len(indices) for indices in state_indices):
            reason = "kvfsm's Mooncake backend does not transfer mamba/SWA state (state_indices given)"
            if not self.handle.is_terminal:
                self.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, reason))
            return
        self._fan_out()
        super().send_chunk(kv_indices, index_slice, is_last, state_indices)
        backend = self.kv_mgr.backend
        for handle in self._extra.handles:
            aux = self.aux_index if is_last and backend.pools is not None and backend.pools.num_aux_slots else None
            _through(handle, backend.send, kv_indices, last=is_last, aux_index=aux)


class MooncakeKVReceiver(_SplitRequest, KVReceiver):
    """SGLang's `MooncakeKVReceiver`: a `KVReceiver` whose pages `MooncakeBackend` receives.

    With a prefill of another attention TP size it pairs as `_heads.pairing`
    says: from several prefill ranks (a room each, each with the request's
    pages and metadata slot), or as slot k of the decode ranks one prefill
    rank feeds (its claim names that prefill's room `sub_room(room, k)`).
    """

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        if not isinstance(mgr, MooncakeKVManager):
            raise TypeError(f"MooncakeKVReceiver needs a MooncakeKVManager; got {type(mgr).__name__}")
        super()._open(mgr, bootstrap_room)
        self._extra = _ExtraRooms(self.handle, mgr)
        self._more_prefill_ranks: list[str] = []
        if bootstrap_room is not None:
            mgr.room_prefill[bootstrap_room] = (self.handle.generation, self.bootstrap_addr)

    def _prefill_peer(self, manager: KVManager) -> str | None:
        assert isinstance(manager, MooncakeKVManager)
        manager.try_ensure_parallel_info(self.bootstrap_addr)
        found = manager.prefill_ranks_for(self.bootstrap_addr, self.prefill_dp_rank or 0)
        if isinstance(found, str):
            if not self.handle.is_terminal:
                self.handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, found))
            return None
        addresses, plan = found
        backend = manager.backend
        if plan.slot and isinstance(backend, SGLangMooncakeBackend):
            backend.wire_rooms[(self.handle.room, self.handle.generation)] = sub_room(self.bootstrap_room, plan.slot)
        self._more_prefill_ranks = addresses[1:]
        return addresses[0]

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        manager = self.kv_mgr
        backend = manager.backend
        if not self._more_prefill_ranks or backend is None or self.handle.is_terminal:
            return
        for index, address in enumerate(self._more_prefill_ranks, start=1):
            handle = self._extra.open(sub_room(self.bootstrap_room, index), self)
            manager.room_prefill[handle.room] = (handle.generation, self.bootstrap_addr)
            if isinstance(backend, SGLangMooncakeBackend):
                backend.wire_rooms[(handle.room, handle.generation)] = self.bootstrap_room
            self.bootstrap_infos.append({"peer": address, "prefill_dp_rank": prefill_dp_rank})
            _through(handle, backend.bootstrap, address)

    def poll(self) -> KVPoll:
        return _request_state(self, self._extra, super().poll())

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = "device",
        **kwargs: Any,
    ) -> None:
        problem = None
        if decode_prefix_len:
            problem = f"kvfsm's Mooncake backend does not reuse a decode prefix (decode_prefix_len={decode_prefix_len})"
        elif state_indices and any(indices is not None and len(indices) for indices in state_indices):
            problem = "kvfsm's Mooncake backend does not transfer mamba/SWA state (state_indices given)"
        if problem is not None:
            if not self.handle.is_terminal:
                self.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, problem))
            return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination, **kwargs)
        backend = self.kv_mgr.backend
        # Each prefill rank writes the metadata slot too (the same bytes on every rank, as in SGLang):
        # a sender given a slot that its receiver did not post fails its room (the commit marker).
        slot = _aux_slot(backend, aux_index)
        for handle in self._extra.handles:
            if not handle.is_terminal:
                _through(handle, backend.expect, kv_indices, slot)

    def failure_text(self, reason: FailureReason | None) -> str | None:
        """SGLang's words for a lost prefill (its scheduler and clients see them)."""
        if reason is not None and reason.kind is FailureKind.PEER_LOST:
            return f"Lost connection with prefill instance (bootstrap_addr: {self.bootstrap_addr}): {reason.message}"
        return None
