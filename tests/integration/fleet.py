"""Many kvfsm endpoints in one child process, running whole rooms on their own: a cluster's worth of load.

The many-process test (4 prefill and 16 decode processes), the admission
test (hundreds of decodes bootstrapping at once) and `benchmarks/bulkheads.py`
start `Fleet` children and hand each a plan: which rooms each of its
endpoints runs, with which peer, which pages, starting when. A child runs
the schedulers' side of every room of its plan (open, bootstrap, expect or
send, then poll until the room ended) without a round trip to the parent,
so the parent is free to stop or kill processes meanwhile, then reports
per room: how it ended, when, and whether its bytes are right.

The children import no torch: pools are plain buffers (`ctypes`), each
endpoint's own, and every page is filled with a pattern derived from its
room and position, so a decode checks what landed without asking the
prefill. Released pages are poisoned, and checked again at the end: a write
that landed after a release shows up there. Rooms never reuse pages within
one run. Timeouts have no drain deadline, so a failed room's pages are
released only on proof (rule 13), never on a timer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tests.pipe_child import PipeChild, build_or_exit, exit_child, serve

if TYPE_CHECKING:
    from kvfsm import TransferHandle, TransferManager
    from kvfsm.backends.remote import RemoteBackend

PAGE = 4096
POISON = b"\xa5"


def pattern(room: Any, index: int, region: int) -> bytes:
    """What page `index` of `room` holds in KV region `region` (0: K, 1: V)."""
    seed = f"{room}|{index}|{region}|".encode()
    return (seed * (PAGE // len(seed) + 1))[:PAGE]


def aux_pattern(room: Any) -> bytes:
    seed = f"aux|{room}|".encode()
    return (seed * (64 // len(seed) + 1))[:64]


class Fleet(PipeChild):
    """A child hosting `count` endpoints of one engine and role; `run` plays a plan on them."""

    def __init__(
        self,
        engine: str,
        role: str,
        count: int,
        config: dict[str, Any],
        pages: int = 256,
        deadline: float = 30.0,
        netns: str | None = None,
        options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`config`: `RemoteConfig` fields; `deadline`: each phase's (bootstrap, waiting, transferring).

        `netns`: the network namespace (its path) the child enters before it
        opens any socket; `options`: the backend's own keywords (Mooncake's
        `hostname`); `env`: set in the child before any engine is imported.
        """
        setup = {"pages": pages, "deadline": deadline, "netns": netns, "options": options or {}, "env": env or {}}
        super().__init__(_child_main, (engine, role, count, config, setup), f"{role} fleet")

    def addresses(self, timeout: float = 120.0) -> list[str]:
        return list(self._call("addresses", timeout=timeout))

    def start(self, plan: list[dict[str, Any]], t0: float, limit: float, grace: float = 3.0) -> None:
        """Post the plan; `collect` waits for its report (the parent may stop or kill children meanwhile).

        The plan's rooms start at wall-clock time `t0` plus their offsets; a
        failed room whose pages are not release-safe `grace` seconds after it
        ended counts as held (quarantined) and is waited for no longer;
        `limit` bounds the whole run.
        """
        self._post("run", (plan, t0, limit, grace))

    def collect(self, timeout: float) -> dict[str, Any]:
        return dict(self._receive("run", timeout))

    def stats(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        return list(self._call("stats", timeout=timeout))

    def cpu(self, timeout: float = 30.0) -> float:
        return float(self._call("cpu", timeout=timeout))


def _child_main(
    conn: Connection, engine: str, role: str, count: int, config: dict[str, Any], setup: dict[str, Any]
) -> None:
    if setup["netns"] is not None:
        from tests.integration.netns import enter

        enter(setup["netns"])  # first: before any thread or socket of this process exists
    os.environ.update(setup["env"])
    logging.basicConfig(level=logging.ERROR, format=f"[{role} {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    host = build_or_exit(
        conn, lambda: _Host(engine, role, count, config, setup["pages"], setup["deadline"], setup["options"])
    )
    serve(conn, host)
    exit_child(host.close)


class _Endpoint:
    """One manager, one backend, its pools as plain buffers."""

    def __init__(
        self, engine: str, role: str, config: dict[str, Any], pages: int, deadline: float, options: dict[str, Any]
    ) -> None:
        import kvfsm
        from kvfsm.backends import get_backend
        from kvfsm.backends.base import KVPools, MemoryRegion
        from kvfsm.backends.remote import RemoteBackend, RemoteConfig

        timeouts = kvfsm.Timeouts(bootstrap=deadline, waiting=deadline, transferring=deadline, drain=None)
        self.manager: TransferManager = kvfsm.TransferManager(role, timeouts=timeouts)
        self.manager.start_reaper(0.05)
        self.kv = [ctypes.create_string_buffer(pages * PAGE) for _ in range(2)]
        self.aux = ctypes.create_string_buffer(pages * 64)
        regions = [
            MemoryRegion(ctypes.addressof(buf), pages * PAGE, PAGE, device="cpu", dtype="uint8", name=f"kv{i}")
            for i, buf in enumerate(self.kv)
        ]
        aux = MemoryRegion(ctypes.addressof(self.aux), pages * 64, 64, device="cpu", dtype="uint8", name="aux")
        backend_class = get_backend(engine)
        assert issubclass(backend_class, RemoteBackend)
        self.backend: RemoteBackend = backend_class(self.manager, RemoteConfig(**config), **options)
        self.backend.register_pools(KVPools(regions, [aux]))

    def write(self, page: int, room: Any, index: int) -> None:
        for region, buf in enumerate(self.kv):
            ctypes.memmove(ctypes.addressof(buf) + page * PAGE, pattern(room, index, region), PAGE)

    def holds(self, page: int, room: Any, index: int) -> bool:
        return all(
            ctypes.string_at(ctypes.addressof(buf) + page * PAGE, PAGE) == pattern(room, index, region)
            for region, buf in enumerate(self.kv)
        )

    def peek(self, page: int) -> bytes:
        return ctypes.string_at(ctypes.addressof(self.kv[0]) + page * PAGE, PAGE)

    def poison(self, pages: Iterable[int]) -> None:
        for page in pages:
            for buf in self.kv:
                ctypes.memset(ctypes.addressof(buf) + page * PAGE, POISON[0], PAGE)

    def poisoned(self, page: int) -> bool:
        return all(ctypes.string_at(ctypes.addressof(buf) + page * PAGE, PAGE) == POISON * PAGE for buf in self.kv)

    def write_aux(self, slot: int, room: Any) -> None:
        ctypes.memmove(ctypes.addressof(self.aux) + slot * 64, aux_pattern(room), 64)

    def aux_holds(self, slot: int, room: Any) -> bool:
        return ctypes.string_at(ctypes.addressof(self.aux) + slot * 64, 64) == aux_pattern(room)


class _Room:
    __slots__ = ("at", "aux", "done", "ep", "handle", "moved", "pages", "peer", "released", "result", "room")

    def __init__(self, spec: dict[str, Any], ep: _Endpoint) -> None:
        self.ep = ep
        self.room = spec["room"]
        self.peer: str = spec["peer"]
        self.pages: list[int] = list(spec["pages"])
        self.aux: int = spec["aux"]
        self.at: float = spec["at"]
        self.handle: TransferHandle | None = None
        self.moved = False
        self.done = False
        self.released = False
        self.result: dict[str, Any] = {"room": self.room, "state": "not started"}


class _Host:
    def __init__(
        self,
        engine: str,
        role: str,
        count: int,
        config: dict[str, Any],
        pages: int,
        deadline: float,
        options: dict[str, Any],
    ) -> None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a server raises it too (SGLang does)
        self.role = role
        self.endpoints = [_Endpoint(engine, role, config, pages, deadline, options) for _ in range(count)]

    def addresses(self) -> list[str]:
        return [str(ep.backend.address) for ep in self.endpoints]

    def run(self, plan: list[dict[str, Any]], t0: float, limit: float, grace: float) -> dict[str, Any]:
        rooms = [_Room(spec, self.endpoints[spec["ep"]]) for spec in plan]
        while time.time() < t0:
            time.sleep(0.001)
        start = time.monotonic()
        sender = self.role == "sender"
        while time.monotonic() - start < limit:
            now = time.monotonic() - start
            busy = False
            for room in rooms:
                if room.done:
                    continue
                busy = True
                if room.handle is None:
                    if now >= room.at:
                        self._open(room, sender, now)
                    continue
                self._step(room, sender, now)
                if not room.done and "ended" in room.result and now - room.result["ended"] > grace:
                    room.done = True  # failed and still held: quarantined, as it must be without a proof
            if not busy:
                break
            time.sleep(0.001)
        for room in rooms:
            self._finish(room, time.monotonic() - start)
        return {"rooms": [room.result for room in rooms], "elapsed": time.monotonic() - start}

    def _open(self, room: _Room, sender: bool, now: float) -> None:
        ep = room.ep
        room.handle = ep.manager.open(room.room)
        room.result.update(state="Bootstrapping", opened=now)
        if sender:
            for index, page in enumerate(room.pages):
                ep.write(page, room.room, index)
            ep.write_aux(room.aux, room.room)
        else:
            ep.poison(room.pages)  # nothing of an earlier room, or of none, may pass for this one's bytes
        ep.backend.bootstrap(room.handle, room.peer)

    def _step(self, room: _Room, sender: bool, now: float) -> None:
        from kvfsm import KVPoll

        handle = room.handle
        assert handle is not None
        state = handle.poll()
        if state is KVPoll.WaitingForInput and not room.moved:
            room.moved = True
            room.result["ready"] = now
            if sender:
                room.ep.backend.send(handle, room.pages, last=True, aux_index=room.aux)
            else:
                room.ep.backend.expect(handle, room.pages, room.aux)
            return
        if not handle.is_terminal:
            return
        state = handle.state  # it may have ended since poll(), on the control thread: read it again
        if "ended" not in room.result:
            reason = handle.reason
            room.result.update(
                state=handle.state.name,
                ended=now,
                kind=reason.kind.value if reason else None,
                message=reason.message[:300] if reason else None,
            )
            if not sender and state is KVPoll.Success:
                wrong = [page for index, page in enumerate(room.pages) if not room.ep.holds(page, room.room, index)]
                aux_ok = room.ep.aux_holds(room.aux, room.room)
                room.result["bytes_ok"] = not wrong and aux_ok
                if not room.result["bytes_ok"]:
                    # What is there instead: poison (nothing landed), another room's pattern, or garbage.
                    page = wrong[0] if wrong else None
                    seen = room.ep.peek(page) if page is not None else b""
                    room.result["wrong"] = {"pages": wrong, "aux_ok": aux_ok, "found": seen[:48].decode("latin-1")}
        if handle.release_safe:
            room.result["release_safe"] = True
            if not sender:
                room.ep.poison(room.pages)  # released: any write landing from now on is caught at the end
                room.released = True
            handle.close()
            room.done = True

    def _finish(self, room: _Room, now: float) -> None:
        handle = room.handle
        if handle is not None and not handle.closed:
            room.result.setdefault("release_safe", handle.release_safe)
            room.result["held_at_end"] = True
            if room.result.get("state") in ("Bootstrapping", "WaitingForInput", "Transferring"):
                room.result["state"] = handle.state.name
        if room.released:
            room.result["poison_intact"] = all(room.ep.poisoned(page) for page in room.pages)

    def cpu(self) -> float:
        """Seconds of CPU this process used so far (user and system)."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return float(usage.ru_utime + usage.ru_stime)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for ep in self.endpoints:
            remote = ep.backend.remote_stats
            control = ep.backend.control.stats
            out.append(
                {
                    "sessions": len(ep.backend.sessions),
                    "peers_lost": remote.peers_lost,
                    "handshake_retries": remote.handshake_retries if hasattr(remote, "handshake_retries") else 0,
                    "evicted": control.sessions_evicted,
                    "unauthenticated": control.unauthenticated,
                    "hellos_dropped": remote.hellos_dropped,
                }
            )
        return out

    def close(self) -> None:
        for ep in self.endpoints:
            ep.backend.close()


# -- the parent's side: a cluster of fleets, a plan crossing every pair, faults mid-run ------------------


def plan_pairs(
    prefills: list[str],
    decode_counts: list[int],
    rooms_per_pair: int,
    spread: float,
    pages_per_room: int = 2,
) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]]]:
    """Rooms crossing every (prefill, decode) pair, their starts spread over `spread` seconds.

    `prefills` are the prefill endpoints' addresses, one fleet each (one
    endpoint); `decode_counts` the endpoints of each decode fleet. Returns
    the plan of each prefill fleet and of each decode fleet. Room ids name
    the pair (`p<i>d<j>e<k>r<n>`), pages are never reused within a run.
    """
    prefill_plans: list[list[dict[str, Any]]] = [[] for _ in prefills]
    decode_plans: list[list[dict[str, Any]]] = [[] for _ in decode_counts]
    prefill_next = [0 for _ in prefills]
    decode_next: dict[tuple[int, int], int] = {}
    total = len(prefills) * sum(decode_counts) * rooms_per_pair
    serial = 0
    for n in range(rooms_per_pair):
        for fleet, count in enumerate(decode_counts):
            for ep in range(count):
                for p, address in enumerate(prefills):
                    room = f"p{p}d{fleet}e{ep}r{n}"
                    at = spread * serial / max(1, total - 1)
                    serial += 1
                    src = list(range(prefill_next[p], prefill_next[p] + pages_per_room))
                    prefill_next[p] += pages_per_room
                    base = decode_next.get((fleet, ep), 0)
                    dst = list(range(base, base + pages_per_room))
                    decode_next[(fleet, ep)] = base + pages_per_room
                    aux_src, aux_dst = src[0], dst[0]
                    prefill_plans[p].append(
                        {"ep": 0, "room": room, "peer": address, "pages": src, "aux": aux_src, "at": at}
                    )
                    decode_plans[fleet].append(
                        {"ep": ep, "room": room, "peer": address, "pages": dst, "aux": aux_dst, "at": at, "prefill": p}
                    )
    return prefill_plans, decode_plans


def summarize(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rooms by final state and failures by kind, per side, from the fleets' reports."""
    out: dict[str, Any] = {}
    for side, report in reports.items():
        states: dict[str, int] = {}
        kinds: dict[str, int] = {}
        for room in report["rooms"]:
            states[room["state"]] = states.get(room["state"], 0) + 1
            if room.get("kind"):
                kinds[room["kind"]] = kinds.get(room["kind"], 0) + 1
        out[side] = {"states": states, "failures": kinds}
    return out
