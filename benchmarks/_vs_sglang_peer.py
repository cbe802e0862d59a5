"""One process of benchmarks/vs_sglang.py: a prefill or a decode, for kvfsm or for SGLang.

`vs_sglang.py` starts this file as a child process, twice per case and
implementation, with the interpreter of that implementation (SGLang brings
its own torch), so this module imports only the standard library at module
level; torch, kvfsm and SGLang are imported by the endpoint that needs them.
The parent sends the case's settings over the socket whose descriptor is
the only argument, then "go" with the prefill's address, and finally
"exit"; the child answers "ready", then its report (or "error").

What lives here:

* `Pools`: the KV pools (2 layers of K and V, float32) and aux slots, and the
  byte checks: the prefill writes every byte of a request, the decode
  compares every byte once the request succeeded;
* the two endpoints behind one small interface (`Endpoint`, `Transfer`):
  kvfsm's `MooncakeBackend` through its public API, and SGLang 0.5.23's
  `MooncakeKVManager` / `MooncakeKVSender` / `MooncakeKVReceiver` with its
  bootstrap server, each concluded the way its own scheduler concludes it;
* `SchedulerLoop`: the loop both implementations run, after SGLang's
  disaggregation queues (poll every request in flight every turn, hand over
  pages on WaitingForInput, conclude and check on a terminal state, nap
  when nothing concluded), with the case deadline;
* `child_main`, with a watchdog that ends the process when its parent is
  gone or its time limit passed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

LAYERS = 2  # K and V per layer: 4 regions
AUX_BYTES = 64
SGLANG_ROOM_BASE = 1 << 40  # SGLang's bootstrap rooms are large integers

# KVPoll values, the same in kvfsm and SGLang.
FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS = range(5)
STATE_NAMES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")


class Pools:
    """One process's KV pools (K, V: [layers, pages, floats]) and aux slots, with the byte checks.

    Request `room` at position i of its page list carries `pattern[i] ^ key(room)`
    in every region: a fixed random pattern (the same bytes in both
    processes, from Python's seeded generator) so that a page landing at the
    wrong place or offset is caught, and a per-request key so that bytes of
    an earlier request in the same pages are caught too.
    """

    def __init__(
        self, torch: Any, num_pages: int, slots: int, max_pages: int, page_bytes: int, checking: bool = True
    ) -> None:
        if page_bytes % (LAYERS * 2 * 8):
            raise ValueError(f"page bytes must be a multiple of {LAYERS * 2 * 8}; got {page_bytes}")
        self.torch = torch
        region_page = page_bytes // (LAYERS * 2)  # bytes of one page in one region
        self.k = torch.zeros(LAYERS, num_pages, region_page // 4, dtype=torch.float32)
        self.v = torch.zeros(LAYERS, num_pages, region_page // 4, dtype=torch.float32)
        self.aux = torch.zeros(slots, AUX_BYTES, dtype=torch.uint8)
        self.region_page_bytes = region_page
        self._k64, self._v64, self._aux64 = (t.view(torch.int64) for t in (self.k, self.v, self.aux))
        words = region_page // 8
        rng = random.Random(20251201)
        self._pattern_k = self._random(rng, (LAYERS, max_pages, words))
        self._pattern_v = self._random(rng, (LAYERS, max_pages, words))
        self._pattern_aux = self._random(rng, (AUX_BYTES // 8,))
        self.harness_cpu = 0.0  # thread CPU seconds spent filling and checking
        # Off (--no-check): nothing is filled or compared, as in the raw rows; every request passes the check.
        self.checking = checking

    def _random(self, rng: random.Random, shape: tuple[int, ...]) -> Any:
        count = 1
        for n in shape:
            count *= n
        raw = bytearray(rng.randbytes(count * 8))
        return self.torch.frombuffer(raw, dtype=self.torch.int64).reshape(shape)

    @staticmethod
    def key(room: int) -> int:
        return ((room + 1) * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)

    def fill(self, room: int, pages: Sequence[int], slot: int) -> None:
        """Prefill: write request `room`'s bytes into its source pages and aux slot."""
        if not self.checking:
            return
        began = time.thread_time()
        torch, key, n = self.torch, self.key(room), len(pages)
        index = torch.tensor(pages, dtype=torch.long)
        self._k64[:, index] = torch.bitwise_xor(self._pattern_k[:, :n], key)
        self._v64[:, index] = torch.bitwise_xor(self._pattern_v[:, :n], key)
        self._aux64[slot] = torch.bitwise_xor(self._pattern_aux, key)
        self.harness_cpu += time.thread_time() - began

    def check(self, room: int, pages: Sequence[int], slot: int) -> bool:
        """Decode: whether every byte of request `room`'s pages and aux slot is what the prefill wrote."""
        if not self.checking:
            return True
        began = time.thread_time()
        torch, key, n = self.torch, self.key(room), len(pages)
        index = torch.tensor(pages, dtype=torch.long)
        same = (
            torch.equal(torch.bitwise_xor(self._k64[:, index], key), self._pattern_k[:, :n])
            and torch.equal(torch.bitwise_xor(self._v64[:, index], key), self._pattern_v[:, :n])
            and torch.equal(torch.bitwise_xor(self._aux64[slot], key), self._pattern_aux)
        )
        self.harness_cpu += time.thread_time() - began
        return bool(same)


class FreePages:
    """Free KV pages and aux slots; a request takes random pages (scattered, as a real pool is)."""

    def __init__(self, pages: int, slots: int) -> None:
        self._pages = list(range(pages))
        self._slots = list(range(slots))

    def take(self, count: int, rng: random.Random) -> tuple[list[int], int] | None:
        if len(self._pages) < count or not self._slots:
            return None
        picked = []
        for _ in range(count):
            i = rng.randrange(len(self._pages))
            self._pages[i], self._pages[-1] = self._pages[-1], self._pages[i]
            picked.append(self._pages.pop())
        return picked, self._slots.pop()

    def give(self, pages: list[int], slot: int) -> None:
        self._pages.extend(pages)
        self._slots.append(slot)


class Transfer(Protocol):
    """One request's endpoint, as the scheduler loop sees it."""

    def poll(self) -> int: ...

    def start(self) -> None:
        """Called once, when the request is WaitingForInput: hand over the pages."""

    def conclude(self, state: int) -> str | None:
        """Called on a terminal state until it returns: None while the pages must stay held; else
        "" if the request succeeded, or why it failed. Releases the request's resources."""

    def abort(self) -> None: ...


class Endpoint(Protocol):
    address: str

    def connect(self, prefill_address: str) -> None: ...

    def open(self, room: int, pages: list[int], slot: int) -> Transfer: ...

    def poll_all(self, transfers: list[Any]) -> list[int]:
        """The states of a turn's transfers, in order (each implementation's own way)."""

    def close(self) -> None: ...


def _chunks(pages: list[int], count: int) -> list[list[int]]:
    size = -(-len(pages) // count)
    return [pages[i : i + size] for i in range(0, len(pages), size)] or [[]]


# -- kvfsm ---------------------------------------------------------------------


class KvfsmEndpoint:
    """A kvfsm prefill or decode endpoint: one manager, one MooncakeBackend, public API only."""

    def __init__(self, role: str, pools: Pools, settings: dict[str, Any]) -> None:
        import kvfsm
        from kvfsm.backends import KVPools, MooncakeBackend, NixlBackend
        from kvfsm.backends.remote import RemoteConfig

        timeout = settings["room_timeout"]
        timeouts = kvfsm.Timeouts(bootstrap=timeout, waiting=timeout, transferring=timeout, drain=settings["drain"])
        self.role = role
        self.manager = kvfsm.TransferManager("sender" if role == "prefill" else "receiver", timeouts=timeouts)
        self.manager.start_reaper()  # as docs/guides/scheduler-loop.md asks of a server
        engine = NixlBackend if settings["impl"] == "kvfsm-nixl" else MooncakeBackend
        self.backend = engine(self.manager, RemoteConfig(host="127.0.0.1", **settings.get("remote", {})))
        self.backend.register_pools(KVPools.from_tensors(pools.k, pools.v, pools.aux))
        self.address = self.backend.address
        self.chunks = settings["chunks"]
        self.peer = self.address
        self.errors = (kvfsm.KVFSMError,)

    def connect(self, prefill_address: str) -> None:
        self.peer = prefill_address  # both roles bootstrap with the prefill's address

    def poll_all(self, transfers: list[Any]) -> list[int]:
        # One batch read per turn (`poll_many`, see docs/guides/scheduler-loop.md).
        return [int(state) for state in self.manager.poll_many([t.room for t in transfers])]

    def open(self, room: int, pages: list[int], slot: int) -> Transfer:
        handle = self.manager.open(room)
        self.backend.bootstrap(handle, self.peer)
        return KvfsmTransfer(self, handle, pages, slot)

    def close(self) -> None:
        self.backend.close()
        self.manager.stop_reaper()


class KvfsmTransfer:
    def __init__(self, endpoint: KvfsmEndpoint, handle: Any, pages: list[int], slot: int) -> None:
        self._endpoint, self._handle, self._pages, self._slot = endpoint, handle, pages, slot
        self.room = handle.room
        self.last_send: float | None = None  # when the prefill called its last send() (the critical path's start)

    def poll(self) -> int:
        return int(self._handle.poll())

    def start(self) -> None:
        endpoint, handle = self._endpoint, self._handle
        try:
            if endpoint.role == "decode":
                endpoint.backend.expect(handle, self._pages, self._slot)
                return
            parts = _chunks(self._pages, endpoint.chunks)
            for n, part in enumerate(parts):
                last = n == len(parts) - 1
                if last:
                    self.last_send = time.perf_counter()
                endpoint.backend.send(handle, part, last=last, aux_index=self._slot if last else None)
        except endpoint.errors:
            pass  # the backend failed the room first; the next poll says Failed

    def conclude(self, state: int) -> str | None:
        handle = self._handle
        if state != SUCCESS and not handle.release_safe:
            return None  # a peer write may still land in these pages (rule 6)
        why = "" if state == SUCCESS else str(handle.failure)
        self._endpoint.manager.close(handle.room)
        return why

    def abort(self) -> None:
        self._handle.abort("the benchmark's case deadline passed")


# -- SGLang --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SGLang's bootstrap server is not listening on port {port} after {timeout}s"
                ) from None
            time.sleep(0.05)


class SglangEndpoint:
    """SGLang 0.5.23's own Mooncake manager for one role, set up as its scheduler sets it up (one CPU rank)."""

    def __init__(self, role: str, pools: Pools, settings: dict[str, Any]) -> None:
        import numpy
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        self.role, self.numpy, self.chunks, self.drain = role, numpy, settings["chunks"], settings["drain"]
        self.port = _free_port()
        server_args = ServerArgs(
            model_path="dummy",
            disaggregation_mode=role,
            disaggregation_transfer_backend="mooncake",
            disaggregation_bootstrap_port=self.port,
            host="127.0.0.1",
            device="cpu",
        )
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        get_parallel().override_permanently(pp_group=None)  # one rank, no torch.distributed
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        self.server = None
        if role == "prefill":
            self.server = conn.MooncakeKVBootstrapServer(host="127.0.0.1", port=self.port)
            _wait_listening(self.port, 30.0)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.manager = conn.MooncakeKVManager(_sglang_kv_args(KVArgs(), pools), mode, server_args, False)
        self.sender_class, self.receiver_class = conn.MooncakeKVSender, conn.MooncakeKVReceiver
        self.address = self.peer = f"127.0.0.1:{self.port}"

    def connect(self, prefill_address: str) -> None:
        self.peer = prefill_address
        if self.role == "decode":
            deadline = time.monotonic() + 60.0
            while not self.manager.try_ensure_parallel_info(prefill_address):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SGLang decode: no prefill registered at {prefill_address} after 60s")
                time.sleep(0.1)

    def open(self, room: int, pages: list[int], slot: int) -> Transfer:
        if self.role == "prefill":
            return SglangPrefillTransfer(self, room, pages, slot)
        return SglangDecodeTransfer(self, room, pages, slot)

    def poll_all(self, transfers: list[Any]) -> list[int]:
        return [t.poll() for t in transfers]  # as SGLang's queues poll each sender/receiver

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.teardown()
        if self.server is not None:
            self.server.close()


def _sglang_kv_args(args: Any, pools: Pools) -> Any:
    """SGLang's KVArgs for an MHA model of LAYERS layers, page size 1 token = one of our pages."""
    buffers = [pools.k[i] for i in range(LAYERS)] + [pools.v[i] for i in range(LAYERS)]  # K layers, then V
    args.kv_data_ptrs = [t.data_ptr() for t in buffers]
    args.kv_data_lens = [t.nbytes for t in buffers]
    args.kv_item_lens = [pools.region_page_bytes] * len(buffers)
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [pools.aux.data_ptr()], [pools.aux.nbytes], [AUX_BYTES]
    args.page_size, args.kv_head_num, args.total_kv_head_num = 1, 1, 1
    args.kv_cache_dtype_str, args.kv_layout, args.kv_layer_ids = "float32", None, []
    args.engine_rank = args.pp_rank = args.system_dp_rank = args.gpu_id = args.prefill_start_layer = 0
    args.prefill_end_layer, args.num_draft_entries, args.rust_http_port, args.ib_device = LAYERS, 0, None, None
    # No state pools (Mamba, SWA, DSA), no MLA, no staging.
    args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
    args.state_dim_per_tensor, args.state_slice_outer_counts, args.state_layer_ids = [], [], []
    args.state_conv_shard_groups, args.is_hybrid_mla_backend = [], False
    args.swa_kv_cache_layout, args.mla_compression_ratios = None, None
    return args


def _failure_text(endpoint: Any) -> str:
    try:
        endpoint.failure_exception()  # what SGLang's schedulers call on Failed; it also clears
    except Exception as exc:  # KVTransferError
        return str(exc)
    return "Failed (failure_exception did not raise)"


class SglangPrefillTransfer:
    def __init__(self, endpoint: SglangEndpoint, room: int, pages: list[int], slot: int) -> None:
        self._endpoint, self._pages, self._slot = endpoint, pages, slot
        self._sender = endpoint.sender_class(endpoint.manager, endpoint.peer, SGLANG_ROOM_BASE + room, False)
        self.last_send: float | None = None  # when its last send() was called (SGLang's sender knows it is the last)

    def poll(self) -> int:
        return int(self._sender.poll())

    def start(self) -> None:
        numpy = self._endpoint.numpy
        self._sender.init(len(self._pages), self._slot)
        parts = _chunks(self._pages, self._endpoint.chunks)
        for n, part in enumerate(parts):
            if n == len(parts) - 1:
                self.last_send = time.perf_counter()
            self._sender.send(numpy.asarray(part, dtype=numpy.int32))

    def conclude(self, state: int) -> str | None:
        if state == SUCCESS:
            self._sender.clear()
            return ""
        return _failure_text(self._sender)

    def abort(self) -> None:
        self._sender.abort()


class SglangDecodeTransfer:
    """SGLang's DecodeTransferQueue for one request, deferred release of a failed one included."""

    def __init__(self, endpoint: SglangEndpoint, room: int, pages: list[int], slot: int) -> None:
        self._endpoint, self._pages, self._slot = endpoint, pages, slot
        self._room = SGLANG_ROOM_BASE + room
        self._receiver = endpoint.receiver_class(endpoint.manager, endpoint.peer, self._room)
        self._receiver.init(0)
        self._why: str | None = None
        self._held: tuple[int, float] | None = None  # (acks required, release deadline)

    def poll(self) -> int:
        return int(self._receiver.poll())

    def start(self) -> None:
        numpy = self._endpoint.numpy
        self._receiver.send_metadata(numpy.asarray(self._pages, dtype=numpy.int32), self._slot, None)

    def conclude(self, state: int) -> str | None:
        receiver, manager = self._receiver, self._endpoint.manager
        if state == SUCCESS:
            receiver.clear()
            return ""
        if self._why is None:  # first sight of the failure, as pop_transferred handles it
            self._why = _failure_text(receiver)
            if manager.enable_deferred_decode_kv_release:
                if not receiver.abort_notified:
                    receiver.ensure_abort_notified(force_arm=True)
                if receiver.abort_notified:
                    acks = len(getattr(receiver, "bootstrap_infos", None) or ())
                    self._held = (acks, time.monotonic() + self._endpoint.drain)
        if self._held is not None:
            acks, deadline = self._held
            if not manager.is_abort_release_safe(self._room, acks) and time.monotonic() < deadline:
                return None
            manager.clear_deferred_abort_state(self._room)
            receiver.clear()
        return self._why

    def abort(self) -> None:
        self._receiver.abort()


ENDPOINTS: dict[str, Callable[[str, Pools, dict[str, Any]], Endpoint]] = {
    "kvfsm": KvfsmEndpoint,
    "kvfsm-nixl": KvfsmEndpoint,
    "sglang": SglangEndpoint,
}


# -- the scheduler loop ----------------------------------------------------------


@dataclass
class InFlight:
    room: int
    transfer: Transfer
    pages: list[int]
    slot: int
    start: float
    started: bool = False
    end: float | None = None  # when the loop first saw it terminal
    state: int = BOOTSTRAPPING
    aborted_in: int | None = None  # the state it was in when the case deadline aborted it


class SchedulerLoop:
    """One process's side of a case: admit, poll every turn, hand over pages, conclude, check."""

    def __init__(self, role: str, endpoint: Endpoint, pools: Pools, free: FreePages, settings: dict[str, Any]) -> None:
        self.role, self.endpoint, self.pools, self.free = role, endpoint, pools, free
        self.settings = settings
        self.active: dict[int, InFlight] = {}
        self.records: list[dict[str, Any]] = []
        # `--trace`: the marks `_trace` took inside kvfsm's calls, per room (see benchmarks/_trace.py).
        self.marks_of: Callable[[int], dict[str, float]] | None = None
        if settings.get("trace"):
            import _trace

            _trace.install(role)
            self.marks_of = _trace.marks_of

    def run(self) -> dict[str, Any]:
        s = self.settings
        warmup, total, inflight = s["warmup"], s["warmup"] + s["requests"], s["inflight"]
        pending = collections.deque(range(total))
        deadline = time.monotonic() + s["case_timeout"]
        cpu0: float | None = None
        harness0 = 0.0
        while (pending or self.active) and time.monotonic() < deadline:
            while pending and len(self.active) < inflight:
                room = pending[0]
                if room == warmup and cpu0 is None:
                    if self.active:
                        break  # the measured phase starts once the warm-up requests are done
                    cpu0, harness0 = _cpu_seconds(), self.pools.harness_cpu
                if not self._admit(room, s["pages"]):
                    break  # no free pages until a request concludes
                pending.popleft()
            if not self._turn() and self.active:
                time.sleep(s["poll_sleep"])
        self._abort_the_rest(s["drain"] + 5.0)
        if self.marks_of is not None:
            # Read at the end: a room's last marks (DONE sent) may come after its loop concluded it.
            for record in self.records:
                record["marks"] = self.marks_of(record["room"])
        cpu = _cpu_seconds() - cpu0 if cpu0 is not None else 0.0
        harness = self.pools.harness_cpu - harness0 if cpu0 is not None else 0.0
        return {
            "rooms": self.records,  # the warm-up requests' too: their bytes are checked as well
            "cpu_s": cpu,
            "harness_cpu_s": harness,
            "checked": self.pools.checking,
            "not_started": len(pending),
        }

    def _admit(self, room: int, count: int) -> bool:
        rng = random.Random(room * 2 + (self.role == "decode"))
        taken = self.free.take(count, rng)
        if taken is None:
            return False
        pages, slot = taken
        if self.role == "prefill":
            self.pools.fill(room, pages, slot)
        start = time.perf_counter()
        self.active[room] = InFlight(room, self.endpoint.open(room, pages, slot), pages, slot, start)
        return True

    def _turn(self) -> bool:
        """Poll every request in flight once; whether any concluded."""
        concluded = []
        polled = [request for request in self.active.values() if request.end is None]
        states = self.endpoint.poll_all([request.transfer for request in polled]) if polled else []
        for request, state in zip(polled, states, strict=True):
            if state == WAITING_FOR_INPUT and not request.started:
                request.started = True
                request.transfer.start()
            elif state in (SUCCESS, FAILED):
                request.end, request.state = time.perf_counter(), state
        for request in self.active.values():
            if request.end is not None:
                why = request.transfer.conclude(request.state)
                if why is not None:
                    self._record(request, why)
                    concluded.append(request.room)
        for room in concluded:
            del self.active[room]
        return bool(concluded)

    def _record(self, request: InFlight, why: str) -> None:
        ok = request.state == SUCCESS
        record: dict[str, Any] = {"room": request.room, "start": request.start, "end": request.end, "ok": ok}
        last_send = getattr(request.transfer, "last_send", None)  # the prefill's; the decode's end closes the cut
        if last_send is not None:
            record["last_send"] = last_send
        if ok and self.role == "decode" and not self.pools.check(request.room, request.pages, request.slot):
            record.update(ok=False, bad=True, why="bytes differ from what the prefill wrote")
        elif not ok:
            if request.aborted_in is not None:
                why = f"still {STATE_NAMES[request.aborted_in]} at the case deadline (aborted)"
            record["why"] = why
        self.records.append(record)
        self.free.give(request.pages, request.slot)

    def _abort_the_rest(self, drain_limit: float) -> None:
        """Abort what is still in flight at the case deadline; wait (bounded) until its pages are released."""
        for request in self.active.values():
            if request.end is None:
                request.aborted_in = request.transfer.poll()
                request.transfer.abort()
        deadline = time.monotonic() + drain_limit
        while self.active and time.monotonic() < deadline:
            if not self._turn():
                time.sleep(0.01)
        for request in self.active.values():  # pages never released: a write may still land there
            self.records.append(
                {"room": request.room, "start": request.start, "end": request.end, "ok": False, "why": "never released"}
            )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _versions(impl: str) -> dict[str, str]:
    from importlib import metadata

    found = {}
    if impl == "kvfsm-nixl":
        names = ["torch", "nixl"]
    else:
        names = ["torch", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"]
    names += ["sglang"] if impl == "sglang" else ["kvfsm"]
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _watchdog(parent: int, limit: float) -> None:
    """End this child if its parent went away or its time limit passed, whatever it is doing."""
    deadline = time.monotonic() + limit
    while True:
        if os.getppid() != parent or time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.5)


def child_main(fd: int) -> None:
    """A prefill or decode process of one implementation for one case, talking to the parent over `fd`."""
    conn = Connection(fd)
    settings = json.loads(conn.recv_bytes())
    threading.Thread(target=_watchdog, args=(settings["parent_pid"], settings["limit_s"]), daemon=True).start()
    role, impl = settings["role"], settings["impl"]
    endpoint: Endpoint | None = None
    try:
        import torch

        # One intra-op thread: after the byte checks' tensor ops, torch's OpenMP
        # workers would spin on the other core and slow down whatever is measured.
        torch.set_num_threads(1)
        pages = settings["inflight"] * settings["pages"]
        num_pages = pages + max(settings["pages"], pages // 2)
        slots = 2 * settings["inflight"]
        pools = Pools(
            torch, num_pages, slots, settings["pages"], settings["page_bytes"], settings.get("check_bytes", True)
        )
        endpoint = ENDPOINTS[impl](role, pools, settings)
        conn.send_bytes(
            json.dumps({"kind": "ready", "address": endpoint.address, "versions": _versions(impl)}).encode()
        )
        go = json.loads(conn.recv_bytes())
        endpoint.connect(go["prefill_address"])
        report = SchedulerLoop(role, endpoint, pools, FreePages(num_pages, slots), settings).run()
        conn.send_bytes(json.dumps({"kind": "report", **report}).encode())
        if conn.poll(settings["case_timeout"] + settings["drain"] + 60.0):
            conn.recv_bytes()  # "exit": the other process is done too, so closing loses nothing
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps({"kind": "error", "text": traceback.format_exc()}).encode())
    finally:
        if endpoint is not None:
            with contextlib.suppress(Exception):
                endpoint.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # engine threads do not hold the process


if __name__ == "__main__":
    child_main(int(sys.argv[1]))
