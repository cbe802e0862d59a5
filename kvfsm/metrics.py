"""Lifecycle metrics, fed by the manager's observer hook (rule 10).

`TransferMetrics` subscribes to one or more managers
(`metrics.attach(manager)`) and turns their `StateChange` notices into:

* time spent in each state (histogram per role and state),
* transfer latency: from entering Transferring (the first chunk's start)
  to the chunk flagged last landing, so every chunk counts, not the last,
* bytes moved and throughput (GB/s per successful transfer),
* counts per final state and per failure kind, and open rooms per state,
* the release phase: rooms and bytes whose pages are quarantined now
  (gauges), quarantines, late proofs and operator overrides (counts).

States are those of each manager's lifecycle (`kvfsm.Lifecycle`): a
lifecycle with a `Staging` state gets its own time-in-state histogram and
open-room gauge; success and failure are read from what each state
reports.

Histograms keep Prometheus-style cumulative buckets plus a bounded sample
reservoir for p50/p99, so memory stays flat however many rooms pass.
`snapshot()` returns all figures as plain dicts (what `kvfsm simulate
--json` writes).

`PrometheusExporter` (extra `prometheus`, package `prometheus-client`)
publishes the same figures under conventional names: `kvfsm_transfers_total
{role,state}`, `kvfsm_transfer_failures_total{role,kind}`,
`kvfsm_transfer_bytes_total{role}`, `kvfsm_transfer_chunks_total{role}`,
`kvfsm_transfer_duration_seconds{role}`, `kvfsm_state_duration_seconds
{role,state}`, `kvfsm_rooms{role,state}`, `kvfsm_quarantined_rooms{role}`,
`kvfsm_quarantined_bytes{role}`, `kvfsm_quarantines_total{role}`,
`kvfsm_quarantine_releases_total{role,how}` (how: proof or override). The core never imports this
module; nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from ._lifecycle import lifecycle_of
from ._manager import TransferManager
from ._observe import StateChange
from ._release import PagesState
from ._states import FailureKind, KVPoll, State

__all__ = ["Histogram", "TransferMetrics", "PrometheusExporter", "DURATION_BUCKETS"]

#: Seconds, from 10 us to 5 min: transfers and deadlines both fit.
DURATION_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
#: GB/s per transfer.
THROUGHPUT_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


class Histogram:
    """Cumulative buckets (as Prometheus) plus a bounded reservoir for quantiles.

    Quantiles are exact while fewer than `reservoir` values were observed,
    and a uniform sample's quantiles afterwards (Vitter's algorithm R,
    seeded, so runs are reproducible). Not thread-safe on its own:
    `TransferMetrics` serialises access.
    """

    def __init__(self, buckets: Sequence[float] = DURATION_BUCKETS, reservoir: int = 65536, seed: int = 0) -> None:
        if list(buckets) != sorted(buckets) or not buckets:
            raise ValueError(f"histogram buckets must be a non-empty ascending sequence; got {buckets!r}")
        if reservoir < 1:
            raise ValueError(f"reservoir must hold at least one value; got {reservoir}")
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._samples: list[float] = []
        self._capacity = reservoir
        self._rng = random.Random(seed)
        self._sorted = True

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if len(self._samples) < self._capacity:
            self._samples.append(value)
        else:
            slot = self._rng.randrange(self.count)
            if slot < self._capacity:
                self._samples[slot] = value
        self._sorted = False

    def quantile(self, q: float) -> float | None:
        """The q-quantile (nearest rank) of the observed values; None if empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1]; got {q}")
        if not self._samples:
            return None
        if not self._sorted:
            self._samples.sort()
            self._sorted = True
        rank = max(1, math.ceil(q * len(self._samples)))
        return self._samples[rank - 1]

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def summary(self) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "mean": self.mean,
            "min": self.min if self.count else None,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
            "max": self.max if self.count else None,
        }


