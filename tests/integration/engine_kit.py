"""The conformance kit's pair factories for the cross-process engines (Mooncake, NIXL).

Used in-process by tests/integration/test_engine_conformance.py for
Mooncake, and in a child process (`python -m tests.integration.engine_kit
nixl EXAMPLES STEPS`) for NIXL, which crashes the interpreter at exit: the
child ends with `os._exit`, 0 when the kit passed, 1 when it failed.
Importing this module imports neither engine; building a backend does.

Three things are particular to a real engine:

* Destroying a Mooncake `TransferEngine` takes about a second, so one
  engine per role and its pools live for the whole process (registered
  once, zeroed at the start of every example); each example still builds
  fresh backends, control planes and managers around them. NIXL agents
  are cheap: each example makes its own.
* `settle()` must prove that nothing the pair started is still moving:
  every control message either side sent has been handled by the other,
  the prefill's writer thread has no room with work left, and no live
  decode room is behind its prefill room (chunks done, or Success): the
  decode fires a notice's events after its control thread handled it. It checks all of that twice around a round trip through
  the writer's command queue, and gives up with an error after
  `SETTLE_LIMIT` seconds.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm import KVPoll, TransferManager
from kvfsm.backends._remote_engine import EngineAdapter, EngineJob, Write
from kvfsm.backends._remote_sender import PrefillEndpoint
from kvfsm.backends.base import KVPools, MemoryRegion
from kvfsm.backends.mooncake import MooncakeBackend, MooncakeEngine
from kvfsm.backends.nixl import NixlBackend
from kvfsm.backends.remote import RemoteBackend, RemoteConfig
from kvfsm.testing import BackendConformance, BackendPair

PAGES = 8
AUX_SLOTS = 4
LAYERS = 2
WORDS_PER_PAGE = 4
SETTLE_LIMIT = 20.0
#: How long one question to the writer thread waits for its answer.
SYNC_WAIT = 0.005
# Heartbeats never fall due within a run (the first goes out before any peer is watched):
# the kit's steps never wait, and settle() counts every message.
CONFIG = RemoteConfig(heartbeat_interval=3600.0)


class Pages:
    """One endpoint's KV tensors and aux slots, written and read one token at a time."""

    def __init__(self) -> None:
        self.tensors = [torch.zeros(LAYERS, PAGES, WORDS_PER_PAGE, dtype=torch.int64) for _ in range(2)]
        self.aux = torch.zeros(AUX_SLOTS, 2, dtype=torch.int64)
        self.pools = KVPools.from_tensors(self.tensors[0], self.tensors[1], self.aux)

    def write(self, page: int, token: int) -> None:
        for tensor in self.tensors:
            tensor[:, page] = token

    def write_aux(self, slot: int, token: int) -> None:
        self.aux[slot] = token

    def read_aux(self, slot: int) -> int:
        values = self.aux[slot].unique()  # type: ignore[no-untyped-call]
        return int(values[0]) if values.numel() == 1 else -2

    def read(self, page: int) -> int:
        values = torch.cat([tensor[:, page].reshape(-1) for tensor in self.tensors]).unique()  # type: ignore[no-untyped-call]
        return int(values[0]) if values.numel() == 1 else -2  # -2: a torn page


class KeptMooncakeEngine(EngineAdapter):
    """A Mooncake engine and its registered pages that outlive one example's backends."""

    name = "mooncake"

    def __init__(self) -> None:
        self.inner = MooncakeEngine()
        self.pages = Pages()
        self.inner.register([*self.pages.pools.kv, *self.pages.pools.aux])

    def register(self, regions: list[MemoryRegion]) -> None:
        return  # registered once, at creation

    def session(self) -> tuple[dict[str, Any], bytes | None]:
        return self.inner.session()

    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        return self.inner.add_peer(session, blob)

    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        return self.inner.submit(target, writes)

    def close(self) -> None:
        return  # kept for the next example


_KEPT: dict[str, KeptMooncakeEngine] = {}


def kept_mooncake(role: str) -> KeptMooncakeEngine:
    if role not in _KEPT:
        _KEPT[role] = KeptMooncakeEngine()
    engine = _KEPT[role]
    for tensor in (*engine.pages.tensors, engine.pages.aux):
        tensor.zero_()  # no token of an earlier example may pass for a write of this one
    return engine


