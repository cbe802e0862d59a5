"""The defects of issue 11, each as one deterministic story over the simulated network.

The same production code as over real engines (tests/wire_sim.py replaces
only sockets, threads and the engine), so each story can put a frame or a
write exactly where it hurts: a late claim after a reused room id, an ABORT
after the prefill closed a room with a write in flight, a write that fails
while the room's notices wait, forged and replayed frames, floods of early
aborts, a shared key. The model-based test (tests/property/test_wire_model.py)
searches the interleavings these stories pick by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

pytest.importorskip("torch", reason="torch is needed for the KV pools")

import kvfsm
from kvfsm import FailureKind, KVPoll
from kvfsm.backends import codec
from kvfsm.backends.remote import RemoteConfig
from tests.wire_sim import CONFIG, SimBackend, World


@pytest.fixture
def world() -> Iterator[World]:
    world = World()
    yield world
    for endpoint in world.endpoints:
        endpoint.close()


def _state(handle: kvfsm.TransferHandle) -> KVPoll:
    """The handle's state now (a call, so a type checker does not carry an earlier comparison over)."""
    return handle.state


def _safe(handle: kvfsm.TransferHandle) -> bool:
    return handle.release_safe


def _open(world: World, room: int, decode: int = 0) -> tuple[kvfsm.TransferHandle, kvfsm.TransferHandle]:
    prefill = world.prefill_manager.open(room)
    receiver = world.decode_managers[decode].open(room)
    world.prefill.bootstrap(prefill, "sim://prefill")
    world.decodes[decode].bootstrap(receiver, "sim://prefill")
    world.settle()
    return prefill, receiver


def test_a_late_claim_of_a_closed_generation_never_binds_to_the_next(world: World) -> None:
    """Defect 1: A's prefill room ends unclaimed and the id is reused for B; A's ROOM arrives last."""
    a_prefill, a_decode = _open(world, 1, decode=0)
    world.decodes[0].expect(a_decode, [3], aux_index=0)  # A's claim, still on the wire
    late_claim = world.net.inflight.pop()
    a_prefill.abort("client went away")
    a_prefill.close()
    b_prefill = world.prefill_manager.open(1)
    world.prefill.bootstrap(b_prefill, "sim://prefill")
    assert b_prefill.state is KVPoll.Failed
    assert b_prefill.reason is not None and "reused within pending_ttl" in b_prefill.reason.message
    world.net.inflight.append(late_claim)
    world.settle()
    assert a_decode.state is KVPoll.Failed and a_decode.release_safe
    assert world.prefill.remote_stats.held_room_refusals >= 1


def test_a_generation_closed_without_bootstrap_holds_its_room_id_too(world: World) -> None:
    """Defect 1, the variant the model found: A's prefill room was opened and closed, never bootstrapped."""
    a_prefill = world.prefill_manager.open(1)
    a_decode = world.decode_managers[0].open(1)
    world.decodes[0].bootstrap(a_decode, "sim://prefill")
    world.settle()
    world.decodes[0].expect(a_decode, [3], aux_index=0)
    late_claim = world.net.inflight.pop()
    a_prefill.abort("gave up before bootstrap")
    a_prefill.close()
    b_prefill = world.prefill_manager.open(1)
    world.prefill.bootstrap(b_prefill, "sim://prefill")
    assert b_prefill.state is KVPoll.Failed
    world.net.inflight.append(late_claim)
    world.settle()
    assert a_decode.state is KVPoll.Failed


def test_an_abort_for_a_closed_room_waits_for_its_writes(world: World) -> None:
    """Defect 2: the prefill closed a room with a write in flight; the decode's ABORT gets no early ACK."""
    prefill, decode = _open(world, 2)
    world.decodes[0].expect(decode, [1, 2], aux_index=None)
    world.net.deliver_all()
    world.prefill.send(prefill, [4, 5], last=True)
    world.pump()
    (job,) = world.prefill.sim_engine.inflight
    decode.abort("client went away")
    world.decodes[0].deliver_notices()
    prefill.abort("client went away")
    prefill.close()
    world.prefill.deliver_notices()
    world.net.deliver_all()
    world.pump()
    world.net.deliver_all()
    assert decode.state is KVPoll.Failed
    assert not decode.release_safe, "released with the prefill's write in flight"
    job.complete()
    world.settle()
    assert _safe(decode) and world.decodes[0].remote_stats.abort_acks_received == 1


