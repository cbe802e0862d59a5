"""The connector stats payload (`kvfsm.compat.vllm._stats`): no vLLM needed."""

from __future__ import annotations

from typing import Any

import pytest

from kvfsm import FailureKind, FailureReason, Role, Timeouts, TransferManager
from kvfsm.compat.vllm import _stats


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_success_counts_its_time_and_bytes_and_a_failure_its_kind() -> None:
    clock = Clock()
    manager = TransferManager(Role.RECEIVER, timeouts=Timeouts(), clock=clock)
    ok, bad = manager.open("ok"), manager.open("bad")
    ok.bootstrapped()
    ok.transfer_started()
    clock.now += 0.25
    ok.chunk_done(4096, last=True)
    ok.transfer_done()
    bad.fail(FailureReason(FailureKind.PEER_LOST, "gone"))
    stats = _stats.TransferStats()
    stats.room_ended(ok)
    stats.room_ended(bad)
    payload = stats.take()
    assert payload is not None
    assert payload["transfer_duration"] == [pytest.approx(0.25)] and payload["bytes_transferred"] == [4096]
    assert payload["failures"] == {"peer_lost": 1}
    assert stats.take() is None, "a report starts afresh"


def test_gauges_are_reported_when_they_change_and_the_last_sample_counts() -> None:
    stats = _stats.TransferStats()
    stats.sample("holds", 2)
    stats.sample("holds", 2)
    stats.sample("quarantined_pages", None)  # no pools registered yet: nothing reported
    first = stats.take()
    assert first is not None and first["holds"] == [2] and first["quarantined_pages"] == []
    stats.sample("holds", 2)
    assert stats.take() is None, "an unchanged level is no news"
    stats.sample("holds", 0)
    second = stats.take()
    assert second is not None
    merged = _stats.merge(first, second)
    assert merged["holds"] == [2, 0] and _stats.reduce(merged)["Held requests"] == 0


def test_merge_adds_events_and_reduce_summarises_them() -> None:
    a: dict[str, Any] = {**_stats.new_payload(), "transfer_duration": [0.1, 0.3], "bytes_transferred": [2**20, 2**20]}
    a["failures"] = {"timeout": 1}
    b: dict[str, Any] = {**_stats.new_payload(), "expired_leases": 2, "refused_tp": 1, "releases": 3}
    b["failures"] = {"timeout": 2, "aborted": 1}
    summary = _stats.reduce(_stats.merge(a, b))
    assert summary["Num successful transfers"] == 2 and summary["Avg xfer time (ms)"] == 200.0
    assert summary["Avg MB per transfer"] == 1.0 and summary["Throughput (MB/s)"] == 5.0
    assert summary["Num failed transfers"] == 4 and summary["Failed (timeout)"] == 3
    assert summary["Num KV expired leases"] == 2 and summary["Num refused (TP)"] == 1
    assert _stats.is_empty(_stats.new_payload()) and not _stats.is_empty(b)
    assert _stats.reduce(_stats.new_payload())["Num successful transfers"] == 0


def test_unknown_keys_are_refused_by_name() -> None:
    stats = _stats.TransferStats()
    with pytest.raises(KeyError, match="'holds' is not a counter"):
        stats.count("holds")
    with pytest.raises(KeyError, match="'releases' is not a gauge"):
        stats.sample("releases", 1)


def test_the_quarantine_gauge_counts_the_cores_quarantined_bytes_in_pages() -> None:
    manager = TransferManager(Role.RECEIVER)
    assert _stats.quarantined_pages_of(None, 4096) is None
    assert _stats.quarantined_pages_of(manager, 0) is None, "no pools registered yet: nothing to report"
    assert _stats.quarantined_pages_of(manager, 4096) == 0
    manager.stats.quarantined_bytes = 3 * 4096  # what the release phase counts for three held pages
    assert _stats.quarantined_pages_of(manager, 4096) == 3
