"""The conformance kit run against what ships: the bare manager (both engines, strict too), for every shipped lifecycle."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import Phase, given, settings

from kvfsm import KVPoll, Lifecycle, Role, TransferManager
from kvfsm.lifecycles import KV_OFFLOAD_LIFECYCLE, STAGED_KV_LIFECYCLE
from kvfsm.testing import (
    Event,
    LifecycleConformance,
    ManualClock,
    event_sequences,
    expected_state,
    faults,
    room_ids,
    timeouts,
)


class CompiledEngineConformance(LifecycleConformance):
    pass


class TransitionsEngineConformance(LifecycleConformance):
    role: ClassVar[Role] = Role.SENDER

    def make_manager(self, clock: ManualClock) -> TransferManager:
        return TransferManager(
            self.role,
            lifecycle=self.lifecycle,
            timeouts=self.timeouts_for_lifecycle(),
            clock=clock,
            engine="transitions",
        )


class StrictConformance(LifecycleConformance):
    strict: ClassVar[bool] = True


class TimerReleaseConformance(LifecycleConformance):
    """The opt-in on_drain_deadline="release": the drain deadline frees the pages (the old behaviour)."""

    on_drain_deadline: ClassVar[str] = "release"


class StagedCompiled(LifecycleConformance):
    lifecycle: ClassVar[Lifecycle] = STAGED_KV_LIFECYCLE


class StagedTransitions(TransitionsEngineConformance):
    lifecycle: ClassVar[Lifecycle] = STAGED_KV_LIFECYCLE


class OffloadCompiled(LifecycleConformance):
    lifecycle: ClassVar[Lifecycle] = KV_OFFLOAD_LIFECYCLE


class OffloadTransitions(TransitionsEngineConformance):
    lifecycle: ClassVar[Lifecycle] = KV_OFFLOAD_LIFECYCLE


class OffloadStrict(StrictConformance):
    lifecycle: ClassVar[Lifecycle] = KV_OFFLOAD_LIFECYCLE


TestCompiledEngine = CompiledEngineConformance.TestCase
TestTransitionsEngine = TransitionsEngineConformance.TestCase
TestStrictMode = StrictConformance.TestCase
TestTimerRelease = TimerReleaseConformance.TestCase
TestStagedCompiled = StagedCompiled.TestCase
TestStagedTransitions = StagedTransitions.TestCase
TestOffloadCompiled = OffloadCompiled.TestCase
TestOffloadTransitions = OffloadTransitions.TestCase
TestOffloadStrict = OffloadStrict.TestCase
# The model checks every rule after every step: half the profile's examples keep CI under a minute here.
TestCompiledEngine.settings = settings(max_examples=max(10, settings().max_examples // 2))
TestTransitionsEngine.settings = settings(max_examples=max(10, settings().max_examples // 3))
TestStrictMode.settings = settings(max_examples=max(10, settings().max_examples // 2))
for _case in (TestTimerRelease, TestStagedCompiled, TestStagedTransitions, TestOffloadCompiled, TestOffloadTransitions):
    _case.settings = settings(max_examples=max(10, settings().max_examples // 4))
TestOffloadStrict.settings = settings(max_examples=max(10, settings().max_examples // 5))


@given(event_sequences())
def test_replaying_a_sequence_follows_the_table(sequence: list[Event]) -> None:
    manager = TransferManager("receiver", clock=ManualClock())
    handle = manager.open(1)
    for event in sequence:
        expected = expected_state(handle.state, event.name)
        event.apply(handle)
        assert handle.state is expected


@given(room_ids(), faults(), timeouts())
def test_strategies_build_valid_values(room: int | str, fault: object, limits: object) -> None:
    manager = TransferManager("sender", clock=ManualClock())
    assert manager.open(room).state is KVPoll.Bootstrapping


def test_expected_state_in_strict_mode_names_the_refusal() -> None:
    assert expected_state(KVPoll.Bootstrapping, "transfer_done", strict=True) is None
    assert expected_state(KVPoll.Bootstrapping, "transfer_done") is KVPoll.Failed
    assert expected_state(KVPoll.Success, "abort", strict=True) is KVPoll.Success
    assert expected_state(KVPoll.Transferring, "chunk_done") is KVPoll.Transferring


def test_timeout_is_not_a_handle_event() -> None:
    handle = TransferManager("sender", clock=ManualClock()).open(1)
    with pytest.raises(ValueError, match="advance the clock"):
        Event("timeout").apply(handle)


def test_the_kit_catches_a_broken_manager() -> None:
    """A manager whose abort forgets the status table must be caught by the kit."""

    class ForgetfulManager(TransferManager):
        def _fire(self, handle, event, reason=None, nbytes=0, last=False):  # type: ignore[no-untyped-def]
            if event == "abort" and handle.state is KVPoll.WaitingForInput:
                handle.state = KVPoll.Failed  # the bug: a local flag, the table never hears of it
                handle.reason = reason
                return True
            return super()._fire(handle, event, reason, nbytes, last)

    class BrokenConformance(LifecycleConformance):
        def make_manager(self, clock: ManualClock) -> TransferManager:
            # The transitions engine has no generated fast path: every event goes through _fire.
            return ForgetfulManager(
                self.role, timeouts=self.timeouts_for_lifecycle(), clock=clock, engine="transitions"
            )

    case = BrokenConformance.TestCase
    # Only that the kit fails matters, not the smallest failing run (shrinking is the cost).
    case.settings = settings(
        report_multiple_bugs=False,
        max_examples=200,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        derandomize=True,
    )
    with pytest.raises(AssertionError):
        case("runTest").runTest()


@given(event_sequences(lifecycle=KV_OFFLOAD_LIFECYCLE))
def test_replaying_an_offload_sequence_follows_its_declaration(sequence: list[Event]) -> None:
    manager = TransferManager("sender", lifecycle=KV_OFFLOAD_LIFECYCLE, clock=ManualClock())
    handle = manager.open(1)
    for event in sequence:
        expected = expected_state(handle.state, event.name, lifecycle=KV_OFFLOAD_LIFECYCLE)
        event.apply(handle)
        assert handle.state is expected
