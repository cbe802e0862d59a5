"""The wire under attack and under bad luck, over real engines in two processes on 127.0.0.1.

One test per defect of issue 11 that involves the engine or the control
port of a real process. Each was reproduced on the code before the wire
protocol was declared (tokens, trusted `addr`/`from` fields, no bounds):
defect 1 ended in a decode Success holding another request's KV, 2 in
pages released under a write, 3 in Success after a failed write, 4 and 8
in rooms failed by a forged frame, 5 in a prefill that could no longer open
sockets, 6 and 7 in every room lost to starved heartbeats.

`hold_writes` / `fail_next_write` (tests/integration/remote_peer.py) let a
test decide when the real engine's writes are reported done or failed; the
bytes themselves still move through Mooncake or NIXL. Skipped, with the
import error, where an engine cannot be imported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from kvfsm.backends import wire
from kvfsm.backends.remote import RemoteConfig

from .remote_peer import PeerProcess
from .test_engines import ENGINES, WAIT, Pair, _rooms, _skip_if_missing

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
pytest.importorskip("torch", reason="torch is needed for the KV pools")

from kvfsm.backends import control


# Each engine once more with completion on the data plane (commit markers: written into the
# decode's slot over Mooncake, sent as NIXL's notification over NIXL): every attack below also
# runs against that path.
@pytest.fixture(params=[*ENGINES, "mooncake+markers", "nixl+markers"])
def fresh(request: pytest.FixtureRequest) -> Iterator[Pair]:
    engine, _, markers = str(request.param).partition("+")
    _skip_if_missing(engine)
    pair = Pair(engine, markers=bool(markers))
    yield pair
    pair.stop()


def _success(pair: Pair, room: int, src: list[int], dst: list[int]) -> None:
    pair.connect(room, dst, aux=1)
    pair.prefill.send(room, src, True, 2)
    decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
    prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
    assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
    pair.close(room)


def test_a_late_claim_never_binds_to_a_reused_room_id(fresh: Pair) -> None:
    """Defect 1: A's prefill room ends unclaimed, the id is reused for B, then A's decode claims it."""
    room = next(_rooms)
    prefill, late_decode = fresh.prefill, fresh.decode
    other_decode = PeerProcess(fresh.engine, "receiver", markers=fresh.markers)
    try:
        prefill.open(room)  # request A
        prefill.bootstrap(room, prefill.address)
        prefill.abort(room)
        prefill.close(room)
        prefill.open(room)  # request B, same room id
        prefill.bootstrap(room, prefill.address)
        prefill.write_pages([0, 1], 42.0)  # B's KV
        late_decode.open(room)  # A's decode, late
        late_decode.bootstrap(room, prefill.address)
        assert late_decode.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"
        late_decode.expect(room, [5, 6], None)
        other_decode.open(room)  # B's decode
        other_decode.bootstrap(room, prefill.address)
        assert other_decode.wait(room, ["WaitingForInput", "Failed"], WAIT)["state"] in ("WaitingForInput", "Failed")
        if other_decode.info(room)["state"] == "WaitingForInput":
            other_decode.expect(room, [5, 6], None)
        if prefill.wait(room, ["WaitingForInput", "Failed"], 2.0)["state"] == "WaitingForInput":
            prefill.send(room, [0, 1], True, None)
        late = late_decode.wait(room, ["Success", "Failed"], WAIT)
        other = other_decode.wait(room, ["Success", "Failed"], WAIT)
        assert late["state"] == "Failed", f"A's decode must never complete with B's KV: {late}"
        assert other["state"] == "Failed", other
        assert "reused within pending_ttl" in (prefill.info(room)["message"] or ""), prefill.info(room)
        assert late_decode.wait_safe(room, WAIT)["release_safe"]
    finally:
        other_decode.stop()


def test_a_closed_prefill_room_keeps_its_writes_accounted(fresh: Pair) -> None:
    """Defect 2: the prefill closes a room with a write in flight; the decode's ABORT waits for it."""
    room = next(_rooms)
    fresh.connect(room, [0, 1, 2, 3], aux=None)
    fresh.prefill.hold_writes()
    submitted = fresh.prefill.stats()["jobs_submitted"]
    fresh.prefill.send(room, [4, 5, 6, 7], False, None)
    deadline = time.monotonic() + WAIT
    while fresh.prefill.stats()["jobs_submitted"] == submitted:  # the write is out, then the room closes
        assert time.monotonic() < deadline, "the write was never submitted"
        time.sleep(0.01)
    fresh.prefill.abort(room)
    fresh.prefill.close(room)
    decode = fresh.decode.abort(room)
    assert decode["state"] == "Failed"
    time.sleep(0.5)
    assert not fresh.decode.info(room)["release_safe"], "released while the prefill still had a write in flight"
    fresh.prefill.release_writes()
    decode = fresh.decode.wait_safe(room, WAIT)
    assert decode["release_safe"] and decode["waited"] < 4.0, "released by the ABORT_ACK, not the 5 s drain deadline"
    fresh.decode.close(room)


