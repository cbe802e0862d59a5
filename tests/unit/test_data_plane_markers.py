"""Completion on the data plane (`kvfsm.backends._markers`), over the simulated engine, as an attacker tries it.

A room with a commit marker succeeds on the decode only when the token the
decode minted is in the room's marker slot, and the prefill writes it only
after every other write of the room landed (the model, test_wire_model.py,
checks that ordering under any interleaving). Here, each promise and the
story that tries hardest to break it: a marker that lands before DONE
completes the room, and the late DONE and CHUNK are expected, not stale;
a forged or stale token in the slot completes nothing; a claim naming a
slot the decode does not have is refused, not written to; a HELLO naming a
malformed marker region is refused; a ROOM whose marker field is malformed
is dropped by the codec; the writes land before the marker (aux slot
included); with no source slot free the room still completes by DONE. Over an engine
that carries notifications (NIXL) the marker is one, and the same attacks
run against it: forged, truncated, repeated and late notifications, a
notification from another engine that knows the token, a failed write.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

pytest.importorskip("torch", reason="torch is needed for the KV pools")

import torch

import kvfsm
from kvfsm import FailureKind, KVPoll
from kvfsm.backends import _markers, codec
from tests.wire_sim import CONFIG, NotifyingSimEngine, World

MARKED = attrs.evolve(CONFIG, completion_markers=True)


@pytest.fixture
def world() -> Iterator[World]:
    world = World(MARKED, decodes=1)
    for tensor in (world.prefill_pools.k, world.prefill_pools.v):
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + 1)
    world.prefill_pools.aux.fill_(7)
    yield world
    for endpoint in world.endpoints:
        endpoint.close()


def _write_all_but_deliver_nothing(world: World) -> None:
    """Every engine write lands (the marker too), the lanes move, and no frame crosses the network."""
    for _ in range(4):
        world.pump()
        for job in list(world.prefill.sim_engine.inflight):
            job.complete()


def _state(handle: kvfsm.TransferHandle) -> KVPoll:
    """The handle's state now (a call, so a type checker does not carry an earlier comparison over)."""
    return handle.state


def _look(world: World) -> None:
    world.decodes[0].housekeeping(world.clock())


def _record(world: World, decode: kvfsm.TransferHandle) -> object:
    return world.decodes[0].decode._recv_by_handle[(decode.room, decode.generation)]


def test_a_marker_that_lands_before_done_completes_the_room_and_the_late_frames_are_not_stale(world: World) -> None:
    prefill, decode = world.open_pair(1, [0, 1])
    world.prefill.send(prefill, [0], last=False)
    world.prefill.send(prefill, [1], last=True, aux_index=1)
    _write_all_but_deliver_nothing(world)
    assert prefill.state is KVPoll.Success
    assert decode.state is KVPoll.WaitingForInput  # no frame has come: CHUNK and DONE are still on the wire
    _look(world)
    assert _state(decode) is KVPoll.Success
    pools, source = world.decode_pools[0], world.prefill_pools
    assert torch.equal(pools.k[[0, 1]], source.k[[0, 1]]) and torch.equal(pools.v[[0, 1]], source.v[[0, 1]])
    assert torch.equal(pools.aux[1], source.aux[1])  # the engine wrote the aux slot before the marker
    # The marker carried the room's counts: both chunks and every byte are counted on the decode.
    assert decode.nbytes == prefill.nbytes and decode.chunks == prefill.chunks == 2
    stats = world.decodes[0].remote_stats
    assert stats.marker_completions == 1
    world.net.deliver_all()
    assert stats.stale_messages == 0  # CHUNK and DONE after the marker are its expected echoes
    assert _state(decode) is KVPoll.Success and decode.nbytes == prefill.nbytes
    assert world.prefill.remote_stats.markers_written == 1


