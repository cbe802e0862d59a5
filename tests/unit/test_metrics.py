"""TransferMetrics fed by a manager on a fake clock, Histogram, the Prometheus exporter."""

from __future__ import annotations

import pytest

import kvfsm
from kvfsm import FailureKind, FailureReason
from kvfsm.metrics import Histogram, PrometheusExporter, TransferMetrics, percentiles
from tests.helpers import FakeClock


def drive(manager: kvfsm.TransferManager, clock: FakeClock, room: int, chunks: list[int], fail: bool = False) -> None:
    handle = manager.open(room)
    clock.advance(0.5)
    handle.bootstrapped()
    clock.advance(0.25)
    handle.transfer_started()
    for index, nbytes in enumerate(chunks):
        clock.advance(0.1)
        handle.chunk_done(nbytes, last=index == len(chunks) - 1)
    clock.advance(0.05)
    if fail:
        handle.fail(FailureReason(FailureKind.TRANSFER_ERROR, "boom"))
    else:
        handle.transfer_done()
    clock.advance(1.0)
    manager.close(room)


def test_time_in_state_latency_bytes_and_counts() -> None:
    clock = FakeClock()
    manager = kvfsm.TransferManager("receiver", clock=clock)
    metrics = TransferMetrics()
    unsubscribe = metrics.attach(manager)
    drive(manager, clock, 1, [1000, 2000, 3000])
    drive(manager, clock, 2, [500], fail=True)
    aborted = manager.open(3)
    clock.advance(0.2)
    aborted.abort()
    snap = metrics.snapshot()["receiver"]
    assert snap["opened"] == 3
    assert snap["closed"] == 2
    assert snap["final_states"] == {"Success": 1, "Failed": 2}
    assert snap["failure_kinds"] == {"aborted": 1, "transfer_error": 1}
    assert snap["open_rooms"] == {"Failed": 1}
    assert snap["bytes"] == 6500
    assert snap["success_bytes"] == 6000
    assert snap["chunks"] == 4
    boot = snap["time_in_state_s"]["Bootstrapping"]
    assert boot["count"] == 3
    assert boot["max"] == pytest.approx(0.5)
    assert boot["min"] == pytest.approx(0.2)
    # Latency spans all chunks: transfer_started to the last chunk_done.
    lat = snap["transfer_latency_s"]
    assert lat["count"] == 2
    assert lat["max"] == pytest.approx(0.3)
    assert lat["min"] == pytest.approx(0.1)
    assert snap["throughput_gbps"]["max"] == pytest.approx(6000 / 0.3 / 1e9)
    assert snap["time_in_state_s"]["Success"]["p50"] == pytest.approx(1.0)  # until close
    unsubscribe()
    manager.close(3)
    assert metrics.snapshot()["receiver"]["closed"] == 2


def test_roles_are_kept_apart_and_unknown_rooms_ignored() -> None:
    clock = FakeClock()
    sender = kvfsm.TransferManager("sender", clock=clock)
    receiver = kvfsm.TransferManager("receiver", clock=clock)
    early = receiver.open(9)  # opened before metrics subscribed
    metrics = TransferMetrics()
    metrics.attach(sender)
    metrics.attach(receiver)
    early.bootstrapped()
    drive(sender, clock, 1, [10])
    snap = metrics.snapshot()
    assert snap["sender"]["final_states"]["Success"] == 1
    assert snap["receiver"]["final_states"]["Success"] == 0
    assert "Bootstrapping" not in snap["receiver"]["time_in_state_s"]


def test_histogram_quantiles_are_nearest_rank_and_buckets_cumulative_inputs() -> None:
    hist = Histogram(buckets=(1.0, 10.0), reservoir=1000)
    assert hist.quantile(0.5) is None
    for value in range(1, 101):
        hist.observe(float(value))
    assert hist.quantile(0.5) == 50.0
    assert hist.quantile(0.99) == 99.0
    assert hist.quantile(1.0) == 100.0
    assert hist.counts == [1, 9, 90]
    assert hist.mean == pytest.approx(50.5)
    with pytest.raises(ValueError, match="quantile must be in"):
        hist.quantile(1.5)
    with pytest.raises(ValueError, match="ascending"):
        Histogram(buckets=(2.0, 1.0))


def test_histogram_reservoir_stays_bounded_and_representative() -> None:
    hist = Histogram(reservoir=200)
    for value in range(10_000):
        hist.observe(float(value))
    assert len(hist._samples) == 200
    assert hist.count == 10_000
    median = hist.quantile(0.5)
    assert median is not None
    assert 3000 < median < 7000


def test_percentiles_helper() -> None:
    assert percentiles([]) == {"p50": None, "p99": None}
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p99": 3.0}


def test_prometheus_exporter_publishes_conventional_names() -> None:
    prometheus_client = pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    exporter = PrometheusExporter()
    clock = FakeClock()
    manager = kvfsm.TransferManager("sender", clock=clock)
    TransferMetrics(exporter=exporter).attach(manager)
    drive(manager, clock, 1, [100, 200])
    drive(manager, clock, 2, [50], fail=True)
    live = manager.open(3)
    live.bootstrapped()
    registry = exporter.registry
    get = registry.get_sample_value
    assert get("kvfsm_transfers_total", {"role": "sender", "state": "Success"}) == 1
    assert get("kvfsm_transfers_total", {"role": "sender", "state": "Failed"}) == 1
    assert get("kvfsm_transfer_failures_total", {"role": "sender", "kind": "transfer_error"}) == 1
    assert get("kvfsm_transfer_bytes_total", {"role": "sender"}) == 350
    assert get("kvfsm_transfer_chunks_total", {"role": "sender"}) == 3
    assert get("kvfsm_transfer_duration_seconds_count", {"role": "sender"}) == 2
    assert get("kvfsm_state_duration_seconds_count", {"role": "sender", "state": "Bootstrapping"}) == 3
    assert get("kvfsm_rooms", {"role": "sender", "state": "WaitingForInput"}) == 1
    assert get("kvfsm_rooms", {"role": "sender", "state": "Bootstrapping"}) == 0
    text = prometheus_client.generate_latest(registry).decode()
    assert "# TYPE kvfsm_transfer_duration_seconds histogram" in text
