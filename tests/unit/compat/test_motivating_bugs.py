"""The bugs that motivated kvfsm, each written as the scenario that failed in production.

Every test runs twice: against `kvfsm.compat.sglang` (must pass) and
against SGLang's own code ported in `sglang_reference` (marked
`xfail(strict=True)`: the bug must still reproduce there, which proves the
scenario really exercises it; if it ever stops reproducing, the xfail
turns into a failure and the test needs a sharper scenario).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from kvfsm import KVPoll
from kvfsm.compat import sglang
from tests.helpers import FakeClock
from tests.unit.compat import sglang_reference as reference

PREFILL_ADDR = "prefill-0:8998"
FAKE_ADDR = "2.2.2.2:8998"


@attrs.define
class Stack:
    """One implementation of SGLang's disaggregation classes, as the scheduler sees it."""

    name: str
    manager: Any
    sender_cls: type[Any]
    #: The sender whose abort() the abort scenarios exercise.
    aborting_sender_cls: type[Any]
    fake_sender: Callable[[], Any]
    fake_receiver: Callable[[], Any]

    def new_sender(self, room: int, cls: type[Any] | None = None) -> Any:
        return (cls or self.sender_cls)(self.manager, PREFILL_ADDR, room, [0], 0)


def kvfsm_stack() -> Iterator[Stack]:
    clock = FakeClock()
    prefill = sglang.KVManager(sglang.KVArgs(), sglang.DisaggregationMode.PREFILL, clock=clock, reaper=False)
    decode = sglang.KVManager(sglang.KVArgs(), sglang.DisaggregationMode.DECODE, clock=clock, reaper=False)
    yield Stack(
        "kvfsm",
        prefill,
        sglang.KVSender,
        sglang.KVSender,
        lambda: sglang.FakeKVSender(prefill, FAKE_ADDR, 0, [0], 0),
        lambda: sglang.FakeKVReceiver(decode, FAKE_ADDR, 0),
    )
    prefill.shutdown()
    decode.shutdown()


def sglang_stack() -> Iterator[Stack]:
    yield Stack(
        "sglang",
        reference.CommonStatusManager(),
        reference.MooncakeStyleSender,
        reference.PreFixSender,
        reference.LegacyFakeKVSender,
        reference.LegacyFakeKVReceiver,
    )


@pytest.fixture(
    params=[
        pytest.param(kvfsm_stack, id="kvfsm"),
        pytest.param(
            sglang_stack,
            id="sglang-reference",
            marks=pytest.mark.xfail(strict=True, reason="reproduces the SGLang bug kvfsm fixes"),
        ),
    ]
)
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    yield from request.param()


def test_abort_reaches_the_manager(stack: Stack) -> None:
    """Bug 1: abort() set a local flag; the shared status table never heard of it."""
    sender = stack.new_sender(11, stack.aborting_sender_cls)
    stack.manager.update_status(11, KVPoll.WaitingForInput)  # backend thread: handshake done
    sender.abort()  # scheduler: client went away
    # What every other reader of the table (transfer threads, peers, other ranks) sees:
    assert stack.manager.check_status(11) == KVPoll.Failed


def test_overridden_abort_cannot_skip_the_sync(stack: Stack) -> None:
    """Bug 2: a backend subclass copy-pasted the buggy abort and never called super()."""

    class CopyPastedSender(stack.sender_cls):  # type: ignore[name-defined,misc]
        def abort(self) -> None:
            self.traced = "aborted"
            # The copied body: the local flag only (kvfsm refuses the assignment).
            with contextlib.suppress(AttributeError):
                self.conclude_state = KVPoll.Failed

    sender = stack.new_sender(12, CopyPastedSender)
    stack.manager.update_status(12, KVPoll.WaitingForInput)
    sender.abort()
    assert sender.traced == "aborted"
    assert sender.poll() == KVPoll.Failed
    assert stack.manager.check_status(12) == KVPoll.Failed


def test_fake_backend_can_be_aborted(stack: Stack) -> None:
    """Bug 3: the warmup backend had no abort; an aborted warmup request hung."""
    sender = stack.fake_sender()
    sender.init(4, 0)
    assert sender.poll() == KVPoll.WaitingForInput
    if hasattr(sender, "abort"):  # what the prefill scheduler does
        sender.abort()
    assert sender.poll() == KVPoll.Failed

    receiver = stack.fake_receiver()
    receiver.init(0)
    receiver.abort()  # the decode scheduler calls it unguarded
    assert receiver.poll() == KVPoll.Failed


def test_late_success_does_not_overwrite_failed(stack: Stack) -> None:
    """Bug 4a: max(old, new) let a transfer thread's late Success overwrite Failed."""
    sender = stack.new_sender(13)
    manager = stack.manager
    manager.update_status(13, KVPoll.WaitingForInput)
    manager.update_status(13, KVPoll.Transferring)
    manager.record_failure(13, "Lost connection with decode instance")  # heartbeat thread
    manager.update_status(13, KVPoll.Failed)
    manager.update_status(13, KVPoll.Success)  # the transfer thread finishes late
    assert manager.check_status(13) == KVPoll.Failed
    assert sender.poll() == KVPoll.Failed


def test_cleared_room_is_not_resurrected(stack: Stack) -> None:
    """Bug 4b: a late update for a cleared room re-created it, polluting the next request."""
    sender = stack.new_sender(14)
    manager = stack.manager
    for status in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success):
        manager.update_status(14, status)
    assert sender.poll() == KVPoll.Success
    sender.clear()
    manager.update_status(14, KVPoll.Transferring)  # a late progress report
    assert 14 not in manager.request_status
    follower = stack.new_sender(14)  # a new request reusing the room id
    assert follower.poll() == KVPoll.Bootstrapping


def test_poll_after_clear_does_not_raise(stack: Stack) -> None:
    """Bug 4c: looking up a cleared room raised KeyError inside the scheduler loop."""
    sender = stack.new_sender(15)
    stack.manager.update_status(15, KVPoll.WaitingForInput)
    sender.clear()  # e.g. the request was dropped while a poll was still due
    assert sender.poll() == KVPoll.Failed
