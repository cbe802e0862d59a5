"""vLLM engines as vLLM's own connector unit tests build them, with the kvfsm connector.

An `Engine` is one real `vllm.v1.core.sched.scheduler.Scheduler` plus one
worker-side connector, on the KV cache tensors of one fake model runner.
`Engine.step()` runs one engine step the way vLLM does: `schedule()`, the
worker connector's calls in the order of vLLM's
`KVConnectorModelRunnerMixin._get_kv_connector_output` (bind metadata,
`start_load_kv`, `wait_for_save`, `get_transfer_results`,
`get_block_ids_with_load_errors`, `get_kv_connector_stats`,
`build_connector_worker_meta`, clear metadata), a mock model output
(one token per request whose prompt is done), then `update_from_output`.

The fake model writes a known pattern into the blocks it computes:
`pattern(tokens)` is what a block must hold after a correct transfer, so a
decode can check the bytes it received block by block. Import only where
vLLM is installed (after `_env.prepare()`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.compat.vllm import KVFSMConnector

from ._env import MODEL

BLOCK_SIZE = 16
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
HEADS, HEAD_SIZE = 2, 8
EOS = 2
init_none_hash(sha256)


def vllm_config(
    kv_role: str,
    *,
    engine_id: str,
    extra: dict[str, Any] | None = None,
    policy: str = "fail",
    connector: str = "KVFSMConnector",
    module: str | None = "kvfsm.compat.vllm",
) -> VllmConfig:
    """A VllmConfig like vLLM's tests' `create_vllm_config`, for one engine of a P/D pair."""
    model = ModelConfig(model=MODEL, trust_remote_code=True, dtype="float16", seed=42)
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role=kv_role,  # type: ignore[arg-type,unused-ignore]
        engine_id=engine_id,
        kv_connector_extra_config=extra or {},
        kv_load_failure_policy=policy,  # type: ignore[arg-type,unused-ignore]
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.kv_cache_layout = "LBNHC"
    return config


#: The sliding window of `hybrid=True` engines' second KV cache group, in tokens.
WINDOW = 2 * BLOCK_SIZE


def kv_cache_config(num_blocks: int, hybrid: bool = False) -> KVCacheConfig:
    """One full-attention group over LAYERS, or (`hybrid`) LAYERS[0] full and LAYERS[1] sliding-window."""
    common: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_kv_heads": HEADS, "head_size": HEAD_SIZE}
    full = FullAttentionSpec(**common, dtype=torch.float32)
    if not hybrid:
        return KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), full)]
        )
    window: KVCacheSpec = SlidingWindowSpec(**common, dtype=torch.float32, sliding_window=WINDOW)
    groups = [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], window)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def pattern(tokens: list[int], layer: int) -> torch.Tensor:
    """The block a correct prefill computes for `tokens` (at most BLOCK_SIZE of them) in `layer`."""
    block = torch.zeros(2, BLOCK_SIZE, HEADS, HEAD_SIZE)
    for slot, token in enumerate(tokens):
        block[0, slot] = token * 4 + layer * 2
        block[1, slot] = token * 4 + layer * 2 + 1
    return block


def make_request(
    request_id: str, tokens: list[int], *, max_tokens: int, params: dict[str, Any] | None = None
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling.update_from_generation_config({}, EOS)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=sampling,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    request.kv_transfer_params = params
    return request


class Engine:
    """A vLLM scheduler and its worker connector on fake KV caches."""

    def __init__(
        self,
        kv_role: str,
        engine_id: str,
        *,
        extra: dict[str, Any] | None = None,
        policy: str = "fail",
        num_blocks: int = 64,
        hybrid: bool = False,
        dp_index: int = 0,
    ) -> None:
        """`hybrid`: two KV cache groups (full attention, sliding window) sharing one KV tensor, as
        vLLM's hybrid KV cache manager lays them out (one layer of each group per tensor)."""
        self.config = vllm_config(kv_role, engine_id=engine_id, extra=extra, policy=policy)
        self.config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
        # A data-parallel rank, as vLLM's engine core sets it in each DP rank's process.
        self.config.parallel_config.data_parallel_index = dp_index
        self.hybrid = hybrid
        self.kv_config = kv_cache_config(num_blocks, hybrid)
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK_SIZE,
        )
        self.worker = KVFSMConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
        # Per layer [num_blocks, 2 (K, V), block_size, heads, head_size]: block-first, like LBNHC.
        # Hybrid: both layers (one per group) view the same tensor; each block id is one group's.
        shared = torch.zeros(num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE) if hybrid else None
        self.kv = {
            name: shared if shared is not None else torch.zeros(num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.kv)
        #: Per step: the request ids the workers reported (sending, recving, failed) and load errors.
        self.reports: list[tuple[set[str], set[str], set[str], set[int]]] = []
        #: The `kv_connector_stats` payloads of vLLM's scheduler stats, one per step that had any.
        self.connector_stats: list[dict[str, Any]] = []

    @property
    def connector(self) -> KVFSMConnector:
        """The scheduler-side connector vLLM built."""
        connector = self.scheduler.connector
        assert isinstance(connector, KVFSMConnector)
        return connector

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def step(self) -> list[EngineCoreOutput]:
        output = self.scheduler.schedule()
        self._compute(output)
        connector_output = self._worker_step(output)
        model_output = self._model_output(output, connector_output)
        outputs = self.scheduler.update_from_output(output, model_output)
        for client in outputs.values():
            stats = client.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
        return [o for client in outputs.values() for o in client.outputs]

    def _worker_step(self, output: SchedulerOutput) -> KVConnectorOutput:
        worker = self.worker
        assert output.kv_connector_metadata is not None
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)  # type: ignore[arg-type,unused-ignore]
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        self.reports.append(
            (set(results.finished_sending), set(results.finished_recving), set(results.failed_recving), set(errors))
        )
        # As vLLM's model runner (`KVConnectorModelRunnerMixin`): the worker's stats and metadata ride on its output.
        return KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=errors,
            kv_connector_stats=stats,
            kv_connector_worker_meta=worker_meta,
        )

    def _layer_blocks(self, request_id: str) -> list[list[int]]:
        """Each layer's block ids of a request (a layer's group's blocks)."""
        groups = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return [list(groups[layer]) for layer in range(len(LAYERS))] if self.hybrid else [list(groups[0])] * 2

    def _compute(self, output: SchedulerOutput) -> None:
        """The fake forward: write each scheduled prompt token's pattern into its block."""
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            layer_blocks = self._layer_blocks(request_id)
            start = request.num_computed_tokens - count
            prompt = request.prompt_token_ids or []
            for position in range(start, min(start + count, len(prompt))):
                block, slot = divmod(position, BLOCK_SIZE)
                for layer, name in enumerate(LAYERS):
                    target = layer_blocks[layer][block]
                    if target != 0:  # 0: vLLM's null block (a sliding window's skipped blocks)
                        self.kv[name][target, :, slot] = pattern([prompt[position]], layer)[:, 0]

    def _model_output(self, output: SchedulerOutput, connector_output: KVConnectorOutput) -> ModelRunnerOutput:
        return model_output(self.scheduler, output, connector_output)

    def blocks_of(self, request_id: str) -> list[int]:
        return self._layer_blocks(request_id)[0]

    def check_blocks(self, request_id: str, tokens: list[int], first_block: int = 0) -> list[int]:
        """Indices (from `first_block`) of this request's blocks that do not hold `tokens`' pattern.

        A hybrid engine's sliding-window layer is checked on the blocks of its window only.
        """
        wrong = []
        layer_blocks = self._layer_blocks(request_id)
        count = (len(tokens) + BLOCK_SIZE - 1) // BLOCK_SIZE
        window_from = count - (-(-WINDOW // BLOCK_SIZE) + 1) if self.hybrid else 0
        for index in range(first_block, count):
            chunk = tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            for layer, name in enumerate(LAYERS):
                if self.hybrid and layer == 1 and index < window_from:
                    continue
                if not torch.equal(self.kv[name][layer_blocks[layer][index]], pattern(chunk, layer)):
                    wrong.append(index)
                    break
        return wrong

    def empty(self) -> bool:
        return scheduler_empty(self.scheduler)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def scheduler(kv_role: str, *, connector: str, module: str | None, num_blocks: int = 64) -> Scheduler:
    """A bare vLLM scheduler with `connector` (as vLLM's scheduler-side unit tests build one)."""
    config = vllm_config(kv_role, engine_id=f"{kv_role}-bare", connector=connector, module=module)
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


def scheduler_empty(scheduler: Scheduler) -> bool:
    """No request, no held block, every block back in the free queue (vLLM's `assert_scheduler_empty`)."""
    pool = scheduler.kv_cache_manager.block_pool
    return (
        not scheduler.requests
        and not scheduler.running
        and len(scheduler.waiting) == 0
        and len(scheduler.kv_holding_waiting) == 0
        and pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
        and all(block.ref_cnt == 0 for block in pool.blocks)
    )


def model_output(
    scheduler: Scheduler, output: SchedulerOutput, connector_output: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """The model runner's output for `output`: one token per request whose prompt is done."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests.get(request_id)
        # A chunk that ends before the prompt samples nothing (a request aborted meanwhile: anything).
        done = request is None or request.num_computed_tokens >= request.num_prompt_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=connector_output,
    )


def run_until(engines: Iterable[Engine], done: Callable[[], bool], *, steps: int = 5000, pause: float = 0.001) -> int:
    """Step every engine until `done()`; the number of rounds. Fails after `steps` rounds."""
    engines = list(engines)
    for round_ in range(steps):
        if done():
            return round_
        for engine in engines:
            engine.step()
        time.sleep(pause)
    raise AssertionError(f"not done after {steps} rounds")
