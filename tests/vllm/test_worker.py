"""The worker half on kvfsm's LocalBackend: bytes, tails, aborts, deadlines (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the worker half moves torch tensors")

from kvfsm import ConfigError, FailureKind, KVPoll  # noqa: E402
from kvfsm.compat.vllm._config import ConnectorConfig  # noqa: E402
from kvfsm.compat.vllm._params import RemoteSource  # noqa: E402
from kvfsm.compat.vllm._plan import AbortSpec, RecvSpec, SendSpec, StepPlan  # noqa: E402
from kvfsm.compat.vllm._worker import kv_pools, local_prefill_address  # noqa: E402

from .local_pair import Clock, Pair, block, new_engine_id, same  # noqa: E402


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(clock: Clock) -> Iterator[Pair]:
    pair = Pair(clock)
    yield pair
    pair.close()


def test_a_transfer_moves_every_block_byte_exact(pair: Pair) -> None:
    pair.plan("r", src=(5, 6, 7), dst=(1, 2, 3))
    pair.until(lambda: "r" in pair.sent and "d-r" in pair.recvd)
    assert not pair.failed and not pair.errors
    for src, dst in ((5, 1), (6, 2), (7, 3)):
        assert same(block(pair.p_kv, src), block(pair.d_kv, dst))
    assert not pair.prefill.busy and not pair.decode.busy
    assert pair.prefill.stats.sent == 1 and pair.decode.stats.loaded == 1
    assert pair.prefill.prefill is not None and pair.prefill.prefill.stats.final_states[KVPoll.Success] == 1


def test_a_decode_with_a_cached_prefix_gets_the_tail(pair: Pair) -> None:
    pair.plan("r", src=(5, 6, 7), dst=(9,))
    pair.until(lambda: "r" in pair.sent and "d-r" in pair.recvd)
    assert same(block(pair.p_kv, 7), block(pair.d_kv, 9))
    assert not same(block(pair.p_kv, 5), block(pair.d_kv, 9))


def test_over_mooncake_too(clock: Clock) -> None:
    from ..integration.remote_peer import engine_missing, free_port

    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)
    pair = Pair(clock, backend="mooncake", port=free_port(), heartbeat_interval=0.1)
    try:
        pair.plan("whole", src=(5, 6, 7), dst=(1, 2, 3))
        pair.plan("tail", src=(8, 9, 10), dst=(11, 12))
        pair.until(lambda: pair.sent == {"whole", "tail"} and pair.recvd == {"d-whole", "d-tail"}, steps=10000)
        assert not pair.failed
        for src, dst in ((5, 1), (6, 2), (7, 3), (9, 11), (10, 12)):
            assert same(block(pair.p_kv, src), block(pair.d_kv, dst))
    finally:
        pair.close()


def test_a_decode_expecting_more_than_the_prefill_holds_fails_both_at_once(pair: Pair) -> None:
    pair.plan("r", src=(5,), dst=(1, 2))
    pair.until(lambda: "r" in pair.sent and "d-r" in pair.recvd)
    assert pair.failed == {"d-r"} and pair.errors == {1, 2}
    assert pair.prefill.stats.failed_sends == 1 and pair.decode.stats.failed_loads == 1


def test_a_release_frees_the_prefills_blocks_without_waiting_for_its_lease(pair: Pair) -> None:
    room = f"{pair.engine}/r"
    pair.prefill.start(StepPlan(send=[SendSpec("r", room, (5, 6))]))
    pair.decode.start(StepPlan(recv=[RecvSpec("d-r", room, pair.source("r", (5, 6)), (), release_only=True)]))
    pair.until(lambda: "r" in pair.sent and not pair.decode.busy)
    assert not pair.recvd, "a release is not a load: vLLM must not hear of it"
    assert pair.decode.stats.releases == 1 and pair.prefill.stats.failed_sends == 1


def test_an_abort_while_waiting_frees_the_decodes_blocks(pair: Pair) -> None:
    room = f"{pair.engine}/r"
    pair.prefill.start(StepPlan(send=[SendSpec("r", room, (5,))]))
    pair.decode.start(StepPlan(recv=[RecvSpec("d-r", room, pair.source("r", (5,)), (1,))]))
    pair.decode.poll()  # expects its block; the prefill's worker has not polled, nothing was sent
    pair.decode.start(StepPlan(abort=[AbortSpec("d-r", "client went away")]))
    _, recvd, failed = pair.decode.poll()
    assert recvd == failed == {"d-r"} and pair.decode.take_load_errors() == {1}
    # The prefill's room failed with it (from the peer): its blocks come back at its next poll.
    sent, _, _ = pair.prefill.poll()
    assert sent == {"r"} and pair.prefill.stats.failed_sends == 1
    # An abort after the load was reported is a late one: counted, nothing else.
    pair.decode.start(StepPlan(abort=[AbortSpec("d-r", "again")]))
    assert pair.decode.stats.late_aborts == 1


def test_an_abort_before_the_prefill_held_the_room_leaves_it_to_the_lease(pair: Pair, clock: Clock) -> None:
    # The local backend forgets a room both sides closed; a remote prefill keeps the early
    # ABORT instead (tests/vllm/test_two_process.py). Either way the blocks come back.
    room = f"{pair.engine}/r"
    pair.decode.start(StepPlan(recv=[RecvSpec("d-r", room, pair.source("r", (5,)), (1,))]))
    pair.decode.start(StepPlan(abort=[AbortSpec("d-r", "client went away")]))
    assert pair.decode.poll() == (set(), {"d-r"}, {"d-r"})
    pair.prefill.start(StepPlan(send=[SendSpec("r", room, (5,))]))
    assert pair.prefill.poll()[0] == set()
    clock.now += ConnectorConfig().hold_timeout + 1
    assert pair.prefill.poll()[0] == {"r"}


def test_an_unclaimed_hold_ends_at_its_deadline(pair: Pair, clock: Clock) -> None:
    pair.prefill.start(StepPlan(send=[SendSpec("r", f"{pair.engine}/r", (5,))]))
    pair.step()
    assert not pair.sent
    clock.now += ConnectorConfig().hold_timeout + 1
    pair.step()
    assert pair.sent == {"r"}
    assert pair.prefill.prefill is not None
    assert pair.prefill.prefill.stats.failure_kinds[FailureKind.TIMEOUT] == 1


def test_a_load_whose_prefill_never_sends_fails_at_its_deadline(pair: Pair, clock: Clock) -> None:
    room = f"{pair.engine}/r"
    pair.prefill.start(StepPlan(send=[SendSpec("r", room, (5,))]))  # held, but its worker never polls again
    pair.decode.start(StepPlan(recv=[RecvSpec("d-r", room, pair.source("r", (5,)), (2,))]))
    for _ in range(5):
        assert pair.decode.poll() == (set(), set(), set())
    clock.now += ConnectorConfig().waiting_timeout + 1
    assert pair.decode.poll() == (set(), {"d-r"}, {"d-r"})
    assert pair.decode.take_load_errors() == {2}


def test_unusable_loads_are_reported_failed_at_once(pair: Pair) -> None:
    nowhere = RemoteSource("no-such-engine", "x", "h", 1, (1,), 1)
    pair.decode.start(
        StepPlan(
            recv=[
                RecvSpec("bad", "!bad", None, (3,), problem="kv_transfer_params['remote_host'] must be ..."),
                RecvSpec("lost", "no-such-engine/x", nowhere, (4,)),
            ]
        )
    )
    assert pair.decode.poll() == (set(), {"bad", "lost"}, {"bad", "lost"})
    assert pair.decode.take_load_errors() == {3, 4}
    assert pair.decode.decode is not None
    assert pair.decode.decode.stats.failure_kinds[FailureKind.BOOTSTRAP_ERROR] == 2


def test_a_second_load_of_a_live_room_is_refused_once(pair: Pair) -> None:
    room = f"{pair.engine}/r"
    spec = RecvSpec("d-1", room, pair.source("r", (5,)), (1,))
    pair.decode.start(StepPlan(recv=[spec, RecvSpec("d-2", room, spec.source, (2,))]))
    assert pair.decode.poll() == (set(), {"d-2"}, {"d-2"})
    assert pair.decode.take_load_errors() == {2}
    assert pair.decode.poll() == (set(), set(), set())


def test_two_tensor_parallel_ranks_move_their_own_shards(clock: Clock) -> None:
    engine = new_engine_id()
    ranks = [Pair(clock, tp_rank=rank, engine=engine) for rank in (0, 1)]
    try:
        for rank in ranks:
            rank.plan("r", src=(3, 4), dst=(10, 11))
        for rank in ranks:
            rank.until(lambda rank=rank: "r" in rank.sent and "d-r" in rank.recvd)  # type: ignore[misc]
        for rank in ranks:
            assert same(block(rank.p_kv, 4), block(rank.d_kv, 11))
        assert not same(block(ranks[0].d_kv, 11), block(ranks[1].d_kv, 11))
    finally:
        for rank in ranks:
            rank.close()


def test_shutdown_fails_live_rooms_and_unregisters(clock: Clock) -> None:
    pair = Pair(clock)
    pair.plan("r", src=(5,), dst=(1,))
    assert local_prefill_address(pair.engine, 0) is not None
    pair.close()
    assert local_prefill_address(pair.engine, 0) is None
    assert pair.prefill.prefill is not None and pair.prefill.prefill.counts()[KVPoll.Failed] == 1


def test_registering_twice_is_refused(pair: Pair) -> None:
    with pytest.raises(ConfigError, match="called twice"):
        pair.decode.register(pair.d_kv)


def test_work_for_the_other_role_ends_at_once(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    # vLLM's scheduler half follows each request's params, whatever the engine's kv_role.
    pair.decode.start(StepPlan(send=[SendSpec("p", "x/p", (1,))]))
    pair.prefill.start(
        StepPlan(recv=[RecvSpec("d", "x/d", None, (2,)), RecvSpec("e", "x/e", None, (), release_only=True)])
    )
    assert pair.decode.poll() == ({"p"}, set(), set())
    assert pair.prefill.poll() == (set(), {"d"}, {"d"}) and pair.prefill.take_load_errors() == {2}
    assert "not a KV producer" in caplog.text and "not a KV consumer" in caplog.text
    assert pair.decode.poll() == pair.prefill.poll() == (set(), set(), set())


# -- vLLM's KV cache tensors as pools ----------------------------------------------------------


def test_block_first_layers_are_one_region_each() -> None:
    pools = kv_pools({"b": torch.zeros(8, 2, 4), "a": torch.zeros(8, 2, 4)}, 8)
    assert [r.name for r in pools.kv] == ["a", "b"] and pools.num_pages == 8
    assert pools.kv[0].page_nbytes == 2 * 4 * 4


def test_kv_first_layers_are_split_into_k_and_v() -> None:
    pools = kv_pools({"a": torch.zeros(2, 8, 4)}, 8)
    assert [r.name for r in pools.kv] == ["a.k", "a.v"] and pools.num_pages == 8


def test_layers_sharing_one_cache_register_it_once() -> None:
    shared = torch.zeros(8, 4)
    assert len(kv_pools({"a": shared, "b": shared}, 8).kv) == 1


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(4, 8, 2), r"expected \[num_blocks=8, ...\]"),
        (torch.zeros(4, 8).t(), "not block-contiguous"),
        (torch.zeros(8, 2, 4).transpose(0, 1), "not block-contiguous"),
    ],
)
def test_layouts_the_backends_cannot_page_are_refused(tensor: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kv_pools({"a": tensor}, 8)


def test_no_caches_is_refused() -> None:
    with pytest.raises(ConfigError, match="no KV cache tensors"):
        kv_pools({}, 8)
