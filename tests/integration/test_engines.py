"""Two processes on 127.0.0.1 per engine: a prefill and a decode endpoint.

Each engine gets one long-lived pair of processes (module scope) for the
happy paths, aborts and malformed traffic, and one fresh pair that the
kill test destroys. Every wait is bounded; every process is stopped.
Skipped, with the import error, where an engine cannot be imported.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from kvfsm.backends import wire

from .remote_peer import PeerProcess, engine_missing, free_port

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
pytest.importorskip("torch", reason="torch is needed for the KV pools")

ENGINES = ["mooncake", "nixl"]
WAIT = 10.0
_rooms = itertools.count(1000)


class Pair:
    def __init__(self, engine: str, heartbeat: float = 0.1, misses: int = 3, markers: bool = False) -> None:
        self.engine = engine
        self.markers = markers
        self.prefill = PeerProcess(engine, "sender", heartbeat=heartbeat, misses=misses, markers=markers)
        self.decode = PeerProcess(engine, "receiver", heartbeat=heartbeat, misses=misses, markers=markers)
        try:
            # Both children start in parallel; these wait until each is ready.
            assert self.prefill.address
            assert self.decode.address
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()

    def connect(self, room: int, dst: list[int], aux: int | None = 1) -> None:
        """Open the room on both sides and run the handshake up to WaitingForInput on both."""
        self.prefill.open(room)
        self.decode.open(room)
        self.prefill.bootstrap(room, self.prefill.address)
        self.decode.bootstrap(room, self.prefill.address)
        assert self.decode.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"
        self.decode.expect(room, dst, aux)
        assert self.prefill.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"

    def close(self, room: int) -> None:
        self.prefill.close(room)
        self.decode.close(room)


_missing: dict[str, str | None] = {}


def _skip_if_missing(engine: str) -> None:
    if engine not in _missing:
        _missing[engine] = engine_missing(engine)
    if _missing[engine]:
        pytest.skip(str(_missing[engine]))


@pytest.fixture(scope="module", params=ENGINES)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    _skip_if_missing(request.param)
    pair = Pair(request.param)
    try:
        yield pair
    finally:
        pair.stop()


def _assert_landed(pair: Pair, src: list[int], dst: list[int], src_aux: int | None, dst_aux: int | None) -> None:
    sent = pair.prefill.read(src, src_aux)
    got = pair.decode.read(dst, dst_aux)
    assert got[0] == sent[0], "K pages differ"
    assert got[1] == sent[1], "V pages differ"
    assert got[2] == sent[2], "aux slot differs"


def test_happy_path_is_byte_exact(pair: Pair) -> None:
    room = next(_rooms)
    src, dst = [0, 1, 2, 3], [8, 9, 10, 11]
    pair.connect(room, dst, aux=2)
    pair.prefill.send(room, src, True, 5)
    decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
    prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
    assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
    assert decode["nbytes"] == prefill["nbytes"] == len(src) * 2 * 2 * 4096
    assert decode["release_safe"]
    assert prefill["release_safe"]
    _assert_landed(pair, src, dst, 5, 2)
    pair.close(room)


def test_chunked_transfer_with_scattered_pages(pair: Pair) -> None:
    room = next(_rooms)
    src = [4, 5, 6, 20, 21, 7, 30]
    dst = [0, 1, 2, 3, 12, 13, 31]
    pair.connect(room, dst, aux=3)
    pair.prefill.send(room, src[:3], False, None)
    pair.prefill.send(room, src[3:5], False, None)
    pair.prefill.send(room, src[5:], True, 0)
    decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
    prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
    assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
    assert decode["chunks"] == prefill["chunks"] == 3
    assert decode["nbytes"] == prefill["nbytes"]
    _assert_landed(pair, src, dst, 0, 3)
    pair.close(room)


@pytest.mark.parametrize("engine", ENGINES)
def test_rooms_complete_on_their_commit_markers(engine: str) -> None:
    """Completion on the data plane, real engine: each room's marker comes after its writes, every byte is there.

    Over Mooncake the marker is written into the decode's slot; over NIXL it
    is sent as NIXL's notification. With DONE held back by nothing, the
    marker and DONE race; the decode counts which one completed each room.
    At least one room must have completed on its marker (on this machine
    nearly all do), every room, however it completed, holds exactly what
    was sent, and no notification is dropped (each carried its room's token).
    """
    _skip_if_missing(engine)
    pair = Pair(engine, markers=True)
    try:
        for index in range(12):
            room = next(_rooms)
            src, dst = [index, 16 + index], [2 * index, 2 * index + 1]
            pair.connect(room, dst, aux=index % 4)
            pair.prefill.send(room, src[:1], False, None)
            pair.prefill.send(room, src[1:], True, (index + 1) % 4)
            decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
            prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
            assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
            assert decode["chunks"] == prefill["chunks"] == 2 and decode["nbytes"] == prefill["nbytes"]
            _assert_landed(pair, src, dst, (index + 1) % 4, index % 4)
            pair.close(room)
        decode_stats, prefill_stats = pair.decode.stats(), pair.prefill.stats()
        assert decode_stats["marker_completions"] >= 1, decode_stats
        assert prefill_stats["markers_written"] >= decode_stats["marker_completions"], prefill_stats
        # A DONE that follows its marker is dropped quietly while the room is open; one that arrives after
        # close() finds no record and is stale, as any late frame. Nothing else may be stale here.
        assert decode_stats["stale_messages"] <= decode_stats["marker_completions"], decode_stats
        assert decode_stats["notifications_dropped"] == 0, decode_stats
    finally:
        pair.stop()


@pytest.mark.parametrize("state", ["Bootstrapping", "WaitingForInput", "Transferring"])
def test_decode_abort(pair: Pair, state: str) -> None:
    room = next(_rooms)
    if state == "Bootstrapping":
        # A prefill that has not answered the handshake yet (nothing listens there).
        silent = f"tcp://127.0.0.1:{free_port()}"
        pair.decode.open(room)
        assert pair.decode.bootstrap(room, silent) == "Bootstrapping"
        now = pair.decode.abort(room)
        # The prefill never learnt where to write: the pages are safe at once.
        assert now == {"state": "Failed", "release_safe": True, "acked": False}
        pair.decode.close(room)
        return
    pair.connect(room, [0, 1, 2, 3], aux=None)
    if state == "Transferring":
        pair.prefill.send(room, [0, 1], False, None)
        assert pair.decode.wait(room, ["Transferring"], WAIT)["state"] == "Transferring"
    now = pair.decode.abort(room)
    assert now["state"] == "Failed"
    assert now["acked"] or not now["release_safe"], "pages must wait for the prefill's ABORT_ACK"
    prefill = pair.prefill.wait(room, ["Failed"], WAIT)
    assert prefill["state"] == "Failed"
    assert (prefill["kind"], prefill["from_peer"]) == ("aborted", True)
    decode = pair.decode.wait_safe(room, WAIT)
    assert decode["release_safe"], "the ABORT_ACK should have opened the release gate"
    assert decode["waited"] < 5.0, "released by the ACK, not by the 5 s drain deadline"
    # A late chunk from the prefill's scheduler changes nothing on either side.
    pair.prefill.send(room, [2, 3], True, None)
    assert pair.decode.info(room)["state"] == "Failed"
    pair.close(room)


@pytest.mark.parametrize("state", ["Bootstrapping", "WaitingForInput", "Transferring"])
def test_prefill_abort(pair: Pair, state: str) -> None:
    room = next(_rooms)
    if state == "Bootstrapping":
        pair.prefill.open(room)
        pair.prefill.bootstrap(room, pair.prefill.address)
        now = pair.prefill.abort(room)
        assert now["state"] == "Failed"
        pair.decode.open(room)
        pair.decode.bootstrap(room, pair.prefill.address)
        assert pair.decode.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"
        pair.decode.expect(room, [0, 1], None)
        # The decode's pages reach a prefill that gave up: it answers ABORT, nothing hangs.
        decode = pair.decode.wait(room, ["Failed"], WAIT)
        assert (decode["kind"], decode["from_peer"]) == ("aborted", True)
        assert pair.decode.wait_safe(room, WAIT)["release_safe"]
        pair.close(room)
        return
    pair.connect(room, [4, 5, 6, 7], aux=None)
    if state == "Transferring":
        pair.prefill.send(room, [0, 1], False, None)
        assert pair.decode.wait(room, ["Transferring"], WAIT)["state"] == "Transferring"
    assert pair.prefill.abort(room)["state"] == "Failed"
    decode = pair.decode.wait(room, ["Failed"], WAIT)
    assert decode["state"] == "Failed"
    assert (decode["kind"], decode["from_peer"]) == ("aborted", True)
    assert pair.decode.wait_safe(room, WAIT)["release_safe"]
    assert pair.prefill.info(room)["release_safe"]
    pair.close(room)


def test_malformed_control_messages_are_dropped(pair: Pair) -> None:
    live = next(_rooms)
    pair.connect(live, [20, 21], aux=None)
    gen = pair.decode.decode_generation(live)
    before_prefill, before_decode = pair.prefill.stats(), pair.decode.stats()
    forged_auth = b"0000000000000000 ffffffffffffffffffffffffffffffff"
    bad = [
        [b"HELLO"],  # one frame
        [b"NOT-KVFSM", b"HEARTBEAT", b"{}"],  # wrong magic
        [b"KVFSM/9", b"HEARTBEAT", b"{}"],  # a future version
        [wire.MAGIC, b"HEARTBEAT"],  # no header frame
        [wire.MAGIC, b"FROB " + forged_auth, b"{}"],  # unknown type
        [wire.MAGIC, b"ABORT", b"{}"],  # no session in the envelope
        [wire.MAGIC, b"ABORT \xff\xfe", b"{}"],  # not ASCII
        [wire.MAGIC, b"HEARTBEAT " + forged_auth, b"{}", b"blob", b"extra"],  # five frames
    ]
    # Headers only a prefill parses without a session (a decode drops every HELLO as not from a peer).
    bad_hellos = [
        [wire.MAGIC, b"HELLO", b"\xff\xfe not json"],
        [wire.MAGIC, b"HELLO", b"[1, 2]"],  # not an object
        [wire.MAGIC, b"HELLO", json.dumps({"addr": "x"}).encode()],  # fields missing
    ]
    for frames in bad:
        pair.decode.send_raw(pair.prefill.address, frames)
        pair.prefill.send_raw(pair.decode.address, frames)
    for frames in bad_hellos:
        pair.decode.send_raw(pair.prefill.address, frames)
    # Well-formed, naming the live room and its generation, from no session of the receiver's.
    forged = {"room": live, "gen": gen, "pgen": None, "kind": "aborted", "message": "forged"}
    pair.decode.send_message(pair.prefill.address, "ABORT", forged)
    pair.prefill.send_message(pair.decode.address, "ABORT", forged)
    pair.prefill.send_message(pair.decode.address, "DONE", {"room": live, "gen": gen, "pgen": 1, "nbytes": 1})
    # The pair still works, and the live room was not changed by any of it.
    pair.prefill.send(live, [0, 1], True, None)
    decode = pair.decode.wait(live, ["Success", "Failed"], WAIT)
    prefill = pair.prefill.wait(live, ["Success", "Failed"], WAIT)
    assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
    after_prefill, after_decode = pair.prefill.stats(), pair.decode.stats()
    sides = ((before_prefill, after_prefill, 1, len(bad_hellos)), (before_decode, after_decode, 2, 0))
    for before, after, forged_count, hellos in sides:
        assert after["dropped"] - before["dropped"] == len(bad) + hellos + forged_count
        assert after["control"]["bad_version"] - before["control"]["bad_version"] == 1
        assert after["control"]["unknown_type"] - before["control"]["unknown_type"] == 1
        assert after["control"]["unauthenticated"] - before["control"]["unauthenticated"] == forged_count
        assert after["control"]["handler_errors"] == before["control"]["handler_errors"]
        assert after["control_running"]
    pair.close(live)


@pytest.mark.parametrize("engine", ENGINES)
def test_killed_prefill_fails_decode_rooms_with_peer_lost(engine: str) -> None:
    _skip_if_missing(engine)
    heartbeat, misses = 0.1, 3
    pair = Pair(engine, heartbeat=heartbeat)
    try:
        waiting, moving = next(_rooms), next(_rooms)
        pair.connect(waiting, [0, 1], aux=None)
        pair.connect(moving, [2, 3, 4, 5], aux=None)
        pair.prefill.send(moving, [8, 9], False, None)
        assert pair.decode.wait(moving, ["Transferring"], WAIT)["state"] == "Transferring"
        pair.prefill.kill()
        window = heartbeat * misses
        for room in (waiting, moving):
            decode = pair.decode.wait(room, ["Failed"], WAIT)
            assert decode["state"] == "Failed"
            assert decode["kind"] == "peer_lost", decode
            # Bounded: the window plus the heartbeat tick and scheduling slack on a busy CI box.
            assert decode["waited"] < window + 2.0, decode
            # A peer we cannot hear may still write: the drain deadline (5 s here) decides.
            assert not decode["release_safe"]
    finally:
        pair.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_first_room_with_no_pages_and_no_aux_completes(engine: str) -> None:
    """Nothing to write at all, on a pair that never moved a byte: both sides still reach Success.

    With NIXL such a room once completed only on the prefill: its completion
    was a standalone notification, which stays queued until the agent is
    progressed again, and on a fresh pair nothing ever did.
    """
    _skip_if_missing(engine)
    pair = Pair(engine)
    try:
        room = next(_rooms)
        pair.connect(room, [], aux=None)
        pair.prefill.send(room, [], True, None)
        decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
        prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
        assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
        assert decode["nbytes"] == prefill["nbytes"] == 0
        pair.close(room)
        # An empty middle chunk is announced too: both sides count the same chunks.
        room = next(_rooms)
        pair.connect(room, [0, 1], aux=None)
        pair.prefill.send(room, [], False, None)
        pair.prefill.send(room, [2, 3], True, None)
        decode = pair.decode.wait(room, ["Success", "Failed"], WAIT)
        prefill = pair.prefill.wait(room, ["Success", "Failed"], WAIT)
        assert (prefill["state"], decode["state"]) == ("Success", "Success"), (prefill, decode)
        assert decode["chunks"] == prefill["chunks"] == 2
        assert decode["nbytes"] == prefill["nbytes"] > 0
        pair.close(room)
    finally:
        pair.stop()
