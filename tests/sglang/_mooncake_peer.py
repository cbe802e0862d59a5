"""One SGLang scheduler's PD queues in a child process, on kvfsm's Mooncake trio.

The prefill child runs SGLang 0.5.23's `PrefillBootstrapQueue`, waiting
queue and inflight queue (tests/sglang/_queues.py), plus the bootstrap
server SGLang starts on a prefill; the decode child runs
`DecodePreallocQueue` and `DecodeTransferQueue`. `get_kv_class` answers
kvfsm's `MooncakeKVManager`/`MooncakeKVSender`/`MooncakeKVReceiver`/
`MooncakeKVBootstrapServer` for `TransferBackend.MOONCAKE`, so the KV moves
over real Mooncake Transfer Engine (TCP, P2PHANDSHAKE, 127.0.0.1) between CPU
tensors, and the metadata slots (SGLang's `MetadataBuffers`) go with it.

Each child loops like SGLang's event loop: between iterations it serves
the parent's calls (add a request, abort it through `Scheduler.abort_request`,
read the log, check bytes) over a pipe. The KV buffers have SGLang's MHA
layout, `[token rows, local heads, head dim]`; the prefill writes a pattern
(`expected_value`, per token, buffer and global head) into the KV of each
token it computes; the decode compares what landed in its own pages, head
by head. Every call and every wait is bounded; the parent stops (or kills)
the child.

A child can be one rank of a TP group (`tp_size`, `tp_rank`): its queues
all-reduce their polls over a real gloo group of `tp_size` processes, as
SGLang's do over its attention TP group, and its KV holds its share of the
heads. The ranks of a group run `stepped`: an iteration only on the
parent's `step`, which the parent posts to every rank of the group before
waiting for any (`step_all`), so every rank sees the same requests at every
collective, as SGLang's broadcast of requests to its TP ranks ensures.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from tests.pipe_child import PipeChild, answer, build_or_exit, exit_child

LAYERS = 2
ROWS = 256  # token slots per KV buffer
HEADS = 4  # KV heads over all TP ranks
HEAD_DIM = 4
PAGE_SIZE = 2
SLOTS = 8  # metadata slots
START_TIMEOUT = 240.0
CALL_TIMEOUT = 30.0


def expected_value(rid: str, position: int, layer: int, head: int = 0) -> float:
    """What the prefill computed for token `position` of `rid`, KV buffer `layer`, global head `head` (exact in float32)."""
    return float(zlib.crc32(rid.encode()) % 997) * 1000.0 + position + layer * 0.25 + head * 0.0625


class PeerProcess(PipeChild):
    """A child process running one role's SGLang queues (one TP rank of them); `call(name, *args)` runs there."""

    def __init__(
        self,
        role: str,
        env: dict[str, str],
        bootstrap_port: int | None = None,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        group_port: int | None = None,
        stepped: bool = False,
    ) -> None:
        self.role = role
        self.tp_rank = tp_rank
        rank = Rank(tp_size, tp_rank, group_port, stepped)
        label = f"{role} peer" + (f" (TP rank {tp_rank} of {tp_size})" if tp_size > 1 else "")
        super().__init__(_child_main, (role, env, bootstrap_port, rank), label)
        self._ready: Any = None

    def ready(self) -> Any:
        """What the child reports once its queues are up (waits for the first time)."""
        if self._ready is None:
            self._ready = self._receive("start", START_TIMEOUT)
        return self._ready

    def call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        self.ready()
        return self._call(name, *args, timeout=timeout)

    def wait_for(self, event: tuple[Any, ...], timeout: float = CALL_TIMEOUT) -> list[tuple[Any, ...]]:
        """Wait until `event` is in the child's queue log; returns the log."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log()
            if event in log:
                return log
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} peer: {event} not logged in {timeout}s; log: {log}")
            time.sleep(0.02)

    def post(self, name: str, *args: Any) -> None:
        """Send a call without waiting for its answer (`answer` collects it)."""
        self.ready()
        self._post(name, args)

    def answer(self, what: str, timeout: float = CALL_TIMEOUT) -> Any:
        return self._receive(what, timeout)

    def log(self) -> list[tuple[Any, ...]]:
        status = self.call("status")
        if status["errors"]:
            raise RuntimeError(f"{self.role} peer: its scheduler loop raised:\n{status['errors'][0]}")
        return [tuple(event) for event in status["log"]]

    def stop(self, grace: float = 15.0) -> None:
        super().stop(grace)


def step_all(peers: list[PeerProcess], iterations: int = 1) -> None:
    """One (or more) iterations on every rank of a stepped TP group, posted to all before waiting for any."""
    for peer in peers:
        peer.post("step", iterations)
    for peer in peers:
        peer.answer(f"step({iterations})")


# -- the child ----------------------------------------------------------------------------


class Rank:
    """A child's place in its server's TP group (picklable: it goes to the child)."""

    def __init__(self, size: int, rank: int, group_port: int | None, stepped: bool) -> None:
        if size > 1 and group_port is None:
            raise ValueError("the ranks of a TP group need the port of their gloo rendezvous (group_port)")
        self.size, self.rank, self.group_port, self.stepped = size, rank, group_port, stepped

    @property
    def local_heads(self) -> range:
        local = HEADS // self.size
        return range(self.rank * local, (self.rank + 1) * local)


def _child_main(conn: Connection, role: str, env: dict[str, str], bootstrap_port: int | None, rank: Rank) -> None:
    os.environ.update(env)
    label = role if rank.size == 1 else f"{role} tp{rank.rank}"
    logging.basicConfig(level=logging.ERROR, format=f"[{label}] %(levelname)s %(name)s: %(message)s")
    stack = contextlib.ExitStack()

    def build() -> _Peer:
        if role == "prefill":
            peer: _Peer = _PrefillPeer(stack, rank, bootstrap_port)
        else:
            peer = _DecodePeer(stack, rank, bootstrap_port)
        conn.send((True, peer.ready()))
        return peer

    def iterate(peer: _Peer) -> None:
        try:
            peer.iterate()
        except Exception:
            if len(peer.errors) < 5:
                peer.errors.append(traceback.format_exc())

    peer = build_or_exit(conn, build)
    while True:  # SGLang's event loop, serving the parent's calls between iterations
        try:
            if conn.poll(None if rank.stepped else 0.002):
                name, args = conn.recv()
                if name == "exit":
                    break
                if name == "step":
                    for _ in range(args[0]):
                        iterate(peer)
                    conn.send((True, None))
                    continue
                answer(conn, peer, name, args)
        except (EOFError, OSError):
            break
        if not rank.stepped:
            iterate(peer)
    with contextlib.suppress(Exception):
        peer.close()
    exit_child(stack.close)


def _kv_args(q: Any, buffers: list[Any], metadata: Any, rank: Rank) -> Any:
    args = q.kv_args(page_size=PAGE_SIZE, engine_rank=rank.rank)
    args.kv_data_ptrs = [b.data_ptr() for b in buffers]
    args.kv_data_lens = [b.nbytes for b in buffers]
    args.kv_item_lens = [b[0].nbytes * PAGE_SIZE for b in buffers]
    args.kv_head_num, args.total_kv_head_num = len(rank.local_heads), HEADS
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata.get_buf_infos()
    return args


class _Peer:
    def __init__(self, stack: contextlib.ExitStack, rank: Rank) -> None:
        import torch

        from kvfsm.compat import sglang as compat
        from tests.sglang import _queues as q
        from tests.sglang._sglang import module

        self.torch, self.q, self.compat, self.module = torch, q, compat, module
        self.rank = rank
        self.errors: list[str] = []
        self.log: list[tuple[Any, ...]] = []
        parallel = {"tp_size": rank.size} if rank.size > 1 else {}
        stack.enter_context(q.sglang_context(rank=rank.rank, **parallel))
        if rank.size == 1:
            self.group = q.gloo_group()
        else:
            assert rank.group_port is not None
            self.group = q.tp_group(rank.rank, rank.size, rank.group_port)
        mooncake = {
            q.KVClassType.MANAGER: compat.MooncakeKVManager,
            q.KVClassType.SENDER: compat.MooncakeKVSender,
            q.KVClassType.RECEIVER: compat.MooncakeKVReceiver,
            q.KVClassType.BOOTSTRAP_SERVER: compat.MooncakeKVBootstrapServer,
        }
        stack.enter_context(q.patched_sglang(self.log, {q.TransferBackend.MOONCAKE: mooncake}))
        self.get_kv_class = q.prefill_mod.get_kv_class  # the patched one
        # SGLang's MHA layout: [token rows, this rank's heads, head dim], one buffer per K/V and layer.
        self.kv = [torch.zeros(ROWS, len(rank.local_heads), HEAD_DIM, dtype=torch.float32) for _ in range(LAYERS)]

    def server_args(self, bootstrap_port: int) -> Any:
        return SimpleNamespace(
            host="127.0.0.1",
            port=None,
            disaggregation_bootstrap_port=bootstrap_port,
            tp_size=self.rank.size,
            dp_size=1,
            pp_size=1,
            disaggregation_decode_allocation_policy="early",
        )

    def status(self) -> dict[str, Any]:
        return {"log": list(self.log), "errors": list(self.errors)}

    def finish_message(self, rid: str) -> str | None:
        reason = self.world.reqs[rid].finished_reason
        return None if reason is None else str(getattr(reason, "message", reason))

    def abort(self, rid: str) -> None:
        self.world.host.abort(rid)

    world: Any

    def ready(self) -> Any:
        raise NotImplementedError

    def iterate(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.world.manager.shutdown()


class _PrefillPeer(_Peer):
    """SGLang's prefill event loop: bootstrap queue, waiting queue (forwarded at once unless held), inflight."""

    def __init__(self, stack: contextlib.ExitStack, rank: Rank, bootstrap_port: int | None) -> None:
        super().__init__(stack, rank)
        q = self.q
        self.server: Any = None
        if rank.rank == 0:  # one bootstrap server per prefill server (on `bootstrap_port`, if given)
            server_class = self.get_kv_class(q.TransferBackend.MOONCAKE, q.KVClassType.BOOTSTRAP_SERVER)
            self.server = server_class(host="127.0.0.1", port=bootstrap_port or 0)
            bootstrap_port = self.server.port
        assert bootstrap_port is not None, "the other prefill ranks register at rank 0's bootstrap server"
        self.bootstrap_port = bootstrap_port
        self.world = q.PrefillWorld(log=self.log, group=self.group, page_size=PAGE_SIZE, slots=SLOTS)
        self.world.queue.tp_rank = rank.rank
        self.world.queue.transfer_backend = q.TransferBackend.MOONCAKE
        # What PrefillBootstrapQueue._init_kv_manager does: SGLang's KVArgs, then get_kv_class's manager.
        manager_class = self.get_kv_class(q.TransferBackend.MOONCAKE, q.KVClassType.MANAGER)
        self.world.set_manager(
            manager_class(
                _kv_args(q, self.kv, self.world.metadata_buffers, rank),
                q.utils.DisaggregationMode.PREFILL,
                self.server_args(self.bootstrap_port),
                False,
            )
        )
        self.world.computed = self._compute
        self.held: set[str] = set()

    def ready(self) -> Any:
        return {"bootstrap_port": self.bootstrap_port}

    def _compute(self, req: Any, slots: Any) -> None:
        for layer, buffer in enumerate(self.kv):
            for position, slot in enumerate(slots.tolist()):
                for local, head in enumerate(self.rank.local_heads):
                    buffer[slot, local] = expected_value(req.rid, position, layer, head)

    def add(self, rid: str, prompt_len: int, room: int, hold: bool = False) -> None:
        if hold:
            self.held.add(rid)
        self.world.add(rid, prompt_len, room, "127.0.0.1", self.bootstrap_port)

    def release(self, rid: str) -> None:
        self.held.discard(rid)

    def iterate(self) -> None:
        world = self.world
        world.pop_bootstrapped()
        world.resolve_waiting()
        for req in list(world.host.waiting_queue):
            if req.rid not in self.held and not self.q.utils.is_aborted(req):
                world.forward(req.rid)
        world.process_inflight()

    def close(self) -> None:
        super().close()
        if self.server is not None:
            self.server.close()