def test_a_failed_write_stops_its_room_before_anything_else_is_issued(world: World) -> None:
    """Defect 3: a write fails while the room's notices wait on a busy thread; the next chunk is ready."""
    for endpoint in world.endpoints:
        endpoint.defer_notices = True
    prefill, decode = _open(world, 3)
    world.decodes[0].expect(decode, [1, 2], aux_index=0)
    world.settle()
    world.prefill.send(prefill, [4], last=False)
    world.pump()
    (first,) = world.prefill.sim_engine.inflight
    world.prefill.send(prefill, [5], last=True, aux_index=1)
    first.fail()
    world.pump()  # the writer sees the failure: the room stops here, now
    world.pump()
    assert not world.prefill.sim_engine.inflight, "a write was issued after one of its room's writes failed"
    world.net.deliver_all()
    assert prefill.state is KVPoll.Failed and prefill.reason is not None
    assert prefill.reason.kind is FailureKind.TRANSFER_ERROR
    world.settle()
    assert decode.state is KVPoll.Failed, "Success with a chunk that never landed"
    assert decode.release_safe


@pytest.mark.parametrize("kind", ["HEARTBEAT", "BYE", "ABORT", "ABORT_ACK", "DONE"])
def test_a_frame_from_no_session_changes_nothing(world: World, kind: str) -> None:
    """Defects 4 and 8: the address and id a frame claims are not a session; a null or wrong secret is refused."""
    prefill, decode = _open(world, 4)
    world.decodes[0].expect(decode, [1], aux_index=None)
    world.net.deliver_all()
    gen = world.decodes[0].decode._recv_by_handle[(4, decode.generation)].gen
    by_kind: dict[str, dict[str, Any]] = {
        "HEARTBEAT": {},
        "BYE": {},
        "ABORT": {"room": 4, "gen": gen, "pgen": None, "kind": "aborted", "message": "forged"},
        "ABORT_ACK": {"room": 4, "gen": gen, "pgen": None},
        "DONE": {"room": 4, "gen": gen, "pgen": prefill.generation, "nbytes": 8},
    }
    fields = by_kind[kind]
    session = world.decodes[0].sessions.up()[0]
    for key in ("f" * 32, "0" * 32):  # a wrong secret for the real session id, then another
        world.decodes[0].receive(codec.encode(kind, {"sid": session.sid, "key": key, **fields}))
    world.decodes[0].receive(codec.encode(kind, {"sid": "1" * 16, "key": session.key, **fields}))
    for _ in range(40):  # 20 s, past the 10 s window: a forged BYE or HEARTBEAT changes nothing
        world.clock.advance(0.5)
        world.housekeeping()
        world.settle()
    assert world.decodes[0].transport.stats.unauthenticated == 3
    assert decode.state is KVPoll.WaitingForInput and prefill.state is KVPoll.WaitingForInput
    world.prefill.send(prefill, [2], last=True)
    world.settle()
    assert _state(decode) is KVPoll.Success


def test_hellos_naming_other_addresses_are_bounded_and_touch_no_engine() -> None:
    """Defect 5: each HELLO costs one half-open session at most, and the engine is not asked anything."""
    config = attrs.evolve(CONFIG, max_half_open=16)
    world = World(config)
    added: list[object] = []
    engine = world.prefill.sim_engine
    original = engine.add_peer

    def counting(session: dict[str, Any], blob: bytes | None) -> Any:
        added.append(session)
        return original(session, blob)

    engine.add_peer = counting  # type: ignore[method-assign]
    fields, blob = world.decodes[0].endpoint._session_fields()
    for i in range(200):
        hello = {
            "addr": f"sim://nobody{i}",
            "reply_sid": f"{i:016x}",
            "reply_key": "f" * 32,
            "role": "receiver",
            "engine": "sim",
            "session": fields,
            "mac": None,
        }
        world.prefill.receive(codec.encode("HELLO", hello, blob))
    assert len(world.prefill.sessions) <= config.max_half_open
    assert world.prefill.transport.stats.sessions_evicted == 200 - config.max_half_open
    assert added == [], "an unconfirmed session reached the engine"
    _prefill, decode = _open(world, 5)  # a real decode still gets its session
    assert decode.state is KVPoll.WaitingForInput
    assert len(added) == 1
    for endpoint in world.endpoints:
        endpoint.close()


