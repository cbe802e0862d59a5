"""kvfsm's figures in vLLM's logging stats and /metrics, through vLLM's own connector stats interface.

Two real vLLM schedulers (one process, LocalBackend): the workers' and the
schedulers' `get_kv_connector_stats()` ride on vLLM's model-runner output
into its `SchedulerStats.kv_connector_stats`, exactly as vLLM carries any
connector's; from there vLLM's own `KVConnectorLogging` (the "KV Transfer
metrics" log line) and `KVConnectorProm` (the Prometheus metrics) take them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

import prometheus_client  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from .harness import BLOCK_SIZE, Engine, make_request, run_until  # noqa: E402

LOCAL = {"backend": "local"}


def _held_and_loaded(p: Engine, d: Engine) -> None:
    tokens = list(range(100, 100 + 2 * BLOCK_SIZE + 5))
    p.add(make_request("p1", tokens, max_tokens=1, params={"do_remote_decode": True}))
    params = None
    for _ in range(10):
        for output in p.step():
            if output.kv_transfer_params is not None:
                params = output.kv_transfer_params
        if params is not None:
            break
    assert params is not None
    request = d.add(make_request("d1", tokens, max_tokens=2, params=dict(params)))
    run_until([p, d], lambda: request.is_finished() and p.empty())
    # A second load whose prefill shut down first: a failure of a known kind.
    p.add(make_request("p2", list(range(60)), max_tokens=1, params={"do_remote_decode": True}))
    params2 = None
    for _ in range(10):
        for output in p.step():
            if output.kv_transfer_params is not None:
                params2 = output.kv_transfer_params
        if params2 is not None:
            break
    assert params2 is not None
    p.step()
    failing = d.add(make_request("d2", list(range(60)), max_tokens=2, params=dict(params2)))
    d.step()
    p.worker.shutdown()
    run_until([d], lambda: failing.is_finished() and d.empty(), steps=100)
    assert failing.status is RequestStatus.FINISHED_ERROR


def _aggregate(engine: Engine) -> dict[str, Any]:
    stats = type(engine.connector).build_kv_connector_stats()
    assert stats is not None
    for payload in engine.connector_stats:
        stats = stats.aggregate(type(engine.connector).build_kv_connector_stats(copy.deepcopy(payload)))
    return dict(stats.data)


def test_transfers_bytes_failures_and_holds_reach_vllms_scheduler_stats(engines: Callable[..., Engine]) -> None:
    p, d = engines("kv_producer", extra=LOCAL), engines("kv_consumer", extra=LOCAL)
    _held_and_loaded(p, d)
    decode, prefill = _aggregate(d), _aggregate(p)
    assert len(decode["transfer_duration"]) == 1 and decode["bytes_transferred"][0] > 0
    assert decode["failures"] == {"peer_failed": 1}
    assert len(prefill["transfer_duration"]) == 1
    assert prefill["bytes_transferred"] == decode["bytes_transferred"]
    # The prefill's holds gauge went up with each held request and back to none.
    assert prefill["holds"][0] == 1 and 0 in prefill["holds"]


def test_vllms_logger_and_prometheus_show_them(
    engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    p, d = engines("kv_producer", extra=LOCAL), engines("kv_consumer", extra=LOCAL)
    _held_and_loaded(p, d)
    config = d.config
    logging_ = KVConnectorLogging(config.kv_transfer_config)
    # Each consumer gets its own copy, as vLLM's (serialized) payloads are: aggregating adds in place.
    for payload in d.connector_stats:
        logging_.observe(copy.deepcopy(payload))
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: ") and "Num successful transfers=1" in line
    assert "Num failed transfers=1" in line

    registry = prometheus_client.CollectorRegistry()

    def bound(cls: Any) -> Any:
        return type(
            cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)}
        )

    class Prom(KVConnectorProm):  # type: ignore[misc,unused-ignore]
        _gauge_cls = bound(prometheus_client.Gauge)
        _counter_cls = bound(prometheus_client.Counter)
        _histogram_cls = bound(prometheus_client.Histogram)

    prom = Prom(config, ["model_name", "engine"], {0: ["m", "0"]})
    for payload in d.connector_stats:
        prom.observe(copy.deepcopy(payload), 0)
    text = prometheus_client.generate_latest(registry).decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:kvfsm_transfers_total{{{labels}}} 1.0" in text
    assert "vllm:kvfsm_transfer_time_seconds_count" in text and "vllm:kvfsm_bytes_transferred_sum" in text
    failed = [line for line in text.splitlines() if line.startswith("vllm:kvfsm_failed_transfers_total{")]
    assert len(failed) >= 7 and sum(float(line.rsplit(" ", 1)[1]) for line in failed) == 1.0
    assert "vllm:kvfsm_expired_leases_total" in text and "vllm:kvfsm_held_requests" in text
