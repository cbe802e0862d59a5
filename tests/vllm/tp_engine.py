"""A vLLM engine of several tensor-parallel ranks: one scheduler, one worker connector per rank.

As vLLM runs it: the scheduler's connector plans each step once, every
rank's worker connector runs the step's hooks, and a request counts as
sent or loaded once every rank reported it (vLLM's `KVOutputAggregator`).
Each rank holds its own slice of the KV heads in vLLM's head-major block
layout (LBHNC: `[num_blocks, heads, block_size, 2 (K, V), head_size]`), and
the fake model writes, for every token, a value naming its token, layer,
K or V and *global* head, so a decode whose ranks merged the heads of
several prefill ranks can check every head of every block.

`TPChild` runs one such engine in a child process over a pipe (the
unequal-TP tests put the prefill there, KV over Mooncake on 127.0.0.1).
"""

from __future__ import annotations

import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any
from unittest import mock

from tests.pipe_child import PipeChild, build_or_exit, exit_child, serve

HEADS_TOTAL = 4
HEAD_SIZE = 8
BLOCK = 16
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")


def value(token: int, layer: int, kv: int, head: int) -> float:
    return float(token * 64 + layer * 16 + kv * 8 + head)


class TPEngine:
    """vLLM's scheduler with the kvfsm connector and `tp` worker connectors on head-sliced caches."""

    def __init__(self, kv_role: str, engine_id: str, tp: int, extra: dict[str, Any], num_blocks: int = 32) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kvfsm.compat.vllm import KVFSMConnector

        from .harness import vllm_config

        self.tp, self.heads = tp, HEADS_TOTAL // tp
        config = vllm_config(kv_role, engine_id=engine_id, extra=extra)
        config.cache_config.block_size = BLOCK
        config.cache_config.kv_cache_layout = "LBHNC"
        config.cache_config.num_gpu_blocks = num_blocks
        config.parallel_config.tensor_parallel_size = tp
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=HEAD_SIZE, dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(list(LAYERS), spec)])
        self.config = config
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.workers = []
        self.kv: list[dict[str, Any]] = []
        for rank in range(tp):
            with mock.patch("kvfsm.compat.vllm._connector._tp_rank", return_value=rank):
                worker = KVFSMConnector(config, KVConnectorRole.WORKER, kv_config)
            caches = {name: torch.zeros(num_blocks, self.heads, BLOCK, 2, HEAD_SIZE) for name in LAYERS}
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.kv.append(caches)
        self._pending: dict[str, Counter[str]] = {"sending": Counter(), "recving": Counter(), "failed": Counter()}
        self.loaded: set[str] = set()
        self.failed: set[str] = set()
        self.requests: dict[str, Any] = {}

    def add(self, request_id: str, tokens: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        from .harness import make_request

        request = make_request(request_id, tokens, max_tokens=max_tokens, params=params)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput

        from .harness import model_output

        output = self.scheduler.schedule()
        self._compute(output)
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for worker in self.workers:
            assert output.kv_connector_metadata is not None
            worker.bind_connector_metadata(output.kv_connector_metadata)
            worker.start_load_kv(None)  # type: ignore[arg-type,unused-ignore]
            results = worker.get_transfer_results(output.finished_req_ids)
            worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            for key, done, into in (
                ("sending", results.finished_sending, sending),
                ("recving", results.finished_recving, recving),
                ("failed", results.failed_recving, failed),
            ):
                for request_id in done:
                    self._pending[key][request_id] += 1
                    if self._pending[key][request_id] == self.tp:
                        del self._pending[key][request_id]
                        into.add(request_id)
        self.failed |= failed
        self.loaded |= recving - failed
        connector_output = KVConnectorOutput(
            finished_sending=sending or None, finished_recving=recving or None, failed_recving=failed
        )
        outputs = self.scheduler.update_from_output(output, model_output(self.scheduler, output, connector_output))
        return [o for client in outputs.values() for o in client.outputs]

    def _compute(self, output: Any) -> None:
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            start = request.num_computed_tokens - count
            prompt = request.prompt_token_ids or []
            for position in range(start, min(start + count, len(prompt))):
                block, slot = divmod(position, BLOCK)
                for rank, caches in enumerate(self.kv):
                    for layer, name in enumerate(LAYERS):
                        for head in range(self.heads):
                            for kv in (0, 1):
                                g = rank * self.heads + head
                                caches[name][blocks[block], head, slot, kv] = value(prompt[position], layer, kv, g)

    def wrong_blocks(self, request_id: str) -> list[int]:
        """Block indices of a loaded request whose heads, on any rank, do not hold the prefill's values."""
        request = self.requests[request_id]
        tokens = list(request.prompt_token_ids or [])
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        wrong = []
        for index in range((len(tokens) - 1) // BLOCK):  # whole blocks before the token the decode computes
            ok = True
            for rank, caches in enumerate(self.kv):
                for layer, name in enumerate(LAYERS):
                    for head in range(self.heads):
                        g = rank * self.heads + head
                        for slot, token in enumerate(tokens[index * BLOCK : (index + 1) * BLOCK]):
                            for kv in (0, 1):
                                got = caches[name][blocks[index], head, slot, kv]
                                ok &= bool((got == value(token, layer, kv, g)).all())
            if not ok:
                wrong.append(index)
        return wrong

    def held(self) -> int:
        half = self.scheduler.connector.scheduler_half  # type: ignore[union-attr,unused-ignore]
        return len(half.held)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


class TPChild(PipeChild):
    """A `TPEngine` in a child process: `prefill`, `run`, `held` over the pipe."""

    def __init__(self, kv_role: str, engine_id: str, tp: int, extra: dict[str, Any]) -> None:
        super().__init__(_child_main, (kv_role, engine_id, tp, extra), f"{kv_role} TP{tp}")

    def ready(self, timeout: float = 180.0) -> None:
        self._receive("start-up", timeout)

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        return self._call(name, *args, timeout=timeout)

    def post(self, name: str, *args: Any) -> None:
        self._post(name, args)

    def result(self, timeout: float = 60.0) -> Any:
        return self._receive("call", timeout)

    def answered(self) -> bool:
        """Whether the posted call's answer is there to read."""
        return bool(self._conn.poll(0))


def _child_main(conn: Connection, kv_role: str, engine_id: str, tp: int, extra: dict[str, Any]) -> None:
    endpoint = build_or_exit(conn, lambda: _Endpoint(kv_role, engine_id, tp, extra))
    conn.send((True, "ready"))
    serve(conn, endpoint)
    exit_child(endpoint.engine.shutdown)


class _Endpoint:
    def __init__(self, kv_role: str, engine_id: str, tp: int, extra: dict[str, Any]) -> None:
        from . import _env

        _env.prepare()
        self.engine = TPEngine(kv_role, engine_id, tp, extra)

    def prefill(self, request_id: str, tokens: list[int]) -> dict[str, Any]:
        self.engine.add(request_id, tokens, 1, {"do_remote_decode": True})
        for _ in range(20):
            for output in self.engine.step():
                if output.request_id == request_id and output.kv_transfer_params is not None:
                    return dict(output.kv_transfer_params)
        raise AssertionError(f"prefill {request_id} did not finish")

    def run(self, seconds: float) -> int:
        """Step for `seconds`; the requests still held at the end."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.engine.step()
            if not self.engine.held():
                break
            time.sleep(0.002)
        return self.engine.held()