def test_a_forged_or_stale_token_in_the_slot_completes_nothing(world: World) -> None:
    prefill, decode = world.open_pair(2, [2])
    rec = _record(world, decode)
    slot, token = rec.marker  # type: ignore[attr-defined]
    markers = world.decodes[0].decode.markers
    assert markers is not None
    for forged in (token ^ 1, token + 1, 1, (1 << 63) - 1):
        if forged != token:
            markers.write(slot, forged, 0, 1)
            _look(world)
            assert decode.state is KVPoll.WaitingForInput, forged
    # The prefill has sent nothing: even the right token cannot be there yet, and no write is out.
    assert not world.prefill.sim_engine.inflight
    world.prefill.send(prefill, [2], last=True, aux_index=2)
    _write_all_but_deliver_nothing(world)
    _look(world)
    assert decode.state is KVPoll.Success


def test_a_claim_naming_a_slot_the_decode_does_not_have_is_refused_not_written(world: World) -> None:
    markers = world.decodes[0].decode.markers
    assert markers is not None
    markers.take = lambda: markers.slots + 5  # type: ignore[method-assign]  # a decode lying about its slot
    prefill, decode = world.open_pair(3, [3])
    world.settle()
    assert decode.state is KVPoll.Failed and decode.reason is not None
    assert decode.reason.kind is FailureKind.BOOTSTRAP_ERROR
    assert f"commit-marker slot {markers.slots + 5} is out of range" in decode.reason.message
    assert world.prefill.sim_engine.submitted == []
    assert prefill.state is not KVPoll.Success


def test_a_hello_naming_a_malformed_marker_region_is_refused(world: World) -> None:
    original = world.decodes[0].decode._session_fields

    def bad_fields() -> tuple[dict[str, object], bytes | None]:
        fields, blob = original()
        return {**fields, "markers": [fields["markers"][0], 0]}, blob

    world.decodes[0].decode._session_fields = bad_fields  # type: ignore[method-assign]
    decode = world.decode_managers[0].open(4)
    world.decodes[0].bootstrap(decode, "sim://prefill")
    world.settle()
    assert decode.state is KVPoll.Failed and decode.reason is not None
    assert "session.markers must be [ptr, slots]" in decode.reason.message


@pytest.mark.parametrize("marker", [[1], [0, 0], [-1, 5], [0, 1 << 63], ["0", 5], [0, 5, 6], 7, True])
def test_a_room_with_a_malformed_marker_field_is_dropped_by_the_codec(marker: object) -> None:
    fields = {"sid": "s", "key": "k", "room": 1, "gen": 1, "pages": [0], "aux": None, "marker": marker}
    with pytest.raises(codec.MalformedFrame, match="marker"):
        codec.decode(codec.encode("ROOM", fields, check=False))


def test_with_no_source_slot_free_the_room_completes_by_done(world: World) -> None:
    markers = world.prefill.prefill.markers
    assert markers is not None
    taken = [markers.take() for _ in range(markers.slots)]
    assert markers.take() is None and None not in taken
    prefill, decode = world.open_pair(5, [4])
    world.prefill.send(prefill, [4], last=True, aux_index=1)
    _write_all_but_deliver_nothing(world)
    _look(world)
    assert decode.state is KVPoll.WaitingForInput  # no marker was written
    world.settle()
    assert (prefill.state, decode.state) == (KVPoll.Success, KVPoll.Success)
    assert world.prefill.remote_stats.markers_missed == 1
    assert world.decodes[0].remote_stats.marker_completions == 0


def test_slots_are_reused_safely_a_late_marker_of_an_earlier_room_proves_nothing(world: World) -> None:
    markers = world.decodes[0].decode.markers
    assert markers is not None
    prefill, decode = world.open_pair(6, [5])
    slot, old_token = _record(world, decode).marker  # type: ignore[attr-defined]
    world.prefill.send(prefill, [5], last=True, aux_index=1)
    world.settle()
    world.decode_managers[0].close(6)
    world.prefill_manager.close(6)
    world.settle()
    prefill, decode = world.open_pair(7, [6])
    assert _record(world, decode).marker[0] == slot  # type: ignore[attr-defined]  # the freed slot, taken again
    markers.write(slot, old_token, 0, 1)  # the earlier room's marker, landing late
    _look(world)
    assert decode.state is KVPoll.WaitingForInput


