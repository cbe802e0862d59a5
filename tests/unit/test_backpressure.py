"""Back-pressure in the prefill's writer (issue 12), over the simulated engine.

Each promise with the story that tries hardest to break it: the budget of
writes in flight to one decode is never exceeded whatever is queued; two
rooms share it (neither waits for the other to finish); a busy engine is
retried, never fails the room, and no write goes out twice, even when it
took part of a submit; an engine that stays busy, or a real engine error,
fails the room with a reason naming it; a stopped room's queued writes never
reach the engine, and its pages stay held until the writes already out end.
Before issue 12 the writer submitted every write of a chunk at once: 7 of
these 8 fail there (the first with 8 writes in flight against a budget of
3). The two failure stories also found a defect of the first back-pressure
commit: a submit that failed before anything went out left its claim
undrained, so no ABORT_ACK came and the decode held its pages until the
drain deadline (forever with none).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import attrs
import pytest

pytest.importorskip("torch", reason="torch is needed for the KV pools")

import torch

import kvfsm
from kvfsm import FailureKind, KVPoll
from kvfsm.backends import _remote_writer
from tests.wire_sim import CONFIG, World

# Pages that coalesce into no runs: each is its own write, one per region (K and V).
A_PAGES, B_PAGES = [0, 2, 4, 6], [1, 3, 5, 7]
WRITES_PER_ROOM = 2 * len(A_PAGES)


def _world(budget: int) -> World:
    world = World(attrs.evolve(CONFIG, max_writes_in_flight=budget), decodes=1)
    for tensor in (world.prefill_pools.k, world.prefill_pools.v):
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + 1)
    world.prefill_pools.aux.fill_(7)
    return world


@pytest.fixture
def world() -> Iterator[World]:
    world = _world(budget=3)
    yield world
    for endpoint in world.endpoints:
        endpoint.close()


def _state(handle: kvfsm.TransferHandle) -> KVPoll:
    """The handle's state now (a call, so a type checker does not carry an earlier comparison over)."""
    return handle.state


def _safe(handle: kvfsm.TransferHandle) -> bool:
    return handle.release_safe


def _in_flight(world: World) -> int:
    return sum(len(job.writes) for job in world.prefill.sim_engine.inflight)


def _drive(world: World, budget: int, turns: int = 400) -> None:
    """Complete the oldest job each turn, checking the budget before every completion."""
    engine = world.prefill.sim_engine
    idle = 0
    for _ in range(turns):
        world.prefill.deliver_notices()
        world.pump()
        assert _in_flight(world) <= budget, f"{_in_flight(world)} writes in flight; the budget is {budget}"
        if engine.inflight:
            engine.inflight[0].complete()
        world.pump()
        world.net.deliver_all()
        idle = idle + 1 if not engine.inflight and not world.net.inflight else 0
        if idle > 5:
            break
        if idle:
            time.sleep(0.001)  # writes may wait for a busy engine's retry, a real millisecond or more
    world.settle()


def _same_bytes(world: World, pages: list[int]) -> bool:
    sent, got = world.prefill_pools, world.decode_pools[0]
    return all(bool((sent.k[p] == got.k[p]).all() and (sent.v[p] == got.v[p]).all()) for p in pages)


def _each_written_once(world: World) -> collections.Counter[int]:
    """How often each KV page write's destination was submitted (the aux slot and the commit marker aside)."""
    pools = world.decode_pools[0]
    kv = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (pools.k, pools.v)]
    return collections.Counter(
        dst for _src, dst, _n in world.prefill.sim_engine.submitted if any(lo <= dst < hi for lo, hi in kv)
    )


def test_the_budget_of_writes_in_flight_holds_however_much_is_queued(world: World) -> None:
    a_prefill, a_decode = world.open_pair(1, A_PAGES)
    b_prefill, b_decode = world.open_pair(2, B_PAGES)
    for prefill, pages in ((a_prefill, A_PAGES), (b_prefill, B_PAGES)):
        world.prefill.send(prefill, pages[:2], last=False)
        world.prefill.send(prefill, pages[2:], last=True, aux_index=int(prefill.room))
    _drive(world, budget=3)
    assert (a_decode.state, b_decode.state) == (KVPoll.Success, KVPoll.Success)
    assert (a_prefill.state, b_prefill.state) == (KVPoll.Success, KVPoll.Success)
    assert _same_bytes(world, A_PAGES + B_PAGES)
    writes = _each_written_once(world)
    assert len(writes) == 2 * WRITES_PER_ROOM and set(writes.values()) == {1}
    assert world.prefill.remote_stats.engine_busy == 0