def test_a_failed_write_never_ends_in_success(fresh: Pair) -> None:
    """Defect 3: a write fails while another thread is busy delivering notices; the next chunk lands."""
    room = next(_rooms)
    fresh.prefill.slow_observers(0.05)
    fresh.connect(room, [0, 1, 2, 3], aux=1)
    fresh.prefill.fail_next_write()
    fresh.prefill.send(room, [0, 1], False, None)
    fresh.prefill.send(room, [2, 3], True, 3)
    decode = fresh.decode.wait(room, ["Success", "Failed"], WAIT)
    prefill = fresh.prefill.wait(room, ["Success", "Failed"], WAIT)
    assert prefill["state"] == "Failed" and prefill["kind"] == "transfer_error", prefill
    assert decode["state"] == "Failed", f"the decode must not succeed with a chunk that never landed: {decode}"
    assert fresh.decode.wait_safe(room, WAIT)["release_safe"]
    fresh.close(room)


def test_forged_frames_never_fail_a_room(fresh: Pair) -> None:
    """Defects 4 and 8: frames that claim a peer's address or an id, or name a room without a session."""
    room = next(_rooms)
    fresh.connect(room, [0, 1], aux=None)
    gen = fresh.decode.decode_generation(room)
    before = (fresh.prefill.stats(), fresh.decode.stats())
    abort = {"room": room, "gen": gen, "pgen": None, "kind": "aborted", "message": "forged"}
    forged = {
        fresh.prefill.address: [
            ("HEARTBEAT", {}),
            ("BYE", {}),
            ("ABORT", abort),
            ("ROOM", {"room": room, "gen": gen, "pages": [9], "aux": None, "marker": None}),
        ],
        fresh.decode.address: [
            ("HEARTBEAT", {}),
            ("BYE", {}),
            ("ABORT", abort),
            ("ABORT_ACK", {"room": room, "gen": gen, "pgen": None}),
            ("DONE", {"room": room, "gen": gen, "pgen": 1, "nbytes": 1}),
        ],
    }
    for target, frames in forged.items():
        for kind, fields in frames:
            fresh.decode.send_message(target, kind, fields)
    # A HELLO naming the decode's own address: a second session at most, never the end of the first.
    fresh.decode.forge_hellos(fresh.prefill.address, 1)
    time.sleep(1.0)  # more than three heartbeat windows (0.3 s)
    assert fresh.decode.info(room)["state"] == "WaitingForInput"
    assert fresh.prefill.info(room)["state"] == "WaitingForInput"
    fresh.prefill.send(room, [2, 3], True, None)
    assert fresh.decode.wait(room, ["Success", "Failed"], WAIT)["state"] == "Success"
    after = (fresh.prefill.stats(), fresh.decode.stats())
    unauthenticated = sum(
        a["control"]["unauthenticated"] - b["control"]["unauthenticated"] for a, b in zip(after, before, strict=True)
    )
    assert unauthenticated == sum(len(frames) for frames in forged.values())
    assert all(a["peers_lost"] == b["peers_lost"] for a, b in zip(after, before, strict=True))
    fresh.close(room)


