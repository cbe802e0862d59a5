"""A room whose peer vanished mid-write is quarantined, not released, and released when proof arrives (issue 24).

On the starting code (7ddfcf8) each of these failed the same way: the drain
deadline made the room release-safe with no proof that the peer's write had
stopped, so the server could give the pages to another request while the
write still landed (SGLang #38961, vLLM #52234). Here the pages stay
quarantined (not release-safe, counted in rooms and bytes) until a proof
comes: the backend's drain, or a fence.
"""

from __future__ import annotations

import itertools

import pytest

import kvfsm
from kvfsm import KVPoll, PagesState
from kvfsm.backends.local import Faults
from kvfsm.metrics import TransferMetrics
from tests.helpers import FakeClock

from .pairs import local_pair, wait_until

_rooms = itertools.count(5000)


def test_local_backend_a_peer_still_writing_after_the_drain_deadline_is_quarantined() -> None:
    clock = FakeClock()
    timeouts = kvfsm.Timeouts(bootstrap=5.0, waiting=5.0, transferring=5.0, drain=30.0)
    # The sender's worker keeps writing queued chunks after the abort (a peer that is slow to stop).
    faults = Faults(delay_s=0.05, linger_chunks=2, linger_s=0.4)
    with local_pair(faults=faults, timeouts=timeouts, clock=clock) as pair:
        metrics = TransferMetrics()
        metrics.attach(pair.receiver)
        send, recv = pair.open(12)
        pair.rb.expect(recv, [20, 21, 22, 23, 24, 25])
        for chunk, last in (([0, 1], False), ([2, 3], False), ([4, 5], True)):
            pair.sb.send(send, chunk, last=last)
        wait_until(lambda: recv.chunks >= 1, "the first chunk")
        recv.abort("client went away")
        clock.advance(31.0)  # past the drain deadline while the peer's write is still in flight
        assert pair.sb.in_flight(send) > 0 or pair.rb.writes_landed(recv) < 3
        assert not recv.release_safe, "released on the timer while the peer may still write"
        assert recv.pages_state is PagesState.QUARANTINED
        stats = pair.receiver.stats
        assert stats.quarantined == 1 and stats.quarantined_bytes == 6 * pair.rb.pools.page_nbytes  # type: ignore[union-attr]
        assert metrics.snapshot()["receiver"]["quarantined_rooms"] == 1
        # The proof comes when the lingering chunks are done: the backend drains, the pages are released.
        wait_until(lambda: recv.release_safe, "the backend's drain")
        assert pair.sb.in_flight(send) == 0
        assert (stats.quarantined, stats.quarantined_bytes, stats.released_after_quarantine) == (0, 0, 1)
        figures = metrics.snapshot()["receiver"]
        assert figures["quarantined_rooms"] == 0 and figures["quarantine_releases"] == {"proof": 1, "override": 0}


def test_local_backend_opt_in_timer_release_frees_at_the_deadline() -> None:
    clock = FakeClock()
    timeouts = kvfsm.Timeouts(bootstrap=5.0, waiting=5.0, transferring=5.0, drain=30.0)
    faults = Faults(delay_s=0.05, linger_chunks=2, linger_s=0.4)
    with local_pair(faults=faults, timeouts=timeouts, clock=clock) as pair:
        opt_in = kvfsm.TransferManager("receiver", timeouts=timeouts, clock=clock, on_drain_deadline="release")
        handle = opt_in.open(1)
        handle.abort("client went away")
        clock.advance(31.0)
        assert handle.release_safe and opt_in.stats.drain_deadline_releases == 1
        del pair


# -- Mooncake and NIXL: two processes, the prefill killed mid-write ------------------------------


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_remote_engines_a_prefill_killed_mid_write_leaves_the_decode_room_quarantined(engine: str) -> None:
    pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")
    from .remote_peer import PeerProcess, engine_missing

    missing = engine_missing(engine)
    if missing:
        pytest.skip(missing)
    prefill = PeerProcess(engine, "sender", heartbeat=0.1, misses=3, drain=1.0)
    decode = PeerProcess(engine, "receiver", heartbeat=0.1, misses=3, drain=1.0)
    try:
        room = next(_rooms)
        prefill.open(room)
        decode.open(room)
        prefill.bootstrap(room, prefill.address)
        decode.bootstrap(room, prefill.address)
        assert decode.wait(room, ["WaitingForInput"], 10.0)["state"] == "WaitingForInput"
        decode.expect(room, [2, 3, 4, 5], None)
        assert prefill.wait(room, ["WaitingForInput"], 10.0)["state"] == "WaitingForInput"
        prefill.hold_writes()  # the prefill's engine reports its write still in flight
        prefill.send(room, [8, 9], False, None)
        assert prefill.wait(room, ["Transferring"], 10.0)["state"] == "Transferring"
        prefill.kill()  # the peer vanishes mid-write: no ABORT_ACK can come
        failed = decode.wait(room, ["Failed"], 10.0)
        assert failed["state"] == "Failed" and failed["kind"] == "peer_lost", failed
        # Well past the 1 s drain deadline: quarantined, not released.
        after = decode.wait_safe(room, 3.0)
        assert not after["release_safe"], after
        assert after["pages"] == "quarantined" and after["quarantined"] == 1, after
        # The proof arrives: the engine says the peer's process is gone (a fence).
        fenced = decode.fence(room, "the prefill process exited (the test killed it)")
        assert fenced["release_safe"] and fenced["pages"] == "released" and fenced["quarantined"] == 0, fenced
        assert fenced["state"] == KVPoll.Failed.name  # the release phase never changes the room's state
    finally:
        decode.stop()
        prefill.stop()
