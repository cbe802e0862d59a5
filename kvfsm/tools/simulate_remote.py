"""`kvfsm simulate --backend mooncake|nixl`: prefill and decode in two processes.

The same job as `kvfsm.simulate`, across a process boundary: the parent
spawns a prefill process and a decode process, each with its own
`TransferManager`, KV pools and engine endpoint on 127.0.0.1, and waits
for both to report. The parent imports neither torch nor an engine.

Both children derive every request's plan from the seed: which side aborts
and at which step, which transfers fail on the prefill (`--fail-rate`, a
`TRANSFER_ERROR` before the last chunk). Each side picks its pages from its
own free list at random (scattered pages), the prefill fills its source
pages and aux slot with data derived from the room id, and the decode,
once a room succeeded, regenerates that data and compares it byte for byte
with what landed. Pages go back to a free list only once release-safe.

At the end the parent joins both reports per room and returns the summary
dict of `kvfsm.simulate` (same keys, same verification block: pages not
identical, rooms left open, status/handle mismatches, released before
safe; `sides_disagree` too). The stall injection of the local backend has
no cross-process equivalent here and is ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import multiprocessing
import os
import random
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TextIO

from .._states import KVPoll
from ._cliargs import MissingDependency, UsageError
from ._native_log import capture_native_stderr
from ._simulation import REMOTE_BACKENDS, PagePool, RequestResult, build_summary, print_summary, write_json

if TYPE_CHECKING:
    from ..backends.base import KVBackend

__all__ = ["simulate_remote", "run", "REMOTE_BACKENDS", "missing_engine", "ENGINE_INSTALL"]

#: What each engine's processes import, and how to install it.
ENGINE_MODULES: dict[str, tuple[str, ...]] = {"mooncake": ("zmq", "mooncake.engine"), "nixl": ("zmq", "nixl._api")}
ENGINE_INSTALL: dict[str, str] = {
    "mooncake": "pip install 'kvfsm[engines]' (pyzmq and Mooncake Transfer Engine), "
    "and Debian's libibverbs1 librdmacm1 libnuma1 (apt-get install libibverbs1 librdmacm1 libnuma1)",
    "nixl": "pip install 'kvfsm[engines]' (pyzmq), then NIXL without its CUDA torch: "
    "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy",
}
LAYERS = 2
AUX_BYTES = 64


def _arg(args: argparse.Namespace, name: str, default: Any) -> Any:
    return getattr(args, name, default)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    page_size = int(_arg(args, "page_size", 16384))
    if page_size % (LAYERS * 2 * 4):
        raise UsageError(f"--page-size must be a multiple of {LAYERS * 2 * 4} bytes (2 layers x K,V x float32)")
    return {
        "backend": args.backend,
        "requests": int(_arg(args, "requests", 200)),
        "pages": int(_arg(args, "pages", 8)),
        "page_size": page_size,
        "chunks": int(_arg(args, "chunks", 3)),
        "concurrency": int(_arg(args, "concurrency", 8)),
        "abort_rate": float(_arg(args, "abort_rate", 0.05)),
        "fail_rate": float(_arg(args, "fail_rate", 0.01)),
        "seed": int(_arg(args, "seed", 0)),
        "progress": not _arg(args, "no_progress", False),
        # Benchmarks turn the data fill and byte check off to time the transfers alone.
        "verify": bool(_arg(args, "verify", True)),
        "heartbeat": 0.5,
        # The children log like the parent (`kvfsm simulate -v ...`).
        "log_level": logging.getLogger().getEffectiveLevel(),
    }


def _plan(settings: dict[str, Any], room: int) -> dict[str, Any]:
    """The request's fate, the same in both processes."""
    rng = random.Random(settings["seed"] * 1_000_003 + room)
    abort_side = None
    abort_step = None
    if rng.random() < settings["abort_rate"]:
        abort_side = rng.choice(("sender", "receiver"))
        # receiver steps: 0 after bootstrap, 1 after expect; sender: 0 after bootstrap, 1.. between chunks
        abort_step = rng.randrange(2) if abort_side == "receiver" else rng.randrange(1 + settings["chunks"])
    fails = rng.random() < 1 - (1 - settings["fail_rate"]) ** settings["chunks"]
    return {"abort_side": abort_side, "abort_step": abort_step, "fails": fails and abort_side is None}


