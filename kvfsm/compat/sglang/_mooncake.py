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

Limits (the migration guide lists them): one prefill rank per decode rank
(equal attention TP sizes, or a one-rank prefill), no pipeline or context
parallelism, no decode prefix reuse (`decode_prefix_len` must be 0), no
mamba/SWA state transfer, no host destinations, no staging buffer.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import weakref
from collections.abc import Callable
from typing import Any

from ..._errors import ConfigError
from ..._lifecycle import Timeouts
from ..._manager import TransferManager
from ..._observe import StateChange
from ..._states import FailureKind, FailureReason, KVPoll, Role, RoomId
from ...backends._errors import BackendError
from ...backends.memory import KVPools, MemoryRegion
from ...backends.mooncake import MooncakeBackend
from ...backends.remote import RemoteConfig
from ._bootstrap import LAYOUT_FIELDS, KVBootstrapServer, fetch_prefill_ranks, register_prefill_rank
from ._endpoint import KVReceiver, KVSender
from ._manager import KVManager
from ._types import (
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
        backend = MooncakeBackend(manager, self._config, **self._engine_options)
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
        fields = {name: layout[name] for name in LAYOUT_FIELDS if layout.get(name) is not None}
        return PrefillServerInfo(
            **fields,
            follow_bootstrap_room=True,
            ranks=[addresses[key] for key in sorted(addresses)],
            addresses=addresses,
        )

    def prefill_rank_for(self, bootstrap_addr: str, prefill_dp_rank: int) -> tuple[str | None, str | None]:
        """(the prefill rank this decode rank pulls from, why none can be used)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            return None, (f"Prefill server with bootstrap_addr: {bootstrap_addr} is healthy before, but now it is down")
        if info.pp_size != 1:
            return (
                None,
                f"kvfsm's Mooncake backend does not support a pipeline-parallel prefill (pp_size={info.pp_size})",
            )
        engine_rank = _int_attr(self.kv_args, "engine_rank", 0)
        tp_rank = 0 if info.attn_tp_size == 1 else engine_rank
        if info.attn_tp_size not in (1, self.attn_tp_size):
            return None, (
                f"kvfsm's Mooncake backend needs equal attention TP sizes (or a one-rank prefill): prefill "
                f"{info.attn_tp_size}, decode {self.attn_tp_size}"
            )
        address = info.addresses.get((prefill_dp_rank, tp_rank, 0))
        if address is None:
            return None, f"prefill server {bootstrap_addr} has no rank dp={prefill_dp_rank} tp={tp_rank} registered"
        return address, None


class MooncakeKVSender(KVSender):
    """SGLang's `MooncakeKVSender`: a `KVSender` whose chunks `MooncakeBackend` writes."""

    def _open(self, mgr: Any, bootstrap_room: int) -> None:
        if not isinstance(mgr, MooncakeKVManager):
            raise TypeError(f"MooncakeKVSender needs a MooncakeKVManager; got {type(mgr).__name__}")
        super()._open(mgr, bootstrap_room)

    def send_chunk(self, kv_indices: Any, index_slice: slice, is_last: bool, state_indices: list[Any] | None) -> None:
        if state_indices and any(indices is not None and len(indices) for indices in state_indices):
            reason = "kvfsm's Mooncake backend does not transfer mamba/SWA state (state_indices given)"
            if not self.handle.is_terminal:
                self.handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, reason))
            return
        super().send_chunk(kv_indices, index_slice, is_last, state_indices)


class MooncakeKVReceiver(KVReceiver):
    """SGLang's `MooncakeKVReceiver`: a `KVReceiver` whose pages `MooncakeBackend` receives."""

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        if not isinstance(mgr, MooncakeKVManager):
            raise TypeError(f"MooncakeKVReceiver needs a MooncakeKVManager; got {type(mgr).__name__}")
        super()._open(mgr, bootstrap_room)
        if bootstrap_room is not None:
            mgr.room_prefill[bootstrap_room] = (self.handle.generation, self.bootstrap_addr)

    def _prefill_peer(self, manager: KVManager) -> str | None:
        assert isinstance(manager, MooncakeKVManager)
        manager.try_ensure_parallel_info(self.bootstrap_addr)
        address, problem = manager.prefill_rank_for(self.bootstrap_addr, self.prefill_dp_rank or 0)
        if problem is not None and not self.handle.is_terminal:
            self.handle.fail(FailureReason(FailureKind.BOOTSTRAP_ERROR, problem))
        return address

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

    def failure_text(self, reason: FailureReason | None) -> str | None:
        """SGLang's words for a lost prefill (its scheduler and clients see them)."""
        if reason is not None and reason.kind is FailureKind.PEER_LOST:
            return f"Lost connection with prefill instance (bootstrap_addr: {self.bootstrap_addr}): {reason.message}"
        return None
