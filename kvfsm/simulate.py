"""`kvfsm simulate`: drive many transfers through a prefill and a decode manager.

Each request opens a room on a sender (prefill) and a receiver (decode)
manager, handshakes, sends its pages in chunks and completes, while worker
threads race aborts and failures against completion. At the end every
lifecycle is verified: all rooms terminal and closed, status table and
handles in agreement, failures structured, nothing released before it was
safe. The exit code is non-zero when any check fails.

This version runs the lifecycle with an in-process fake transport (no data
is moved); the data-plane backends plug in here.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from ._manager import TransferHandle, TransferManager
from ._states import FailureKind, FailureReason, KVPoll, Timeouts

__all__ = ["configure", "run", "simulate"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["fake"], default="fake", help="transport to drive (default: %(default)s)")
    parser.add_argument("--requests", type=_positive_int, default=2000, help="transfers to run (default: %(default)s)")
    parser.add_argument("--pages", type=_positive_int, default=16, help="KV pages per request (default: %(default)s)")
    parser.add_argument("--page-size", type=_positive_int, default=65536, help="bytes per page (default: %(default)s)")
    parser.add_argument("--chunks", type=_positive_int, default=4, help="chunks per request (default: %(default)s)")
    parser.add_argument("--concurrency", type=_positive_int, default=8, help="worker threads (default: %(default)s)")
    parser.add_argument(
        "--abort-rate", type=_rate, default=0.05, help="fraction aborted mid-flight (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-rate", type=_rate, default=0.02, help="fraction failing in transfer (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a rate between 0 and 1, got {text}")
    return value


class _Progress:
    """A one-line progress bar on stderr (plain lines when not a terminal)."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.done = 0
        self._lock = threading.Lock()
        self._tty = stream.isatty()
        self._next_line = 0.0

    def step(self) -> None:
        with self._lock:
            self.done += 1
            if not self.enabled:
                return
            now = time.monotonic()
            if self.done == self.total or now >= self._next_line:
                self._next_line = now + (0.1 if self._tty else 2.0)
                filled = int(30 * self.done / self.total)
                bar = "#" * filled + "-" * (30 - filled)
                end = "\r" if self._tty and self.done < self.total else "\n"
                self.stream.write(f"simulate [{bar}] {self.done}/{self.total}{end}")
                self.stream.flush()


def _one_request(
    room: int,
    sender: TransferManager,
    receiver: TransferManager,
    rng: random.Random,
    args: argparse.Namespace,
) -> dict[str, Any]:
    send, recv = sender.open(room), receiver.open(room)
    ends: list[TransferHandle] = [send, recv]
    abort_at = rng.randrange(4) if rng.random() < args.abort_rate else None
    fail_at = rng.randrange(args.chunks) if rng.random() < args.fail_rate else None
    chunk_bytes = args.pages * args.page_size // args.chunks
    for phase in range(4):
        if abort_at == phase:
            # Either side may give up; the other learns it from the peer.
            victim, peer = (send, recv) if rng.random() < 0.5 else (recv, send)
            victim.abort("simulated client abort")
            peer.fail(FailureReason(FailureKind.ABORTED, "peer aborted", from_peer=True))
            victim.writes_drained()
            peer.writes_drained()
            break
        if phase == 0:
            for h in ends:
                h.bootstrapped()
        elif phase == 1:
            for h in ends:
                h.transfer_started()
        elif phase == 2:
            for i in range(args.chunks):
                if fail_at == i:
                    send.fail(FailureReason(FailureKind.TRANSFER_ERROR, f"simulated error in chunk {i}"))
                    recv.fail(
                        FailureReason(FailureKind.PEER_FAILED, "sender reported a transfer error", from_peer=True)
                    )
                    for h in ends:
                        h.writes_drained()
                    break
                for h in ends:
                    h.chunk_done(chunk_bytes, last=i == args.chunks - 1)
            else:
                continue
            break
        else:
            for h in ends:
                h.transfer_done()
    result = {
        "room": room,
        "sender": send.state,
        "receiver": recv.state,
        "mismatch": int(sender.status(room) != send.state) + int(receiver.status(room) != recv.state),
        "unsafe_release": int(not (sender.release_safe(room) and receiver.release_safe(room))),
        "kind": send.reason.kind.value if send.reason else None,
        "latency": recv.transfer_latency,
        "bytes": recv.nbytes,
    }
    sender.close(room)
    receiver.close(room)
    return result


