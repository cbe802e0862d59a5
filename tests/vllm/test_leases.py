"""Leases (`kvfsm.compat.vllm._leases`): a prefill's hold lives while its decode renews it.

Issue 20 / vLLM #41383: a prefill's blocks for a decode that died stayed
pinned for `hold_timeout` (480 s). Now each hold is a lease the decode
renews while it intends to load; nobody renewing frees it after
`lease_duration`, and a claimed hold is never freed by its lease. The lease
book, the two scheduler halves over an in-memory channel, the workers'
expiry, and the ZeroMQ channel itself; no vLLM needed. Deadlines run on
injected clocks, except the channel's round trips.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvfsm import FailureKind, KVPoll
from kvfsm.compat.vllm._config import ConnectorConfig
from kvfsm.compat.vllm._leases import MAX_IDS_PER_FRAME, LeaseBook, LeaseChannel, renew_all
from kvfsm.compat.vllm._plan import SchedulerHalf, StepPlan

from .local_pair import Clock, Pair


def test_a_renewed_lease_lives_and_an_unrenewed_one_expires_whatever_the_order() -> None:
    clock = Clock()
    book = LeaseBook(30.0, clock)
    for request in ("head", "a", "b"):
        book.grant(request)
    expired: list[str] = []
    for _ in range(5):  # the head is renewed for 50 s: vllm #58222's reaper stopped at it
        clock.now += 10
        assert book.renew("head")
        expired += book.expired()
        if clock.now < 1030:
            assert expired == []
    assert expired == ["a", "b"]
    assert set(book.manager) == {book.manager.get("head")}
    assert book.renewed == 5
    clock.now += 31
    assert book.expired() == ["head"] and len(book) == 0


def test_an_expired_lease_cannot_be_renewed_back_to_life() -> None:
    clock = Clock()
    book = LeaseBook(30.0, clock)
    book.grant("r")
    clock.now += 30
    assert book.renew("r") is False and book.late_renewals == 1
    assert book.expired() == ["r"]
    assert book.renew("never-held") is False and book.late_renewals == 2


def test_renewals_for_another_engine_are_ignored() -> None:
    clock = Clock()
    book = LeaseBook(30.0, clock)
    book.grant("r")
    clock.now += 20
    assert renew_all(book, "P", [("Q", ["r"], 1), ("P", ["x"], 1)]) == 0
    clock.now += 11
    assert book.expired() == ["r"]


class Bus:
    """An in-memory lease channel: what a decode sends, the prefill receives."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int, str, list[str], int]] = []
        self.delivered = 0
        self.down = False

    def send(self, host: str, port: int, engine_id: str, request_ids: list[str], tp_size: int = 0) -> None:
        if not self.down:
            self.frames.append((host, port, engine_id, list(request_ids), tp_size))

    def receive(self) -> list[tuple[str, list[str], int]]:
        got = [(engine, ids, tp) for _, _, engine, ids, tp in self.frames[self.delivered :]]
        self.delivered = len(self.frames)
        return got


