"""LocalBackend end to end: real torch pages through the lifecycle machine."""

from __future__ import annotations

import threading

import pytest
import torch

import kvfsm
from kvfsm import FailureKind, KVPoll
from kvfsm.backends import FakeBackend, TransferInputError
from kvfsm.backends.local import Faults, room_key
from tests.helpers import FakeClock

from .pairs import PAGES, SLOTS, LocalPair, local_pair, make_pools, wait_until

FAST = kvfsm.Timeouts(bootstrap=5.0, waiting=5.0, transferring=5.0, drain=30.0)


def finish(pair: LocalPair, send: kvfsm.TransferHandle, recv: kvfsm.TransferHandle) -> None:
    wait_until(lambda: send.is_terminal and recv.is_terminal, f"room {send.room!r} to end")


# -- happy paths ------------------------------------------------------------------------------


def test_one_chunk_copies_pages_and_aux_bit_exactly() -> None:
    with local_pair() as pair:
        send, recv = pair.open(7)
        assert recv.state is KVPoll.WaitingForInput
        assert send.state is KVPoll.Bootstrapping  # until the receiver posts its pages
        pair.rb.expect(recv, [3, 4, 20], aux_index=1)
        assert send.poll() is KVPoll.WaitingForInput
        pair.sb.send(send, [10, 2, 30], last=True, aux_index=2)
        finish(pair, send, recv)
        assert (send.state, recv.state) == (KVPoll.Success, KVPoll.Success)
        assert pair.same_pages([10, 2, 30], [3, 4, 20])
        assert torch.equal(pair.dst["aux"][1], pair.src["aux"][2])
        assert pair.rb.pools is not None
        page_bytes = pair.rb.pools.page_nbytes
        assert recv.nbytes == send.nbytes == 3 * page_bytes
        assert recv.transfer_latency is not None
        assert recv.release_safe
        assert send.release_safe


def test_chunked_with_zero_page_last_chunk() -> None:
    with local_pair() as pair:
        send, recv = pair.open("req-a")
        dst = [1, 2, 3, 4, 9, 8, 7]
        src = [30, 31, 0, 5, 6, 12, 11]
        pair.rb.expect(recv, dst, aux_index=0)
        pair.sb.send(send, src[:3])
        pair.sb.send(send, src[3:])
        pair.sb.send(send, [], last=True, aux_index=3)
        finish(pair, send, recv)
        assert recv.state is KVPoll.Success
        assert recv.chunks == send.chunks == 3
        assert pair.same_pages(src, dst)
        assert torch.equal(pair.dst["aux"][0], pair.src["aux"][3])


def test_index_tensors_are_accepted() -> None:
    with local_pair() as pair:
        send, recv = pair.open(1)
        pair.rb.expect(recv, torch.tensor([5, 6]))
        pair.sb.send(send, torch.tensor([8, 9], dtype=torch.int32), last=True)
        finish(pair, send, recv)
        assert recv.state is KVPoll.Success
        assert pair.same_pages([8, 9], [5, 6])


def test_big_runs_and_scattered_pages_in_one_chunk() -> None:
    src_pools = make_pools(True, pages=64, row=4096)  # 8 KiB per region page
    dst_pools = make_pools(False, pages=64, row=4096)
    with local_pair(src_pools=src_pools, dst_pools=dst_pools) as pair:
        send, recv = pair.open(2)
        src = [*range(0, 40), 50, 45, 60]  # a 320 KiB run, then scattered pages
        dst = [*range(10, 50), 0, 63, 5]
        pair.rb.expect(recv, dst)
        pair.sb.send(send, src, last=True)
        finish(pair, send, recv)
        assert recv.state is KVPoll.Success
        assert pair.same_pages(src, dst)