def simulate(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the simulation described by `args`; return the summary."""
    timeouts = Timeouts(bootstrap=30.0, waiting=30.0, transferring=30.0, drain=5.0)
    sender = TransferManager("sender", timeouts=timeouts)
    receiver = TransferManager("receiver", timeouts=timeouts)
    progress = _Progress(args.requests, err, not args.no_progress)
    seeds = random.Random(args.seed)
    jobs = [(room, random.Random(seeds.getrandbits(64))) for room in range(args.requests)]

    def job(item: tuple[int, random.Random]) -> dict[str, Any]:
        try:
            return _one_request(item[0], sender, receiver, item[1], args)
        finally:
            progress.step()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        results = list(pool.map(job, jobs))
    elapsed = time.perf_counter() - start

    finals = Counter(r["receiver"].name for r in results)
    kinds = Counter(r["kind"] for r in results if r["kind"])
    latencies = sorted(r["latency"] for r in results if r["latency"] is not None and r["receiver"] is KVPoll.Success)
    total_bytes = sum(r["bytes"] for r in results if r["receiver"] is KVPoll.Success)
    verification = {
        "rooms_left_open": len(sender) + len(receiver),
        "status_handle_mismatches": sum(r["mismatch"] for r in results),
        "released_before_safe": sum(r["unsafe_release"] for r in results),
        "sides_disagree": sum(
            1 for r in results if (r["sender"] is KVPoll.Success) != (r["receiver"] is KVPoll.Success)
        ),
    }
    summary: dict[str, Any] = {
        "backend": args.backend,
        "requests": args.requests,
        "elapsed_s": elapsed,
        "requests_per_s": args.requests / elapsed if elapsed else None,
        "final_states": dict(finals),
        "failure_kinds": dict(kinds),
        "latency_s": {"p50": _percentile(latencies, 0.5), "p99": _percentile(latencies, 0.99)},
        "bytes": total_bytes,
        "late_events": sender.stats.late_events + receiver.stats.late_events,
        "verification": verification,
        "ok": all(v == 0 for v in verification.values()),
    }
    _print_summary(summary, out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return summary


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def _print_summary(summary: dict[str, Any], out: TextIO) -> None:
    rows = [("backend", summary["backend"]), ("requests", summary["requests"])]
    rows += [(f"final {k}", v) for k, v in sorted(summary["final_states"].items())]
    rows += [(f"failure {k}", v) for k, v in sorted(summary["failure_kinds"].items())]
    for q, v in summary["latency_s"].items():
        rows.append((f"transfer latency {q}", f"{v * 1e6:.1f} us" if v is not None else "-"))
    rows.append(("throughput", f"{summary['requests_per_s']:.0f} req/s"))
    rows.append(("bytes (accounted)", summary["bytes"]))
    rows.append(("late events absorbed", summary["late_events"]))
    width = max(len(k) for k, _ in rows)
    out.write("\nSummary\n")
    for key, value in rows:
        out.write(f"  {key:<{width}}  {value}\n")
    out.write("\nVerification\n")
    for key, value in summary["verification"].items():
        mark = "ok" if value == 0 else "FAIL"
        out.write(f"  {key.replace('_', ' '):<{width}}  {value}  {mark}\n")
    out.write(f"\n{'all checks passed' if summary['ok'] else 'VERIFICATION FAILED'}\n")


def run(args: argparse.Namespace) -> int:
    return 0 if simulate(args)["ok"] else 1
