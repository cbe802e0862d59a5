"""The connector's figures for vLLM's metrics, as plain data (the payload of its connector stats).

vLLM collects a connector's stats through the connector itself: each
worker's `get_kv_connector_stats()` (and the scheduler's) returns an object
whose `data` dict travels to the engine's loggers, where the connector
class builds its stats object back (`build_kv_connector_stats`), adds up
the workers' and the intervals' (`aggregate`), logs a summary (`reduce`)
and feeds Prometheus (`build_prom_metrics`). `_metrics.py` holds those
vLLM classes; the payload and its arithmetic are here, free of vLLM, so
the main test suite checks them.

A payload (`new_payload()`), all of it serializable:

    transfer_duration   seconds of each successful room (first chunk to last)
    bytes_transferred   bytes of each successful room
    failures            failed rooms by `kvfsm.FailureKind` value
    releases            rooms a decode released unread (its prefix cache had their blocks)
    refused_tp          loads refused for a prefill of another TP size these workers cannot map
    expired_leases      prefill holds freed because their decode stopped renewing the lease
    holds               samples of the prefill's held requests (a gauge: the last one counts)
    quarantined_pages   samples of the pages the core holds in quarantine (a gauge; see
                        `quarantined_pages_of`)
"""

from __future__ import annotations

from typing import Any

from ..._manager import TransferHandle, TransferManager
from ..._states import KVPoll

__all__ = [
    "GAUGES",
    "TransferStats",
    "is_empty",
    "merge",
    "new_payload",
    "quarantined_pages_of",
    "reduce",
]

#: Payload keys whose samples are levels, not events: the last sample counts.
GAUGES = ("holds", "quarantined_pages")
_LISTS = ("transfer_duration", "bytes_transferred", *GAUGES)
_COUNTERS = ("releases", "refused_tp", "expired_leases")


def new_payload() -> dict[str, Any]:
    """An empty payload."""
    payload: dict[str, Any] = {key: [] for key in _LISTS}
    payload.update({key: 0 for key in _COUNTERS})
    payload["failures"] = {}
    return payload


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add `other` to `into` (in place; returned): events add up, gauge samples follow in order."""
    for key in _LISTS:
        into.setdefault(key, []).extend(other.get(key, ()))
    for key in _COUNTERS:
        into[key] = into.get(key, 0) + int(other.get(key, 0))
    failures = into.setdefault("failures", {})
    for kind, count in other.get("failures", {}).items():
        failures[kind] = failures.get(kind, 0) + int(count)
    return into


def is_empty(payload: dict[str, Any]) -> bool:
    return not any(payload.get(key) for key in (*_LISTS, *_COUNTERS, "failures"))


def reduce(payload: dict[str, Any]) -> dict[str, int | float]:
    """The summary vLLM logs each interval ("KV Transfer metrics: ...")."""
    durations = sorted(float(d) for d in payload.get("transfer_duration", ()))
    sizes = [int(b) for b in payload.get("bytes_transferred", ())]
    count = len(durations)
    total_mb = sum(sizes) / 2**20
    total_s = sum(durations)
    failures = payload.get("failures", {})
    summary: dict[str, int | float] = {
        "Num successful transfers": count,
        "Avg xfer time (ms)": round(total_s / count * 1e3, 3) if count else 0,
        "P90 xfer time (ms)": round(durations[min(count - 1, int(0.9 * count))] * 1e3, 3) if count else 0,
        "Avg MB per transfer": round(total_mb / count, 3) if count else 0,
        "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
        "Num failed transfers": sum(int(n) for n in failures.values()),
    }
    for kind in sorted(failures):
        summary[f"Failed ({kind})"] = int(failures[kind])
    summary["Num released unread"] = int(payload.get("releases", 0))
    summary["Num refused (TP)"] = int(payload.get("refused_tp", 0))
    summary["Num KV expired leases"] = int(payload.get("expired_leases", 0))
    for key, label in (("holds", "Held requests"), ("quarantined_pages", "Quarantined pages")):
        samples = payload.get(key) or ()
        if samples:
            summary[label] = int(samples[-1])
    return summary


def quarantined_pages_of(manager: TransferManager | None, page_nbytes: int) -> int | None:
    """Pages of failed rooms `manager` holds in quarantine now, until a proof (DESIGN.md rule 6).

    The core counts the bytes each room holds (`stats.quarantined_bytes`);
    `page_nbytes` is the size of one page of the rank's pools (a vLLM block,
    or one KV head of a block where the pools are head-major). None when
    there is no manager or no pools yet: the gauge is then not reported.
    """
    if manager is None or page_nbytes <= 0:
        return None
    return manager.stats.quarantined_bytes // page_nbytes


class TransferStats:
    """One half's figures since its last report (`take`)."""

    def __init__(self) -> None:
        self._payload = new_payload()
        self._last_gauges: dict[str, int] = {}

    def room_ended(self, handle: TransferHandle) -> None:
        """A transfer room was reported: a success's time and bytes, or a failure's kind."""
        if handle.state is KVPoll.Success:
            latency = handle.transfer_latency
            self._payload["transfer_duration"].append(0.0 if latency is None else float(latency))
            self._payload["bytes_transferred"].append(int(handle.nbytes))
        elif handle.reason is not None:
            kind = handle.reason.kind.value
            failures = self._payload["failures"]
            failures[kind] = failures.get(kind, 0) + 1

    def count(self, key: str, n: int = 1) -> None:
        if key not in _COUNTERS:
            raise KeyError(f"{key!r} is not a counter of the connector's stats; counters: {', '.join(_COUNTERS)}")
        self._payload[key] += n

    def sample(self, key: str, value: int | None) -> None:
        """A gauge's level, reported when it changed since the last report."""
        if key not in GAUGES:
            raise KeyError(f"{key!r} is not a gauge of the connector's stats; gauges: {', '.join(GAUGES)}")
        if value is not None and self._last_gauges.get(key) != value:
            self._last_gauges[key] = value
            self._payload[key].append(value)

    def take(self) -> dict[str, Any] | None:
        """The figures since the last call (None: nothing happened), and start afresh."""
        payload, self._payload = self._payload, new_payload()
        return None if is_empty(payload) else payload