def test_room_id_reuse_after_close_and_many_rooms_in_parallel() -> None:
    with local_pair(workers=3) as pair:
        for generation in range(2):
            rooms = {room: pair.open(room) for room in range(6)}
            for room, (_send, recv) in rooms.items():
                # One aux slot per live room, as a server allocates them: rooms sharing a slot
                # would overwrite each other's commit marker. The rooms past the slots post none.
                aux = room if room < SLOTS else None
                pair.rb.expect(recv, [room * 5 + i for i in range(5)], aux_index=aux)
            for part in range(2):
                for room, (send, _) in rooms.items():
                    pages = [(room * 3 + part + generation) % PAGES, (room * 7 + part) % PAGES]
                    aux = 0 if room < SLOTS else None
                    pair.sb.send(send, pages if part == 0 else [*pages, 31], last=part == 1, aux_index=aux)
            for room, (send, recv) in rooms.items():
                finish(pair, send, recv)
                assert recv.state is KVPoll.Success, recv.reason
                src = [(room * 3 + generation) % PAGES, (room * 7) % PAGES]
                src += [(room * 3 + 1 + generation) % PAGES, (room * 7 + 1) % PAGES, 31]
                assert pair.same_pages(src, [room * 5 + i for i in range(5)])
                pair.sender.close(room)
                pair.receiver.close(room)
        assert pair.rb.audited_rooms() == []
        assert not pair.sb._links
        assert not pair.rb._links


def test_commit_marker_holds_room_key_and_page_count() -> None:
    with local_pair() as pair:
        send, recv = pair.open("marker")
        pair.rb.expect(recv, [1, 2], aux_index=3)
        pair.sb.send(send, [4, 5], last=True, aux_index=0)
        finish(pair, send, recv)
        assert pair.rb._markers is not None
        assert pair.rb._markers[3].tolist() == [room_key("marker"), 2]


# -- abort in each state ------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("stage", ["bootstrapping", "waiting", "transferring", "in_flight"])
def test_abort_in_each_state_fails_both_sides_and_drains(side: str, stage: str) -> None:
    faults = Faults(delay_s=0.2) if stage == "in_flight" else Faults()
    with local_pair(faults=faults) as pair:
        send, recv = pair.sender.open(5), pair.receiver.open(5)
        pair.sb.bootstrap(send, pair.sb.address)
        pair.rb.bootstrap(recv, pair.sb.address)
        if stage != "bootstrapping":
            pair.rb.expect(recv, [1, 2, 3, 4])
        if stage == "transferring":
            pair.sb.send(send, [5, 6])
            wait_until(lambda: recv.chunks == 1, "the first chunk to land")
            assert recv.state is KVPoll.Transferring
        if stage == "in_flight":
            pair.sb.send(send, [5, 6, 7, 8], last=True)
            wait_until(lambda: pair.sb.in_flight(send) == 1, "the chunk to be in flight")
        victim, peer = (send, recv) if side == "sender" else (recv, send)
        before = victim.state
        assert victim.abort("client went away")
        assert victim.state is KVPoll.Failed  # synchronous
        assert victim.reason is not None
        assert victim.reason.kind is FailureKind.ABORTED
        assert victim.reason.state is before
        wait_until(lambda: peer.is_terminal, "the peer to learn about the abort")
        assert peer.state is KVPoll.Failed
        assert peer.reason is not None
        assert peer.reason.from_peer
        if stage == "in_flight":
            # The posted copy still lands: nothing is release-safe until it drained.
            assert not recv.release_safe
        wait_until(lambda: recv.release_safe and send.release_safe, "writes drained")
        assert pair.sb.in_flight(send) == 0
        pair.sender.close(5)
        pair.receiver.close(5)
        assert len(pair.sender) == len(pair.receiver) == 0


def test_abort_after_success_changes_nothing() -> None:
    with local_pair() as pair:
        send, recv = pair.open(3)
        pair.rb.expect(recv, [1])
        pair.sb.send(send, [2], last=True)
        finish(pair, send, recv)
        assert not recv.abort()
        assert recv.state is KVPoll.Success
        assert pair.receiver.stats.late_events == 1


def test_close_of_a_live_room_aborts_it_and_the_peer() -> None:
    with local_pair() as pair:
        send, recv = pair.open(4)
        pair.rb.expect(recv, [1, 2])
        pair.receiver.close(4)
        wait_until(lambda: send.is_terminal, "the sender to fail")
        assert send.reason is not None
        assert send.reason.kind is FailureKind.ABORTED
        assert send.reason.from_peer
        wait_until(lambda: send.release_safe, "the sender to drain")


