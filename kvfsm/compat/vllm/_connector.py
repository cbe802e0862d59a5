"""`KVFSMConnector`: the vLLM (v1) KV connector whose every transfer is a kvfsm room.

The only module of `kvfsm.compat.vllm` that imports vLLM. It translates
vLLM's hooks (`vllm/distributed/kv_transfer/kv_connector/v1/base.py` of
vLLM 0.33.0) into calls on the two halves, which take plain values:

scheduler role (`_plan.SchedulerHalf`)
    on_new_request               a prefill request of a Mamba model stops one token short
    get_num_new_matched_tokens   prompt tokens to load, async; None: ask again
    update_state_after_alloc     park the load on the blocks vLLM allocated
    build_connector_meta         this step's `StepPlan` for the workers
    request_finished(_all_groups) hold a prefill's blocks; abort a decode's load
    update_connector_output      pass on each held request's notice once

worker role (`_worker.WorkerHalf`)
    register_kv_caches           one kvfsm page per vLLM block, backends started
    start_load_kv                open and bootstrap the step's rooms
    get_finished / get_transfer_results   rooms that ended and are release-safe
    get_block_ids_with_load_errors        the blocks of failed loads
    get_kv_connector_stats       both roles: the figures vLLM's loggers and /metrics get
                                 (`_metrics`: build_kv_connector_stats, build_prom_metrics)
    shutdown                     backends closed, live rooms failed
    wait_for_layer_load, save_kv_layer, wait_for_save: nothing to do (the KV
    is already in vLLM's blocks; the backend writes them whole)

Hybrid KV caches (several KV cache groups: full attention, sliding window,
Mamba) move group by group, each group's blocks clipped as vLLM's
NixlConnector clips them (`_group_shapes`). Data parallel ranks each take
their own ports (`dp_port`). Refused with a `kvfsm.ConfigError` at
construction: pipeline or context parallelism. Unequal TP sizes where one
is a multiple of the other move per-head pages (heads merged or split); a
request from a prefill of a TP size the workers cannot map is computed
locally and its prefill told to free its blocks at once (`_plan`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from ..._errors import ConfigError
from ._config import ConnectorConfig
from ._plan import GroupShape, SchedulerHalf, StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ._worker import WorkerHalf

__all__ = ["KVFSMConnector", "KVFSMConnectorMetadata"]

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class KVFSMConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the rooms to open, send and abort."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        plan = self.plan
        return f"<KVFSMConnectorMetadata recv={len(plan.recv)} send={len(plan.send)} abort={len(plan.abort)}>"


class KVFSMStoppedLoads(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: loads that failed and wait for proof of drain (request -> why).

    Their blocks stay held until a worker proves no write can still land
    (DESIGN.md rules 6 and 13), so vLLM hears of them only then; meanwhile
    the scheduler stops counting them as running loads (`max_inflight_loads`),
    so a dead prefill's quarantined loads do not defer every other request.
    """

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVFSMStoppedLoads):
            return KVFSMStoppedLoads({**other.reasons, **self.reasons})
        return self

    def __repr__(self) -> str:
        return f"<KVFSMStoppedLoads {sorted(self.reasons)}>"


