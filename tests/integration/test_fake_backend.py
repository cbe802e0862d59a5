"""FakeBackend: SGLang's warmup semantics, but through the lifecycle machine."""

from __future__ import annotations

import sys

import pytest

import kvfsm
from kvfsm import FailureKind, KVPoll
from kvfsm.backends import FakeBackend, KVPools, MemoryRegion, TransferInputError
from tests.helpers import FakeClock


def endpoints(
    clock: FakeClock | None = None, timeouts: kvfsm.Timeouts | None = None
) -> tuple[kvfsm.TransferManager, FakeBackend, kvfsm.TransferManager, FakeBackend]:
    kwargs = {"clock": clock} if clock is not None else {}
    timeouts = kvfsm.Timeouts() if timeouts is None else timeouts
    sender = kvfsm.TransferManager("sender", timeouts=timeouts, **kwargs)  # type: ignore[arg-type]
    receiver = kvfsm.TransferManager("receiver", timeouts=timeouts, **kwargs)  # type: ignore[arg-type]
    return sender, FakeBackend(sender), receiver, FakeBackend(receiver)


def test_fake_backend_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, kvfsm.backends as b; b.FakeBackend; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instant_handshake_and_transfer() -> None:
    sender, sb, receiver, rb = endpoints()
    send, recv = sender.open(1), receiver.open(1)
    rb.bootstrap(recv, sb.address)
    sb.bootstrap(send, sb.address)
    assert recv.state is send.state is KVPoll.WaitingForInput
    rb.expect(recv, [1, 2, 3])
    assert recv.poll() is KVPoll.Success  # SGLang's fake receiver succeeds on init
    assert recv.nbytes == 3 * 4096
    sb.send(send, [4, 5])
    assert send.poll() is KVPoll.Transferring
    sb.send(send, [6])
    sb.send(send, [], last=True)
    assert send.poll() is KVPoll.Success
    assert send.chunks == 3
    assert send.nbytes == 3 * 4096
    assert send.release_safe
    assert recv.release_safe


def test_registered_pools_set_the_page_size_and_range() -> None:
    sender = kvfsm.TransferManager("sender")
    pools = KVPools([MemoryRegion(ptr=0, nbytes=10 * 512, page_nbytes=512)])
    sb = FakeBackend(sender, pools)
    send = sender.open(1)
    sb.bootstrap(send, sb.address)
    with pytest.raises(TransferInputError, match=r"source pages\[0\] = 10 is out of range"):
        sb.send(send, [10], last=True)
    assert send.state is KVPoll.Failed


@pytest.mark.parametrize("stage", ["bootstrapping", "waiting", "transferring"])
def test_abort_in_each_state_is_release_safe_at_once(stage: str) -> None:
    sender, sb, _receiver, _rb = endpoints()
    send = sender.open(7)
    if stage != "bootstrapping":
        sb.bootstrap(send, sb.address)
    if stage == "transferring":
        sb.send(send, [1])
    assert send.abort("warmup cancelled")
    assert send.state is KVPoll.Failed
    assert send.reason is not None
    assert send.reason.kind is FailureKind.ABORTED
    if stage == "bootstrapping":
        # The backend never saw the room; handing it over now drains it at once.
        assert not send.release_safe
        sb.bootstrap(send, sb.address)
    assert send.release_safe
    sb.send(send, [2], last=True)  # late: ignored
    assert send.state is KVPoll.Failed


def test_sender_that_never_sends_hits_the_waiting_deadline() -> None:
    clock = FakeClock()
    sender, sb, _receiver, _rb = endpoints(clock, kvfsm.Timeouts(waiting=2.0))
    send = sender.open(1)
    sb.bootstrap(send, sb.address)
    clock.advance(1.0)
    assert send.poll() is KVPoll.WaitingForInput
    clock.advance(1.5)
    assert sender.status(1) is KVPoll.Failed
    assert send.reason is not None
    assert send.reason.kind is FailureKind.TIMEOUT
    assert send.reason.state is KVPoll.WaitingForInput
    assert send.release_safe


def test_closing_the_backend_fails_its_live_rooms() -> None:
    sender, sb, _receiver, _rb = endpoints()
    live, done = sender.open(1), sender.open(2)
    for handle in (live, done):
        sb.bootstrap(handle, sb.address)
    sb.send(done, [1], last=True)
    sb.close()
    assert live.state is KVPoll.Failed
    assert live.reason is not None
    assert "was closed" in live.reason.message
    assert live.release_safe  # nothing was in flight
    assert done.state is KVPoll.Success
    later = sender.open(3)
    later.abort()
    assert not later.release_safe  # nobody observes any more: only the drain deadline frees it