def test_two_rooms_share_the_budget_instead_of_one_waiting_for_the_other() -> None:
    world = _world(budget=2)
    a_prefill, _ = world.open_pair(1, A_PAGES)
    b_prefill, _ = world.open_pair(2, B_PAGES)
    world.prefill.send(a_prefill, A_PAGES, last=True, aux_index=1)
    world.prefill.send(b_prefill, B_PAGES, last=True, aux_index=2)
    engine = world.prefill.sim_engine
    order: list[str] = []
    pages_of = {dst: "a" for dst, _ in world.decode_pools[0].page_ranges(A_PAGES)}
    pages_of.update({dst: "b" for dst, _ in world.decode_pools[0].page_ranges(B_PAGES)})
    for _ in range(4):
        world.pump()
        order.extend(pages_of[job.writes[0][1]] for job in engine.inflight if job.status == "pending")
        for job in list(engine.inflight):
            job.complete()
    # A was queued first and has writes for 4 turns of this budget; B got the budget within them.
    assert "b" in order[: WRITES_PER_ROOM // 2], f"room B waited for room A: {order}"
    for endpoint in world.endpoints:
        endpoint.close()


def test_a_busy_engine_is_retried_and_no_write_goes_out_twice(world: World) -> None:
    prefill, decode = world.open_pair(1, A_PAGES)
    engine = world.prefill.sim_engine
    engine.refuse = 3
    world.prefill.send(prefill, A_PAGES, last=True, aux_index=1)
    world.pump()
    assert prefill.state is KVPoll.Transferring  # busy is not a failure
    _drive(world, budget=3)
    assert _state(decode) is KVPoll.Success and _state(prefill) is KVPoll.Success
    assert _same_bytes(world, A_PAGES)
    assert world.prefill.remote_stats.engine_busy == 3
    assert set(_each_written_once(world).values()) == {1}


def test_writes_a_busy_engine_took_part_of_are_neither_lost_nor_repeated(world: World) -> None:
    prefill, decode = world.open_pair(1, A_PAGES)
    world.prefill.sim_engine.take_part = 1  # of a slice of 3, one goes out, then "busy"
    world.prefill.send(prefill, A_PAGES, last=True, aux_index=1)
    _drive(world, budget=3)
    assert decode.state is KVPoll.Success and _same_bytes(world, A_PAGES)
    writes = _each_written_once(world)
    assert len(writes) == WRITES_PER_ROOM and set(writes.values()) == {1}


def test_an_engine_busy_for_too_long_fails_the_room_and_says_so(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_remote_writer, "_BUSY_GIVE_UP", 0.0)
    prefill, decode = world.open_pair(1, A_PAGES)
    world.prefill.sim_engine.refuse = 10**9
    world.prefill.send(prefill, A_PAGES, last=True, aux_index=1)
    for _ in range(50):
        world.pump()
        if prefill.state is KVPoll.Failed:
            break
        time.sleep(0.002)
    assert prefill.state is KVPoll.Failed and prefill.reason is not None
    assert prefill.reason.kind is FailureKind.TRANSFER_ERROR and "stayed busy" in prefill.reason.message
    world.settle()
    assert decode.state is KVPoll.Failed and decode.release_safe  # nothing was written: no pages held
    assert not world.prefill.sim_engine.submitted


def test_a_real_engine_error_fails_the_room_at_once(world: World) -> None:
    prefill, decode = world.open_pair(1, A_PAGES)
    world.prefill.sim_engine.broken = "the NIC went away"
    world.prefill.send(prefill, A_PAGES, last=True, aux_index=1)
    world.pump()
    assert prefill.state is KVPoll.Failed and prefill.reason is not None
    assert prefill.reason.kind is FailureKind.TRANSFER_ERROR and "the NIC went away" in prefill.reason.message
    world.settle()
    assert decode.state is KVPoll.Failed and decode.release_safe
    assert world.prefill.remote_stats.engine_busy == 0


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_stopped_room_drops_its_queued_writes_and_waits_for_those_out(world: World, side: str) -> None:
    prefill, decode = world.open_pair(1, A_PAGES)
    engine = world.prefill.sim_engine
    world.prefill.send(prefill, A_PAGES, last=True, aux_index=1)
    world.pump()
    out = list(engine.inflight)
    assert _in_flight(world) == 3  # the budget; the other writes wait in the writer
    (prefill if side == "prefill" else decode).abort("client went away")
    for _ in range(3):
        world.prefill.deliver_notices()
        world.decodes[0].deliver_notices()
        world.pump()
        world.net.deliver_all()
    assert len(engine.submitted) == 3, "a queued write of a stopped room reached the engine"
    assert decode.state is KVPoll.Failed and prefill.state is KVPoll.Failed
    assert not _safe(decode), "the decode's pages were released with writes still landing"
    for job in out:
        job.complete()
    world.settle()
    assert _safe(decode) and len(engine.submitted) == 3
    assert not world.prefill.active_claims()