def _refuse_unsupported(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise ConfigError(f"the kvfsm connector supports tensor and data parallelism only; got {name}={size}")


def _group_shapes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[GroupShape, ...]:
    """What a transfer moves of each transfer group: NixlConnector's `get_exchange_clipped_blocks`."""
    groups = kv_cache_config.transfer_groups
    hybrid = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and any(
        not isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups
    )
    shapes = []
    for group in groups:
        spec = group.kv_cache_spec
        if hybrid and isinstance(spec, SlidingWindowSpec):
            shapes.append(GroupShape("window", -(-spec.sliding_window // spec.block_size) + 1))
        elif hybrid and isinstance(spec, MambaSpec):
            shapes.append(GroupShape("state", int(spec.num_speculative_blocks)))
        else:
            shapes.append(GroupShape())
    return tuple(shapes) or (GroupShape(),)


def _prefill_backoff(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Trailing prompt tokens the decode recomputes (NixlConnector's `_prefill_backoff`)."""
    replay = any(g.kv_cache_spec.prefix_replay_tokens > 0 for g in kv_cache_config.kv_cache_groups)
    return max(
        1 if kv_cache_config.has_mamba_layers or replay else 0, int(vllm_config.num_prefill_lookahead_tokens) - 1
    )


def _kv_heads(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int | None:
    """KV heads per rank of the one full-attention group whose heads a decode can merge (else None)."""
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        return None
    if model is not None and getattr(model, "use_mla", False):
        return None
    return int(groups[0].kv_cache_spec.num_kv_heads)


def _unequal_tp(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """Why this decode cannot load from a prefill of another TP size, or None when it merges heads."""
    if _kv_heads(vllm_config, kv_cache_config) is None:
        return (
            "heads are merged only for one full-attention KV cache group (not hybrid, not MLA): "
            "run prefill and decode with the same TP size"
        )
    layout = vllm_config.cache_config.kv_cache_layout
    if layout is not None and getattr(layout, "name", layout) != "LBHNC":
        return f"heads are merged only in the head-major KV cache layout LBHNC; this engine runs {layout}"
    return None


def _total_kv_heads(vllm_config: VllmConfig) -> int | None:
    model = vllm_config.model_config
    try:
        return int(model.get_total_num_kv_heads()) if model is not None else None
    except Exception:  # a config without the attribute (tests' stand-ins): no replication check
        return None


def dp_port(port: int, vllm_config: VllmConfig) -> int:
    """The first port of this data-parallel rank: each DP rank takes `tp_size + 1` ports from `port`.

    Its TP ranks listen on the first `tp_size` of them; the one after is kept
    for the rank's scheduler. DP ranks on one host therefore never collide.
    """
    parallel = vllm_config.parallel_config
    index = int(getattr(parallel, "data_parallel_index", 0) or 0)
    return port + index * (int(parallel.tensor_parallel_size) + 1)


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVFSMConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer for vLLM with kvfsm lifecycles.

    Select it with `--kv-transfer-config '{"kv_connector": "KVFSMConnector",
    "kv_connector_module_path": "kvfsm.compat.vllm", "kv_role":
    "kv_producer"}'` on the prefill (`kv_consumer` on the decode); settings
    go in `kv_connector_extra_config` (see `ConnectorConfig`).
    """

    _cache_hit_source = CacheHitSource.P2P
    #: The clock of the workers' deadlines (tests replace it).
    clock: ClassVar[Callable[[], float]] = staticmethod(time.monotonic)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, kv_port=transfer.kv_port)
        _refuse_unsupported(vllm_config)
        engine_id = transfer.engine_id
        if not engine_id:
            raise ConfigError("kv_transfer_config.engine_id must be set for the kvfsm connector")
        self.engine_id: str = engine_id
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.port = dp_port(self.config.port, vllm_config)
        self.groups = _group_shapes(vllm_config, kv_cache_config)
        if self.port + self.tp_size > 65535:
            raise ConfigError(
                f"the kvfsm connector's ports for this data-parallel rank ({self.port}..{self.port + self.tp_size}) "
                f"run past 65535: lower kv_connector_extra_config['port'] (now {self.config.port})"
            )
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        if role is KVConnectorRole.SCHEDULER:
            renewals = None
            if self.config.lease_duration is not None:
                from ._leases import LeaseChannel

                renewals = LeaseChannel(self.config.shared_key)
            self.scheduler_half = SchedulerHalf(
                self.config,
                engine_id=engine_id,
                tp_size=self.tp_size,
                port=self.port,
                groups=self.groups,
                prefill_backoff=_prefill_backoff(vllm_config, kv_cache_config),
                renewals=renewals,
                clock=type(self).clock,
                unequal_tp=_unequal_tp(vllm_config, kv_cache_config),
                total_kv_heads=_total_kv_heads(vllm_config),
            )
        else:
            from ._worker import WorkerHalf

            self.worker_half = WorkerHalf(
                self.config,
                engine_id=engine_id,
                tp_rank=_tp_rank(self.tp_size),
                num_blocks=int(kv_cache_config.num_blocks),
                producer=bool(transfer.is_kv_producer),
                consumer=bool(transfer.is_kv_consumer),
                clock=type(self).clock,
                port=self.port,
                tp_size=self.tp_size,
                kv_heads=_kv_heads(vllm_config, kv_cache_config),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Head-major blocks (as NixlConnector asks): each KV head's bytes in one run, so a decode
        # can merge the heads of several prefill ranks. MLA has one latent head: any layout.
        model = vllm_config.model_config
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # The backends register vLLM's KV memory; sleep mode would remap it under them.
        return False

    # -- scheduler side -------------------------------------------------------------------------

    def _scheduler(self) -> SchedulerHalf:
        if self.scheduler_half is None:
            raise RuntimeError("a scheduler hook was called on the worker-side kvfsm connector")
        return self.scheduler_half

    def on_new_request(self, request: Request) -> None:
        self._scheduler().new_request(request.request_id, request.kv_transfer_params)
        # A Mamba (or bounded-replay, or lookahead) model's prefill stops short of the
        # tokens its decode recomputes, as NixlConnector's `_truncate_request_for_prefill`.
        backoff = self._scheduler().prefill_backoff
        params = request.kv_transfer_params
        if (
            backoff
            and params
            and params.get("do_remote_decode")
            and not params.get("_kvfsm_truncated")
            and request.num_prompt_tokens > backoff
            and not request.get_skip_reading_prefix_cache()
            and request.prompt_token_ids is not None
        ):
            del request.prompt_token_ids[-backoff:]
            del request._all_token_ids[-backoff:]
            request.num_prompt_tokens -= backoff
            request.max_tokens = 1
            params["_kvfsm_truncated"] = True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids or []
        return self._scheduler().matched_tokens(request.kv_transfer_params, len(prompt), num_computed_tokens)

    def _transfer_blocks(self, blocks: tuple[list[int], ...] | list[list[int]]) -> tuple[list[int], ...]:
        groups = self._kv_cache_config.kv_cache_groups
        if len(blocks) == len(groups):
            return tuple(self._kv_cache_config.select_transfer_block_ids(list(blocks)))
        return tuple(blocks)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        unhashed = self._transfer_blocks(blocks.get_unhashed_block_ids_all_groups()) if num_external_tokens > 0 else ()
        self._scheduler().after_alloc(request.request_id, request.kv_transfer_params, unhashed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVFSMConnectorMetadata(self._scheduler().build())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stopped = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(stopped, KVFSMStoppedLoads):
            self._scheduler().loads_stopped(stopped.reasons)
        sending, recving = self._scheduler().notices(
            connector_output.finished_sending,
            connector_output.finished_recving,
            connector_output.failed_recving,
            connector_output.invalid_block_ids,
        )
        # vLLM's scheduler reads these sets right after this hook; a notice for a request
        # the connector does not hold would fail its `assert req_id in self.requests`.
        if connector_output.finished_sending is not None:
            connector_output.finished_sending = sending
        if connector_output.finished_recving is not None:
            connector_output.finished_recving = recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(
            request.request_id,
            request.kv_transfer_params,
            finished_ok=request.status in _FINISHED_OK,
            block_ids=self._transfer_blocks(block_ids) if block_ids else (),
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    # -- worker side -----------------------------------------------------------------------------

    def _worker(self) -> WorkerHalf:
        if self.worker_half is None:
            raise RuntimeError("a worker hook was called on the scheduler-side kvfsm connector")
        return self.worker_half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker()
        # One page per head needs each head's bytes in one run: vLLM's head-major layout only (the
        # layout is resolved by now). Prefill and decode run the same layout, so both page alike.
        layout = self._vllm_config.cache_config.kv_cache_layout
        if getattr(layout, "name", layout) != "LBHNC":
            worker.kv_heads = None
        worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KVFSMConnectorMetadata):
            raise TypeError(f"the kvfsm connector got {type(metadata).__name__} metadata")
        self._worker().start(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _failed = self._worker().poll()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        stopped = self._worker().stopped_loads()
        return KVFSMStoppedLoads(stopped) if stopped else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker().take_load_errors()
        # Block ids are only unique within one KV cache group: with several, vLLM's
        # scheduler cannot map them back (it raises), so a failed load is reported
        # by request alone (`failed_recving`), as vLLM asks connectors to.
        return errors if len(self._kv_cache_config.kv_cache_groups) == 1 else set()

    # -- vLLM's metrics ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self.worker_half if self.worker_half is not None else self.scheduler_half
        payload = half.report() if half is not None else None
        if payload is None:
            return None
        from ._metrics import KVFSMConnectorStats

        return KVFSMConnectorStats(data=payload)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from ._metrics import KVFSMConnectorStats

        return KVFSMConnectorStats(data=data) if data is not None else KVFSMConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from ._metrics import KVFSMPromMetrics

        return KVFSMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.shutdown()
        if self.scheduler_half is not None:
            self.scheduler_half.shutdown()