# -- children ---------------------------------------------------------------------------------


class _Side:
    """One process's half of the simulation."""

    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        import torch

        import kvfsm
        from kvfsm.backends import get_backend
        from kvfsm.backends.base import KVPools
        from kvfsm.backends.remote import RemoteBackend, RemoteConfig

        self.torch, self.kvfsm, self.role, self.settings = torch, kvfsm, role, settings
        timeouts = kvfsm.Timeouts(bootstrap=20.0, waiting=20.0, transferring=20.0, drain=5.0)
        self.manager = kvfsm.TransferManager(role, timeouts=timeouts)
        self.manager.start_reaper(0.05)
        self.events: dict[int, threading.Event] = {}
        self.manager.subscribe(self._wake)
        pages = settings["concurrency"] * settings["pages"] * 2
        floats = settings["page_size"] // (LAYERS * 2 * 4)
        self.floats = floats
        self.k = torch.zeros(LAYERS, pages, floats)
        self.v = torch.zeros(LAYERS, pages, floats)
        self.aux = torch.zeros(settings["concurrency"] * 2, AUX_BYTES, dtype=torch.uint8)
        self.free = PagePool(pages, settings["concurrency"] * 2)
        backend_class = get_backend(settings["backend"])
        if issubclass(backend_class, RemoteBackend):
            config = RemoteConfig(heartbeat_interval=settings["heartbeat"], heartbeat_misses=4)
            self.backend: KVBackend = backend_class(self.manager, config)
        else:  # an in-process engine (the benchmark's local baseline)
            self.backend = backend_class(self.manager)
        self.backend.register_pools(KVPools.from_tensors(self.k, self.v, self.aux))
        self.done = 0
        self.lock = threading.Lock()

    def pattern(self, room: int) -> tuple[Any, Any, Any]:
        torch = self.torch
        generator = torch.Generator().manual_seed(room)
        shape = (LAYERS, self.settings["pages"], self.floats)
        k = torch.randn(shape, generator=generator)
        v = torch.randn(shape, generator=generator)
        aux = torch.randint(0, 256, (AUX_BYTES,), dtype=torch.uint8, generator=generator)
        return k, v, aux

    def _wake(self, change: Any) -> None:
        event = self.events.get(change.room)
        if event is not None:
            event.set()

    def wait(self, handle: Any, until: Any, limit: float = 60.0) -> None:
        """Sleep until `until(handle)`, woken by the room's state changes (no busy polling)."""
        event = self.events.setdefault(handle.room, threading.Event())
        deadline = time.monotonic() + limit
        while not until(handle) and time.monotonic() < deadline:
            event.wait(0.05)
            event.clear()
            handle.poll()

    def finish(self, handle: Any, room: int, pages: list[int], slot: int, result: dict[str, Any]) -> dict[str, Any]:
        self.wait(handle, lambda h: h.is_terminal)
        mismatch = int(self.manager.status(room) is not handle.state)
        safe_limit = time.monotonic() + (self.manager.timeouts.drain or 5.0) + 5.0
        while not handle.release_safe and time.monotonic() < safe_limit:
            time.sleep(0.001)
        released_unsafe = int(not handle.release_safe)
        reason = handle.reason
        result.update(
            state=handle.state.name,
            kind=reason.kind.value if reason else None,
            latency=handle.transfer_latency,
            nbytes=handle.nbytes,
            mismatch=mismatch,
            released_before_safe=released_unsafe,
        )
        self.manager.close(room)
        self.events.pop(room, None)
        if self.role == "receiver" and self.settings["verify"]:
            # Scrub before the pages go back: a write landing after release would show up
            # as a mismatch in the next room that gets these pages.
            index = self.torch.tensor(pages)
            self.k[:, index] = 0
            self.v[:, index] = 0
            self.aux[slot] = 0
        self.free.give(pages, slot)
        with self.lock:
            self.done += 1
        return result

    def bootstrap(self, room: int, address: str, plan: dict[str, Any]) -> tuple[Any, bool]:
        """Open the room and wait out its handshake (aborting at step 0 if planned); whether this side aborts."""
        handle = self.manager.open(room)
        mine = plan["abort_side"] == self.role
        self.backend.bootstrap(handle, address)
        if mine and plan["abort_step"] == 0:
            handle.abort("simulated client abort")
        self.wait(handle, lambda h: h.state is not self.kvfsm.KVPoll.Bootstrapping)
        return handle, mine

    def sender_request(self, room: int, address: str) -> dict[str, Any]:
        settings, plan = self.settings, _plan(self.settings, room)
        rng = random.Random(room)
        pages, slot = self.free.take(settings["pages"], rng)
        if settings["verify"]:
            k, v, aux = self.pattern(room)
            index = self.torch.tensor(pages)
            self.k[:, index] = k
            self.v[:, index] = v
            self.aux[slot] = aux
        handle, mine = self.bootstrap(room, address, plan)
        if handle.state is self.kvfsm.KVPoll.WaitingForInput:
            # Chunks keep page order: the k-th page sent lands in the k-th page expected.
            size = -(-len(pages) // settings["chunks"])
            parts = [pages[i : i + size] for i in range(0, len(pages), size)] or [[]]
            for number, part in enumerate(parts):
                if mine and plan["abort_step"] == number + 1:
                    handle.abort("simulated client abort")
                if handle.is_terminal:
                    break
                last = number == len(parts) - 1
                if last and plan["fails"]:
                    handle.fail(
                        self.kvfsm.FailureReason(self.kvfsm.FailureKind.TRANSFER_ERROR, "simulated transport error")
                    )
                    break
                self.backend.send(handle, part, last=last, aux_index=slot if last else None)
        return self.finish(handle, room, pages, slot, {"room": room})

    def receiver_request(self, room: int, address: str) -> dict[str, Any]:
        settings, plan = self.settings, _plan(self.settings, room)
        rng = random.Random(room + 7)
        pages, slot = self.free.take(settings["pages"], rng)
        handle, mine = self.bootstrap(room, address, plan)
        if handle.state is self.kvfsm.KVPoll.WaitingForInput:
            self.backend.expect(handle, pages, slot)
            if mine and plan["abort_step"] == 1:
                handle.abort("simulated client abort")
        self.wait(handle, lambda h: h.is_terminal)
        checked = bad = 0
        if handle.state is self.kvfsm.KVPoll.Success and settings["verify"]:
            k, v, aux = self.pattern(room)
            index = self.torch.tensor(pages)
            for position in range(len(pages)):
                checked += 1
                got_k, got_v = self.k[:, index[position]], self.v[:, index[position]]
                if not (self.torch.equal(got_k, k[:, position]) and self.torch.equal(got_v, v[:, position])):
                    bad += 1
            if not self.torch.equal(self.aux[slot], aux):
                bad += 1
        return self.finish(handle, room, pages, slot, {"room": room, "checked": checked, "bad": bad})


def missing_engine(backend: str, module: str | None = None) -> MissingDependency:
    """The one-line error for `backend` when `module` (or one of its modules) cannot be imported."""
    what = (
        f"Python module {module!r}, which cannot be imported here" if module else "modules that cannot be imported here"
    )
    return MissingDependency(f"--backend {backend} needs {what}: {ENGINE_INSTALL[backend]}")


def _check_engine(backend: str) -> None:
    """Refuse at once (before any process starts) when the engine's modules are absent."""
    for module in ENGINE_MODULES[backend]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing
            found = False
        if not found:
            raise missing_engine(backend, module)


def _missing_module(exc: BaseException) -> str | None:
    """The module an import failure behind `exc` names ("" if unnamed), or None if it is no import failure."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ImportError):
            return cause.name or ""
        cause = cause.__cause__
    return None


def _child(role: str, settings: dict[str, Any], conn: Connection) -> None:
    native = capture_native_stderr()  # Mooncake's glog lines, into logging
    logging.basicConfig(level=settings["log_level"], format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    try:
        try:
            side = _Side(role, settings)
        except Exception as exc:
            module = _missing_module(exc)
            if module is None:
                raise
            conn.send(("missing", module))
            return
        conn.send(("address", side.backend.address))
        _go, prefill_address = conn.recv()
        rooms = range(settings["requests"])
        work = side.sender_request if role == "sender" else side.receiver_request
        progress = settings["progress"] and role == "receiver"
        stop = threading.Event()
        if progress:
            threading.Thread(target=_progress, args=(side, settings["requests"], stop), daemon=True).start()
        with ThreadPoolExecutor(settings["concurrency"]) as pool:
            results = list(pool.map(lambda room: work(room, prefill_address), rooms))
        stop.set()
        report = {
            "results": results,
            "left_open": len(side.manager),
            "late_events": side.manager.stats.late_events,
        }
        side.backend.close()
        conn.send(("report", report))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        sys.stdout.flush()
        native.close()
        # Skip interpreter teardown: NIXL's bundled libraries may crash there.
        os._exit(0)


def _progress(side: _Side, total: int, stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.wait(2.0):
        rate = side.done / max(time.monotonic() - start, 1e-9)
        sys.stderr.write(f"simulate [{side.settings['backend']}] {side.done}/{total} {rate:.0f} req/s\n")
        sys.stderr.flush()


# -- the parent ---------------------------------------------------------------------------------


def _receive(conn: Connection, what: str, limit: float, backend: str) -> Any:
    if not conn.poll(limit):
        raise RuntimeError(f"simulate: the {what} process did not answer within {limit:.0f}s")
    kind, value = conn.recv()
    if kind == "missing":
        raise missing_engine(backend, value or None)
    if kind == "error":
        raise RuntimeError(f"simulate: the {what} process failed:\n{value}")
    return value


def simulate_remote(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the cross-process simulation described by `args`; return the summary dict."""
    settings = _settings(args)
    if settings["backend"] not in REMOTE_BACKENDS:
        raise UsageError(f"simulate_remote runs {', '.join(REMOTE_BACKENDS)}; got {settings['backend']!r}")
    _check_engine(settings["backend"])
    ctx = multiprocessing.get_context("spawn")
    pipes = {role: ctx.Pipe() for role in ("sender", "receiver")}
    processes = {
        role: ctx.Process(
            target=_child, args=(role, settings, pipes[role][1]), name=f"kvfsm-simulate-{role}", daemon=True
        )
        for role in pipes
    }
    for process in processes.values():
        process.start()
    try:
        addresses = {role: _receive(pipes[role][0], role, 120.0, settings["backend"]) for role in pipes}
        start = time.perf_counter()
        for role in pipes:
            pipes[role][0].send(("go", addresses["sender"]))
        limit = 120.0 + settings["requests"] * 0.5
        reports = {role: _receive(pipes[role][0], role, limit, settings["backend"]) for role in pipes}
        elapsed = time.perf_counter() - start
    finally:
        for process in processes.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
    summary = _summary(settings, reports, elapsed)
    print_summary(summary, out)
    json_path = _arg(args, "json", None)
    if json_path:
        write_json(json_path, summary)
    return summary


def _summary(settings: dict[str, Any], reports: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """The `kvfsm.simulate` summary, from the two processes' per-room reports."""
    sender: dict[int, dict[str, Any]] = {r["room"]: r for r in reports["sender"]["results"]}
    receiver: dict[int, dict[str, Any]] = {r["room"]: r for r in reports["receiver"]["results"]}
    results = [_joined(room, sender[room], receiver[room]) for room in sorted(set(sender) | set(receiver))]
    return build_summary(
        results,
        backend=settings["backend"],
        elapsed=elapsed,
        managers=(),
        late_events=reports["sender"]["late_events"] + reports["receiver"]["late_events"],
        extra_checks={"rooms_left_open": reports["sender"]["left_open"] + reports["receiver"]["left_open"]},
        reproducible=False,  # two processes racing on a real engine: timing decides more than the seed
        config={k: v for k, v in settings.items() if k not in ("progress", "log_level")} | {"processes": 2},
    )


def _joined(room: int, sent: dict[str, Any], received: dict[str, Any]) -> RequestResult:
    """One room's two reports as the `RequestResult` an in-process run would have made."""
    receiver_state = KVPoll[received["state"]]
    return RequestResult(
        room,
        KVPoll[sent["state"]],
        receiver_state,
        sent["kind"],
        received["kind"],
        latency=received["latency"] if receiver_state is KVPoll.Success else None,
        nbytes=received["nbytes"],
        pages_checked=received["checked"],
        pages_not_identical=received["bad"],
        status_handle_mismatches=sent["mismatch"] + received["mismatch"],
        released_before_safe=sent["released_before_safe"] + received["released_before_safe"],
    )


def run(args: argparse.Namespace) -> int:
    return 0 if simulate_remote(args)["ok"] else 1
