"""The Mooncake adapter's submit and poll, against a scripted stand-in for Mooncake's `TransferEngine`.

What is pinned down: a job reads every batch exactly once and in order
(Mooncake frees a batch when its status is read as done or failed, so a
second read would ask about a freed id), stops at the first batch still
running and resumes there, and a check that raises leaves that batch to be
read again. A submit answered 0 is "busy" (the writes that went out are
handed back to be waited for); -1, 2**64 - 1 or any other negative id is an
engine error, never a batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfsm.backends import mooncake
from kvfsm.backends._errors import BackendError
from kvfsm.backends.remote import EngineBusy, PartialSubmit


class ScriptedEngine:
    """Answers `transfer_submit_write` and `transfer_check_status` from scripts; records every call."""

    def __init__(self) -> None:
        self.batch_ids: Iterator[int] = iter(range(100, 10_000))
        self.statuses: dict[int, list[int | Exception]] = {}
        self.checks: list[int] = []
        self.freed: set[int] = set()

    def initialize(self, *_args: object) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 1

    def transfer_submit_write(self, target: str, src: int, dst: int, length: int) -> int:
        return next(self.batch_ids)

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.freed, f"batch {batch} was read after Mooncake freed it"
        self.checks.append(batch)
        answer = self.statuses[batch].pop(0)
        if isinstance(answer, Exception):
            raise answer
        if answer in (1, -1):
            self.freed.add(batch)
        return answer


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> mooncake.MooncakeEngine:
    monkeypatch.setattr(mooncake, "_import_engine", lambda: ScriptedEngine)
    return mooncake.MooncakeEngine()


WRITES = [(0, 0, 16), (16, 16, 16), (32, 32, 16)]


def test_every_batch_is_read_once_in_order_and_polling_resumes_at_the_running_one(
    engine: mooncake.MooncakeEngine,
) -> None:
    te = engine.te
    assert isinstance(te, ScriptedEngine)
    te.statuses = {100: [1], 101: [0, -2, 1], 102: [1]}
    job = engine.submit("peer", WRITES)
    assert job.poll() == "pending"
    assert job.poll() == "timeout"  # slow, not over: asked again later
    assert job.poll() == "done"
    assert job.poll() == "done"  # nothing is read again once every batch ended
    assert te.checks == [100, 101, 101, 101, 102]


def test_a_failed_batch_fails_the_job_once_every_batch_was_read(engine: mooncake.MooncakeEngine) -> None:
    te = engine.te
    assert isinstance(te, ScriptedEngine)
    te.statuses = {100: [-1], 101: [7], 102: [0, 1]}  # 7: a status this adapter does not know
    job = engine.submit("peer", WRITES)
    assert job.poll() == "pending"
    assert job.poll() == "failed"
    assert te.checks == [100, 101, 102, 102]


def test_a_check_that_raises_leaves_its_batch_to_be_read_again(engine: mooncake.MooncakeEngine) -> None:
    te = engine.te
    assert isinstance(te, ScriptedEngine)
    te.statuses = {100: [1], 101: [RuntimeError("binding hiccup"), 1], 102: [1]}
    job = engine.submit("peer", WRITES)
    with pytest.raises(RuntimeError, match="binding hiccup"):
        job.poll()
    assert job.poll() == "done"
    assert te.checks == [100, 101, 101, 102]


def test_a_refused_submit_is_busy_and_hands_back_what_went_out(engine: mooncake.MooncakeEngine) -> None:
    te = engine.te
    assert isinstance(te, ScriptedEngine)
    te.batch_ids = iter([100, 0])
    te.statuses = {100: [1]}
    with pytest.raises(EngineBusy) as caught:
        engine.submit("peer", WRITES)
    assert caught.value.submitted == 1 and caught.value.job is not None
    assert caught.value.job.poll() == "done"


@pytest.mark.parametrize("answer", [-1, (1 << 64) - 1, -7])
def test_an_id_that_is_no_batch_is_an_engine_error(engine: mooncake.MooncakeEngine, answer: int) -> None:
    te = engine.te
    assert isinstance(te, ScriptedEngine)
    te.batch_ids = iter([answer])
    with pytest.raises(BackendError, match=f"returned {answer}"):
        engine.submit("peer", WRITES)
    te.batch_ids = iter([100, answer])  # after a write went out: it is handed back to be waited for
    te.statuses = {100: [1]}
    with pytest.raises(PartialSubmit) as caught:
        engine.submit("peer", WRITES)
    assert caught.value.submitted == 1 and caught.value.job.poll() == "done"
