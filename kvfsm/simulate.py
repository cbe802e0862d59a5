"""`kvfsm simulate`, the main job: many prefill->decode transfers, then proof.

Each request allocates pages in a prefill pool and a decode pool, opens its
room on a sender and a receiver manager, bootstraps both sides through the
chosen backend (`--backend`, default `local`: real torch pages), posts the
decode pages, sends the prefill pages in `--chunks` chunks (the last one
possibly empty), waits for both sides to end, checks the data, waits until
the pages are release-safe, frees them and closes the rooms. Aborts race the
transfer at random points from either side; the local backend injects chunk
failures and stalls (`--fail-rate`, `--stall-rate`), and stalled transfers
end by their transferring deadline.

At the end it prints a summary (final states, failure kinds, latency
percentiles, throughput, bytes) and a verification block:

* every decode page is bit-identical to its prefill source (and the aux
  slot to its source) for every request that succeeded,
* no room is left open on either manager,
* no room's status-table entry disagrees with its handle,
* no pages were released before they were release-safe: at release the
  room was release-safe with no chunk in flight, and (local backend) no
  copy landed in them afterwards.

The exit code is 1 when any check fails. `--inject-bug` breaks a run on
purpose to show that the checks catch it.

For other harnesses (the cross-process engines reuse this format):
`build_summary(results, ...)` turns per-request `RequestResult`s plus
extra check counts into the summary dict, `print_summary(summary, out)`
renders it, and `summary["ok"]` is true iff every verification value is 0.
`simulate(args)` runs the whole thing and returns that dict. The dict:

    {"backend": str, "requests": int, "elapsed_s": float,
     "requests_per_s": float, "config": {...},
     "final_states": {"sender": {"Success": n, "Failed": n}, "receiver": {...}},
     "failure_kinds": {"sender": {"aborted": n, ...}, "receiver": {...}},
     "latency_s": {"p50", "p99", "mean", "max"}      # receiver, successes
     "throughput": {"bytes": int, "gb_per_s": float, "per_transfer_gb_per_s": {"p50", "p99"}},
     "pages_checked": int, "late_events": int, "sides_disagree": int,
     "verification": {"pages_not_identical": 0, "rooms_left_open": 0,
                      "status_handle_mismatches": 0, "released_before_safe": 0},
     "ok": bool, "metrics": TransferMetrics.snapshot()}
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from ._manager import TransferHandle, TransferManager
from ._observe import StateChange
from ._states import TERMINAL, FailureKind, FailureReason, KVPoll, Timeouts
from .metrics import TransferMetrics, percentiles

if TYPE_CHECKING:
    import torch

    from .backends.base import KVBackend
    from .backends.local import LocalBackend

__all__ = [
    "configure",
    "run",
    "simulate",
    "RequestResult",
    "build_summary",
    "print_summary",
    "VERIFICATION_CHECKS",
]

#: The verification block's keys; each must be 0 for the run to pass.
VERIFICATION_CHECKS = ("pages_not_identical", "rooms_left_open", "status_handle_mismatches", "released_before_safe")
BUGS = ("none", "corrupt-page", "leave-open", "early-release")
LAYERS = 2


def configure(parser: argparse.ArgumentParser) -> None:
    from .backends import BACKENDS

    parser.add_argument(
        "--backend", choices=sorted(BACKENDS), default="local", help="transfer engine (default: %(default)s)"
    )
    parser.add_argument("--requests", type=_positive_int, default=1000, help="transfers to run (default: %(default)s)")
    parser.add_argument(
        "--page-size",
        type=_positive_int,
        default=16384,
        help="bytes of one page over all layers' K and V (default: %(default)s)",
    )
    parser.add_argument("--pages", type=_positive_int, default=8, help="KV pages per request (default: %(default)s)")
    parser.add_argument(
        "--chunks",
        type=_positive_int,
        default=3,
        help="send() calls per request, the last flagged (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency", type=_positive_int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    parser.add_argument(
        "--abort-rate", type=_rate, default=0.05, help="fraction of requests aborted by one side (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-rate", type=_rate, default=0.01, help="probability that a chunk fails (default: %(default)s)"
    )
    parser.add_argument(
        "--stall-rate",
        type=_rate,
        default=0.005,
        help="fraction of transfers that stall until their deadline (default: %(default)s)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=0.5,
        help="seconds a room may stay Transferring (ends stalls; default: %(default)s)",
    )
    parser.add_argument("--workers", type=_positive_int, default=2, help="copy threads of the local backend")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    parser.add_argument(
        "--inject-bug",
        choices=BUGS,
        default="none",
        help="break the run on purpose to prove the verification catches it (default: %(default)s)",
    )


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
    """A one-line progress bar on stderr (a line every 2 s when not a terminal)."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.done = 0
        self._lock = threading.Lock()
        self._tty = stream.isatty()
        self._next_line = 0.0
        self._start = time.monotonic()

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
                rate = self.done / max(now - self._start, 1e-9)
                end = "\r" if self._tty and self.done < self.total else "\n"
                self.stream.write(f"simulate [{bar}] {self.done}/{self.total} {rate:.0f} req/s{end}")
                self.stream.flush()


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