def test_markers_from_fields_takes_a_region_or_nothing() -> None:
    assert _markers.markers_from_fields(None) is None
    assert _markers.markers_from_fields([4096, 8]) == (4096, 8)
    for bad in ([0, 8], [4096, 0], [4096], "4096,8", [4096, 1 << 21], [4096.0, 8]):
        with pytest.raises(TypeError, match=r"session\.markers"):
            _markers.markers_from_fields(bad)


# -- markers as the engine's notifications (NIXL's way) ------------------------------------------


@pytest.fixture
def notified() -> Iterator[World]:
    world = World(MARKED, decodes=2, notifying=True)
    world.prefill_pools.k.fill_(3)
    world.prefill_pools.v.fill_(4)
    world.prefill_pools.aux.fill_(7)
    yield world
    for endpoint in world.endpoints:
        endpoint.close()


def _engine(backend: object) -> NotifyingSimEngine:
    engine = backend.engine  # type: ignore[attr-defined]
    assert isinstance(engine, NotifyingSimEngine)
    return engine


def test_a_notified_marker_completes_the_room_and_nothing_is_written_into_the_slot(notified: World) -> None:
    world = notified
    prefill, decode = world.open_pair(11, [0, 1])
    slot, token = _record(world, decode).marker  # type: ignore[attr-defined]
    world.prefill.send(prefill, [0, 1], last=True, aux_index=2)
    _write_all_but_deliver_nothing(world)
    assert prefill.state is KVPoll.Success and decode.state is KVPoll.WaitingForInput
    # One notification, to the decode's engine, carrying the slot's three words; no 24-byte write.
    decode_engine = _engine(world.decodes[0]).engine_id
    assert _engine(world.prefill).notified == [(decode_engine, _markers.notification(token, prefill.nbytes, 1))]
    assert all(length != _markers.MARKER_BYTES for _src, _dst, length in world.prefill.sim_engine.submitted)
    _look(world)
    assert _state(decode) is KVPoll.Success and decode.nbytes == prefill.nbytes
    pools, source = world.decode_pools[0], world.prefill_pools
    assert torch.equal(pools.k[[0, 1]], source.k[[0, 1]]) and torch.equal(pools.aux[3], source.aux[2])
    markers = world.decodes[0].decode.markers
    assert markers is not None and not markers.holds(slot, token)  # the slot itself was never written
    stats = world.decodes[0].remote_stats
    assert (stats.marker_completions, stats.notifications_dropped) == (1, 0)
    world.net.deliver_all()
    assert stats.stale_messages == 0 and _state(decode) is KVPoll.Success


@pytest.mark.parametrize(
    "forgery",
    ["another engine", "another token", "truncated", "wrong prefix", "token zero", "empty"],
)
def test_a_forged_notification_completes_nothing(notified: World, forgery: str) -> None:
    world = notified
    prefill, decode = world.open_pair(12, [2])
    token = _record(world, decode).marker[1]  # type: ignore[attr-defined]
    good = _markers.notification(token, 1 << 20, 1)
    sender, message = _engine(world.prefill).engine_id, good
    if forgery == "another engine":
        sender = _engine(world.decodes[1]).engine_id  # another decode of the same prefill, knowing the token
    elif forgery == "another token":
        message = _markers.notification(token ^ 1, 1 << 20, 1)
    elif forgery == "truncated":
        message = good[:-1]
    elif forgery == "wrong prefix":
        message = b"x" + good[1:]
    elif forgery == "token zero":
        message = _markers.notification(0, 1 << 20, 1)
    else:
        message = b""
    world.net.notes.setdefault(_engine(world.decodes[0]).engine_id, []).append((sender, message))
    _look(world)
    assert decode.state is KVPoll.WaitingForInput
    assert world.decodes[0].remote_stats.notifications_dropped == 1
    # The room still completes on its own marker once its writes landed.
    world.prefill.send(prefill, [2], last=True, aux_index=1)
    _write_all_but_deliver_nothing(world)
    _look(world)
    assert _state(decode) is KVPoll.Success
    assert world.decodes[0].remote_stats.marker_completions == 1


