"""`kvfsm simulate`, the main job: many prefill->decode transfers, then proof.

Each request allocates pages in a prefill pool and a decode pool, opens its
room on a sender and a receiver manager, bootstraps both sides through the
chosen backend (`--backend`, default `local`: real torch pages), posts the
decode pages, sends the prefill pages in `--chunks` chunks (the last one
possibly empty), waits for both sides to end, checks the data, waits until
the pages are release-safe, frees them and closes the rooms. Aborts race the
transfer at random points from either side; some transfers fail before
their last chunk (`--fail-rate`, a `TRANSFER_ERROR` on the prefill, the
decode told its peer failed) and some transfers stall (`--stall-rate`: the
last chunk is never sent, and the room ends by its deadline).

Every random choice of a request (abort side and step, failure, stall,
pages, data) is drawn by this harness from that request's own generator,
the n-th request always getting the n-th seed of `--seed`; so a seeded run
on the in-process backends ends the same way every time, except where a
planned abort races the room's last copy (counted as `raced`, see
`kvfsm._simulation`). Requests are made only as `--concurrency` workers
take them, and their results folded into a `Tally` as they end, so memory
does not grow with `--requests`; Ctrl-C lets the requests in flight end and
returns the summary of what ran, marked `"interrupted": true`.

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

For other harnesses (the cross-process engines reuse this format; it lives
in `kvfsm._simulation`): `build_summary(results, ...)` turns per-request
`RequestResult`s (or a `Tally` of them) plus extra check counts into the
summary dict, `print_summary(summary, out)` renders it, and
`summary["ok"]` is true iff every verification value is 0.
`simulate(args)` runs the whole thing and returns that dict. The dict:

    {"backend": str, "requests": int, "elapsed_s": float,
     "requests_per_s": float, "config": {...},
     "final_states": {"sender": {"Success": n, "Failed": n}, "receiver": {...}},
     "failure_kinds": {"sender": {"aborted": n, ...}, "receiver": {...}},
     "latency_s": {"p50", "p99", "mean", "max"}      # receiver, successes
     "throughput": {"bytes": int, "gb_per_s": float, "per_transfer_gb_per_s": {"p50", "p99"}},
     "pages_checked": int, "late_events": int, "sides_disagree": int,
     "outcomes": {"digest": str, "raced": int} or None,   # None across processes
     "interrupted": bool,                                 # `simulate` only
     "verification": {"pages_not_identical": 0, "rooms_left_open": 0,
                      "status_handle_mismatches": 0, "released_before_safe": 0},
     "ok": bool, "metrics": TransferMetrics.snapshot()}
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from .._lifecycle import TERMINAL, Timeouts
from .._manager import TransferHandle, TransferManager
from .._observe import StateChange
from .._states import FailureKind, FailureReason, KVPoll
from ..metrics import TransferMetrics
from ._cliargs import UsageError, output_path, positive_int, positive_seconds, rate
from ._simulation import (
    REMOTE_BACKENDS,
    VERIFICATION_CHECKS,
    PagePool,
    RequestResult,
    Tally,
    build_summary,
    interrupted_line,
    print_summary,
    write_json,
)

if TYPE_CHECKING:
    import torch

    from ..backends.base import KVBackend
    from ..backends.local import LocalBackend

__all__ = [
    "configure",
    "run",
    "simulate",
    "check_args",
    "default_args",
    "RequestResult",
    "build_summary",
    "print_summary",
    "VERIFICATION_CHECKS",
]

BUGS = ("none", "corrupt-page", "leave-open", "early-release")
LAYERS = 2


def configure(parser: argparse.ArgumentParser) -> None:
    from ..backends import BACKENDS

    parser.add_argument(
        "--backend", choices=sorted(BACKENDS), default="local", help="transfer engine (default: %(default)s)"
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=1000,
        help="transfers to run, made one at a time as others finish: any number fits in memory (default: %(default)s)",
    )
    parser.add_argument(
        "--page-size",
        type=positive_int,
        default=16384,
        help="bytes of one page over all layers' K and V; a multiple of 8 (16 for mooncake and nixl) "
        "(default: %(default)s)",
    )
    parser.add_argument("--pages", type=positive_int, default=8, help="KV pages per request (default: %(default)s)")
    parser.add_argument(
        "--chunks",
        type=positive_int,
        default=3,
        help="send() calls per request, the last flagged (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    parser.add_argument(
        "--abort-rate", type=rate, default=0.05, help="fraction of requests aborted by one side (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-rate", type=rate, default=0.01, help="probability that a chunk fails (default: %(default)s)"
    )
    parser.add_argument(
        "--stall-rate",
        type=rate,
        default=0.005,
        help="fraction of transfers that stall (the last chunk never comes) until their deadline (default: %(default)s)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=positive_seconds,
        default=0.5,
        help="seconds a room may stay Transferring, and a sender may wait to send (ends stalls; default: %(default)s)",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="copy threads of the local backend")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="fixes every request's plan (aborts, failures, stalls, pages, data); on fake and local the "
        "outcomes too, except an abort that races a last copy (see 'outcome digest') (default: %(default)s)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="also write the summary as JSON to PATH (checked first)"
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    parser.add_argument(
        "--inject-bug",
        choices=BUGS,
        default="none",
        help="break the run on purpose to prove the verification catches it (default: %(default)s)",
    )


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, options that cannot work together (`UsageError`)."""
    if args.backend in REMOTE_BACKENDS:
        multiple = LAYERS * 2 * 4  # float32 K and V pages in both processes
        if args.inject_bug != "none":
            raise UsageError(f"--inject-bug runs on the in-process backends only, not on {args.backend!r}")
    else:
        multiple = 2 * LAYERS * 2  # bfloat16 K and V
    if args.page_size % multiple:
        raise UsageError(
            f"--page-size must be a multiple of {multiple} bytes for --backend {args.backend}; got {args.page_size}"
        )


