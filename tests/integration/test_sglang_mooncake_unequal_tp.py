"""kvfsm's SGLang Mooncake trio across unequal attention TP sizes, over real Mooncake, in one process.

Every rank is a `MooncakeKVManager` of its own (its own Mooncake engine,
control plane and rooms), registered with one bootstrap server as the
ranks of one prefill server are: prefill TP 2 to decode TP 1 (the decode
pulls from both prefill ranks), TP 1 to TP 2 (both decode ranks pull from
the one prefill rank), and TP 2 to TP 4. The KV buffers are SGLang's MHA
layout, `[token rows, local heads, head dim]`; every value says which
token, head, dimension and buffer it belongs to, so a head that lands in
the wrong place, or a row of the wrong page, is seen. The metadata slot
travels too. Then what the request must do when one of its rooms fails,
and the refusals.

tests/sglang/test_sglang_unequal_tp.py runs the same pairings through
SGLang's own queues, in processes, with a two-rank gloo group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvfsm import FailureKind, KVPoll
from kvfsm.compat import sglang
from kvfsm.compat.sglang._heads import Pairing, TPLayout, pairing

from .pairs import poll_until

torch = pytest.importorskip("torch", reason="the KV buffers are torch tensors")
pytest.importorskip("zmq", reason="pyzmq is needed for kvfsm's control plane")
pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is needed (mooncake-transfer-engine-non-cuda)")


WAIT = 20.0
HEADS = 4
HEAD_DIM = 3
LAYERS = 2
PAGE_SIZE = 2
ROWS = 32  # token rows per buffer: 16 pages


@pytest.fixture(autouse=True)
def patient_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to six managers share this process and its GIL: a 30 s heartbeat window, not kvfsm's 3 s, so a
    loaded machine does not lose a peer that is alive. Seen in CI: 'no message for 6.09s (window 3s)',
    and a handshake not done within 10 s while Mooncake removed earlier tests' segments, one a second."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "1")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "30")


def value(buffer: int, row: int, head: int, dim: int) -> float:
    """What the prefill computed for (KV buffer, token row, global head, dimension): exact in float32."""
    return buffer * 100000.0 + row * 100.0 + head * 10.0 + dim


class Rank:
    """One TP rank's KV buffers (K then V of every layer, SGLang's order) and 4 metadata slots."""

    def __init__(self, tp: int, rank: int, *, prefill: bool) -> None:
        self.tp, self.rank = tp, rank
        local = HEADS // tp
        self.heads = range(rank * local, (rank + 1) * local)
        self.kv = [torch.zeros(ROWS, local, HEAD_DIM, dtype=torch.float32) for _ in range(2 * LAYERS)]
        if prefill:
            for index, buffer in enumerate(self.kv):
                for row in range(ROWS):
                    for local_head, head in enumerate(self.heads):
                        for dim in range(HEAD_DIM):
                            buffer[row, local_head, dim] = value(index, row, head, dim)
        self.aux = torch.zeros(4, 16, dtype=torch.int64)

    def kv_args(self) -> sglang.KVArgs:
        args = sglang.KVArgs(
            engine_rank=self.rank, pp_rank=0, system_dp_rank=0, page_size=PAGE_SIZE, kv_cache_dtype_str="auto"
        )
        args.kv_data_ptrs = [b.data_ptr() for b in self.kv]
        args.kv_data_lens = [b.nbytes for b in self.kv]
        args.kv_item_lens = [b[0].nbytes * PAGE_SIZE for b in self.kv]
        args.kv_head_num, args.total_kv_head_num = len(self.heads), HEADS
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [self.aux.data_ptr()], [self.aux.nbytes], [128]
        return args

    def holds(self, pages: list[int], src_pages: list[int]) -> bool:
        """Whether decode pages `pages` hold the prefill's pages `src_pages`, each of this rank's heads right."""
        for index, buffer in enumerate(self.kv):
            for page, src_page in zip(pages, src_pages, strict=True):
                for token in range(PAGE_SIZE):
                    row, src_row = page * PAGE_SIZE + token, src_page * PAGE_SIZE + token
                    for local_head, head in enumerate(self.heads):
                        expected = [value(index, src_row, head, dim) for dim in range(HEAD_DIM)]
                        if buffer[row, local_head].tolist() != expected:
                            return False
        return True

    def untouched_except(self, pages: list[int]) -> bool:
        rows = [p * PAGE_SIZE + t for p in pages for t in range(PAGE_SIZE)]
        keep = torch.ones(ROWS, dtype=torch.bool)
        keep[rows] = False
        return all(not buffer[keep].any() for buffer in self.kv)


class Deployment:
    """A prefill server of `prefill_tp` ranks and a decode server of `decode_tp` ranks."""

    def __init__(self, prefill_tp: int, decode_tp: int) -> None:
        self.server = sglang.MooncakeKVBootstrapServer("127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self.server.port}"
        self.prefill_ranks = [Rank(prefill_tp, r, prefill=True) for r in range(prefill_tp)]
        self.decode_ranks = [Rank(decode_tp, r, prefill=False) for r in range(decode_tp)]
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        try:
            for rank in self.prefill_ranks:
                args = SimpleNamespace(
                    host="127.0.0.1", disaggregation_bootstrap_port=self.server.port, tp_size=prefill_tp
                )
                self.prefills.append(sglang.MooncakeKVManager(rank.kv_args(), sglang.DisaggregationMode.PREFILL, args))
            for rank in self.decode_ranks:
                args = SimpleNamespace(
                    host="127.0.0.1", disaggregation_bootstrap_port=self.server.port, tp_size=decode_tp
                )
                self.decodes.append(sglang.MooncakeKVManager(rank.kv_args(), sglang.DisaggregationMode.DECODE, args))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for manager in [*self.decodes, *self.prefills]:
            manager.shutdown()
        self.server.close()

    def learn_the_prefill_layout(self) -> None:
        for manager in self.decodes:
            wait_until(lambda m=manager: m.try_ensure_parallel_info(self.addr), f"{manager!r} knows the prefill")

    def request(self, room: int, src_pages: list[int], dst_pages: list[int]) -> tuple[list[Any], list[Any]]:
        """SGLang's order on every rank: receivers init and send metadata, senders wait, init and send two chunks.

        First, as SGLang's decode scheduler does (`_ensure_prefill_info`)
        before it builds a receiver, each decode rank retries the look-up of
        the prefill's layout until it is known: one attempt can time out on a
        loaded machine, and `init` without it fails the request ("is healthy
        before, but now it is down"), as SGLang's does. Seen once in CI.
        """
        self.learn_the_prefill_layout()
        receivers = [sglang.MooncakeKVReceiver(m, self.addr, room) for m in self.decodes]
        senders = [sglang.MooncakeKVSender(m, self.addr, room) for m in self.prefills]
        for receiver in receivers:
            receiver.init(0)
        for receiver in receivers:
            assert wait(receiver, KVPoll.WaitingForInput) is KVPoll.WaitingForInput, receiver
        for receiver in receivers:
            receiver.send_metadata(dst_pages, 2, [], 0)
        for sender in senders:
            assert wait(sender, KVPoll.WaitingForInput) is KVPoll.WaitingForInput, sender
        for rank, sender in zip(self.prefill_ranks, senders, strict=True):
            rank.aux[1, :] = room  # what MetadataBuffers.set_buf writes (every TP rank writes the same)
            sender.init(len(src_pages), 1)
        return senders, receivers


def wait(endpoint: Any, wanted: KVPoll, timeout: float = WAIT) -> KVPoll:
    return poll_until(endpoint, wanted, timeout)


def wait_until(condition: Any, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.01)


@pytest.fixture(params=[(2, 1), (1, 2), (2, 4)], ids=lambda p: f"prefill-tp{p[0]}-decode-tp{p[1]}")
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    started = Deployment(*request.param)
    try:
        yield started
    finally:
        started.close()


def test_every_head_lands_in_its_decode_rank(deployment: Deployment) -> None:
    src_pages, dst_pages = [3, 4, 9], [7, 2, 5]
    senders, receivers = deployment.request(41, src_pages, dst_pages)
    for sender in senders:
        sender.send(src_pages[:2], None)
        sender.send(src_pages[2:], [])
    for endpoint in [*senders, *receivers]:
        assert wait(endpoint, KVPoll.Success) is KVPoll.Success, endpoint
    for rank in deployment.decode_ranks:
        assert rank.holds(dst_pages, src_pages), f"decode rank {rank.rank} of {rank.tp}: wrong KV"
        assert rank.untouched_except(dst_pages)
        assert rank.aux[2].tolist() == [41] * 16  # the metadata slot, on every decode rank
    rooms_per_request = {len(r._extra.all()) for r in receivers} | {len(s._extra.all()) for s in senders}
    prefill_tp, decode_tp = len(senders), len(receivers)
    if prefill_tp > decode_tp:
        assert {len(r._extra.all()) for r in receivers} == {prefill_tp // decode_tp}
    elif decode_tp > prefill_tp:
        assert {len(s._extra.all()) for s in senders} == {decode_tp // prefill_tp}
    assert max(rooms_per_request) > 1
    for endpoint in [*senders, *receivers]:
        assert endpoint.release_safe
        endpoint.clear()
    for manager in [*deployment.prefills, *deployment.decodes]:
        assert manager.open_rooms() == [], manager
        assert manager.is_abort_release_safe(41)


def test_a_second_request_on_the_same_pages_reuses_the_rooms_ids(deployment: Deployment) -> None:
    for room in (51, 52):
        senders, receivers = deployment.request(room, [1], [1])
        for sender in senders:
            sender.send([1], None)
        for endpoint in [*senders, *receivers]:
            assert wait(endpoint, KVPoll.Success) is KVPoll.Success
            endpoint.clear()
    for rank in deployment.decode_ranks:
        assert rank.holds([1], [1])


def consensus(endpoints: list[Any], timeout: float = WAIT) -> KVPoll:
    """SGLang's MIN all-reduce of the ranks' polls, until it is terminal."""
    deadline = time.monotonic() + timeout
    while True:
        state = min(KVPoll(endpoint.poll()) for endpoint in endpoints)
        if state in (KVPoll.Success, KVPoll.Failed):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{endpoints} never concluded (MIN is {state.name})")
        time.sleep(0.005)


def test_one_failed_room_fails_the_request_on_every_rank(deployment: Deployment) -> None:
    """An abort on one prefill rank only, then SGLang's failure path on every rank of both servers.

    (A client's abort reaches every rank in SGLang; a lost or failing rank
    does not.) Each server's ranks agree through the MIN all-reduce, then
    call `failure_exception()`, which clears the room on the prefill.
    """
    senders, receivers = deployment.request(61, [2, 3], [4, 5])
    senders[-1].abort()
    for sender in senders[:-1]:
        sender.send([2, 3], None)
    assert consensus(senders) is KVPoll.Failed
    assert consensus(receivers) is KVPoll.Failed
    for receiver in receivers:
        with pytest.raises(sglang.KVTransferError) as caught:
            receiver.failure_exception()
        assert caught.value.failure_reason  # a reason, not "no reason recorded"
        wait_until(lambda r=receiver: r.release_safe, f"{receiver!r}'s pages release-safe")
        receiver.clear()
    for sender in senders:
        with pytest.raises(sglang.KVTransferError):
            sender.failure_exception()  # clears, as SGLang's Common sender does
    for manager in [*deployment.decodes, *deployment.prefills]:
        wait_until(lambda m=manager: m.open_rooms() == [], f"{manager!r} closed every room")
        assert manager.is_abort_release_safe(61)


def test_a_dropped_receiver_releases_all_its_rooms(deployment: Deployment) -> None:
    senders, receivers = deployment.request(71, [1], [1])
    counts = [len(r._extra.all()) for r in receivers]
    del receivers
    for manager in deployment.decodes:
        manager.collect_orphans()
        assert manager.open_rooms() == [], f"rooms left open by a dropped receiver ({counts} rooms per request)"
    for sender in senders:
        assert wait(sender, KVPoll.Failed) is KVPoll.Failed
        sender.clear()


def test_mla_kv_is_not_pulled_from_a_larger_prefill_tp() -> None:
    deployment = Deployment(2, 1)
    try:
        for manager in deployment.decodes:
            manager.tp_layout = TPLayout(1, 0, PAGE_SIZE)  # as an MLA decode rank says
        deployment.learn_the_prefill_layout()
        receiver = sglang.MooncakeKVReceiver(deployment.decodes[0], deployment.addr, 81)
        receiver.init(0)
        assert receiver.poll() is KVPoll.Failed
        reason = receiver.handle.reason
        assert reason is not None and reason.kind is FailureKind.BOOTSTRAP_ERROR
        assert "one side has MLA KV and the other per-head KV (prefill attention TP 2, decode 1)" in reason.message
        receiver.clear()
    finally:
        deployment.close()


def test_a_decode_rank_out_of_its_slot_is_refused_by_the_prefill() -> None:
    """A decode rank 1 of 2 that claims the room itself (not its slot's `sub_room`) fails the request, named."""
    deployment = Deployment(1, 2)
    try:
        manager = deployment.decodes[1]
        honest = manager.tp_layout
        assert pairing(1, honest, HEADS) == Pairing((0,), slot=1, fan_out=2)
        # A buggy decode rank 1 that pairs as if it were rank 0; its engine session still says rank 1.
        manager.tp_layout = TPLayout(2, 0, PAGE_SIZE, HEADS, HEADS // 2)
        deployment.learn_the_prefill_layout()
        receiver = sglang.MooncakeKVReceiver(manager, deployment.addr, 91)
        sender = sglang.MooncakeKVSender(deployment.prefills[0], deployment.addr, 91)
        receiver.init(0)
        assert wait(receiver, KVPoll.WaitingForInput) is KVPoll.WaitingForInput
        receiver.send_metadata([1], 0, [], 0)
        assert wait(sender, KVPoll.Failed) is KVPoll.Failed
        reason = sender.handle.reason
        assert reason is not None and "decode rank 1 of 2 claimed room 91" in reason.message, reason
        assert "must be claimed by slot 0 of 2" in reason.message
        assert wait(receiver, KVPoll.Failed) is KVPoll.Failed
        sender.clear()
        receiver.clear()
    finally:
        deployment.close()


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ({"pp_size": 2}, "does not support a pipeline-parallel prefill (pp_size=2)"),
        ({"attn_cp_size": 2}, "does not support a context-parallel prefill (cp_size=2)"),
        ({"attn_tp_size": 3, "total_kv_heads": 4}, "4 KV heads do not divide over 3 ranks"),
        ({"attn_tp_size": 2, "total_kv_heads": 8}, "the prefill has 8 KV heads, the decode 4"),
        ({"attn_tp_size": 2, "total_kv_heads": None}, "did not say how many KV heads it has"),
    ],
)
def test_what_stays_unsupported_is_refused_at_init_with_its_name(layout: dict[str, Any], expected: str) -> None:
    deployment = Deployment(1, 1)
    try:
        manager = deployment.decodes[0]
        deployment.learn_the_prefill_layout()
        info = manager.prefill_info_table[deployment.addr]
        for name, value in layout.items():
            setattr(info, name, value)  # what the prefill server registered
        receiver = sglang.MooncakeKVReceiver(manager, deployment.addr, 95)
        receiver.init(0)
        assert receiver.poll() is KVPoll.Failed
        reason = receiver.handle.reason
        assert reason is not None and reason.kind is FailureKind.BOOTSTRAP_ERROR
        assert expected in reason.message, reason.message
        receiver.clear()
    finally:
        deployment.close()
