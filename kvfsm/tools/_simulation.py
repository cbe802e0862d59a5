"""What both `kvfsm simulate` harnesses share: results, the summary, page free lists.

`kvfsm.simulate` (prefill and decode in one process) and
`kvfsm.simulate_remote` (two processes, Mooncake or NIXL) both report each
request as a `RequestResult`, fold the results into a `Tally` as they
arrive, and turn that into the summary dict (`build_summary`) printed by
`print_summary`; both take pages from a `PagePool`. Living here, one layer
below both harnesses, they let each harness import only from below.

A `Tally` keeps counters and two bounded reservoirs (latency and per-
transfer rate, `kvfsm.metrics.Histogram`: exact percentiles up to 65,536
successes, a uniform sample's beyond), so a run's memory does not grow with
its number of requests.

For reproducibility a tally also keeps an order-independent digest of
every room's outcome (room id, both final states and failure kinds). Two
runs with the same seed and options that end in the same outcomes have the
same digest; rooms whose planned abort races their last copy (`raced`) are
counted but left out of it, since which side of that race wins is timing.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, TextIO

import attrs

from .._manager import TransferManager
from .._states import KVPoll
from ..metrics import THROUGHPUT_BUCKETS, Histogram, TransferMetrics
from ._cliargs import CommandError

__all__ = [
    "VERIFICATION_CHECKS",
    "RequestResult",
    "PagePool",
    "Tally",
    "build_summary",
    "print_summary",
    "interrupted_line",
    "write_json",
    "REMOTE_BACKENDS",
]

#: Engines whose prefill and decode run as two processes (`kvfsm.simulate_remote`).
REMOTE_BACKENDS = ("mooncake", "nixl")

#: The verification block's keys; each must be 0 for the run to pass.
VERIFICATION_CHECKS = ("pages_not_identical", "rooms_left_open", "status_handle_mismatches", "released_before_safe")


@attrs.define(slots=True)
class RequestResult:
    """What one request ended as, and what the checks found for it."""

    room: Hashable
    sender: KVPoll
    receiver: KVPoll
    sender_kind: str | None = None
    receiver_kind: str | None = None
    latency: float | None = None
    nbytes: int = 0
    pages_checked: int = 0
    pages_not_identical: int = 0
    status_handle_mismatches: int = 0
    released_before_safe: int = 0
    #: Its planned abort raced the last copy (the outcome is timing, not the seed).
    raced: bool = False


class PagePool:
    """A free list of page indices (and aux slots) that blocks when empty."""

    def __init__(self, pages: int, slots: int) -> None:
        self._free = list(range(pages))
        self._slots = list(range(slots))
        self._cond = threading.Condition()

    def take(self, count: int, rng: random.Random) -> tuple[list[int], int]:
        with self._cond:
            while len(self._free) < count or not self._slots:
                self._cond.wait()
            # Random picks: scattered pages, like a long-running allocator.
            picked = [self._free.pop(rng.randrange(len(self._free))) for _ in range(count)]
            return picked, self._slots.pop()

    def give(self, pages: Sequence[int], slot: int) -> None:
        with self._cond:
            self._free.extend(pages)
            self._slots.append(slot)
            self._cond.notify_all()


class Tally:
    """Requests' results folded in one at a time; memory stays flat (see the module docstring)."""

    def __init__(self) -> None:
        self.requests = 0
        self.sender_states: Counter[str] = Counter()
        self.receiver_states: Counter[str] = Counter()
        self.sender_kinds: Counter[str] = Counter()
        self.receiver_kinds: Counter[str] = Counter()
        self.latency = Histogram()
        self.rates = Histogram(THROUGHPUT_BUCKETS)
        self.bytes = 0
        self.pages_checked = 0
        self.sides_disagree = 0
        self.raced = 0
        self.checks = dict.fromkeys(VERIFICATION_CHECKS, 0)
        self._digest = 0
        self._lock = threading.Lock()

    def add(self, result: RequestResult) -> None:
        """Fold in one request's result (thread-safe)."""
        outcome = (result.room, result.sender.name, result.receiver.name, result.sender_kind, result.receiver_kind)
        mark = repr(("raced", result.room) if result.raced else outcome).encode()
        digest = int.from_bytes(hashlib.blake2b(mark, digest_size=8).digest(), "little")
        with self._lock:
            self.requests += 1
            self._digest = (self._digest + digest) % 2**64
            self.sender_states[result.sender.name] += 1
            self.receiver_states[result.receiver.name] += 1
            if result.sender_kind:
                self.sender_kinds[result.sender_kind] += 1
            if result.receiver_kind:
                self.receiver_kinds[result.receiver_kind] += 1
            if result.receiver is KVPoll.Success:
                self.bytes += result.nbytes
                if result.latency is not None:
                    self.latency.observe(result.latency)
                if result.latency:
                    self.rates.observe(result.nbytes / result.latency / 1e9)
            self.pages_checked += result.pages_checked
            self.sides_disagree += (result.sender is KVPoll.Success) != (result.receiver is KVPoll.Success)
            self.raced += result.raced
            self.checks["pages_not_identical"] += result.pages_not_identical
            self.checks["status_handle_mismatches"] += result.status_handle_mismatches
            self.checks["released_before_safe"] += result.released_before_safe

    @property
    def digest(self) -> str:
        """The outcomes' digest (16 hex digits), whatever order the results came in."""
        return f"{self._digest:016x}"