class _Room:
    __slots__ = ("entered_at", "nbytes", "state", "transfer_started_at")

    def __init__(self, state: State, now: float) -> None:
        self.state = state
        self.entered_at = now
        self.transfer_started_at: float | None = None
        self.nbytes = 0


class _RoleFigures:
    def __init__(self, reservoir: int) -> None:
        self.reservoir = reservoir
        # Per state of whichever lifecycles report here (the KV lifecycle's listed from the start).
        self.time_in_state: dict[State, Histogram] = {state: Histogram(reservoir=reservoir) for state in KVPoll}
        self.transfer_latency = Histogram(reservoir=reservoir)
        self.throughput = Histogram(THROUGHPUT_BUCKETS, reservoir=reservoir)
        self.final_states: dict[State, int] = {KVPoll.Success: 0, KVPoll.Failed: 0}
        self.failure_kinds = {kind: 0 for kind in FailureKind}
        self.open_rooms: dict[State, int] = {state: 0 for state in KVPoll}
        self.bytes = 0
        self.success_bytes = 0
        self.chunks = 0
        self.opened = 0
        self.closed = 0
        self.quarantined_rooms = 0
        self.quarantined_bytes = 0
        self.quarantines = 0
        self.quarantine_releases = {"proof": 0, "override": 0}

    def stay(self, state: State) -> Histogram:
        hist = self.time_in_state.get(state)
        if hist is None:
            hist = self.time_in_state[state] = Histogram(reservoir=self.reservoir)
        return hist

    def count_open(self, state: State, delta: int) -> None:
        self.open_rooms[state] = self.open_rooms.get(state, 0) + delta