class _Progress:
    """A one-line progress bar on stderr (a line every 2 s when not a terminal), drawn from the start."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.done = 0
        self._lock = threading.Lock()
        self._tty = stream.isatty()
        self._next_line = 0.0
        self._start = time.monotonic()

    def begin(self) -> None:
        """Draw the bar at 0 before the first request ends (a long run shows it is alive)."""
        if self.enabled:
            with self._lock:
                self._draw(time.monotonic())

    def step(self) -> None:
        with self._lock:
            self.done += 1
            if not self.enabled:
                return
            now = time.monotonic()
            if self.done == self.total or now >= self._next_line:
                self._draw(now)

    def _draw(self, now: float) -> None:
        self._next_line = now + (0.1 if self._tty else 2.0)
        filled = int(30 * self.done / self.total)
        bar = "#" * filled + "-" * (30 - filled)
        rate = self.done / max(now - self._start, 1e-9)
        end = "\r" if self._tty and self.done < self.total else "\n"
        self.stream.write(f"simulate [{bar}] {self.done}/{self.total} {rate:.0f} req/s{end}")
        self.stream.flush()


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
    prefill: PagePool
    decode: PagePool
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
    # Page picks get their own generator: how many draws they take depends on
    # how many pages are free, which depends on timing; the plan must not.
    picks = random.Random(rng.getrandbits(64))
    src_pages, src_aux = world.prefill.take(args.pages, picks)
    dst_pages, dst_aux = world.decode.take(args.pages, picks)
    given: list[PagePool] = []
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
    given: list[PagePool],
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
    # The harness, not the backend's copy threads, draws the faults: from the
    # request's own generator, so the seed decides them whatever the timing.
    harness_fail = rng.random() < 1 - (1 - args.fail_rate) ** args.chunks
    harness_stall = rng.random() < args.stall_rate
    step = 0
    last_sent = False
    raced = False

    def maybe_abort() -> bool:
        nonlocal step, raced
        hit = abort_at == step
        step += 1
        if hit:
            # After the last chunk went out the abort races its copy: which
            # one wins is timing, so the seed cannot decide this outcome.
            raced = last_sent
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
        if not maybe_abort() and send.poll() is KVPoll.WaitingForInput:
            parts = _split(src_pages, args.chunks)
            for index, part in enumerate(parts):
                if index and maybe_abort():
                    break
                last = index == len(parts) - 1
                if harness_stall and last:
                    # The last chunk never comes: the room ends by its
                    # transferring deadline (waiting, with a single chunk).
                    break
                if harness_fail and last:
                    send.fail(FailureReason(FailureKind.TRANSFER_ERROR, "simulated transport error"))
                    recv.fail(FailureReason(FailureKind.PEER_FAILED, "sender failed", from_peer=True))
                    break
                sb.send(send, part, last=last, aux_index=src_aux if last else None)
                last_sent = last
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
            raced=raced,
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
    given: list[PagePool],
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
    from ..backends import KVPools, get_backend

    backend_cls = get_backend(args.backend)
    # The sender sends as soon as it is bootstrapped and holds the deadlines
    # that end a stall: `--transfer-timeout` for its wait and its transfer.
    # The receiver waits for its first chunk behind other rooms' chunks and
    # hears of a stalled sender as PEER_FAILED, so its own deadlines are a
    # longer backstop: a stall ends the same way whichever reaper runs first.
    sender_timeouts = Timeouts(
        bootstrap=30.0, waiting=args.transfer_timeout, transferring=args.transfer_timeout, drain=30.0
    )
    backstop = args.transfer_timeout if args.backend == "fake" else max(2.0, 4 * args.transfer_timeout)
    receiver_timeouts = attrs.evolve(sender_timeouts, waiting=backstop, transferring=backstop)
    sender = TransferManager("sender", timeouts=sender_timeouts)
    receiver = TransferManager("receiver", timeouts=receiver_timeouts)
    pool_pages = args.concurrency * args.pages * 2 + 8
    slots = args.concurrency * 2 + 4
    tensors: dict[str, Any] = {}
    if args.backend == "fake":
        send_backend: KVBackend = backend_cls(sender)
        recv_backend: KVBackend = backend_cls(receiver)
        return _World(
            args, sender, receiver, send_backend, recv_backend, PagePool(pool_pages, slots),
            PagePool(pool_pages, slots), _Ends(), tensors, check_data=False, peers_linked=False,
        )  # fmt: skip
    import torch

    from ..backends._pagecopy import word_view
    from ..backends.local import Faults, LocalBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    element = 2  # bfloat16
    check_args(args)
    per_region = args.page_size // (2 * LAYERS)
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
    # Failures and stalls are the harness's (see _run_request); the backend
    # only delays and lingers for the early-release bug.
    faults = Faults(
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
        args, sender, receiver, send_backend, recv_backend, PagePool(pool_pages, slots),
        PagePool(pool_pages, slots), _Ends(), tensors, check_data=True,
        audit=recv_backend if isinstance(recv_backend, LocalBackend) else None,
    )  # fmt: skip


def _plans(args: argparse.Namespace) -> Iterator[tuple[int, random.Random]]:
    """Each request's room id and random generator, made only when a worker asks for it.

    Made lazily (a generator holds about 2.5 KB): however many requests a
    run has, only those in flight exist. Room `n` always gets the `n`-th
    seed, whichever worker takes it.
    """
    seeds = random.Random(args.seed)
    for room in range(args.requests):
        yield room, random.Random(seeds.getrandbits(64))


class _Interrupted(Exception):
    """Ctrl-C stopped the run; the requests already finished are in `tally`."""


def _drive(world: _World, args: argparse.Namespace, tally: Tally, progress: _Progress) -> bool:
    """Run every request on `args.concurrency` workers; False if Ctrl-C stopped it early.

    After a Ctrl-C no new request starts, and the ones in flight end as
    usual (each is bounded by its deadlines), so what ran is still checked.
    A second Ctrl-C stops waiting for them.
    """
    plans = _plans(args)
    feed = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            with feed:
                plan = next(plans, None)
            if plan is None:
                return
            try:
                result = _one_request(world, *plan)
            except BaseException as exc:  # a harness error: stop feeding, report it
                errors.append(exc)
                stop.set()
                return
            finally:
                progress.step()
            tally.add(result)

    workers = [
        threading.Thread(target=worker, name=f"kvfsm-simulate-{n}", daemon=True) for n in range(args.concurrency)
    ]
    for thread in workers:
        thread.start()
    finished = True
    try:
        for thread in workers:
            thread.join()
    except KeyboardInterrupt:
        finished = False
        stop.set()
        try:
            for thread in workers:
                thread.join()
        except KeyboardInterrupt:
            raise _Interrupted from None
    if errors:
        raise errors[0]
    return finished


def simulate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> dict[str, Any]:
    """Run the simulation described by `args` (see `configure`); print and return the summary.

    The summary goes to `out` (default stdout), the progress bar to `err`
    (default stderr). Stopped by Ctrl-C, it returns the summary of the
    requests that finished, with `"interrupted": True`, and prints nothing.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    check_args(args)
    if args.backend in REMOTE_BACKENDS:
        # Real engines run prefill and decode as two processes on loopback.
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
    tally = Tally()
    managers: tuple[TransferManager, ...] = (world.sender, world.receiver)
    start = time.perf_counter()
    progress.begin()
    try:
        finished = _drive(world, args, tally, progress)
    except _Interrupted:
        # Requests are still in flight: nothing more can be checked or closed.
        finished, managers = False, ()
    finally:
        elapsed = time.perf_counter() - start
        if managers:
            world.send_backend.close()
            world.recv_backend.close()
        for manager in (world.sender, world.receiver):
            manager.stop_reaper()
    summary = build_summary(
        tally,
        backend=args.backend,
        elapsed=elapsed,
        managers=managers,
        metrics=metrics,
        extra_checks={"released_before_safe": _late_writes(world) if managers else 0},
        config={
            k: getattr(args, k)
            for k in (
                "requests", "page_size", "pages", "chunks", "concurrency", "abort_rate",
                "fail_rate", "stall_rate", "transfer_timeout", "seed", "inject_bug",
            )
        },
    )  # fmt: skip
    summary["interrupted"] = not finished
    if finished:
        print_summary(summary, out)
    if args.json:
        write_json(args.json, summary)
    return summary


def _late_writes(world: _World) -> int:
    """Copies that landed in a room's decode pages after the harness released them."""
    backend = world.audit
    if backend is None:
        return 0
    # Closing a room drops its audit entry; any entry left belongs to a room
    # some copy wrote into after it was closed.
    return len(backend.audited_rooms())


def run(args: argparse.Namespace) -> int:
    summary = simulate(args)
    if summary.get("interrupted"):
        print(f"\nkvfsm simulate: {interrupted_line(summary, args.requests)}", file=sys.stderr)
        return 130
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