def build_summary(
    results: Iterable[RequestResult] | Tally,
    *,
    backend: str,
    elapsed: float,
    managers: Sequence[TransferManager],
    metrics: TransferMetrics | None = None,
    extra_checks: dict[str, int] | None = None,
    config: dict[str, Any] | None = None,
    late_events: int = 0,
    reproducible: bool = True,
) -> dict[str, Any]:
    """The summary dict (format in `kvfsm.simulate`'s docstring) from per-request results.

    `managers` are checked for rooms left open and their late events
    counted; a harness whose managers live elsewhere passes their counts
    instead, as `extra_checks["rooms_left_open"]` and `late_events`.
    `extra_checks` adds counts to verification keys (the same key adds
    up). `ok` is true iff every verification value is 0. `reproducible`
    adds the outcomes' digest (a harness whose outcomes the seed cannot fix,
    such as two processes racing on a real engine, passes False).
    """
    if isinstance(results, Tally):
        tally = results
    else:
        tally = Tally()
        for result in results:
            tally.add(result)
    verification = dict(tally.checks)
    verification["rooms_left_open"] += sum(len(m) for m in managers)
    for key, value in (extra_checks or {}).items():
        verification[key] = verification.get(key, 0) + value
    requests = tally.requests
    return {
        "backend": backend,
        "requests": requests,
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed if elapsed > 0 else None,
        "config": config or {},
        "final_states": {"sender": dict(tally.sender_states), "receiver": dict(tally.receiver_states)},
        "failure_kinds": {"sender": dict(tally.sender_kinds), "receiver": dict(tally.receiver_kinds)},
        "latency_s": {
            "p50": tally.latency.quantile(0.5),
            "p99": tally.latency.quantile(0.99),
            "mean": tally.latency.mean,
            "max": tally.latency.max if tally.latency.count else None,
        },
        "throughput": {
            "bytes": tally.bytes,
            "gb_per_s": tally.bytes / elapsed / 1e9 if elapsed > 0 else None,
            "per_transfer_gb_per_s": {"p50": tally.rates.quantile(0.5), "p99": tally.rates.quantile(0.99)},
        },
        "pages_checked": tally.pages_checked,
        "late_events": late_events + sum(m.stats.late_events for m in managers),
        "sides_disagree": tally.sides_disagree,
        "outcomes": {"digest": tally.digest, "raced": tally.raced} if reproducible else None,
        "verification": verification,
        "ok": all(v == 0 for v in verification.values()),
        "metrics": metrics.snapshot() if metrics is not None else {},
    }


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.1f} us"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def _fmt_bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def print_summary(summary: dict[str, Any], out: TextIO) -> None:
    """Render `summary` as the table and verification block `kvfsm simulate` prints."""
    rows: list[tuple[str, str]] = [
        ("backend", str(summary["backend"])),
        ("requests", str(summary["requests"])),
        ("elapsed", _fmt_seconds(summary["elapsed_s"])),
    ]
    for side in ("receiver", "sender"):
        states = summary["final_states"][side]
        rows.append((f"final ({side})", ", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "-"))
    for side in ("receiver", "sender"):
        kinds = summary["failure_kinds"][side]
        rows.append((f"failures ({side})", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-"))
    lat = summary["latency_s"]
    rows.append(("transfer latency", f"p50 {_fmt_seconds(lat['p50'])}, p99 {_fmt_seconds(lat['p99'])}"))
    rate = summary["requests_per_s"]
    rows.append(("throughput", f"{rate:.0f} req/s" if rate else "-"))
    thr = summary["throughput"]
    gbps = thr["gb_per_s"]
    rows.append(("bytes moved (successes)", f"{_fmt_bytes(thr['bytes'])} ({gbps:.2f} GB/s overall)" if gbps else "0"))
    per = thr["per_transfer_gb_per_s"]
    if per.get("p50") is not None:
        rows.append(("per-transfer rate", f"p50 {per['p50']:.2f} GB/s, p99 {per['p99']:.2f} GB/s"))
    rows.append(("pages checked", str(summary["pages_checked"])))
    rows.append(("late events absorbed", str(summary["late_events"])))
    rows.append(("sides disagree (race)", str(summary["sides_disagree"])))
    outcomes = summary.get("outcomes")
    if outcomes is not None:
        raced = f" ({outcomes['raced']} raced abort vs last copy: not in it)" if outcomes["raced"] else ""
        rows.append(("outcome digest", f"{outcomes['digest']}{raced}"))
    width = max(max(len(k) for k, _ in rows), max(len(k) for k in summary["verification"]))
    out.write("\nSummary\n")
    for key, value in rows:
        out.write(f"  {key:<{width}}  {value}\n")
    out.write("\nVerification\n")
    for key, value in summary["verification"].items():
        mark = "ok" if value == 0 else "FAIL"
        out.write(f"  {key.replace('_', ' '):<{width}}  {value:<6} {mark}\n")
    out.write(f"\n{'all checks passed' if summary['ok'] else 'VERIFICATION FAILED'}\n")
    note = failure_note(summary)
    if note:
        out.write(f"{note}\n")


def failure_note(summary: dict[str, Any]) -> str | None:
    """A warning when most rooms did not succeed: the checks say the run was consistent, not that it worked."""
    requests = summary["requests"]
    succeeded = summary["final_states"]["receiver"].get("Success", 0)
    if not requests or succeeded * 2 >= requests:
        return None
    kinds = summary["failure_kinds"]["receiver"]
    top = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items(), key=lambda item: -item[1])[:3])
    return (
        f"note: only {succeeded} of {requests} rooms succeeded ({top or 'no reason recorded'}); "
        "the checks above are about consistency (no wrong byte, nothing released early), not success"
    )


def interrupted_line(summary: dict[str, Any], planned: int) -> str:
    """One line on what an interrupted run did (`kvfsm simulate` prints it on Ctrl-C)."""
    finals = summary["final_states"]["receiver"]
    states = ", ".join(f"{name} {count:,}" for name, count in sorted(finals.items())) or "none finished"
    failed = [key.replace("_", " ") for key, value in summary["verification"].items() if value]
    verdict = "all checks passed so far" if not failed else "VERIFICATION FAILED: " + ", ".join(failed)
    return (
        f"interrupted after {summary['requests']:,} of {planned:,} requests in {summary['elapsed_s']:.1f} s "
        f"(receiver: {states}); {verdict}"
    )


def write_json(path: str, summary: dict[str, Any]) -> None:
    """Write `summary` as JSON; `CommandError` (one line) if the file cannot be written."""
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, default=str)
    except OSError as exc:  # checked before the run; the disk may still fill up
        raise CommandError(f"cannot write --json {path}: {exc.strerror or exc}") from None