class TransferMetrics:
    """Figures over every room of the managers it is attached to, per role.

    Use as an observer: `metrics.attach(manager)` (or
    `manager.subscribe(metrics)`). `snapshot()` returns plain data.
    Thread-safe; memory is bounded by the number of open rooms plus the
    histograms' reservoirs.
    """

    def __init__(self, *, reservoir: int = 65536, exporter: PrometheusExporter | None = None) -> None:
        self._lock = threading.Lock()
        self._reservoir = reservoir
        self._roles: dict[str, _RoleFigures] = {}
        self._rooms: dict[tuple[str, Hashable, int], _Room] = {}
        # Rooms whose pages are quarantined, with the bytes they hold (closed ones too).
        self._quarantined: dict[tuple[str, Hashable, int], int] = {}
        self.exporter = exporter

    def attach(self, manager: TransferManager) -> Callable[[], None]:
        """Subscribe to `manager`; returns the unsubscribe function."""
        return manager.subscribe(self)

    def __call__(self, change: StateChange) -> None:
        role = change.role.value
        key = (role, change.room, change.generation)
        exporter = self.exporter
        with self._lock:
            figures = self._roles.get(role)
            if figures is None:
                figures = self._roles[role] = _RoleFigures(self._reservoir)
            event = change.event
            if change.pages is not None:
                self._pages(figures, key, change, exporter, role)
                return
            if event == "open":
                assert change.dest is not None
                self._rooms[key] = _Room(change.dest, change.time)
                figures.opened += 1
                figures.count_open(change.dest, 1)
                if exporter is not None:
                    exporter.room_entered(role, change.dest)
                return
            room = self._rooms.get(key)
            if event == "close":
                closed = self._rooms.pop(key, None)
                figures.closed += 1
                if closed is not None:
                    # Time in the final state: how long the pages waited to be released.
                    figures.stay(closed.state).observe(change.time - closed.entered_at)
                if change.source is not None:
                    figures.count_open(change.source, -1)
                    if exporter is not None:
                        exporter.room_left(role, change.source)
                return
            if room is None:  # opened before we subscribed
                return
            if change.dest is None or change.dest is change.source:  # chunk_done: progress only
                room.nbytes += change.nbytes
                figures.bytes += change.nbytes
                figures.chunks += 1
                if exporter is not None:
                    exporter.chunk(role, change.nbytes)
                if change.last and room.transfer_started_at is not None:
                    self._transfer_finished(figures, room, change.time, exporter, role)
                return
            stay = change.time - room.entered_at
            source, dest = room.state, change.dest
            figures.stay(source).observe(stay)
            figures.count_open(source, -1)
            figures.count_open(dest, 1)
            if exporter is not None:
                exporter.state_left(role, source, stay)
                exporter.room_left(role, source)
                exporter.room_entered(role, dest)
            room.state = dest
            room.entered_at = change.time
            lifecycle = lifecycle_of(dest)
            report = lifecycle.reports[dest]
            if dest in lifecycle.transfer_openers and room.transfer_started_at is None:
                room.transfer_started_at = change.time
            elif report is KVPoll.Success:
                figures.final_states[dest] = figures.final_states.get(dest, 0) + 1
                figures.success_bytes += room.nbytes
                if exporter is not None:
                    exporter.finished(role, dest, None)
            elif report is KVPoll.Failed:
                kind = change.reason.kind if change.reason is not None else FailureKind.TRANSFER_ERROR
                figures.final_states[dest] = figures.final_states.get(dest, 0) + 1
                figures.failure_kinds[kind] += 1
                if exporter is not None:
                    exporter.finished(role, dest, kind)

    def _pages(
        self,
        figures: _RoleFigures,
        key: tuple[str, Hashable, int],
        change: StateChange,
        exporter: PrometheusExporter | None,
        role: str,
    ) -> None:
        """A step of the release phase: the quarantine gauges move."""
        if change.pages is PagesState.QUARANTINED:
            if key not in self._quarantined:
                self._quarantined[key] = change.nbytes
                figures.quarantined_rooms += 1
                figures.quarantined_bytes += change.nbytes
                figures.quarantines += 1
                if exporter is not None:
                    exporter.quarantine(role, change.nbytes, 1)
        elif change.pages is PagesState.RELEASED:
            nbytes = self._quarantined.pop(key, None)
            if nbytes is not None:
                how = "override" if change.event == "override" else "proof"
                figures.quarantined_rooms -= 1
                figures.quarantined_bytes -= nbytes
                figures.quarantine_releases[how] += 1
                if exporter is not None:
                    exporter.quarantine(role, nbytes, -1, how)

    def _transfer_finished(
        self, figures: _RoleFigures, room: _Room, now: float, exporter: PrometheusExporter | None, role: str
    ) -> None:
        assert room.transfer_started_at is not None
        latency = now - room.transfer_started_at
        figures.transfer_latency.observe(latency)
        if latency > 0:
            figures.throughput.observe(room.nbytes / latency / 1e9)
        if exporter is not None:
            exporter.transfer(role, latency)

    def snapshot(self) -> dict[str, Any]:
        """All figures as plain data: {role: {...}} (see the module docstring)."""
        with self._lock:
            return {role: self._role_snapshot(figures) for role, figures in sorted(self._roles.items())}

    @staticmethod
    def _role_snapshot(figures: _RoleFigures) -> dict[str, Any]:
        return {
            "opened": figures.opened,
            "closed": figures.closed,
            "open_rooms": {state.name: n for state, n in figures.open_rooms.items() if n},
            "final_states": {state.name: n for state, n in figures.final_states.items()},
            "failure_kinds": {kind.value: n for kind, n in figures.failure_kinds.items() if n},
            "bytes": figures.bytes,
            "success_bytes": figures.success_bytes,
            "chunks": figures.chunks,
            "time_in_state_s": {
                state.name: hist.summary() for state, hist in figures.time_in_state.items() if hist.count
            },
            "transfer_latency_s": figures.transfer_latency.summary(),
            "throughput_gbps": figures.throughput.summary(),
            "quarantined_rooms": figures.quarantined_rooms,
            "quarantined_bytes": figures.quarantined_bytes,
            "quarantines": figures.quarantines,
            "quarantine_releases": dict(figures.quarantine_releases),
        }