class Settling(RemoteBackend):
    """What `settle()` reads from an endpoint: control messages handled, and whether the writer is idle."""

    handled: int

    def _count_handled(self) -> None:
        self.handled = 0
        admit = self.endpoint.admit

        def counting(frames: list[bytes]) -> Callable[[], None] | None:
            work = admit(frames)
            if work is None:
                self.handled += 1
                return None

            def counted() -> None:
                try:
                    work()
                finally:
                    self.handled += 1

            return counted

        # Counted after the handler returned: whatever it queued for the writer is queued by then.
        setattr(self.transport, "_on_frames", counting)  # noqa: B010

    def writer_idle(self) -> bool:
        """True when every lane took up every command queued so far and had no work left.

        False when one still had work at that moment (or is slow to answer): ask again.
        """
        endpoint = self.endpoint
        return not isinstance(endpoint, PrefillEndpoint) or endpoint.lanes_idle(SYNC_WAIT)


class SettlingMooncakeBackend(Settling, MooncakeBackend):
    def __init__(self, manager: TransferManager, engine: KeptMooncakeEngine) -> None:
        self.kept = engine
        super().__init__(manager, CONFIG)
        self._count_handled()

    def _make_engine(self) -> EngineAdapter:
        return self.kept


class SettlingNixlBackend(Settling, NixlBackend):
    def __init__(self, manager: TransferManager) -> None:
        super().__init__(manager, CONFIG)
        self._count_handled()


def decode_behind(sending: Settling, receiving: Settling) -> bool:
    """True while a live decode room has seen fewer chunks than its prefill room, or is not done when it is."""
    prefill, decode = sending.endpoint, receiving.endpoint
    assert isinstance(prefill, PrefillEndpoint)
    with prefill._lock:
        rooms = [(claim.gen, claim.handle) for claim in prefill._claim_of.values() if claim.handle is not None]
    with decode._lock:
        records = {gen: rec for session in decode.sessions for gen, rec in session.records.items()}
    for gen, send in rooms:
        rec = records.get(gen)
        if rec is None or rec.handle.is_terminal:
            continue
        if rec.handle.chunks < send.chunks or send.state is KVPoll.Success:
            return True
    return False


def settle_pair(sending: Settling, receiving: Settling) -> None:
    """Block until the pair is quiet (see the module docstring), twice in a row with no change."""

    def counts() -> tuple[int, int, int, int]:
        return (sending.control.stats.sent, receiving.handled, receiving.control.stats.sent, sending.handled)

    def notices_pending() -> bool:
        # Backends learn of aborts and failures through manager notices, which
        # another thread may still be delivering after the event returned.
        return any(m._outbox or m._dispatching.locked() for m in (sending.manager, receiving.manager))

    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        before = counts()
        idle = sending.writer_idle() and not notices_pending()
        behind = decode_behind(sending, receiving)
        after = counts()
        if idle and not behind and before == after and before[0] == before[1] and before[2] == before[3]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the {sending.name} pair did not settle in {SETTLE_LIMIT}s: writer idle {idle}, "
                f"decode behind {behind}, messages (sent, handled) both ways {after}"
            )
        time.sleep(0.0005)


def _pair(sending: Settling, receiving: Settling, source: Pages, destination: Pages) -> BackendPair:
    sending.register_pools(source.pools)
    receiving.register_pools(destination.pools)
    return BackendPair(
        sender=sending,
        receiver=receiving,
        peer=sending.address,
        write_source=source.write,
        read_destination=destination.read,
        write_destination=destination.write,
        write_source_aux=source.write_aux,
        read_destination_aux=destination.read_aux,
        settle=lambda: settle_pair(sending, receiving),
    )


class MooncakeConformance(BackendConformance):
    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        source, destination = kept_mooncake("sender"), kept_mooncake("receiver")
        return _pair(
            SettlingMooncakeBackend(sender, source),
            SettlingMooncakeBackend(receiver, destination),
            source.pages,
            destination.pages,
        )


class NixlConformance(BackendConformance):
    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        return _pair(SettlingNixlBackend(sender), SettlingNixlBackend(receiver), Pages(), Pages())


MACHINES: dict[str, type[BackendConformance]] = {"mooncake": MooncakeConformance, "nixl": NixlConformance}


def main(argv: list[str]) -> None:
    """Run the kit over one engine in this process, then leave at once (no exit handlers: NIXL)."""
    engine, examples, steps = argv[0], int(argv[1]), int(argv[2])
    try:
        run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]  # typed in newer hypothesis
            MACHINES[engine], settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None)
        )
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"conformance kit over {engine}: {examples} examples passed", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
