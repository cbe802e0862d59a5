"""kvfsm's figures in vLLM's metrics, through vLLM's own connector stats interface.

`KVFSMConnectorStats` is the `KVConnectorStats` each half returns from
`get_kv_connector_stats()`; vLLM adds up the workers' and the scheduler's,
logs `reduce()` each logging interval ("KV Transfer metrics: ...") and
hands the payload to `KVFSMPromMetrics`, which `/metrics` serves:

    vllm:kvfsm_transfer_time_seconds     histogram: a successful room, first chunk to last
    vllm:kvfsm_bytes_transferred         histogram: a successful room's bytes
    vllm:kvfsm_transfers                 counter: successful rooms
    vllm:kvfsm_failed_transfers{kind}    counter: failed rooms by kvfsm.FailureKind
    vllm:kvfsm_released_unread           counter: rooms a decode released unread
    vllm:kvfsm_refused_tp                counter: loads refused for a prefill of another TP size
    vllm:kvfsm_expired_leases            counter: holds freed because their decode stopped renewing
    vllm:kvfsm_held_requests             gauge: requests whose blocks a prefill holds
    vllm:kvfsm_quarantined_pages         gauge: pages of failed loads held in quarantine (the
                                         core's count, in pages: `_stats.quarantined_pages_of`)

The payload and its arithmetic are `_stats`' (no vLLM there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from ..._states import FailureKind
from . import _stats

__all__ = ["KVFSMConnectorStats", "KVFSMPromMetrics"]


@dataclass
class KVFSMConnectorStats(KVConnectorStats):
    """The connector's figures of one interval, as vLLM's loggers take them."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _stats.new_payload()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        _stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return _stats.reduce(self.data)

    def is_empty(self) -> bool:
        return _stats.is_empty(self.data)


class KVFSMPromMetrics(KVConnectorPromMetrics):
    """The Prometheus metrics of the kvfsm connector, one series per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            made: dict[int, Any] = create_metric_per_engine(metric, self.per_engine_labelvalues)
            return made

        self.transfer_time = per_engine(
            self._histogram_cls(
                name="vllm:kvfsm_transfer_time_seconds",
                documentation="Seconds of a successful kvfsm KV transfer room, first chunk to last.",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0],
                labelnames=labelnames,
            )
        )
        self.transfer_bytes = per_engine(
            self._histogram_cls(
                name="vllm:kvfsm_bytes_transferred",
                documentation="Bytes of a successful kvfsm KV transfer room.",
                buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
                labelnames=labelnames,
            )
        )
        self.transfers = per_engine(
            self._counter_cls(
                name="vllm:kvfsm_transfers",
                documentation="Successful kvfsm KV transfer rooms.",
                labelnames=labelnames,
            )
        )
        self.failed = self._counter_cls(
            name="vllm:kvfsm_failed_transfers",
            documentation="Failed kvfsm KV transfer rooms, by failure kind (kvfsm.FailureKind).",
            labelnames=[*labelnames, "kind"],
        )
        self.counters = {
            key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, name, doc in (
                ("releases", "vllm:kvfsm_released_unread", "kvfsm rooms a decode released unread."),
                ("refused_tp", "vllm:kvfsm_refused_tp", "Loads refused: a prefill of a TP size not mapped."),
                (
                    "expired_leases",
                    "vllm:kvfsm_expired_leases",
                    "Prefill holds freed because their decode stopped renewing the lease. "
                    "NOTE: tracked on the prefill.",
                ),
            )
        }
        self.gauges = {
            key: per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, name, doc in (
                ("holds", "vllm:kvfsm_held_requests", "Requests whose KV blocks a kvfsm prefill holds."),
                ("quarantined_pages", "vllm:kvfsm_quarantined_pages", "KV pages kvfsm holds in quarantine."),
            )
        }
        # Every kind exists from the start, so a rate over it never starts from nothing.
        for engine, values in self.per_engine_labelvalues.items():
            for kind in FailureKind:
                self.failed.labels(*values, kind.value)
            del engine

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for seconds in data.get("transfer_duration", ()):
            self.transfer_time[engine_idx].observe(seconds)
        for nbytes in data.get("bytes_transferred", ()):
            self.transfer_bytes[engine_idx].observe(nbytes)
        if data.get("transfer_duration"):
            self.transfers[engine_idx].inc(len(data["transfer_duration"]))
        values = self.per_engine_labelvalues[engine_idx]
        for kind, count in data.get("failures", {}).items():
            if count:
                self.failed.labels(*values, kind).inc(count)
        for key, counter in self.counters.items():
            if data.get(key):
                counter[engine_idx].inc(data[key])
        for key, gauge in self.gauges.items():
            samples = data.get(key)
            if samples:
                gauge[engine_idx].set(samples[-1])