class _DecodePeer(_Peer):
    """SGLang's decode queue processing: deferred releases, preallocation, transfer polling."""

    def __init__(self, stack: contextlib.ExitStack, rank: Rank, bootstrap_port: int | None) -> None:
        super().__init__(stack, rank)
        assert bootstrap_port is not None
        q = self.q
        self.bootstrap_port = bootstrap_port
        envs = self.module("sglang.srt.environ").envs
        self.world = q.DecodeWorld(
            log=self.log,
            group=self.group,
            page_size=PAGE_SIZE,
            slots=SLOTS,
            deferred_release=envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get(),
        )
        manager_class = self.get_kv_class(q.TransferBackend.MOONCAKE, q.KVClassType.MANAGER)
        self.world.set_manager(
            manager_class(
                _kv_args(q, self.kv, self.world.metadata_buffers, rank),
                q.utils.DisaggregationMode.DECODE,
                self.server_args(bootstrap_port),
                False,
            )
        )
        self.world.transfer.deferred_kv_release_timeout = 60.0  # kvfsm's release gate decides first
        self.world.transfer.tp_rank = self.world.prealloc.tp_rank = rank.rank
        self.world.prealloc.transfer_backend = q.TransferBackend.MOONCAKE
        self.world.prealloc._ensure_retry_interval = 0.2

    def ready(self) -> Any:
        return {"deferred_release": self.world.transfer.enable_deferred_kv_release}

    def add(self, rid: str, prompt_len: int, room: int) -> None:
        self.world.add(rid, prompt_len, room, "127.0.0.1", self.bootstrap_port)

    def iterate(self) -> None:
        self.world.pop_preallocated()
        self.world.pop_transferred()

    def held(self) -> list[str]:
        return [entry[0].req.rid for entry in self.world.transfer._deferred_releases]

    def quarantined(self) -> list[object]:
        """The rooms whose pages kvfsm quarantined (no proof their writes stopped by the drain deadline)."""
        return [handle.room for handle in self.world.manager.transfer_manager.quarantined()]

    def release_quarantined(self, room: int, why: str) -> int:
        """An operator's override: free a quarantined room's pages (kvfsm counts and logs it)."""
        released: int = self.world.manager.transfer_manager.release_quarantined(room, why)
        return released

    def first_token(self, rid: str) -> int:
        return int(self.world.reqs[rid].output_ids[0])

    def kv_matches(self, rid: str) -> bool:
        """Whether every token of `rid` in every KV buffer holds what the prefill computed."""
        req = self.world.reqs[rid]
        slots = self.world.pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].tolist()
        for layer, buffer in enumerate(self.kv):
            for position, slot in enumerate(slots):
                for local, head in enumerate(self.rank.local_heads):
                    if not bool((buffer[slot, local] == expected_value(rid, position, layer, head)).all()):
                        return False
        return True
