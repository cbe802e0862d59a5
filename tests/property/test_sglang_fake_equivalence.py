"""The fake pair answers poll for poll like SGLang's fake backend, for any call sequence.

The reference is SGLang's code (tests/unit/compat/sglang_reference.py) on
the same injected clock. An abort after a poll returned Success answers
Failed on both (DESIGN.md, "Compat semantics"), while kvfsm's room, the
transfer's record, stays Success; the comparison goes on. Where kvfsm
deliberately differs, the trace is checked to end exactly as the documented
rule says, and comparison stops there (both sides are latched from then on):

* send after the sender's waiting deadline passed unpolled: kvfsm enforces
  deadlines on every event, so the room is Failed (TIMEOUT) where SGLang,
  which only looks at the clock in poll, reports Success.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from kvfsm import FailureKind, KVPoll
from kvfsm.compat import sglang
from tests.helpers import FakeClock
from tests.unit.compat import sglang_reference as reference

WAITING_TIMEOUT = 10.0

Op = tuple[str, float]
advances = st.floats(min_value=0.0, max_value=2 * WAITING_TIMEOUT, allow_nan=False).map(lambda dt: ("advance", dt))
sender_ops = st.lists(
    st.one_of(st.sampled_from(["init", "send", "abort", "poll"]).map(lambda op: (op, 0.0)), advances), max_size=25
)
receiver_ops = st.lists(
    st.one_of(st.sampled_from(["init", "send_metadata", "abort", "poll"]).map(lambda op: (op, 0.0)), advances),
    max_size=25,
)


@contextmanager
def managers(clock: FakeClock) -> Iterator[tuple[sglang.KVManager, sglang.KVManager]]:
    with mock.patch.dict(os.environ, {sglang.WAITING_TIMEOUT_ENV: str(WAITING_TIMEOUT)}):
        prefill = sglang.KVManager(sglang.KVArgs(), "prefill", clock=clock, reaper=False)
        decode = sglang.KVManager(sglang.KVArgs(), "decode", clock=clock, reaper=False)
        try:
            yield prefill, decode
        finally:
            prefill.shutdown()
            decode.shutdown()


def replay(
    ours: sglang.FakeKVSender | sglang.FakeKVReceiver,
    theirs: reference.FakeKVSender | reference.FakeKVReceiver,
    clock: FakeClock,
    ops: list[Op],
    step: Callable[[str], bool],
) -> None:
    """Apply `ops` to both sides, comparing each poll and every `conclude_state` on the way.

    `advance`, `abort` and `poll` are common to both roles; `step` applies
    the other ops and returns False where the trace ends at a documented
    difference it has already checked.
    """
    for op, dt in ops:
        if op == "advance":
            clock.advance(dt)
        elif op == "abort":
            succeeded = theirs.conclude_state is KVPoll.Success
            ours.abort()
            theirs.abort()
            if succeeded:
                assert ours.handle.state is KVPoll.Success  # the bytes landed: the room keeps its record
        elif op == "poll":
            assert ours.poll() is theirs.poll()
        elif not step(op):
            return
        assert ours.conclude_state is theirs.conclude_state, op


@given(sender_ops)
def test_fake_sender_polls_like_sglangs(ops: list[Op]) -> None:
    clock = FakeClock()
    with managers(clock) as (prefill, _decode):
        ours = sglang.FakeKVSender(prefill, "2.2.2.2:8998", 0, [0], 0)
        theirs = reference.FakeKVSender(clock, WAITING_TIMEOUT)

        def step(op: str) -> bool:
            if op == "init":
                ours.init(3, 0)
                theirs.init(3, 0)
                return True
            assert op == "send", op
            deadline_passed_unpolled = (
                theirs.conclude_state is None
                and not theirs.has_sent
                and theirs.waiting_since is not None
                and clock() - theirs.waiting_since >= WAITING_TIMEOUT
            )
            ours.send([1, 2, 3])
            theirs.send([1, 2, 3])
            if deadline_passed_unpolled:
                assert ours.poll() is KVPoll.Failed
                failure = ours.handle.failure
                assert failure is not None
                assert failure.kind is FailureKind.TIMEOUT
                assert theirs.poll() is KVPoll.Success
                return False
            return True

        replay(ours, theirs, clock, ops, step)


@given(receiver_ops)
def test_fake_receiver_polls_like_sglangs(ops: list[Op]) -> None:
    clock = FakeClock()
    with managers(clock) as (_prefill, decode):
        ours = sglang.FakeKVReceiver(decode, "2.2.2.2:8998", 0)
        theirs = reference.FakeKVReceiver()

        def step(op: str) -> bool:
            if op == "init":
                ours.init(0)
                theirs.init(0)
            else:
                assert op == "send_metadata", op
                ours.send_metadata([1, 2, 3], 0)
                theirs.send_metadata([1, 2, 3], 0)
            return True

        replay(ours, theirs, clock, ops, step)


@given(sender_ops)
def test_every_fake_request_goes_through_the_machine(ops: list[Op]) -> None:
    """The manager always knows: the fake's poll equals its room's state.

    Two exceptions, both documented: the instant handshake (the fake says
    WaitingForInput while its room still bootstraps), and an abort after
    Success (the request answers Failed, the room keeps its Success).
    """
    clock = FakeClock()
    with managers(clock) as (prefill, _decode):
        sender = sglang.FakeKVSender(prefill, "2.2.2.2:8998", 0, [0], 0)
        aborted_after_success = False
        for op, dt in ops:
            if op == "advance":
                clock.advance(dt)
            elif op == "init":
                sender.init(3, 0)
            elif op == "send":
                sender.send([1])
            elif op == "abort":
                aborted_after_success = aborted_after_success or sender.handle.state is KVPoll.Success
                sender.abort()
            else:
                polled = sender.poll()
                state = sender.handle.state
                if aborted_after_success:
                    assert (polled, state) == (KVPoll.Failed, KVPoll.Success)
                else:
                    assert polled is state or (polled, state) == (KVPoll.WaitingForInput, KVPoll.Bootstrapping)
        (manager,) = prefill.fake_rooms.managers()
        stats = manager.stats
        failure = sender.handle.failure
        aborted = failure is not None and failure.kind is FailureKind.ABORTED
        assert stats.aborts == (1 if aborted else 0)
        sender.clear()
        assert len(manager) == 0
