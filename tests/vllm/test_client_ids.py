"""Client-chosen ids never raise out of a connector hook (issue 22, item 4; no vLLM needed).

vLLM takes request ids from its clients, and stops its engine core on an
exception from a connector hook. Before the fix the kvfsm connector raised
`InvalidRoomId` out of `request_finished` for a 1,100-character request id,
out of the prefill worker's `start_load_kv` for 1,000 characters (the room
`engine_id/request_id` must fit in 1,024), and out of the decode worker's
for a `remote_request_id` or `remote_engine_id` of 2,000. Now each such id
maps to a room id that fits, the same on both sides, and the transfer moves
every byte as any other.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch", reason="the worker half moves torch tensors")

from kvfsm._states import MAX_ROOM_ID_CHARS  # noqa: E402
from kvfsm.compat.vllm._config import ConnectorConfig  # noqa: E402
from kvfsm.compat.vllm._params import RemoteSource, prefill_params, room_id  # noqa: E402
from kvfsm.compat.vllm._plan import RecvSpec, SchedulerHalf, SendSpec, StepPlan  # noqa: E402

from .local_pair import Clock, Pair, block, same  # noqa: E402

LONG = "r" * 1100


def _half(engine: str = "E") -> SchedulerHalf:
    return SchedulerHalf(ConnectorConfig.from_extra({"backend": "local"}), engine_id=engine, tp_size=1)


def test_request_finished_takes_a_request_id_of_any_length() -> None:
    plan = _half()
    hold, params = plan.request_finished(LONG, {"do_remote_decode": True}, finished_ok=True, block_ids=[4, 5])
    assert hold is True and params is not None and params["remote_request_id"] == LONG
    (send,) = plan.build().send
    assert send.request_id == LONG and len(send.room) <= MAX_ROOM_ID_CHARS
    assert send.room == room_id("E", LONG)
    assert plan.notices({LONG}, None) == ({LONG}, set())
    assert plan.held == frozenset()


def test_a_decode_parks_a_load_whose_remote_ids_are_any_length() -> None:
    plan = _half()
    params = prefill_params(
        engine_id="P" * 2000, request_id="q" * 2000, host="h", port=5000, block_ids=(0, 1), tp_size=1
    )
    assert plan.matched_tokens(params, 16, 0) == (16, True)
    plan.after_alloc("d" * 1500, params, [3, 4], 16)
    (recv,) = plan.build().recv
    assert recv.problem is None and len(recv.room) <= MAX_ROOM_ID_CHARS
    assert recv.room == room_id("P" * 2000, "q" * 2000)
    assert plan.notices(None, {"d" * 1500}) == (set(), {"d" * 1500})


def test_two_ids_that_map_to_one_room_get_one_each_in_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest collision (forced here): the scheduler's rooms stay in this process, so the second takes another."""
    from kvfsm.compat import _room_ids
    from kvfsm.compat.vllm import _plan

    first, second = "x" * 1100 + "1", "x" * 1100 + "2"
    real = _room_ids.fit_text
    monkeypatch.setattr(_plan, "fit_text", lambda key: "collides" if key in (first, second) else real(key))
    plan = _half()
    for request in (first, second):
        assert plan.request_finished(request, {"do_remote_decode": True}, finished_ok=True, block_ids=[1])[0]
    assert len(plan.prefill) == 2
    plan.build()
    assert plan.notices({first, second}, None) == ({first, second}, set())
    assert len(plan.prefill) == 0


def test_a_second_request_on_a_held_transfer_room_is_refused_alone(pair: Pair) -> None:
    """Two live requests on one transfer room (a digest collision): the newcomer is reported at once, not held."""
    room = room_id(pair.engine, "p")
    pair.prefill.start(StepPlan(send=[SendSpec("p", room, (5,)), SendSpec("other", room, (6,))]))
    sent, _, _ = pair.prefill.poll()
    assert sent == {"other"}
    assert pair.prefill.stats.sent == 0


@pytest.fixture
def pair() -> Iterator[Pair]:
    pair = Pair(Clock(), engine="E" * 600)
    yield pair
    pair.close()


@pytest.mark.parametrize(("prefill_request", "decode_request"), [("p" * 1000, "d-short"), ("p" * 2000, "d" * 2000)])
def test_workers_move_a_transfer_whose_ids_are_long(pair: Pair, prefill_request: str, decode_request: str) -> None:
    room = room_id(pair.engine, prefill_request)
    source = RemoteSource(pair.engine, prefill_request, pair.config.host, pair.config.port, (5, 6), 1)
    pair.prefill.start(StepPlan(send=[SendSpec(prefill_request, room, (5, 6))]))
    pair.decode.start(StepPlan(recv=[RecvSpec(decode_request, room, source, (1, 2))]))
    pair.until(lambda: prefill_request in pair.sent and decode_request in pair.recvd)
    assert not pair.failed and not pair.errors
    assert same(block(pair.p_kv, 5), block(pair.d_kv, 1)) and same(block(pair.p_kv, 6), block(pair.d_kv, 2))