class PrometheusExporter:
    """Publishes `TransferMetrics` figures through `prometheus-client`.

    `registry` defaults to a fresh `CollectorRegistry` (pass
    `prometheus_client.REGISTRY` to serve them from the default one).
    Requires the `prometheus` extra.
    """

    def __init__(self, registry: Any = None, namespace: str = "kvfsm") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError("PrometheusExporter needs prometheus-client: pip install 'kvfsm[prometheus]'") from exc
        self.registry = prom.CollectorRegistry() if registry is None else registry
        kw: dict[str, Any] = {"namespace": namespace, "registry": self.registry}
        self.transfers = prom.Counter("transfers", "Rooms that reached a final state", ["role", "state"], **kw)
        self.failures = prom.Counter("transfer_failures", "Failed rooms by failure kind", ["role", "kind"], **kw)
        self.bytes = prom.Counter("transfer_bytes", "Bytes reported by chunk_done", ["role"], **kw)
        self.chunks = prom.Counter("transfer_chunks", "Chunks reported by chunk_done", ["role"], **kw)
        self.duration = prom.Histogram(
            "transfer_duration_seconds",
            "First chunk start to last chunk done",
            ["role"],
            buckets=DURATION_BUCKETS,
            **kw,
        )
        self.state_duration = prom.Histogram(
            "state_duration_seconds", "Time spent in a state", ["role", "state"], buckets=DURATION_BUCKETS, **kw
        )
        self.rooms = prom.Gauge("rooms", "Open rooms per state", ["role", "state"], **kw)
        self.quarantined_rooms = prom.Gauge(
            "quarantined_rooms", "Rooms whose pages are quarantined (no proof their writes stopped)", ["role"], **kw
        )
        self.quarantined_bytes = prom.Gauge("quarantined_bytes", "Bytes of quarantined pages", ["role"], **kw)
        self.quarantines = prom.Counter("quarantines", "Rooms whose pages were quarantined", ["role"], **kw)
        self.quarantine_releases = prom.Counter(
            "quarantine_releases", "Quarantined rooms released, by a late proof or an override", ["role", "how"], **kw
        )

    def room_entered(self, role: str, state: State) -> None:
        self.rooms.labels(role, state.name).inc()

    def room_left(self, role: str, state: State) -> None:
        self.rooms.labels(role, state.name).dec()

    def quarantine(self, role: str, nbytes: int, rooms: int, how: str | None = None) -> None:
        self.quarantined_rooms.labels(role).inc(rooms)
        self.quarantined_bytes.labels(role).inc(nbytes * rooms)
        if rooms > 0:
            self.quarantines.labels(role).inc()
        elif how is not None:
            self.quarantine_releases.labels(role, how).inc()

    def state_left(self, role: str, state: State, seconds: float) -> None:
        self.state_duration.labels(role, state.name).observe(seconds)

    def chunk(self, role: str, nbytes: int) -> None:
        self.chunks.labels(role).inc()
        self.bytes.labels(role).inc(nbytes)

    def transfer(self, role: str, seconds: float) -> None:
        self.duration.labels(role).observe(seconds)

    def finished(self, role: str, state: State, kind: FailureKind | None) -> None:
        self.transfers.labels(role, state.name).inc()
        if kind is not None:
            self.failures.labels(role, kind.value).inc()


def percentiles(values: Iterable[float], qs: Sequence[float] = (0.5, 0.99)) -> dict[str, float | None]:
    """Nearest-rank percentiles of `values` as {"p50": ..., "p99": ...}."""
    data = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        name = f"p{q * 100:g}"
        out[name] = data[max(1, math.ceil(q * len(data))) - 1] if data else None
    return out
