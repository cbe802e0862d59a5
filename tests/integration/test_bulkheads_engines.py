"""Bulkheads over the real engines, each endpoint its own process on 127.0.0.1 (issue 22, items 1 and 8).

* A decode SIGSTOPped after claiming its rooms, before the prefill's first
  write to it, is what a hung host looks like. On 7ddfcf8 the prefill's one
  writer sat in Mooncake's first write to it (a synchronous handshake, under
  a mutex every submit of the process takes), and another decode's 8 rooms
  waited until the stopped one resumed: 5.8 s, and forever on SGLang.
  Here they must all succeed while it is still stopped.
* 16 valid-JSON frames of about 6 MiB, naming no session, from 8 connections:
  on 7ddfcf8 each was parsed before any check (0.45 s each) and a healthy
  decode's 20 rooms went PEER_LOST. Here the envelope is read first and none
  of them costs more than a lookup.

Every wait is bounded; every process is stopped (a stopped one is resumed
first). Skipped, with the import error, where an engine cannot be imported.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .remote_peer import PeerProcess
from .test_engines import ENGINES, WAIT, _rooms, _skip_if_missing

zmq = pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
pytest.importorskip("torch", reason="torch is needed for the KV pools")


def _connect(prefill: PeerProcess, decode: PeerProcess, room: int, dst: list[int]) -> None:
    prefill.open(room)
    decode.open(room)
    prefill.bootstrap(room, prefill.address)
    decode.bootstrap(room, prefill.address)
    assert decode.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"
    decode.expect(room, dst, None)
    assert prefill.wait(room, ["WaitingForInput"], WAIT)["state"] == "WaitingForInput"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stopped_decode_holds_up_no_other_decodes_writes(engine: str) -> None:
    _skip_if_missing(engine)
    prefill = PeerProcess(engine, "sender", drain=60.0)
    stopped = PeerProcess(engine, "receiver", drain=60.0)
    healthy = PeerProcess(engine, "receiver", drain=60.0)
    resumed = False
    try:
        for peer in (prefill, stopped, healthy):
            assert peer.address
        theirs = [next(_rooms) for _ in range(4)]
        ours = [next(_rooms) for _ in range(8)]
        for index, room in enumerate(theirs):
            _connect(prefill, stopped, room, [index])
        for index, room in enumerate(ours):
            _connect(prefill, healthy, room, [index])
        pid = stopped.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        for index, room in enumerate(theirs):
            prefill.send(room, [index], True, None)
        for index, room in enumerate(ours):
            prefill.send(room, [index + 8], True, None)
        for room in ours:
            decode = healthy.wait(room, ["Success", "Failed"], WAIT)
            assert decode["state"] == "Success", decode
        assert stopped.process.is_alive(), "the stopped decode must still be stopped: the rooms above did not wait"
        for room in theirs:
            # Lost after the window (0.3 s); the writes into it are still accounted for, never released early.
            lost = prefill.wait(room, ["Failed"], WAIT)
            assert (lost["state"], lost["kind"]) == ("Failed", "peer_lost"), lost
        os.kill(pid, signal.SIGCONT)
        resumed = True
        # The healthy decode's session goes on: one more room after all this.
        room = next(_rooms)
        _connect(prefill, healthy, room, [20])
        prefill.send(room, [20], True, None)
        assert healthy.wait(room, ["Success", "Failed"], WAIT)["state"] == "Success"
    finally:
        if not resumed and stopped.process.pid is not None:
            os.kill(stopped.process.pid, signal.SIGCONT)
        for peer in (healthy, stopped, prefill):
            peer.stop()


def test_large_frames_from_no_session_never_take_a_live_session_down() -> None:
    """16 frames of about 6 MiB of valid JSON, naming no session, from 8 connections: no room is lost."""
    from kvfsm.backends import codec, wire

    engine = "mooncake"
    _skip_if_missing(engine)
    prefill = PeerProcess(engine, "sender")
    decode = PeerProcess(engine, "receiver")
    context = zmq.Context()
    sockets = []
    try:
        rooms = [next(_rooms) for _ in range(20)]
        for index, room in enumerate(rooms):
            _connect(prefill, decode, room, [index])
        before = prefill.stats()
        pages = list(range(10**6, 10**6 + 720_000))  # 8 digits and a comma each: about 5.8 MiB of JSON
        fields = {
            "sid": "0" * 16,
            "key": "f" * 32,
            "room": rooms[0],
            "gen": 1,
            "pages": pages,
            "aux": None,
            "marker": None,
        }
        frames = codec.encode("ROOM", fields, check=False)
        assert 5 << 20 < len(frames[-1]) <= wire.MAX_HEADER_BYTES
        for _ in range(8):
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(prefill.address)
            sockets.append(sock)
        for copy in range(16):
            sockets[copy % 8].send_multipart(frames)
        deadline = time.monotonic() + WAIT
        while prefill.stats()["control"]["received"] < before["control"]["received"] + 16:
            assert time.monotonic() < deadline, "the frames did not all arrive"
            time.sleep(0.05)
        time.sleep(1.0)  # more than three windows (0.3 s) after the last one arrived
        after = prefill.stats()
        assert after["peers_lost"] == before["peers_lost"], "frames from no session took a live session down"
        assert after["control"]["unauthenticated"] - before["control"]["unauthenticated"] == 16
        for index, room in enumerate(rooms):
            prefill.send(room, [index], True, None)
        for room in rooms:
            assert decode.wait(room, ["Success", "Failed"], WAIT)["state"] == "Success"
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
        decode.stop()
        prefill.stop()