def test_a_failed_write_is_never_followed_by_a_notification(notified: World) -> None:
    world = notified
    prefill, decode = world.open_pair(13, [3, 4])
    world.prefill.send(prefill, [3], last=False)
    world.prefill.send(prefill, [4], last=True, aux_index=1)
    for _ in range(3):
        world.pump()  # a claim submits one slice a turn: both chunks go out
    jobs = list(world.prefill.sim_engine.inflight)
    assert len(jobs) == 2
    jobs[0].fail()
    jobs[1].complete()
    for _ in range(4):
        world.pump()
    assert prefill.state is KVPoll.Failed
    assert _engine(world.prefill).notified == []
    world.settle()
    assert decode.state is KVPoll.Failed
    assert world.decodes[0].remote_stats.marker_completions == 0


def test_a_repeated_or_late_notification_completes_nothing_more(notified: World) -> None:
    world = notified
    prefill, decode = world.open_pair(14, [5])
    world.prefill.send(prefill, [5], last=True, aux_index=1)
    _write_all_but_deliver_nothing(world)
    ((_to, sent),) = _engine(world.prefill).notified
    mine = _engine(world.decodes[0]).engine_id
    world.net.notes.setdefault(mine, []).append((_engine(world.prefill).engine_id, sent))  # a duplicate
    _look(world)
    stats = world.decodes[0].remote_stats
    assert decode.state is KVPoll.Success
    assert (stats.marker_completions, stats.notifications_dropped) == (1, 1)
    world.settle()
    world.decode_managers[0].close(14)
    world.prefill_manager.close(14)
    # The next room of the same decode, and the earlier room's notification once more, late.
    prefill, decode = world.open_pair(15, [6])
    world.net.notes.setdefault(mine, []).append((_engine(world.prefill).engine_id, sent))
    _look(world)
    assert decode.state is KVPoll.WaitingForInput and stats.notifications_dropped == 2


def test_a_decode_that_asks_for_notifications_from_a_prefill_whose_engine_has_none_gets_writes(world: World) -> None:
    """`notify` in a HELLO is a request, not an order: a prefill whose engine cannot notify writes the marker."""
    original = world.decodes[0].decode._session_fields

    def asking(self: object = None) -> tuple[dict[str, object], bytes | None]:
        fields, blob = original()
        return {**fields, "notify": True}, blob

    world.decodes[0].decode._session_fields = asking  # type: ignore[method-assign]
    prefill, decode = world.open_pair(16, [7])
    world.prefill.send(prefill, [7], last=True, aux_index=1)
    _write_all_but_deliver_nothing(world)
    _look(world)
    assert decode.state is KVPoll.Success
    assert world.prefill.remote_stats.markers_written == 1
    assert any(length == _markers.MARKER_BYTES for _src, _dst, length in world.prefill.sim_engine.submitted)


def test_notifications_round_trip_and_refuse_what_is_not_one() -> None:
    note = _markers.notification(5, 1 << 40, 3)
    assert len(note) == _markers.NOTE_BYTES
    assert _markers.parse_notification(note) == (5, 1 << 40, 3)
    for bad in (note[:-1], note + b"\0", b"", note.replace(b"kvfsm", b"KVFSM"), _markers.notification(0, 0, 0)):
        assert _markers.parse_notification(bad) is None
