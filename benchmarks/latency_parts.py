"""The parts a one-page cross-process request is made of, each measured alone.

`benchmarks/vs_sglang.py` measures whole requests; this script measures the
pieces their latency cannot go below on this machine, so that a latency
figure can be read against its floor (docs/performance.md, "Why one-page
latency stays near SGLang's"):

* round trips between two processes: raw TCP, ZeroMQ PUSH/PULL (what the
  control plane rides on, as SGLang's does) and kvfsm's `ControlPlane`
  (the receiving test thread waits on an event, one hand-off more);
* ``zmq-tuning``:
  the ZeroMQ round trip three ways, in turns: blocking in zmq's poll (what
  the control plane does), both ends spinning on non-blocking receives
  (what a wake-up costs), and over ``ipc://`` (one host only; what the
  loopback TCP stack costs under ZeroMQ);
* one page's engine writes: Mooncake, one 64 KiB write and the same bytes
  as four 16 KiB writes (K and V of two layers), from the first submit to
  the last completion, two engines in one process, and the same four
  writes followed by a 16-byte completion marker once they all completed
  (the floor of completion on the data plane, issue 23); NIXL (``nixl``), the
  same four 16 KiB writes as the one transfer of four descriptors that
  kvfsm's NIXL backend submits, two agents in one process (these are the
  ``raw`` rows of `benchmarks/vs_sglang.py`, which runs them through
  `raw_page_writes`); with NIXL also the same transfer into a second
  process napping 100 us between progress calls (kvfsm's decode), alone
  and right after a notification to it (what a commit marker sent as a
  notification costs the next transfer);
* naps: `time.sleep(20e-6)` with the default timer slack and with 1 us
  (`kvfsm.backends._naps.precise_naps`, what the writer and control
  threads set);
* hot and cold code: encoding a ROOM frame in a tight loop and after a 1 ms
  sleep each time.

Run from the project root: ``PYTHONPATH=. python benchmarks/latency_parts.py``
(``--only tcp,zmq,zmq-tuning,control,mooncake,nixl,naps,codec``; ``--count N`` round
trips or writes per figure, default 2000; ``--json PATH`` writes every
figure, and the engine parts' samples, there). Medians, in microseconds.
An engine's part is skipped, with a line saying why, where that engine is
not installed.
Every process it starts ends with it, and it talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PARTS = ("tcp", "zmq", "zmq-tuning", "control", "mooncake", "nixl", "naps", "codec")
REGIONS = 4  # K and V of two layers: one page is four writes
PAGE = 64 * 1024


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _samples(count: int, step: Callable[[], object], warmup: int = 20) -> list[float]:
    """Seconds each of `count` calls of `step` took, after `warmup` unmeasured calls."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return samples


def _timed(count: int, step: Callable[[], object], warmup: int = 20) -> float:
    return _median_us(_samples(count, step, warmup))


# -- round trips -------------------------------------------------------------------