class Outbox:
    """The decode's end of the bus: it sends, and nobody renews the decode's own (absent) holds."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    def send(self, host: str, port: int, engine_id: str, request_ids: list[str], tp_size: int = 0) -> None:
        self.bus.send(host, port, engine_id, request_ids, tp_size)

    def receive(self) -> list[tuple[str, list[str], int]]:
        return []


def halves(clock: Clock, bus: Bus, **extra: Any) -> tuple[SchedulerHalf, SchedulerHalf]:
    config = ConnectorConfig.from_extra({"backend": "local", "port": 7000, **extra})
    prefill = SchedulerHalf(config, engine_id="P", tp_size=2, renewals=bus, clock=clock)
    decode = SchedulerHalf(config, engine_id="D", tp_size=2, renewals=Outbox(bus), clock=clock)
    return prefill, decode


def test_a_decode_that_intends_to_load_keeps_the_hold_and_one_that_died_frees_it_in_a_lease() -> None:
    clock, bus = Clock(), Bus()
    prefill, decode = halves(clock, bus)
    hold, params = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1, 2])
    assert hold and params is not None
    prefill.build()
    decode.new_request("d1", params)  # the request reached the decode; it waits for blocks for a while
    for _ in range(60):  # ten minutes of decode steps, a renewal every 5 s
        clock.now += 10
        decode.build()
        assert prefill.build().expire == []
    # Renewals go to the prefill's lease port: its first port plus its TP size.
    assert {(host, port, engine, tp) for host, port, engine, _, tp in bus.frames} == {("127.0.0.1", 7002, "P", 2)}
    bus.down = True  # the decode died
    clock.now += 29
    assert prefill.build().expire == []
    clock.now += 2
    assert prefill.build().expire == ["r1"]
    assert prefill.stats.expired_leases == 1
    report = prefill.report()
    assert report is not None and report["expired_leases"] == 1


def test_a_decode_stops_renewing_once_its_load_ended_and_the_prefill_forgets_the_lease() -> None:
    clock, bus = Clock(), Bus()
    prefill, decode = halves(clock, bus)
    _, params = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    assert params is not None
    prefill.build()
    decode.new_request("d1", params)
    decode.after_alloc("d1", params, [5], 16)
    decode.build()
    sent = len(bus.frames)
    assert sent == 1
    assert decode.notices(None, {"d1"}) == (set(), {"d1"})
    assert prefill.notices({"r1"}, None) == ({"r1"}, set())
    for _ in range(10):
        clock.now += 10
        decode.build()
        assert prefill.build().expire == []
    assert len(bus.frames) == sent, "nothing more to renew"
    assert prefill.leases is not None and len(prefill.leases) == 0


def test_a_request_finished_before_its_load_stops_renewing_at_once() -> None:
    clock, bus = Clock(), Bus()
    prefill, decode = halves(clock, bus)
    _, params = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    assert params is not None
    decode.new_request("d1", params)
    decode.request_finished("d1", params, finished_ok=False, block_ids=[])
    decode.build()
    assert bus.frames == []
    assert decode.renewer is not None and "d1" not in decode.renewer


def test_leases_can_be_switched_off() -> None:
    clock, bus = Clock(), Bus()
    prefill, _ = halves(clock, bus, lease_duration=None)
    prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    clock.now += 3600
    assert prefill.build().expire == [] and prefill.leases is None


def test_an_expired_lease_frees_an_unclaimed_hold_and_never_a_claimed_one() -> None:
    clock = Clock()
    pair = Pair(clock)
    try:
        pair.prefill.start(StepPlan(send=[SendSpecs.one("lonely", (1,))]))
        pair.plan("claimed", (2, 3), (4, 5))
        pair.until(
            lambda: pair.prefill.prefill is not None and pair.prefill.prefill.counts()[KVPoll.Bootstrapping] == 1
        )
        pair.prefill.start(StepPlan(expire=["lonely", "claimed", "unknown"]))
        pair.until(lambda: "lonely" in pair.sent and "claimed" in pair.sent and "d-claimed" in pair.recvd)
        assert "d-claimed" not in pair.failed, "the claimed hold was sent, not freed"
        manager = pair.prefill.prefill
        assert manager is not None and manager.stats.failure_kinds[FailureKind.TIMEOUT] == 1
    finally:
        pair.close()


class SendSpecs:
    @staticmethod
    def one(request: str, blocks: tuple[int, ...]) -> Any:
        from kvfsm.compat.vllm._plan import SendSpec

        return SendSpec(request, f"nobody/{request}", blocks)


# -- the ZeroMQ channel ------------------------------------------------------------------------


@pytest.fixture
def channels() -> Iterator[list[LeaseChannel]]:
    pytest.importorskip("zmq", reason="pyzmq is needed for the lease channel (pip install pyzmq)")
    made: list[LeaseChannel] = []
    yield made
    for channel in made:
        channel.close()


def _receive(channel: LeaseChannel, frames: int) -> list[tuple[str, list[str], int]]:
    got: list[tuple[str, list[str], int]] = []
    for _ in range(400):  # bounded: 2 s of loopback
        got += channel.receive()
        if len(got) >= frames:
            break
        time.sleep(0.005)
    return got


def test_the_channel_carries_renewals_and_drops_forged_ones(channels: list[LeaseChannel]) -> None:
    from ..integration.remote_peer import free_port

    key = "k" * 16
    prefill, decode, forger = LeaseChannel(key), LeaseChannel(key), LeaseChannel("x" * 16)
    channels += [prefill, decode, forger]
    port = free_port()
    prefill.listen("127.0.0.1", port)
    forger.send("127.0.0.1", port, "P", ["r1"])
    decode.send("127.0.0.1", port, "P", ["r1", "r2"], 4)
    assert _receive(prefill, 1) == [("P", ["r1", "r2"], 4)]
    assert prefill.dropped == 1, "the frame without the shared key's MAC"


def test_a_taken_lease_port_is_refused_naming_it(channels: list[LeaseChannel]) -> None:
    from kvfsm import ConfigError

    from ..integration.remote_peer import free_port

    first, second = LeaseChannel(), LeaseChannel()
    channels += [first, second]
    port = free_port()
    first.listen("127.0.0.1", port)
    with pytest.raises(ConfigError, match=f"lease port 127.0.0.1:{port}"):
        second.listen("127.0.0.1", port)


def test_a_prefill_whose_lease_port_is_taken_holds_without_leases_and_says_so(
    channels: list[LeaseChannel], caplog: pytest.LogCaptureFixture
) -> None:
    from ..integration.remote_peer import free_port

    port = free_port()
    taken = LeaseChannel()
    channels.append(taken)
    taken.listen("127.0.0.1", port + 1)
    mine = LeaseChannel()
    channels.append(mine)
    config = ConnectorConfig.from_extra({"backend": "local", "port": port})
    prefill = SchedulerHalf(config, engine_id="P", tp_size=1, renewals=mine)
    hold, _ = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    assert hold and prefill.leases is None  # never raises in vLLM's hook
    assert "are not leased" in caplog.text


def test_malformed_frames_are_dropped_and_counted(channels: list[LeaseChannel]) -> None:
    import zmq

    from ..integration.remote_peer import free_port

    prefill = LeaseChannel()
    channels.append(prefill)
    port = free_port()
    prefill.listen("127.0.0.1", port)
    push: Any = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        for frame in (b"not json", b'{"v": 2}', b'{"v": 1, "engine": "P", "requests": [1]}', b"[]"):
            push.send(frame)
        push.send_multipart([b"{}", b"extra"])
        push.send(
            b'{"v": 1, "engine": "P", "requests": '
            + str(["r"] * (MAX_IDS_PER_FRAME + 1)).replace("'", '"').encode()
            + b"}"
        )
        push.send(b'{"v": 1, "engine": "P", "requests": ["x"], "tp": -1}')
        push.send(b'{"v": 1, "engine": "P", "requests": ["ok"]}')
        assert _receive(prefill, 1) == [("P", ["ok"], 0)]
        assert prefill.dropped == 7
    finally:
        push.close(0)


def test_a_clients_oversized_request_id_is_not_renewed_and_sinks_no_other_renewal() -> None:
    # One frame carries many requests' renewals: an id too long for it must not take them down.
    from kvfsm.compat.vllm._leases import MAX_ID_CHARS

    clock, bus = Clock(), Bus()
    prefill, decode = halves(clock, bus)
    _, params = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    assert params is not None
    decode.new_request("d1", params)
    decode.new_request("d-huge", {**params, "remote_request_id": "x" * (MAX_ID_CHARS + 1)})
    decode.build()
    assert [frame[3] for frame in bus.frames] == [["r1"]]
    assert decode.renewer is not None and decode.renewer.too_long == 1


def test_a_decode_of_a_larger_tp_size_announces_it_and_the_prefill_slices_the_hold_once() -> None:
    clock, bus = Clock(), Bus()
    config = ConnectorConfig.from_extra({"backend": "local", "port": 7000})
    prefill = SchedulerHalf(config, engine_id="P", tp_size=1, renewals=bus, clock=clock)
    decode = SchedulerHalf(config, engine_id="D", tp_size=4, renewals=Outbox(bus), clock=clock)
    _, params = prefill.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[1])
    assert params is not None
    prefill.build()
    decode.new_request("d1", params)
    decode.build()
    assert prefill.build().slices == [("r1", 4)]
    clock.now += 10
    decode.build()
    assert prefill.build().slices == [], "sliced once"
