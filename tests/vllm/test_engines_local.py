"""Two vLLM engines in one process, a prefill and a decode, over kvfsm's LocalBackend.

Real vLLM schedulers (vLLM 0.33.0's `Scheduler`), real connectors on both
roles, the worker side driven as vLLM's model runner drives it
(`harness.Engine.step`), and a fake model that writes a known pattern into
the blocks it computes, so every transfer is checked byte for byte.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm import ConfigError, FailureKind, KVPoll  # noqa: E402
from kvfsm.compat.vllm import KVFSMConnector, KVFSMConnectorMetadata  # noqa: E402
from kvfsm.compat.vllm._plan import RecvSpec, SendSpec, StepPlan  # noqa: E402

from .harness import BLOCK_SIZE, Engine, make_request, run_until, vllm_config  # noqa: E402

LOCAL = {"backend": "local"}


def prefill(engine: Engine, request_id: str, tokens: list[int]) -> dict[str, Any]:
    """Run a prefill request to its end on `engine`; its kv_transfer_params for the decode."""
    engine.add(make_request(request_id, tokens, max_tokens=1, params={"do_remote_decode": True}))
    for _ in range(10):
        for output in engine.step():
            if output.request_id == request_id and output.finish_reason is not None:
                assert output.finish_reason is FinishReason.LENGTH
                assert output.kv_transfer_params is not None
                return dict(output.kv_transfer_params)
    raise AssertionError("the prefill did not finish")


def test_the_connector_is_found_as_vllm_finds_third_party_ones() -> None:
    transfer = KVTransferConfig(
        kv_connector="KVFSMConnector", kv_connector_module_path="kvfsm.compat.vllm", kv_role="kv_producer"
    )
    cls = KVConnectorFactory.get_connector_class(transfer)
    assert cls is KVFSMConnector and supports_hma(cls)


def test_a_prefill_reaches_its_decode_byte_exact(engines: Callable[..., Engine]) -> None:
    p, d = engines("kv_producer", extra=LOCAL), engines("kv_consumer", extra=LOCAL)
    tokens = list(range(100, 100 + 2 * BLOCK_SIZE + 5))
    params = prefill(p, "p1", tokens)
    assert params["remote_engine_id"] == p.config.kv_transfer_config.engine_id
    assert len(params["remote_block_ids"][0]) == 3 and p.scheduler.requests, "the prefill holds its blocks"
    request = d.add(make_request("d1", tokens, max_tokens=4, params=params))
    run_until([p, d], lambda: any("d1" in report[1] for report in d.reports))
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.check_blocks("d1", tokens) == []
    run_until([p, d], lambda: request.is_finished() and p.empty())
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert d.empty()
    worker = d.worker.worker_half
    assert worker is not None and worker.stats.loaded == 1 and worker.stats.failed_loads == 0
    assert p.connector.scheduler_half is not None and p.connector.scheduler_half.stats.absorbed_notices == 0


def test_a_decode_with_a_cached_prefix_loads_only_the_tail(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = engines("kv_producer", extra=LOCAL), engines("kv_consumer", extra=LOCAL)
    receiver = d.worker.worker_half.receiver if d.worker.worker_half else None
    assert receiver is not None
    expected: list[int] = []
    expect = receiver.expect

    def spy(handle: Any, pages: Any, aux_index: int | None = None) -> None:
        expected.append(len(pages))
        expect(handle, pages, aux_index)

    monkeypatch.setattr(receiver, "expect", spy)
    prefix = list(range(500, 500 + 2 * BLOCK_SIZE))
    first, second = [*prefix, 1, 2, 3], [*prefix, 7, 8, 9, 10]
    for name, tokens in (("a", first), ("b", second)):
        params = prefill(p, f"p-{name}", tokens)
        request = d.add(make_request(f"d-{name}", tokens, max_tokens=2, params=params))
        run_until([p, d], lambda name=name: any(f"d-{name}" in r[1] for r in d.reports))  # type: ignore[misc]
        assert d.check_blocks(f"d-{name}", tokens) == []
        run_until([p, d], lambda request=request: request.is_finished() and p.empty())  # type: ignore[misc]
    # The second load moved one block (the prefill sent its last): the decode had the first two cached.
    assert expected == [3, 1]
    assert d.empty()


def test_a_decode_aborted_while_waiting_frees_both_sides_without_a_deadline(engines: Callable[..., Engine]) -> None:
    p, d = engines("kv_producer", extra=LOCAL), engines("kv_consumer", extra=LOCAL)
    tokens = list(range(40))
    params = prefill(p, "p1", tokens)
    p.step()  # the prefill's worker holds the room now
    request = d.add(make_request("d1", tokens, max_tokens=4, params=params))
    d.step()
    d.step()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS  # the prefill's worker does not step: no bytes
    d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert d.scheduler.requests, "vLLM keeps the blocks of a request waiting for its KV"
    run_until([d], d.empty, steps=50)
    run_until([p], p.empty, steps=50)
    decode, prefill_worker = d.worker.worker_half, p.worker.worker_half
    assert decode is not None and decode.decode is not None
    assert decode.decode.stats.failure_kinds[FailureKind.ABORTED] == 1
    assert prefill_worker is not None and prefill_worker.prefill is not None
    assert prefill_worker.prefill.stats.failure_kinds[FailureKind.ABORTED] == 1  # told by the decode


def _load_while_the_prefill_shuts_down(engines: Callable[..., Engine], **kind: Any) -> tuple[Engine, Any]:
    """A decode starts loading d1 from a prefill whose worker then shuts down; run to the end."""
    p = engines("kv_producer", extra=LOCAL, **kind)
    d = engines("kv_consumer", extra=LOCAL, **kind)
    tokens = list(range(40))
    params = prefill(p, "p1", tokens)
    p.step()
    request = d.add(make_request("d1", tokens, max_tokens=4, params=params))
    d.step()
    p.worker.shutdown()
    run_until([d], d.empty, steps=50)
    return d, request


def test_a_prefill_shutting_down_fails_the_decodes_load(engines: Callable[..., Engine]) -> None:
    _, request = _load_while_the_prefill_shuts_down(engines)
    assert request.status is RequestStatus.FINISHED_ERROR  # kv_load_failure_policy="fail"


def test_unusable_params_make_the_decode_compute_locally(engines: Callable[..., Engine]) -> None:
    d = engines("kv_consumer", extra=LOCAL)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "p1",
        "remote_block_ids": [[1, 2]],
        "remote_host": "h",
        "remote_port": 0,
        "tp_size": 1,
    }
    tokens = list(range(20))
    request = d.add(make_request("d1", tokens, max_tokens=2, params=params))
    d.step()
    assert request.status is RequestStatus.RUNNING
    run_until([d], lambda: request.is_finished() and d.empty(), steps=20)
    assert d.connector.scheduler_half is not None and d.connector.scheduler_half.stats.invalid_params == 1


def test_a_hybrid_kv_cache_moves_every_group_with_its_own_blocks(engines: Callable[..., Engine]) -> None:
    # Full attention and a sliding window in one KV tensor (vLLM's hybrid layout): each
    # group's blocks are other block ids, and the window keeps only its tail.
    p = engines("kv_producer", extra=LOCAL, hybrid=True)
    d = engines("kv_consumer", extra=LOCAL, hybrid=True)
    tokens = list(range(300, 300 + 5 * BLOCK_SIZE + 3))
    params = prefill(p, "p1", tokens)
    full, window = params["remote_block_ids"]
    assert len(full) == 6 and len(window) == 3 and set(full).isdisjoint(window)
    request = d.add(make_request("d1", tokens, max_tokens=3, params=params))
    run_until([p, d], lambda: any("d1" in report[1] for report in d.reports))
    assert not any("d1" in report[2] for report in d.reports), "the load did not fail"
    assert d.check_blocks("d1", tokens) == []
    run_until([p, d], lambda: request.is_finished() and p.empty() and d.empty())
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    prefill_worker = p.worker.worker_half
    assert prefill_worker is not None and prefill_worker.prefill is not None
    assert prefill_worker.prefill.stats.final_states[KVPoll.Success] == 2  # one room per group


def test_a_hybrid_load_that_fails_is_reported_by_request_not_by_block(engines: Callable[..., Engine]) -> None:
    # vLLM raises on block-level errors with several KV cache groups (block ids repeat across groups).
    d, request = _load_while_the_prefill_shuts_down(engines, hybrid=True)
    assert request.status is RequestStatus.FINISHED_ERROR
    assert any("d1" in report[2] for report in d.reports) and not any(report[3] for report in d.reports)


def test_unknown_settings_are_refused_at_start() -> None:
    config = vllm_config("kv_consumer", engine_id="e", extra={"hold_timout": 5})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ConfigError, match="hold_timout"):
        KVFSMConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(10, [], [KVCacheGroupSpec(["a"], spec)]))


def test_the_metadata_pickles(engines: Callable[..., Engine]) -> None:
    # vLLM's multiprocess executor ships the scheduler output (with this metadata) to its workers.
    plan = StepPlan(recv=[RecvSpec("d", "P/p", None, (1, 2), problem="x")], send=[SendSpec("p", "E/p", (3,))])
    copy = pickle.loads(pickle.dumps(KVFSMConnectorMetadata(plan)))
    assert isinstance(copy, KVFSMConnectorMetadata) and copy.plan == plan