# -- fault injection --------------------------------------------------------------------------


def test_injected_chunk_failure_fails_both_and_leaves_other_pages_alone() -> None:
    with local_pair(faults=Faults(fail_rate=1.0, seed=1)) as pair:
        untouched = pair.snapshot()
        send, recv = pair.open(9)
        pair.rb.expect(recv, [10, 11, 12, 13])
        pair.sb.send(send, [0, 1, 2, 3], last=True)
        finish(pair, send, recv)
        assert send.reason is not None
        assert send.reason.kind is FailureKind.TRANSFER_ERROR
        assert "injected" in send.reason.message
        assert recv.reason is not None
        assert recv.reason.kind is FailureKind.PEER_FAILED
        assert recv.reason.from_peer
        wait_until(lambda: recv.release_safe, "drain after the failure")
        # Half the chunk was written (a partial write), nothing outside it.
        assert pair.same_pages([0, 1], [10, 11])
        changed = (pair.dst["k"] != untouched["k"]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
        assert set(changed) <= {10, 11}


def test_corrupt_commit_marker_fails_the_receiver() -> None:
    with local_pair(faults=Faults(corrupt_marker_rate=1.0)) as pair:
        send, recv = pair.open(6)
        pair.rb.expect(recv, [1, 2], aux_index=0)
        pair.sb.send(send, [3, 4], last=True, aux_index=0)
        finish(pair, send, recv)
        assert recv.state is KVPoll.Failed
        assert recv.reason is not None
        assert "commit marker" in recv.reason.message
        assert send.state is KVPoll.Failed  # told by its peer


def test_stalled_transfer_hits_the_transferring_deadline_on_a_fake_clock() -> None:
    clock = FakeClock()
    timeouts = kvfsm.Timeouts(bootstrap=10.0, waiting=100.0, transferring=2.0, drain=30.0)
    with local_pair(faults=Faults(stall_rate=1.0), timeouts=timeouts, clock=clock) as pair:
        send, recv = pair.open(8)
        pair.rb.expect(recv, [1, 2])
        pair.sb.send(send, [3, 4], last=True)
        assert send.state is KVPoll.Transferring
        clock.advance(1.9)
        assert send.poll() is KVPoll.Transferring
        clock.advance(0.2)
        assert send.poll() is KVPoll.Failed
        assert send.reason is not None
        assert send.reason.kind is FailureKind.TIMEOUT
        assert recv.state is KVPoll.Failed
        # A stalled room had nothing in flight: release-safe at once, no drain deadline needed.
        assert send.release_safe
        assert recv.release_safe
        assert pair.rb.writes_landed(recv) == 0


def test_sender_that_never_sends_hits_the_waiting_deadline() -> None:
    clock = FakeClock()
    timeouts = kvfsm.Timeouts(bootstrap=10.0, waiting=3.0, transferring=None, drain=30.0)
    with local_pair(timeouts=timeouts, clock=clock) as pair:
        send, recv = pair.open(10)
        pair.rb.expect(recv, [1])
        clock.advance(3.5)
        assert pair.receiver.check_deadlines() == [10]
        assert recv.reason is not None
        assert recv.reason.kind is FailureKind.TIMEOUT
        assert "waiting" in recv.reason.message
        assert send.state is KVPoll.Failed
        assert send.release_safe


def test_receiver_that_never_comes_hits_the_bootstrap_deadline() -> None:
    clock = FakeClock()
    timeouts = kvfsm.Timeouts(bootstrap=1.0, waiting=10.0, drain=30.0)
    with local_pair(timeouts=timeouts, clock=clock) as pair:
        send = pair.sender.open(11)
        pair.sb.bootstrap(send, pair.sb.address)
        clock.advance(1.5)
        assert send.poll() is KVPoll.Failed
        assert send.reason is not None
        assert send.reason.kind is FailureKind.TIMEOUT
        assert send.release_safe


def test_release_gate_peer_keeps_writing_after_abort() -> None:
    faults = Faults(delay_s=0.05, linger_chunks=2)
    with local_pair(faults=faults, timeouts=FAST) as pair:
        send, recv = pair.open(12)
        dst = [20, 21, 22, 23, 24, 25]
        pair.rb.expect(recv, dst)
        pair.sb.send(send, [0, 1])
        pair.sb.send(send, [2, 3])
        pair.sb.send(send, [4, 5], last=True)
        wait_until(lambda: recv.chunks >= 1, "the first chunk")
        recv.abort("client went away")
        assert recv.state is KVPoll.Failed
        landed_at_abort = pair.rb.writes_landed(recv)
        safe_seen: list[bool] = []
        # The sender's worker still writes queued chunks into the aborted room's pages.
        while not recv.release_safe:
            safe_seen.append(recv.release_safe)
            threading.Event().wait(0.001)
        landed = pair.rb.writes_landed(recv)
        assert landed > landed_at_abort, "the lingering peer wrote nothing after abort"
        assert pair.sb.in_flight(send) == 0
        assert safe_seen, "release_safe was true while the peer was still writing"
        assert pair.same_pages([0, 1, 2, 3, 4, 5][: 2 * landed], dst[: 2 * landed])
        threading.Event().wait(0.15)
        assert pair.rb.writes_landed(recv) == landed  # nothing lands after release-safe


def test_closing_an_endpoint_fails_its_rooms_and_their_peers() -> None:
    with local_pair() as pair:
        send, recv = pair.open(13)
        pair.rb.expect(recv, [1])
        pair.rb.close()
        assert recv.state is KVPoll.Failed
        assert recv.reason is not None
        assert "local backend" in recv.reason.message
        wait_until(lambda: send.is_terminal, "the sender to learn")
        assert send.reason is not None
        assert send.reason.from_peer
        wait_until(lambda: send.release_safe and recv.release_safe, "drain")


class SilentBackend(FakeBackend):
    """Never reports writes drained: a peer that went away mid-write."""

    def _stop(self, handle: kvfsm.TransferHandle) -> None:
        return


def test_drain_deadline_quarantines_when_a_backend_never_drains() -> None:
    clock = FakeClock()
    manager = kvfsm.TransferManager("receiver", timeouts=kvfsm.Timeouts(drain=5.0), clock=clock)
    backend = SilentBackend(manager)
    recv = manager.open(1)
    backend.bootstrap(recv, backend.address)
    recv.abort("client went away")
    assert not manager.release_safe(1)
    clock.advance(4.9)
    assert not manager.release_safe(1)
    clock.advance(0.2)
    # No proof, so the pages are quarantined, not released (issue 24: this used to answer True).
    assert not manager.release_safe(1)
    assert recv.pages_state is kvfsm.PagesState.QUARANTINED and manager.stats.quarantined == 1
    assert manager.stats.drain_deadline_releases == 0


# -- bad input ------------------------------------------------------------------------------------


def test_out_of_range_page_names_the_room_fails_it_and_touches_nothing() -> None:
    with local_pair() as pair:
        before = pair.snapshot()
        other_send, other_recv = pair.open(1)
        pair.rb.expect(other_recv, [0, 1])
        send, recv = pair.open(2)
        with pytest.raises(TransferInputError, match=r"room 2: destination pages\[1\] = 99 is out of range"):
            pair.rb.expect(recv, [3, 99])
        assert recv.state is KVPoll.Failed
        assert recv.reason is not None
        assert recv.reason.kind is FailureKind.TRANSFER_ERROR
        assert "99" in recv.reason.message
        wait_until(lambda: send.is_terminal, "the peer to fail")
        assert other_recv.state is KVPoll.WaitingForInput  # the other room is untouched
        assert all(torch.equal(before[n], pair.dst[n]) for n in before)
        pair.sb.send(other_send, [5, 6], last=True)
        finish(pair, other_send, other_recv)
        assert other_recv.poll() is KVPoll.Success


def test_source_page_out_of_range() -> None:
    with local_pair() as pair:
        send, recv = pair.open(3)
        pair.rb.expect(recv, [1])
        with pytest.raises(TransferInputError, match=r"room 3: source pages\[0\] = -1 is out of range"):
            pair.sb.send(send, [-1], last=True)
        assert send.state is KVPoll.Failed
        wait_until(lambda: recv.is_terminal, "the receiver to fail")
        assert pair.rb.writes_landed(recv) == 0


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        (torch.tensor([1.0, 2.0]), "integer dtype"),
        (torch.tensor([[1, 2]]), "must be 1-D"),
        ("12", "sequence of ints"),
        ([1, "x"], "must be an integer page index"),
        ([1.9, 2.2], "must be an integer page index; got float"),
        ([True, 2], "must be an integer page index; got bool"),
        ([3, 3], r"destination pages\[1\] = 3 appears twice"),
    ],
)
def test_page_lists_of_the_wrong_type(pages: object, match: str) -> None:
    with local_pair() as pair:
        _send, recv = pair.open(4)
        with pytest.raises(TransferInputError, match=match):
            pair.rb.expect(recv, pages)
        assert recv.state is KVPoll.Failed