def _tcp_echo(listener: socket.socket, count: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        for _ in range(count):
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(data)


def tcp_round_trip(count: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    echo = multiprocessing.Process(target=_tcp_echo, args=(listener, count + 20), daemon=True)
    echo.start()
    with socket.create_connection(listener.getsockname()) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def step() -> None:
            conn.sendall(b"x" * 100)
            conn.recv(65536)

        result = _timed(count, step)
    echo.join(10)
    listener.close()
    return result


def _zmq_receive(sock: Any, spin: bool, timeout_s: float = 10.0) -> list[bytes] | None:
    """One message: blocking in zmq's poll, or (`spin`) asking without blocking until one is there."""
    import zmq

    if not spin:
        return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[no-any-return]
        except zmq.Again:
            if time.monotonic() > deadline:
                return None


def _zmq_echo(port_in: int, address_out: str, count: int, transport: str = "tcp", spin: bool = False) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(_zmq_endpoint(transport, port_in))
    push.connect(address_out)
    for _ in range(count):
        frames = _zmq_receive(pull, spin)
        if frames is None:
            break
        push.send_multipart(frames)
    ctx.destroy(linger=0)


def _zmq_endpoint(transport: str, port: int) -> str:
    if transport == "ipc":
        return f"ipc:///tmp/kvfsm-latency-parts-{os.getpid() if port == 0 else port}.sock"
    return f"tcp://127.0.0.1:{port}"


def zmq_round_trip(count: int, transport: str = "tcp", spin: bool = False) -> float:
    """PUSH/PULL round trips to an echo process: `transport` "tcp" (loopback) or "ipc" (a Unix socket,
    one host only); `spin`: both ends ask without blocking instead of sleeping in zmq's poll."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    with socket.socket() as probe:  # free ports (also naming the ipc sockets)
        probe.bind(("127.0.0.1", 0))
        echo_port = probe.getsockname()[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pull.bind(_zmq_endpoint(transport, port))
    echo = multiprocessing.Process(
        target=_zmq_echo,
        args=(echo_port, _zmq_endpoint(transport, port), count + 20, transport, spin),
        daemon=True,
    )
    echo.start()
    push.connect(_zmq_endpoint(transport, echo_port))

    def step() -> None:
        push.send_multipart([b"x" * 100])
        if _zmq_receive(pull, spin) is None:
            raise RuntimeError("the ZeroMQ echo did not answer in 10 s")

    try:
        return _timed(count, step)
    finally:
        echo.join(10)
        ctx.destroy(linger=0)
        if transport == "ipc":
            for n in (port, echo_port):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_zmq_endpoint("ipc", n).removeprefix("ipc://"))


def _control_echo(address_queue: Any, count: int) -> None:
    from kvfsm.backends.control import ControlPlane

    holder: dict[str, Any] = {}
    done = threading.Event()
    seen = [0]

    def on_frames(frames: list[bytes]) -> None:
        holder["plane"].send(holder["channel"], frames)
        seen[0] += 1
        if seen[0] >= count:
            done.set()

    plane = ControlPlane(on_frames=on_frames, on_housekeeping=lambda: 0.05)
    holder["plane"] = plane
    address_queue.put(plane.address)
    holder["channel"] = plane.connect(address_queue.get())
    plane.start()
    done.wait(60)
    time.sleep(0.2)
    plane.stop()


def control_round_trip(count: int) -> float:
    from kvfsm.backends.control import ControlPlane

    addresses: Any = multiprocessing.Queue()
    echo = multiprocessing.Process(target=_control_echo, args=(addresses, count + 20), daemon=True)
    echo.start()
    echo_address = addresses.get(timeout=30)
    arrived = threading.Event()
    plane = ControlPlane(on_frames=lambda frames: arrived.set(), on_housekeeping=lambda: 0.05)
    addresses.put(plane.address)
    channel = plane.connect(echo_address)
    plane.start()

    def step() -> None:
        arrived.clear()
        plane.send(channel, [b"x" * 100])
        arrived.wait(5)

    try:
        return _timed(count, step)
    finally:
        plane.stop()
        echo.join(10)


# -- engine writes -----------------------------------------------------------------


def _mooncake_engine(buffer: Any) -> tuple[Any, str]:
    """A Mooncake engine in this process (TCP, P2P handshake) with `buffer` registered; (engine, its target name)."""
    from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    engine.register_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size())
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def _mooncake_pair(src: Any, dst: Any) -> tuple[Any, Any, str]:
    """Two Mooncake engines in this process (TCP, P2P handshake): `src` registered on one, `dst` on the other.

    Returns (writer, receiver, the receiver's target name); the receiver must outlive the writes.
    """
    a, _ = _mooncake_engine(src)
    b, target = _mooncake_engine(dst)
    return a, b, target


def mooncake_page_samples(count: int) -> tuple[list[float], list[float]]:
    """One 64 KiB page as one write and as four 16 KiB writes, submit to last completion (seconds each)."""
    import torch

    src = torch.ones(PAGE, dtype=torch.uint8)
    dst = torch.zeros(PAGE, dtype=torch.uint8)
    a, _receiver, target = _mooncake_pair(src, dst)  # the receiver lives as long as this call

    def writes(parts: int) -> Callable[[], None]:
        size = PAGE // parts

        def step() -> None:
            batches = [
                a.transfer_submit_write(target, src.data_ptr() + i * size, dst.data_ptr() + i * size, size)
                for i in range(parts)
            ]
            for batch in batches:
                while (status := a.transfer_check_status(batch)) == 0:
                    pass
                if status != 1:
                    raise RuntimeError(f"Mooncake write ended with status {status}")

        return step

    return _samples(count, writes(1)), _samples(count, writes(REGIONS))


MARKER = 16  # bytes: a generation and a token, what a data-plane completion marker would carry


def mooncake_marker_samples(count: int) -> list[float]:
    """The floor of completion on the data plane: one page's four writes, then a marker once all four completed.

    From the first submit to the marker's completion (seconds each). Rule 14
    allows a marker only after every write of the room succeeded, so it is
    submitted after the last completion, not with the writes. Each sample
    writes a new token and checks that it landed in the receiver's memory,
    where a decode would read it. (`transfer_check_status` reads only task
    0 of a batch, so each write is a batch of its own, as kvfsm submits.)
    """
    import torch

    src = torch.ones(PAGE + MARKER, dtype=torch.uint8)
    dst = torch.zeros(PAGE + MARKER, dtype=torch.uint8)
    a, _receiver, target = _mooncake_pair(src, dst)
    size = PAGE // REGIONS
    marker_src, marker_dst = src[PAGE:].view(torch.int64), dst[PAGE:].view(torch.int64)
    tokens = itertools.count(1)

    def wait(batch: int) -> None:
        while (status := a.transfer_check_status(batch)) == 0:
            pass
        if status != 1:
            raise RuntimeError(f"Mooncake write ended with status {status}")

    def step() -> None:
        token = next(tokens)
        marker_src[0], marker_src[1] = token, token ^ 0x5A5A
        batches = [
            a.transfer_submit_write(target, src.data_ptr() + i * size, dst.data_ptr() + i * size, size)
            for i in range(REGIONS)
        ]
        for batch in batches:
            wait(batch)
        wait(a.transfer_submit_write(target, src.data_ptr() + PAGE, dst.data_ptr() + PAGE, MARKER))
        if int(marker_dst[0]) != token or int(marker_dst[1]) != token ^ 0x5A5A:
            raise RuntimeError(f"the marker of token {token} did not land")

    return _samples(count, step)


def mooncake_page(count: int) -> tuple[float, float]:
    """Medians (us) of `mooncake_page_samples`."""
    one, four = mooncake_page_samples(count)
    return _median_us(one), _median_us(four)


def _nixl_agent(name: str, buffer: Any) -> Any:
    """A NIXL agent in this process (UCX, no progress thread, as `NixlBackend` runs it) with `buffer` registered."""
    from kvfsm.backends.nixl import _import_nixl

    nixl_agent, nixl_agent_config = _import_nixl()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory([(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0, "")], "DRAM")
    return agent


def _nixl_peer(agent: Any, metadata: bytes) -> str:
    """Load a remote agent's metadata into `agent`; the name its transfers and notifications address."""
    name = agent.add_remote_agent(metadata)
    return name.decode() if isinstance(name, bytes) else str(name)


def nixl_page_samples(count: int) -> list[float]:
    """One page's four 16 KiB writes as one NIXL transfer of four descriptors, as kvfsm submits them.

    Two agents (UCX, no progress thread, as `NixlBackend` runs them) in one
    process; from `initialize_xfer` to `check_xfer_state` saying DONE, the
    receiving agent polled as kvfsm's decode polls it. Seconds each.
    """
    import torch

    src = torch.ones(PAGE, dtype=torch.uint8)
    dst = torch.zeros(PAGE, dtype=torch.uint8)
    a, b = _nixl_agent("raw-a", src), _nixl_agent("raw-b", dst)
    name = _nixl_peer(a, b.get_agent_metadata())
    size = PAGE // REGIONS
    local = a.get_xfer_descs([(src.data_ptr() + i * size, size, 0) for i in range(REGIONS)], "DRAM")
    remote = a.get_xfer_descs([(dst.data_ptr() + i * size, size, 0) for i in range(REGIONS)], "DRAM")

    def step() -> None:
        handle = a.initialize_xfer("WRITE", local, remote, name, b"")
        state = a.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL write ended with ERR")
            b.get_new_notifs()  # the receiving side's progress, as kvfsm's decode makes it
            state = a.check_xfer_state(handle)
        a.release_xfer_handle(handle)

    return _samples(count, step)


NOTE = b"n" * 37  # a commit marker's size as a NIXL notification (kvfsm.backends._markers.NOTE_BYTES)


def _nixl_note_receiver(conn: Any, nap: float) -> None:
    """The decode's side of `nixl_after_a_notification`: an agent progressed every `nap` s, as kvfsm's decode does."""
    import torch

    dst = torch.zeros(2 * PAGE, dtype=torch.uint8)
    agent = _nixl_agent("raw-note-b", dst)
    conn.send((bytes(agent.get_agent_metadata()), dst.data_ptr()))
    notes = 0
    while not conn.poll(0):
        notes += sum(len(messages) for messages in agent.get_new_notifs().values())
        time.sleep(nap)
    conn.recv()
    conn.send(notes)


def nixl_after_a_notification(count: int, nap: float = 100e-6) -> dict[str, list[float]]:
    """One page's transfer into another process, alone and right after a NIXL notification to it (seconds each).

    The receiver is a second process that progresses its agent every `nap`
    (kvfsm's decode: every 0.1 ms while a prefill may write into it). In
    turns: the page's four 16 KiB writes as one transfer, from
    `initialize_xfer` to `check_xfer_state` saying DONE (polled without
    pause); then the same after a notification sent to the receiver
    (`send_notif`, as kvfsm's prefill sends a room's commit marker). Each
    notification is counted on arrival. Descriptors have gaps between them,
    as K and V of two layers do, so NIXL cannot merge them.
    """
    import torch

    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds engine threads
    ours, theirs = spawn.Pipe()
    receiver = spawn.Process(target=_nixl_note_receiver, args=(theirs, nap), daemon=True)
    receiver.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the NIXL receiver process did not start within 60 s")
        metadata, dst = ours.recv()
        src = torch.ones(2 * PAGE, dtype=torch.uint8)
        agent = _nixl_agent("raw-note-a", src)
        name = _nixl_peer(agent, metadata)
        size = PAGE // REGIONS
        mine = agent.get_xfer_descs([(src.data_ptr() + 2 * i * size, size, 0) for i in range(REGIONS)], "DRAM")
        yours = agent.get_xfer_descs([(dst + 2 * i * size, size, 0) for i in range(REGIONS)], "DRAM")

        def transfer() -> float:
            start = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", mine, yours, name, b"")
            state = agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("NIXL write ended with ERR")
                state = agent.check_xfer_state(handle)
            took = time.perf_counter() - start
            agent.release_xfer_handle(handle)
            return took

        found: dict[str, list[float]] = {"alone": [], "after": []}
        sent = 0
        for index in range(20 + count):
            for kind in ("alone", "after"):
                time.sleep(0.0005)  # the receiver's naps, not this loop, set the pace
                if kind == "after":
                    agent.send_notif(name, NOTE)
                    agent.get_new_notifs()
                    sent += 1
                took = transfer()
                if index >= 20:
                    found[kind].append(took)
        ours.send("stop")
        if not ours.poll(10):
            raise RuntimeError("the NIXL receiver process did not answer within 10 s")
        arrived = ours.recv()
        if arrived != sent:
            raise RuntimeError(f"{sent} notifications sent, {arrived} arrived")
        return found
    finally:
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
            receiver.join()


def raw_page_writes(engine: str, count: int) -> list[float]:
    """The raw engine's time for one page's writes as kvfsm issues them (seconds, one per page).

    `engine` is "mooncake" (four `transfer_submit_write`, then each polled)
    or "nixl" (one transfer of four descriptors).
    """
    if engine == "mooncake":
        return mooncake_page_samples(count)[1]
    if engine == "nixl":
        return nixl_page_samples(count)
    raise ValueError(f"engine must be 'mooncake' or 'nixl'; got {engine!r}")


def _scattered_writes(rng: random.Random, pages: int, pool_pages: int, region: int) -> list[tuple[int, int, int]]:
    """One request's writes as kvfsm makes them: random pages, runs of contiguous pairs coalesced, one per region.

    (offset in the source, offset in the destination, bytes); region r of
    the pool starts at r * pool_pages * region.
    """
    from kvfsm.backends.remote import coalesce_runs

    src = rng.sample(range(pool_pages), pages)
    dst = rng.sample(range(pool_pages), pages)
    writes = []
    for start_s, start_d, count in coalesce_runs(src, dst):
        for r in range(REGIONS):
            base = r * pool_pages * region
            writes.append((base + start_s * region, base + start_d * region, count * region))
    return writes


#: Longest a two-process raw stream's receiver waits for its writer (seconds).
RAW_STREAM_LIMIT = 600.0


def _scheduler_loop(stop: Any, nap: float) -> None:
    """What a scheduler's loop costs its process when nothing concludes: a glance at a few requests, a nap."""
    requests = {room: 0 for room in range(16)}
    while not stop.is_set():
        sum(requests[room] for room in requests)
        time.sleep(nap)


def _stream_receiver(size: int, nap: float, ready: Any, stop: Any) -> None:
    """The receiving Mooncake engine in a process of its own, beside a scheduler loop (`raw_stream`'s `beside_loop`).

    It ends when told, when its parent is gone (killed on a timeout, say) or
    after `RAW_STREAM_LIMIT` seconds, whichever comes first.
    """
    import torch

    parent = os.getppid()
    dst = torch.zeros(size, dtype=torch.uint8)
    _engine, target = _mooncake_engine(dst)
    threading.Thread(target=_scheduler_loop, args=(stop, nap), daemon=True).start()
    ready.put((target, dst.data_ptr()))
    ends = time.monotonic() + RAW_STREAM_LIMIT
    while not stop.wait(0.5) and os.getppid() == parent and time.monotonic() < ends:
        pass


def raw_stream(
    engine: str,
    inflight: int,
    requests: int,
    pages: int,
    budget: int | None = None,
    beside_loop: float | None = None,
) -> dict[str, float]:
    """The raw engine's throughput for 4 MiB-style requests with the same writes in flight as kvfsm's.

    `requests` requests of `pages` scattered pages (the writes kvfsm makes
    of them: runs coalesced, one write per run and region), `inflight` of
    them at a time, at most `budget` writes in flight (kvfsm's per-decode
    default: 512 for Mooncake, 1024 for NIXL) and 64 writes per submit (a
    claim's slice per turn; Mooncake submits them one by one). Two engines
    in one process; the bytes are not checked. Returns GB/s and seconds.

    With `beside_loop` (Mooncake only) the receiving engine runs in a process
    of its own, and each process also runs a thread that does what a
    scheduler's loop does when nothing concluded: glance at its requests and
    nap `beside_loop` seconds (`vs_sglang.py`'s loop, 100 us). kvfsm's and
    SGLang's rows run beside such a loop in both processes; the bare rows
    do not, and on a small machine that alone moves the engine's figure.
    """
    import torch

    region = PAGE // REGIONS
    pool_pages = max(2 * pages, 256)
    size = pool_pages * region * REGIONS
    src = torch.ones(size, dtype=torch.uint8)
    rng = random.Random(23)
    todo = [_scattered_writes(rng, pages, pool_pages, region) for _ in range(requests)]
    from kvfsm.backends._naps import precise_naps

    precise_naps()  # this thread's naps as short as the writer's
    if beside_loop is None:
        dst = torch.zeros(size, dtype=torch.uint8)
        submit, poll, close = _stream_engine(engine, src, dst)
    else:
        if engine != "mooncake":
            raise ValueError(f"a raw stream beside a scheduler loop runs on Mooncake only; got {engine!r}")
        submit, poll, close = _stream_to_a_process(src, size, beside_loop)
    budget = budget or (512 if engine == "mooncake" else 1024)
    waiting: list[list[tuple[int, int, int]]] = []  # per request in flight: writes not yet submitted
    jobs: list[tuple[Any, int]] = []  # (job, writes) in submission order
    began = time.perf_counter()
    done_bytes = sum(w[2] for request in todo for w in request)
    in_flight = 0
    pending = list(reversed(todo))
    try:
        while pending or waiting or jobs:
            while pending and len(waiting) < inflight:
                waiting.append(list(pending.pop()))
            for writes in waiting:
                while writes and in_flight < budget:
                    part = writes[: min(64, budget - in_flight)]
                    del writes[: len(part)]
                    jobs.append((submit(part), len(part)))
                    in_flight += len(part)
            waiting = [w for w in waiting if w]
            still = []
            for job, count in jobs:
                if poll(job):
                    in_flight -= count
                else:
                    still.append((job, count))
            if len(still) == len(jobs) and still:
                time.sleep(20e-6)  # nothing ended: nap as kvfsm's writer does (a spin takes the engine's core)
            jobs = still
    finally:
        close()
    elapsed = time.perf_counter() - began
    return {"gb_s": done_bytes / elapsed / 1e9, "seconds": elapsed, "bytes": done_bytes, "requests": requests}


def _mooncake_stream_calls(
    writer: Any, target: str, s0: int, d0: int
) -> tuple[Callable[[list[tuple[int, int, int]]], Any], Callable[[Any], bool]]:
    """submit(writes) -> batches and poll(batches) -> ended, for a raw stream's Mooncake writes to `target`."""

    def submit(writes: list[tuple[int, int, int]]) -> Any:
        return [writer.transfer_submit_write(target, s0 + s, d0 + d, n) for s, d, n in writes]

    def poll(batches: list[int]) -> bool:
        while batches:
            status = writer.transfer_check_status(batches[0])
            if status == 0:
                return False
            if status != 1:
                raise RuntimeError(f"Mooncake write ended with status {status}")
            batches.pop(0)
        return True

    return submit, poll


def _stream_to_a_process(
    src: Any, size: int, nap: float
) -> tuple[Callable[..., Any], Callable[[Any], bool], Callable[[], object]]:
    """submit, poll, close for Mooncake writes into a receiver process (`_stream_receiver`), both beside a loop."""
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds engine threads
    ready, stop = spawn.Queue(), spawn.Event()
    receiver = spawn.Process(target=_stream_receiver, args=(size, nap, ready, stop), daemon=True)
    receiver.start()
    loop_stop = threading.Event()
    try:
        target, d0 = ready.get(timeout=120)
        writer, _ = _mooncake_engine(src)
        s0 = src.data_ptr()
        # A write of nothing opens the receiver's segment before the clock starts.
        opening = writer.transfer_submit_write(target, s0, d0, 0)
        status = 0
        for _ in range(10_000):  # 10 s at most
            status = writer.transfer_check_status(opening)
            if status != 0:
                break
            time.sleep(0.001)
        if status != 1:
            raise RuntimeError(f"Mooncake could not open the receiver's segment (status {status})")
    except BaseException:
        stop.set()
        receiver.join(10)
        raise
    threading.Thread(target=_scheduler_loop, args=(loop_stop, nap), daemon=True).start()

    submit, poll = _mooncake_stream_calls(writer, target, s0, d0)

    def close() -> None:
        loop_stop.set()
        stop.set()
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()

    return submit, poll, close


def _stream_engine(
    engine: str, src: Any, dst: Any
) -> tuple[Callable[..., Any], Callable[[Any], bool], Callable[[], object]]:
    """submit(writes) -> job, poll(job) -> ended, close(): two engines in one process, src -> dst."""
    if engine == "mooncake":
        a, b, target = _mooncake_pair(src, dst)
        submit, poll = _mooncake_stream_calls(a, target, src.data_ptr(), dst.data_ptr())
        held = (a, b)  # the receiving engine must outlive the writes: only `close` drops it
        return submit, poll, held.__len__
    if engine == "nixl":
        na, nb = _nixl_agent("raw-stream-a", src), _nixl_agent("raw-stream-b", dst)
        name = _nixl_peer(na, nb.get_agent_metadata())
        s1, d1 = src.data_ptr(), dst.data_ptr()

        def submit_nixl(writes: list[tuple[int, int, int]]) -> Any:
            local = na.get_xfer_descs([(s1 + s, n, 0) for s, _, n in writes], "DRAM")
            remote = na.get_xfer_descs([(d1 + d, n, 0) for _, d, n in writes], "DRAM")
            handle = na.initialize_xfer("WRITE", local, remote, name, b"")
            if na.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer returned ERR")
            return handle

        def poll_nixl(handle: Any) -> bool:
            nb.get_new_notifs()
            state = na.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL write ended with ERR")
            if state == "DONE":
                na.release_xfer_handle(handle)
                return True
            return False

        agents = (na, nb)
        return submit_nixl, poll_nixl, agents.__len__
    raise ValueError(f"engine must be 'mooncake' or 'nixl'; got {engine!r}")


# -- naps and cold code ------------------------------------------------------------


def _sleep_20us() -> float:
    return _timed(500, lambda: time.sleep(20e-6))


def naps() -> tuple[float, float]:
    from kvfsm.backends._naps import precise_naps

    result: dict[str, float] = {}

    def measure() -> None:
        result["default"] = _sleep_20us()
        result["precise"] = _sleep_20us() if precise_naps() else float("nan")

    thread = threading.Thread(target=measure)  # the slack is per thread: leave this one's alone
    thread.start()
    thread.join()
    return result["default"], result["precise"]


def codec(count: int) -> tuple[float, float]:
    from kvfsm.backends import codec as frames

    fields = {"sid": "a" * 32, "key": "b" * 32, "room": 5, "gen": 123456789, "pages": [3], "aux": 1, "marker": None}

    def encode() -> None:
        frames.encode("ROOM", fields, check=False)

    def cold() -> None:
        time.sleep(0.001)
        start = time.perf_counter()
        encode()
        samples.append(time.perf_counter() - start)

    hot = _timed(count, encode)
    samples: list[float] = []
    for _ in range(min(count, 500)):
        cold()
    return hot, _median_us(samples)


def _percentile_us(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[int(fraction * (len(ordered) - 1))] * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The parts of a one-page cross-process request, each alone.")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts (default {','.join(PARTS)})")
    parser.add_argument("--count", type=int, default=2000, help="round trips or writes per figure (default 2000)")
    parser.add_argument(
        "--json", metavar="PATH", help="write every figure (us) and the engine parts' samples (s) there"
    )
    parser.add_argument(
        "--stream",
        metavar="N",
        type=int,
        action="append",
        default=[],
        help="also the engine parts' throughput with N requests in flight (repeatable; see raw_stream)",
    )
    parser.add_argument("--stream-requests", type=int, default=100, help="requests per --stream figure (default 100)")
    parser.add_argument("--stream-pages", type=int, default=64, help="64 KiB pages per --stream request (default 64)")
    parser.add_argument(
        "--stream-beside-loop",
        metavar="SECONDS",
        type=float,
        help="Mooncake's --stream figures with the receiver in its own process, both beside a loop napping that long",
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    if args.count < 1:
        parser.error("--count must be at least 1")
    if args.stream_beside_loop is not None and not args.stream_beside_loop >= 0:  # NaN fails too
        parser.error(f"--stream-beside-loop must be at least 0 seconds; got {args.stream_beside_loop}")
    figures: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}

    def show(key: str, text: str, value: float) -> None:
        figures[key] = value
        print(f"  {text:<52}{value:8.1f}", flush=True)

    print(f"medians over {args.count} (naps and cold code: 500), microseconds")
    if "tcp" in parts:
        show("tcp", "round trip, raw TCP between two processes", tcp_round_trip(args.count))
    if "zmq" in parts:
        show("zmq", "round trip, ZeroMQ PUSH/PULL between two processes", zmq_round_trip(args.count))
    if "zmq-tuning" in parts:
        # Measured in turns with the default, so that a busy spell hits them alike.
        turns = {"zmq_default": ("tcp", False), "zmq_spin": ("tcp", True), "zmq_ipc": ("ipc", False)}
        found: dict[str, list[float]] = {key: [] for key in turns}
        for _ in range(3):
            for key, (transport, spin) in turns.items():
                found[key].append(zmq_round_trip(max(1, args.count // 3), transport, spin))
        show(
            "zmq_default", "ZeroMQ round trip, tcp, blocking (3 turns, median)", statistics.median(found["zmq_default"])
        )
        show("zmq_spin", "ZeroMQ round trip, tcp, both ends spinning (NOBLOCK)", statistics.median(found["zmq_spin"]))
        show("zmq_ipc", "ZeroMQ round trip, ipc (one host only), blocking", statistics.median(found["zmq_ipc"]))
    if "control" in parts:
        show("control", "round trip, kvfsm ControlPlane (+1 thread hand-off)", control_round_trip(args.count))
    if "mooncake" in parts:
        try:
            one, four = mooncake_page_samples(args.count)
        except ImportError as exc:
            skipped["mooncake"] = str(exc)
            print(f"  Mooncake: skipped ({exc})")
        else:
            samples.update(mooncake_one=one, mooncake=four)
            show("mooncake_one", "Mooncake, one 64 KiB write, submit to completion", _median_us(one))
            show("mooncake", "Mooncake, four 16 KiB writes (one page, 4 regions)", _median_us(four))
            show("mooncake_p99", "Mooncake, the same four writes, p99", _percentile_us(four, 0.99))
            marker = mooncake_marker_samples(args.count)
            samples["mooncake_marker"] = marker
            show("mooncake_marker", "Mooncake, the four writes, then a 16-byte marker", _median_us(marker))
    if "nixl" in parts:
        try:
            nixl = nixl_page_samples(args.count)
        except ImportError as exc:
            skipped["nixl"] = str(exc)
            print(f"  NIXL: skipped ({exc})")
        else:
            samples["nixl"] = nixl
            show("nixl", "NIXL, four 16 KiB writes in one transfer", _median_us(nixl))
            show("nixl_p99", "NIXL, the same transfer, p99", _percentile_us(nixl, 0.99))
            noted = nixl_after_a_notification(args.count)
            samples.update(nixl_apart=noted["alone"], nixl_after_note=noted["after"])
            show("nixl_apart", "NIXL, the same into another process", _median_us(noted["alone"]))
            show("nixl_after_note", "NIXL, the same right after a notification to it", _median_us(noted["after"]))
    streams: dict[str, dict[str, float]] = {}
    for engine in (e for e in ("mooncake", "nixl") if e in parts and e not in skipped):
        for inflight in args.stream:
            beside = args.stream_beside_loop if engine == "mooncake" else None
            found = raw_stream(engine, inflight, args.stream_requests, args.stream_pages, beside_loop=beside)
            streams[f"{engine}/{inflight}"] = found
            where = "" if beside is None else f", two processes beside a {beside * 1e6:.0f} us loop"
            print(
                f"  {engine}, {args.stream_requests} requests of {args.stream_pages} pages, {inflight} in flight"
                f"{where}: {found['gb_s']:.3f} GB/s",
                flush=True,
            )
    if "naps" in parts:
        default, precise = naps()
        show("nap_default", "time.sleep(20e-6), default timer slack", default)
        show("nap_precise", "time.sleep(20e-6), timer slack 1 us", precise)
    if "codec" in parts:
        hot, cold = codec(args.count)
        show("codec_hot", "encode a ROOM frame, hot", hot)
        show("codec_cold", "encode a ROOM frame, after a 1 ms sleep", cold)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"figures_us": figures, "samples_s": samples, "skipped": skipped, "streams": streams})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
