"""`precise_naps()` sets the calling thread's timer slack on Linux, and only there; it never raises."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from kvfsm.backends import _naps

_PR_GET_TIMERSLACK = 30


def _slack_ns() -> int:
    return int(ctypes.CDLL(None).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread setting")
def test_it_sets_one_microsecond_on_the_calling_thread_only() -> None:
    seen: dict[str, int | bool] = {}

    def in_a_thread() -> None:
        seen["before"] = _slack_ns()
        seen["set"] = _naps.precise_naps()
        seen["after"] = _slack_ns()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen["set"] is True and seen["after"] == 1000
    assert seen["before"] != 1000
    assert _slack_ns() != 1000, "the test's own thread kept its slack"


def test_elsewhere_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _naps.precise_naps() is False


def test_a_libc_without_prctl_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")

    def no_libc(*_args: object, **_kwargs: object) -> object:
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert _naps.precise_naps() is False