@pytest.mark.parametrize("aux", [True, 1.5, "1"])
def test_an_aux_index_must_be_an_integer_slot(aux: object) -> None:
    with local_pair() as pair:
        _send, recv = pair.open(4)
        with pytest.raises(TransferInputError, match="aux_index must be an integer slot or None"):
            pair.rb.expect(recv, [1], aux_index=aux)  # type: ignore[arg-type]
        assert recv.state is KVPoll.Failed
        send, recv = pair.open(5)
        pair.rb.expect(recv, [1], aux_index=0)
        with pytest.raises(TransferInputError, match="aux_index must be an integer slot or None"):
            pair.sb.send(send, [1], last=True, aux_index=aux)  # type: ignore[arg-type]
        assert send.state is KVPoll.Failed


def test_mismatched_page_counts_too_many_and_too_few() -> None:
    with local_pair() as pair:
        send, recv = pair.open(5)
        pair.rb.expect(recv, [1, 2, 3])
        pair.sb.send(send, [1, 2])
        with pytest.raises(TransferInputError, match=r"mismatched page counts.*expects 3"):
            pair.sb.send(send, [3, 4])
        assert send.state is KVPoll.Failed
        send2, recv2 = pair.open(6)
        pair.rb.expect(recv2, [1, 2, 3])
        with pytest.raises(TransferInputError, match="last chunk ends after 2 pages but the receiver expects 3"):
            pair.sb.send(send2, [1, 2], last=True)
        wait_until(lambda: recv2.is_terminal, "the receiver to fail")
        assert recv2.reason is not None
        assert recv2.reason.from_peer