def test_reply_addresses_cannot_exhaust_the_prefills_sockets(fresh: Pair) -> None:
    """Defect 5: 1,100 HELLOs naming distinct reply addresses; a real decode still bootstraps.

    Each keeps a half-open session (and its socket) at most, `max_half_open` in all, plus
    the few closed ones kept open a moment for the BYE that tells an evicted decode.
    """
    before = fresh.prefill.stats()
    fresh.decode.forge_hellos(fresh.prefill.address, 1100)
    deadline = time.monotonic() + WAIT
    evicted = before["control"]["sessions_evicted"] + 1100 - RemoteConfig().max_half_open
    while (after := fresh.prefill.stats())["control"]["sessions_evicted"] < evicted:
        assert time.monotonic() < deadline, f"the HELLOs were not all handled: {after}"
        time.sleep(0.05)
    # Half-open sessions, and the channels kept open a moment for the BYE that tells an evicted decode.
    held = RemoteConfig().max_half_open + control._LINGERING
    assert after["channels"] <= before["channels"] + held, (before, after)
    assert after["fds"] <= before["fds"] + 3 * held + 8, (before, after)
    newcomer = PeerProcess(fresh.engine, "receiver", markers=fresh.markers)
    try:
        room = next(_rooms)
        fresh.prefill.open(room)
        fresh.prefill.bootstrap(room, fresh.prefill.address)
        newcomer.open(room)
        newcomer.bootstrap(room, fresh.prefill.address)
        assert newcomer.wait(room, ["WaitingForInput", "Failed"], WAIT)["state"] == "WaitingForInput"
        newcomer.close(room)
        fresh.prefill.close(room)
    finally:
        newcomer.stop()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "payload",
    [b'{"type": "HEARTBEAT", "sid": ' + b"9" * 5000 + b"}", b"[" * 50_000 + b"]" * 50_000],
    ids=["a 5,000-digit integer", "nesting 50,000 deep"],
)
def test_frames_json_cannot_read_never_starve_heartbeats(engine: str, payload: bytes) -> None:
    """Defect 6: a flood of frames that make `json.loads` raise, three times longer than the heartbeat window."""
    _skip_if_missing(engine)
    fresh = Pair(engine, heartbeat=0.2, misses=5)  # a 1 s window: the flood, not the box's load, is tested
    try:
        _flood_with(fresh, payload)
    finally:
        fresh.stop()


def _flood_with(fresh: Pair, payload: bytes) -> None:
    room = next(_rooms)
    fresh.connect(room, [0, 1], aux=None)
    before = fresh.prefill.stats()
    for _ in range(15):  # about three seconds of flood
        fresh.decode.send_raw(fresh.prefill.address, [wire.MAGIC, payload], 100)
        fresh.prefill.send_raw(fresh.decode.address, [wire.MAGIC, payload], 100)
        time.sleep(0.2)
    time.sleep(0.5)
    after = fresh.prefill.stats()
    assert after["peers_lost"] == before["peers_lost"], "a flood of unreadable frames starved the heartbeats"
    assert after["control"]["malformed"] - before["control"]["malformed"] == 1500
    assert after["control"]["handler_errors"] == before["control"]["handler_errors"]
    fresh.prefill.send(room, [2, 3], True, None)
    assert fresh.decode.wait(room, ["Success", "Failed"], WAIT)["state"] == "Success"
    fresh.close(room)


def test_huge_frames_are_refused_before_they_are_read(fresh: Pair) -> None:
    """Defect 7: five valid 48 MiB frames; memory stays flat and no room is lost."""
    rooms = [next(_rooms) for _ in range(5)]
    for room in rooms:
        fresh.connect(room, [room % 8], aux=None)
    before = fresh.prefill.stats()
    gen = fresh.decode.decode_generation(rooms[0])
    header = {
        "type": "ROOM",
        "sid": "0" * 16,
        "key": "f" * 32,
        "room": rooms[0],
        "gen": gen,
        "aux": None,
        "marker": None,
    }
    pages = json.dumps([1] * (24 << 20)).encode()  # 48 MiB of "1, "
    frame = json.dumps(header).encode()[:-1] + b', "pages": ' + pages + b"}"
    fresh.decode.send_raw(fresh.prefill.address, [wire.MAGIC, frame], 5)
    time.sleep(1.5)
    after = fresh.prefill.stats()
    assert after["rss_mb"] - before["rss_mb"] < 100, (before["rss_mb"], after["rss_mb"])
    assert after["peers_lost"] == before["peers_lost"]
    for room in rooms:
        assert fresh.decode.info(room)["state"] == "WaitingForInput"
        fresh.prefill.send(room, [room % 8 + 8], True, None)
        assert fresh.decode.wait(room, ["Success", "Failed"], WAIT)["state"] == "Success"
        fresh.close(room)


def test_a_reason_too_long_for_the_wire_still_reaches_the_peer(fresh: Pair) -> None:
    """Defect 9: a 10,000-character abort reason once made encoding raise inside the stop path."""
    room = next(_rooms)
    fresh.connect(room, [0, 1, 2, 3], aux=None)
    fresh.prefill.send(room, [0, 1], False, None)
    assert fresh.decode.wait(room, ["Transferring"], WAIT)["state"] == "Transferring"
    fresh.decode.abort(room, "x" * 10_000)
    prefill = fresh.prefill.wait(room, ["Failed"], WAIT)
    assert prefill["state"] == "Failed" and prefill["from_peer"], prefill
    assert "more characters cut" in prefill["message"]
    assert fresh.decode.wait_safe(room, WAIT)["release_safe"], "the prefill drained and acknowledged"
    fresh.close(room)