class _PagePool:
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


class _Ends:
    """Wakes the request waiting on a room when either side becomes terminal."""

    def __init__(self) -> None:
        self._events: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()

    def register(self, room: Hashable) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._events[room] = event
        return event

    def forget(self, room: Hashable) -> None:
        with self._lock:
            self._events.pop(room, None)

    def __call__(self, change: StateChange) -> None:
        if change.dest in TERMINAL:
            with self._lock:
                event = self._events.get(change.room)
            if event is not None:
                event.set()


@attrs.define
class _World:
    args: argparse.Namespace
    sender: TransferManager
    receiver: TransferManager
    send_backend: KVBackend
    recv_backend: KVBackend
    prefill: _PagePool
    decode: _PagePool
    ends: _Ends
    tensors: dict[str, Any]
    check_data: bool
    peers_linked: bool = True
    #: The receiver endpoint when it counts the copies landing in each room's pages.
    audit: LocalBackend | None = None
    lock: threading.Lock = attrs.Factory(threading.Lock)
    corrupted: bool = False


def _split(items: list[int], parts: int) -> list[list[int]]:
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def _wait_terminal(handles: Sequence[TransferHandle], event: threading.Event, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(h.is_terminal for h in handles):
        event.wait(0.05)
        event.clear()
        for h in handles:
            h.poll()  # enforce deadlines even if the reaper is slow
        if time.monotonic() > deadline:
            raise RuntimeError(f"simulate: room {handles[0].room!r} did not end within {limit}s: {handles}")


def _wait_release_safe(handle: TransferHandle, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not handle.release_safe:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _one_request(world: _World, room: int, rng: random.Random) -> RequestResult:
    args = world.args
    src_pages, src_aux = world.prefill.take(args.pages, rng)
    dst_pages, dst_aux = world.decode.take(args.pages, rng)
    given: list[_PagePool] = []
    try:
        return _run_request(world, room, rng, src_pages, src_aux, dst_pages, dst_aux, given)
    finally:
        # A harness error must not starve the other requests of pages.
        if world.prefill not in given:
            world.prefill.give(src_pages, src_aux)
        if world.decode not in given:
            world.decode.give(dst_pages, dst_aux)


def _run_request(
    world: _World,
    room: int,
    rng: random.Random,
    src_pages: list[int],
    src_aux: int,
    dst_pages: list[int],
    dst_aux: int,
    given: list[_PagePool],
) -> RequestResult:
    args = world.args
    sb, rb = world.send_backend, world.recv_backend
    if world.check_data:
        # Per-request aux metadata: the room id and a random tag.
        world.tensors["prefill_aux"][src_aux, :2] = _aux_words(room, rng)
    event = world.ends.register(room)
    send, recv = world.sender.open(room), world.receiver.open(room)
    aborter, other = (send, recv) if rng.random() < 0.5 else (recv, send)
    abort_at = rng.randrange(4 + args.chunks) if rng.random() < args.abort_rate else None
    harness_fail = args.backend != "local" and rng.random() < 1 - (1 - args.fail_rate) ** args.chunks
    harness_stall = args.backend != "local" and rng.random() < args.stall_rate
    step = 0

    def maybe_abort() -> bool:
        nonlocal step
        hit = abort_at == step
        step += 1
        if hit:
            aborter.abort("simulated client abort")
            if step == 1 or not world.peers_linked:
                # Before any handshake nobody can tell the peer (a router
                # cancels both); the fake backend has no peer link at all.
                other.fail(FailureReason(FailureKind.ABORTED, "peer aborted the request", from_peer=True))
        return hit or send.is_terminal

    try:
        # Every opened room goes to its backend, even one already aborted:
        # the backend then reports its writes drained (nothing was issued).
        maybe_abort()
        rb.bootstrap(recv, sb.address)
        sb.bootstrap(send, sb.address)
        if not maybe_abort() and recv.poll() is KVPoll.WaitingForInput:
            rb.expect(recv, dst_pages, dst_aux)
        if not maybe_abort() and send.poll() is KVPoll.WaitingForInput and not harness_stall:
            parts = _split(src_pages, args.chunks)
            for index, part in enumerate(parts):
                if index and maybe_abort():
                    break
                last = index == len(parts) - 1
                if harness_fail and last:
                    send.fail(FailureReason(FailureKind.TRANSFER_ERROR, "simulated transport error"))
                    recv.fail(FailureReason(FailureKind.PEER_FAILED, "sender failed", from_peer=True))
                    break
                sb.send(send, part, last=last, aux_index=src_aux if last else None)
        maybe_abort()  # races the copy of the last chunk
        _wait_terminal((send, recv), event, limit=60.0)
        # Handles are read without the managers' locks; passing through each
        # lock once makes sure the transition we saw has finished writing.
        world.sender.check_deadlines()
        world.receiver.check_deadlines()
        result = RequestResult(
            room,
            send.state,
            recv.state,
            send.reason.kind.value if send.reason else None,
            recv.reason.kind.value if recv.reason else None,
            recv.transfer_latency if recv.state is KVPoll.Success else None,
            recv.nbytes,
        )
        if recv.state is KVPoll.Success and world.check_data:
            _check_pages(world, result, src_pages, dst_pages, src_aux, dst_aux)
        result.status_handle_mismatches = int(world.sender.status(room) != send.state) + int(
            world.receiver.status(room) != recv.state
        )
        _release(world, result, send, recv, src_pages, src_aux, dst_pages, dst_aux, given)
    finally:
        world.ends.forget(room)
    return result


def _aux_words(room: int, rng: random.Random) -> Any:
    import torch

    return torch.tensor([room, rng.getrandbits(62)], dtype=torch.int64)


def _check_pages(
    world: _World, result: RequestResult, src_pages: list[int], dst_pages: list[int], src_aux: int, dst_aux: int
) -> None:
    import torch

    t = world.tensors
    if world.args.inject_bug == "corrupt-page":
        with world.lock:
            corrupt, world.corrupted = not world.corrupted, True
        if corrupt:
            t["decode_views"][0][dst_pages[0], 0] += 1
    src_idx = torch.tensor(src_pages)
    dst_idx = torch.tensor(dst_pages)
    same = torch.ones(len(src_pages), dtype=torch.bool)
    for src_view, dst_view in zip(t["prefill_views"], t["decode_views"], strict=True):
        same &= (src_view.index_select(0, src_idx) == dst_view.index_select(0, dst_idx)).all(dim=1)
    result.pages_checked = len(src_pages)
    result.pages_not_identical = int((~same).sum())
    if not torch.equal(t["prefill_aux"][src_aux], t["decode_aux"][dst_aux]):
        result.pages_not_identical += 1


def _release(
    world: _World,
    result: RequestResult,
    send: TransferHandle,
    recv: TransferHandle,
    src_pages: list[int],
    src_aux: int,
    dst_pages: list[int],
    dst_aux: int,
    given: list[_PagePool],
) -> None:
    args = world.args
    audit = world.audit
    early = args.inject_bug == "early-release"
    landed = 0  # copies in the decode pages when they were released; one more by close is a late write
    for handle, pool, pages, slot, backend in (
        (recv, world.decode, dst_pages, dst_aux, world.recv_backend),
        (send, world.prefill, src_pages, src_aux, world.send_backend),
    ):
        safe = early or _wait_release_safe(handle, limit=30.0)
        if audit is not None and backend is audit:
            in_flight = audit.in_flight(handle)
            landed = audit.writes_landed(handle)
        else:
            in_flight = 0
        if not safe or not handle.release_safe or in_flight:
            result.released_before_safe += 1
        pool.give(pages, slot)
        given.append(pool)
    if args.inject_bug == "leave-open" and result.room == 0:
        return
    if audit is not None and audit.writes_landed(recv) != landed:
        result.released_before_safe += 1  # a copy landed between release and close
    world.sender.close(send.room)
    world.receiver.close(recv.room)


def _make_world(args: argparse.Namespace) -> _World:
    from .backends import KVPools, get_backend

    backend_cls = get_backend(args.backend)
    # A stalled fake sender never sends: its waiting deadline ends it. Local
    # receivers wait for their first chunk behind other rooms' chunks, so
    # their waiting phase gets more room.
    waiting = args.transfer_timeout if args.backend == "fake" else max(2.0, 4 * args.transfer_timeout)
    timeouts = Timeouts(bootstrap=30.0, waiting=waiting, transferring=args.transfer_timeout, drain=30.0)
    sender = TransferManager("sender", timeouts=timeouts)
    receiver = TransferManager("receiver", timeouts=timeouts)
    pool_pages = args.concurrency * args.pages * 2 + 8
    slots = args.concurrency * 2 + 4
    tensors: dict[str, Any] = {}
    if args.backend == "fake":
        send_backend: KVBackend = backend_cls(sender)
        recv_backend: KVBackend = backend_cls(receiver)
        return _World(
            args, sender, receiver, send_backend, recv_backend, _PagePool(pool_pages, slots),
            _PagePool(pool_pages, slots), _Ends(), tensors, check_data=False, peers_linked=False,
        )  # fmt: skip
    import torch

    from .backends._pagecopy import word_view
    from .backends.local import Faults, LocalBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    element = 2  # bfloat16
    per_region = args.page_size // (2 * LAYERS)
    if per_region * 2 * LAYERS != args.page_size or per_region % element:
        raise SystemExit(f"--page-size must be a multiple of {2 * LAYERS * element} bytes; got {args.page_size}")
    generator = torch.Generator().manual_seed(args.seed)

    def pools(fill: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (LAYERS, pool_pages, per_region // element)
        if fill:
            k = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)
            v = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)
        else:
            k = torch.zeros(shape, dtype=torch.bfloat16)
            v = torch.zeros(shape, dtype=torch.bfloat16)
        aux = torch.zeros((slots, 4), dtype=torch.int64)
        return k.to(device), v.to(device), aux.to(device)

    pk, pv, paux = pools(True)
    dk, dv, daux = pools(False)
    faults = Faults(
        fail_rate=args.fail_rate,
        stall_rate=args.stall_rate,
        seed=args.seed,
        delay_s=0.001 if args.inject_bug == "early-release" else 0.0,
        linger_chunks=2 if args.inject_bug == "early-release" else 0,
    )
    if backend_cls is LocalBackend:
        send_backend = LocalBackend(sender, workers=args.workers, faults=faults)
        recv_backend = LocalBackend(receiver, audit=True)
    else:  # another in-process engine: constructed with its manager only
        send_backend = backend_cls(sender)
        recv_backend = backend_cls(receiver)
    send_pools = KVPools.from_tensors(pk, pv, paux)
    recv_pools = KVPools.from_tensors(dk, dv, daux)
    send_backend.register_pools(send_pools)
    recv_backend.register_pools(recv_pools)
    tensors["prefill_views"] = [word_view(r.tensor, r.num_pages) for r in send_pools.kv]
    tensors["decode_views"] = [word_view(r.tensor, r.num_pages) for r in recv_pools.kv]
    tensors["prefill_aux"] = paux
    tensors["decode_aux"] = daux
    return _World(
        args, sender, receiver, send_backend, recv_backend, _PagePool(pool_pages, slots),
        _PagePool(pool_pages, slots), _Ends(), tensors, check_data=True,
        audit=recv_backend if isinstance(recv_backend, LocalBackend) else None,
    )  # fmt: skip


def simulate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> dict[str, Any]:
    """Run the simulation described by `args` (see `configure`); print and return the summary.

    The summary goes to `out` (default stdout), the progress bar to `err`
    (default stderr).
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if args.backend in ("mooncake", "nixl"):
        # Real engines run prefill and decode as two processes on loopback.
        if args.inject_bug != "none":
            raise ValueError(f"--inject-bug runs on the in-process backends only, not on {args.backend!r}")
        from .simulate_remote import simulate_remote

        return simulate_remote(args, out, err)
    if args.inject_bug == "early-release":
        # Pages released early only show when a copy is still in flight,
        # which aborts racing the transfer make common.
        args.abort_rate = max(args.abort_rate, 0.5)
    world = _make_world(args)
    metrics = TransferMetrics()
    for manager in (world.sender, world.receiver):
        metrics.attach(manager)
        manager.subscribe(world.ends)
        manager.start_reaper(interval=min(0.05, args.transfer_timeout / 4))
    progress = _Progress(args.requests, err, not args.no_progress)
    seeds = random.Random(args.seed)
    jobs = [(room, random.Random(seeds.getrandbits(64))) for room in range(args.requests)]

    def job(item: tuple[int, random.Random]) -> RequestResult:
        try:
            return _one_request(world, item[0], item[1])
        finally:
            progress.step()

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="kvfsm-simulate") as pool:
            results = list(pool.map(job, jobs))
        elapsed = time.perf_counter() - start
    finally:
        world.send_backend.close()
        world.recv_backend.close()
        for manager in (world.sender, world.receiver):
            manager.stop_reaper()
    late_writes = _late_writes(world)
    summary = build_summary(
        results,
        backend=args.backend,
        elapsed=elapsed,
        managers=(world.sender, world.receiver),
        metrics=metrics,
        extra_checks={"released_before_safe": late_writes},
        config={
            k: getattr(args, k)
            for k in (
                "requests", "page_size", "pages", "chunks", "concurrency", "abort_rate",
                "fail_rate", "stall_rate", "transfer_timeout", "seed", "inject_bug",
            )
        },
    )  # fmt: skip
    print_summary(summary, out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, default=str)
    return summary


def _late_writes(world: _World) -> int:
    """Copies that landed in a room's decode pages after the harness released them."""
    backend = world.audit
    if backend is None:
        return 0
    # Closing a room drops its audit entry; any entry left belongs to a room
    # some copy wrote into after it was closed.
    return len(backend.audited_rooms())


def build_summary(
    results: Sequence[RequestResult],
    *,
    backend: str,
    elapsed: float,
    managers: Sequence[TransferManager],
    metrics: TransferMetrics | None = None,
    extra_checks: dict[str, int] | None = None,
    config: dict[str, Any] | None = None,
    late_events: int = 0,
) -> dict[str, Any]:
    """The summary dict (format in the module docstring) from per-request results.

    `managers` are checked for rooms left open and their late events
    counted; a harness whose managers live elsewhere passes their counts
    instead, as `extra_checks["rooms_left_open"]` and `late_events`.
    `extra_checks` adds counts to verification keys (the same key adds
    up). `ok` is true iff every verification value is 0.
    """
    successes = [r for r in results if r.receiver is KVPoll.Success]
    latencies = [r.latency for r in successes if r.latency is not None]
    rates = [r.nbytes / r.latency / 1e9 for r in successes if r.latency]
    total_bytes = sum(r.nbytes for r in successes)
    verification = {
        "pages_not_identical": sum(r.pages_not_identical for r in results),
        "rooms_left_open": sum(len(m) for m in managers),
        "status_handle_mismatches": sum(r.status_handle_mismatches for r in results),
        "released_before_safe": sum(r.released_before_safe for r in results),
    }
    for key, value in (extra_checks or {}).items():
        verification[key] = verification.get(key, 0) + value
    lat = percentiles(latencies)
    return {
        "backend": backend,
        "requests": len(results),
        "elapsed_s": elapsed,
        "requests_per_s": len(results) / elapsed if elapsed > 0 else None,
        "config": config or {},
        "final_states": {
            "sender": dict(Counter(r.sender.name for r in results)),
            "receiver": dict(Counter(r.receiver.name for r in results)),
        },
        "failure_kinds": {
            "sender": dict(Counter(r.sender_kind for r in results if r.sender_kind)),
            "receiver": dict(Counter(r.receiver_kind for r in results if r.receiver_kind)),
        },
        "latency_s": {
            "p50": lat["p50"],
            "p99": lat["p99"],
            "mean": sum(latencies) / len(latencies) if latencies else None,
            "max": max(latencies) if latencies else None,
        },
        "throughput": {
            "bytes": total_bytes,
            "gb_per_s": total_bytes / elapsed / 1e9 if elapsed > 0 else None,
            "per_transfer_gb_per_s": percentiles(rates),
        },
        "pages_checked": sum(r.pages_checked for r in results),
        "late_events": late_events + sum(m.stats.late_events for m in managers),
        "sides_disagree": sum(1 for r in results if (r.sender is KVPoll.Success) != (r.receiver is KVPoll.Success)),
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
    width = max(max(len(k) for k, _ in rows), max(len(k) for k in summary["verification"]))
    out.write("\nSummary\n")
    for key, value in rows:
        out.write(f"  {key:<{width}}  {value}\n")
    out.write("\nVerification\n")
    for key, value in summary["verification"].items():
        mark = "ok" if value == 0 else "FAIL"
        out.write(f"  {key.replace('_', ' '):<{width}}  {value:<6} {mark}\n")
    out.write(f"\n{'all checks passed' if summary['ok'] else 'VERIFICATION FAILED'}\n")


def run(args: argparse.Namespace) -> int:
    try:
        summary = simulate(args)
    except ValueError as exc:  # options that cannot go together
        print(f"kvfsm simulate: error: {exc}", file=sys.stderr)
        return 2
    return 0 if summary["ok"] else 1


def default_args(**overrides: Any) -> argparse.Namespace:
    """The defaults `configure` sets, with `overrides` (for callers without a command line)."""
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown simulate option {key!r}")
        setattr(args, key, value)
    return args