def test_early_aborts_are_bounded_per_session(world: World) -> None:
    """Defect 8: a session's aborts for rooms never opened are held, bounded, oldest first, O(1) each."""
    config = RemoteConfig(heartbeat_interval=1.0, heartbeat_misses=10, max_pending_per_session=50, max_pending=80)
    small = World(config)
    try:
        _prefill, decode = _open(small, 6)
        session = small.decodes[0].sessions.up()[0]
        for room in range(1000, 1300):
            fields = {"room": room, "gen": room, "pgen": None, "kind": "aborted", "message": "gone"}
            small.decodes[0].endpoint._send_frame(session, "ABORT", fields)
        small.net.deliver_all()
        assert len(small.prefill.prefill._pending) == 50
        assert small.prefill.remote_stats.pending_dropped == 250
        late = small.prefill_manager.open(1299 - 250 - 1)  # one whose early abort was never held
        small.prefill.bootstrap(late, "sim://prefill")
        assert late.state is KVPoll.Bootstrapping
        held = small.prefill_manager.open(1299)
        small.prefill.bootstrap(held, "sim://prefill")
        assert held.state is KVPoll.Failed and held.reason is not None and held.reason.from_peer
        assert decode.state is KVPoll.WaitingForInput
    finally:
        for endpoint in small.endpoints:
            endpoint.close()


def test_a_reason_longer_than_the_wire_carries_still_tells_the_peer(world: World) -> None:
    """Defect 9: the stop path encodes the ABORT; a reason of 10,000 characters arrives cut, with a marker."""
    prefill, decode = _open(world, 7)
    world.decodes[0].expect(decode, [1, 2], aux_index=None)
    world.net.deliver_all()
    world.prefill.send(prefill, [3], last=False)
    world.pump()
    decode.abort("x" * 10_000)
    world.settle()
    assert prefill.state is KVPoll.Failed and prefill.reason is not None
    assert prefill.reason.from_peer and prefill.reason.message.endswith("more characters cut]")
    assert decode.release_safe


def test_a_replayed_claim_of_a_finished_transfer_is_stale(world: World) -> None:
    """Rule 12: a duplicated ROOM of a closed generation never reaches the id's next generation."""
    prefill, decode = _open(world, 8)
    world.decodes[0].expect(decode, [1], aux_index=None)
    claim = list(world.net.inflight[-1][1])
    world.settle()
    world.prefill.send(prefill, [2], last=True)
    world.settle()
    assert decode.state is KVPoll.Success
    prefill.close()
    decode.close()
    world.settle()
    again = world.prefill_manager.open(8)
    world.prefill.bootstrap(again, "sim://prefill")
    stale = world.prefill.remote_stats.stale_messages
    world.prefill.receive(claim)
    assert again.state is KVPoll.Bootstrapping
    assert world.prefill.remote_stats.stale_messages == stale + 1


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("heartbeat_interval", math.inf, "heartbeat_interval must be finite"),
        ("heartbeat_interval", 0, "heartbeat_interval must be finite and > 0"),
        ("poll_interval", -1.0, "poll_interval must be finite and >= 0"),
        ("poll_interval", math.nan, "poll_interval must be finite"),
        ("pending_ttl", math.nan, "pending_ttl must be finite"),
        ("heartbeat_misses", 0, "heartbeat_misses must be an int >= 1"),
        ("heartbeat_misses", True, "heartbeat_misses must be an int"),
        ("port", 70000, "port must be an int in 0..65535"),
        ("host", "", "host must be a host name"),
        ("shared_key", b"short", "at least 16 bytes"),
        ("max_half_open", 0, "max_half_open must be an int >= 1"),
    ],
)
def test_remote_config_refuses_what_cannot_work(field: str, value: object, needle: str) -> None:
    """Defect 11: `heartbeat_interval=inf` silently disabled liveness; NaN and negatives were accepted."""
    with pytest.raises(kvfsm.ConfigError, match=needle):
        RemoteConfig(**{field: value})  # type: ignore[arg-type]


def test_with_a_shared_key_only_its_holders_open_sessions() -> None:
    """Rule 15: a HELLO without the key's MAC is dropped before any session exists."""
    keyed = RemoteConfig(heartbeat_interval=1.0, heartbeat_misses=10, shared_key=b"k" * 32)
    world = World(keyed)
    stranger = SimBackend(kvfsm.TransferManager("receiver", clock=world.clock), world.net, "sim://stranger")
    try:
        stranger.register_pools(world.decode_pools[0].kv_pools())
        _prefill, decode = _open(world, 9)
        assert decode.state is KVPoll.WaitingForInput, "holders of the key talk as usual"
        handle = stranger.manager.open(9)
        stranger.bootstrap(handle, "sim://prefill")
        world.settle()
        assert handle.state is KVPoll.Bootstrapping
        assert world.prefill.transport.stats.unauthenticated == 1
        assert len(world.prefill.sessions) == 1
    finally:
        stranger.close()
        for endpoint in world.endpoints:
            endpoint.close()