@pytest.mark.parametrize("mismatch", ["row", "dtype", "layers"])
def test_pools_of_different_layouts_fail_the_room_at_bootstrap(mismatch: str) -> None:
    if mismatch == "row":
        dst = make_pools(False, row=32)
    elif mismatch == "dtype":
        dst = make_pools(False, dtype=torch.float16)
    else:
        full = make_pools(False)
        dst = {"k": full["k"][:1].contiguous(), "v": full["v"][:1].contiguous(), "aux": full["aux"]}
    with local_pair(dst_pools=dst) as pair:
        before = pair.snapshot()
        send, recv = pair.sender.open(7), pair.receiver.open(7)
        pair.sb.bootstrap(send, pair.sb.address)
        with pytest.raises(TransferInputError, match="room 7: the sender's and the receiver's pools differ"):
            pair.rb.bootstrap(recv, pair.sb.address)
        for handle in (send, recv):
            assert handle.state is KVPoll.Failed
            assert handle.reason is not None
            assert handle.reason.kind is FailureKind.BOOTSTRAP_ERROR
        assert all(torch.equal(before[n], pair.dst[n]) for n in before)


def test_sending_on_a_closed_room_is_a_clear_error() -> None:
    with local_pair() as pair:
        send, recv = pair.open(8)
        pair.rb.expect(recv, [1])
        pair.sender.close(8)
        with pytest.raises(TransferInputError, match="room 8: send\\(\\) on a closed room"):
            pair.sb.send(send, [1], last=True)
        assert pair.rb.writes_landed(recv) == 0


