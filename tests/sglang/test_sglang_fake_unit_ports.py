"""SGLang's own CPU unit tests of the fake classes, run on SGLang's fakes and on kvfsm's.

Ported case for case (same calls, same assertions; pytest instead of
unittest, parametrized over both implementations) from
sgl-project/sglang `test/registered/unit/disaggregation/`:

* `test_fake_kv_sender.py` (the version that matches 0.5.23's
  `fake/conn.py`: waiting deadline armed at the first poll after `init()`,
  `waiting_since` / `waiting_timeout` / `inited`), all 11 cases;
* from `test_decode_queue_cleanup.py`, the one case that tests a fake
  class: `test_fake_receiver_initializes_deferred_release_state`.

Left out, with the reason:

* `test_fake_sender_chunked.py` is written for another SGLang version's
  fake (it passes `dest_tp_ranks`/`pp_rank` to the constructor and expects
  Success only after the last chunk); 0.5.23's own fake fails it (its
  constructor rejects those arguments, and any chunk concludes it), so it
  says nothing about a drop-in for 0.5.23.
* The other cases of `test_decode_queue_cleanup.py` drive SGLang's queues
  with hand-made receiver stand-ins, not the fake classes: the queue
  behaviour they check is covered for kvfsm's classes by
  test_sglang_queues_differential.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple
from unittest.mock import MagicMock

import numpy as np
import pytest

from tests.sglang._sglang import module, sglang_or_skip

sglang_or_skip()

from kvfsm.compat import sglang as kvfsm_sglang  # noqa: E402

base_conn = module("sglang.srt.disaggregation.base.conn")
fake_conn = module("sglang.srt.disaggregation.fake.conn")
utils = module("sglang.srt.disaggregation.utils")
envs = module("sglang.srt.environ").envs
KVPoll = base_conn.KVPoll


class Fakes(NamedTuple):
    manager: Any
    sender: Any
    receiver: Any


IMPLEMENTATIONS = {
    "sglang": Fakes(fake_conn.FakeKVManager, fake_conn.FakeKVSender, fake_conn.FakeKVReceiver),
    "kvfsm": Fakes(kvfsm_sglang.FakeKVManager, kvfsm_sglang.FakeKVSender, kvfsm_sglang.FakeKVReceiver),
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def fakes(request: pytest.FixtureRequest) -> Fakes:
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def mgr(fakes: Fakes) -> Iterator[Any]:
    manager = fakes.manager(
        args=base_conn.KVArgs(), disaggregation_mode=utils.DisaggregationMode.PREFILL, server_args=MagicMock()
    )
    yield manager
    shutdown = getattr(manager, "shutdown", None)
    if shutdown is not None:
        shutdown()


def make_sender(fakes: Fakes, mgr: Any) -> Any:
    return fakes.sender(mgr=mgr, bootstrap_addr="fake_addr:1234", bootstrap_room=42)


@pytest.fixture
def sender(fakes: Fakes, mgr: Any) -> Any:
    return make_sender(fakes, mgr)


def waiting_since(sender: Any) -> float | None:
    return sender.waiting_since  # type: ignore[no-any-return]


def expire_deadline(sender: Any, by: float = 1.0) -> None:
    """Push the armed deadline `by` seconds past the timeout."""
    sender.waiting_since -= sender.waiting_timeout + by


def test_polls_before_send_stay_waiting_for_input(sender: Any) -> None:
    sender.init(3, 5)
    for _ in range(1000):
        assert sender.poll() == KVPoll.WaitingForInput
    assert sender.conclude_state is None


def test_normal_send_flow(sender: Any) -> None:
    sender.init(3, 5)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.send(np.array([0, 1, 2], dtype=np.int32))
    assert sender.has_sent
    assert sender.poll() == KVPoll.Success
    assert sender.conclude_state == KVPoll.Success
    assert sender.poll() == KVPoll.Success


def test_zero_page_last_chunk_still_sends(sender: Any) -> None:
    assert sender.should_send_kv_chunk(0, last_chunk=True)
    assert not sender.should_send_kv_chunk(0, last_chunk=False)
    assert sender.should_send_kv_chunk(3, last_chunk=False)


def test_fully_cached_request_concludes(sender: Any) -> None:
    sender.init(0, 0)
    page_indices = np.array([], dtype=np.int32)
    if sender.should_send_kv_chunk(len(page_indices), True):
        sender.send(page_indices)
    assert sender.poll() == KVPoll.Success


def test_send_without_init_or_poll(sender: Any) -> None:
    sender.send(np.array([0, 1], dtype=np.int32))
    assert sender.poll() == KVPoll.Success


def test_waiting_timeout_fails_a_stuck_sender(sender: Any) -> None:
    sender.init(1, 0)
    assert sender.poll() == KVPoll.WaitingForInput
    expire_deadline(sender)
    assert sender.poll() == KVPoll.Failed
    assert sender.conclude_state == KVPoll.Failed
    sender.send(np.array([0], dtype=np.int32))
    assert sender.poll() == KVPoll.Failed


def test_poll_does_not_read_the_timeout_off_the_manager(fakes: Fakes) -> None:
    class ManagerWithoutWaitingTimeout:
        pass

    sender = make_sender(fakes, ManagerWithoutWaitingTimeout())
    sender.init(1, 0)
    assert sender.poll() == KVPoll.WaitingForInput
    expire_deadline(sender)
    assert sender.poll() == KVPoll.Failed


def test_queue_and_prefill_time_is_not_charged_to_the_deadline(sender: Any) -> None:
    sender.init(1, 0)
    assert sender.waiting_since is None
    after_init = time.monotonic()
    assert sender.poll() == KVPoll.WaitingForInput
    armed_at = waiting_since(sender)  # read after the poll (mypy would keep the narrowing above)
    assert armed_at is not None
    assert armed_at >= after_init


def test_no_timeout_before_init(sender: Any) -> None:
    assert not sender.inited
    for _ in range(100):
        assert sender.poll() == KVPoll.WaitingForInput
    assert sender.waiting_since is None


def test_timeout_is_configurable(fakes: Fakes, mgr: Any) -> None:
    with envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.override(600):
        sender = make_sender(fakes, mgr)
    assert sender.waiting_timeout == 600
    sender.init(1, 0)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.waiting_since -= 599
    assert sender.poll() == KVPoll.WaitingForInput
    sender.waiting_since -= 2
    assert sender.poll() == KVPoll.Failed


def test_abort_sets_failed_state(sender: Any) -> None:
    sender.abort()
    assert sender.conclude_state == KVPoll.Failed
    assert sender.poll() == KVPoll.Failed


def test_fake_receiver_initializes_deferred_release_state(fakes: Fakes) -> None:
    manager = MagicMock()
    receiver = fakes.receiver(manager, "")
    assert receiver.kv_mgr is manager
    assert not receiver.abort_notified