def test_protocol_misuse_is_rejected_with_the_room_named() -> None:
    with local_pair() as pair:
        send, recv = pair.open(9)
        with pytest.raises(TransferInputError, match="before the room finished bootstrapping"):
            pair.sb.send(send, [1])
        send, recv = pair.open(10)
        pair.rb.expect(recv, [1, 2])
        with pytest.raises(TransferInputError, match="expect\\(\\) is for a receiver"):
            pair.sb.expect(send, [1])
        send, recv = pair.open(11)
        pair.rb.expect(recv, [1])
        with pytest.raises(TransferInputError, match="room 11: expect\\(\\) was already called"):
            pair.rb.expect(recv, [1])
        send, recv = pair.open(12)
        pair.rb.expect(recv, [1])
        pair.sb.send(send, [1], last=True)
        finish(pair, send, recv)
        pair.sb.send(send, [1], last=True)  # the room already succeeded: ignored, not an error
        assert send.state is KVPoll.Success
        send, recv = pair.open(14)
        pair.rb.expect(recv, [1])
        with pytest.raises(TransferInputError, match="receiver posted no aux slot"):
            pair.sb.send(send, [1], last=True, aux_index=0)


def test_send_after_the_last_chunk_is_rejected() -> None:
    with local_pair(faults=Faults(stall_rate=1.0)) as pair:  # the room stays Transferring
        send, recv = pair.open(13)
        pair.rb.expect(recv, [1, 2])
        pair.sb.send(send, [1, 2], last=True)
        with pytest.raises(TransferInputError, match="room 13: send\\(\\) after the chunk flagged last"):
            pair.sb.send(send, [], last=True)
        assert send.state is KVPoll.Failed
        assert recv.state is KVPoll.Failed
        assert pair.rb.writes_landed(recv) == 0


def test_unknown_peer_address_is_a_bootstrap_error() -> None:
    with local_pair() as pair:
        recv = pair.receiver.open(1)
        pair.rb.bootstrap(recv, "local://sender/nowhere")
        assert recv.state is KVPoll.Failed
        assert recv.reason is not None
        assert recv.reason.kind is FailureKind.BOOTSTRAP_ERROR
        assert recv.release_safe


def test_handle_of_another_manager_is_refused() -> None:
    with local_pair() as pair:
        stranger = kvfsm.TransferManager("receiver").open(1)
        with pytest.raises(TransferInputError, match="another manager"):
            pair.rb.bootstrap(stranger, pair.sb.address)
        assert stranger.state is KVPoll.Bootstrapping


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pools_copy_bit_exactly() -> None:
    src = {name: t.cuda() for name, t in make_pools(True).items()}
    dst = {name: t.cuda() for name, t in make_pools(False).items()}
    with local_pair(src_pools=src, dst_pools=dst) as pair:
        send, recv = pair.open(1)
        pair.rb.expect(recv, [1, 2, 9, 4], aux_index=0)
        pair.sb.send(send, [7, 3])
        pair.sb.send(send, [0, 30], last=True, aux_index=1)
        finish(pair, send, recv)
        assert recv.state is KVPoll.Success
        assert pair.same_pages([7, 3, 0, 30], [1, 2, 9, 4])


def test_a_failure_the_backend_reports_stops_the_room_even_while_notices_are_held_up() -> None:
    # Observers run on whichever thread dispatches; while one is busy, the
    # backend's own notice waits. The backend must stop the room anyway, or
    # the receiver would "succeed" with a half-written chunk.
    release = threading.Event()
    held = threading.Event()
    with local_pair(faults=Faults(fail_rate=1.0)) as pair:

        def slow_observer(change: kvfsm.StateChange) -> None:
            if change.room == "hold" and change.event == "open":
                held.set()
                release.wait(10)

        pair.sender.subscribe(slow_observer)
        holder = threading.Thread(target=pair.sender.open, args=("hold",))
        holder.start()
        try:
            assert held.wait(10)
            send, recv = pair.open(1)
            pair.rb.expect(recv, [1, 2, 3, 4])
            pair.sb.send(send, [5, 6])
            pair.sb.send(send, [7, 8], last=True)
            finish(pair, send, recv)
            assert send.state is KVPoll.Failed
            assert recv.state is KVPoll.Failed
            assert pair.rb.writes_landed(recv) == 1  # only the failed chunk's half
        finally:
            release.set()
            holder.join()
