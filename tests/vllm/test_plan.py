"""The scheduler half on its own: holds, loads, aborts and the notices vLLM may see (no vLLM needed)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm import FailureKind, KVPoll
from kvfsm.compat.vllm._config import ConnectorConfig
from kvfsm.compat.vllm._params import prefill_params
from kvfsm.compat.vllm._plan import AbortSpec, RecvSpec, SchedulerHalf, SendSpec

CONFIG = ConnectorConfig.from_extra({"backend": "local"})


def half(**extra: Any) -> SchedulerHalf:
    return SchedulerHalf(ConnectorConfig.from_extra({"backend": "local", **extra}), engine_id="E", tp_size=1)


def decode_params(request: str = "p1", blocks: tuple[int, ...] = (0, 1, 2)) -> dict[str, Any]:
    return prefill_params(engine_id="P", request_id=request, host="h", port=5000, block_ids=blocks, tp_size=1)


# -- prefill ---------------------------------------------------------------------------------


def test_a_finished_prefill_is_held_until_its_one_notice() -> None:
    plan = half()
    hold, params = plan.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[4, 5])
    assert hold is True and params is not None
    assert params["remote_engine_id"] == "E" and params["remote_request_id"] == "r1"
    assert params["remote_block_ids"] == [[4, 5]] and params["remote_port"] == CONFIG.port
    assert plan.prefill.status("r1") is KVPoll.Bootstrapping
    step = plan.build()
    assert step.send == [SendSpec("r1", "E/r1", (4, 5))] and not step.recv and not step.abort
    assert plan.prefill.status("r1") is KVPoll.WaitingForInput
    assert plan.held == frozenset({"r1"})
    assert plan.notices({"r1"}, None) == ({"r1"}, set())
    assert plan.held == frozenset()
    # The same notice again (a stale worker's, an expiry racing the decode's read): dropped.
    assert plan.notices({"r1"}, None) == (set(), set())
    assert plan.stats.absorbed_notices == 1
    assert plan.prefill.stats.final_states[KVPoll.Success] == 1


def test_an_aborted_prefill_holds_nothing() -> None:
    plan = half()
    assert plan.request_finished("r1", {"do_remote_decode": True}, finished_ok=False, block_ids=[4]) == (False, None)
    assert not plan.build() and plan.stats.holds == 0


def test_a_prefill_without_blocks_is_not_held_but_still_tells_its_decode() -> None:
    hold, params = half().request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[])
    assert hold is False and params is not None and params["remote_block_ids"] == [[]]


def test_requests_without_transfer_params_are_not_touched() -> None:
    plan = half()
    assert plan.matched_tokens(None, 40, 0) == (0, False)
    plan.after_alloc("r1", None, [1, 2], 0)
    assert plan.request_finished("r1", None, finished_ok=True, block_ids=[1]) == (False, None)
    assert plan.request_finished("r1", {}, finished_ok=True, block_ids=[1]) == (False, None)
    assert not plan.build()


# -- decode ---------------------------------------------------------------------------------


def test_a_decode_loads_the_prompt_beyond_its_local_hits() -> None:
    plan = half()
    params = decode_params()
    assert plan.matched_tokens(params, 40, 0) == (40, True)
    assert plan.matched_tokens(params, 40, 16) == (24, True)
    assert plan.matched_tokens(params, 40, 40) == (0, False)
    plan.after_alloc("d1", params, [7, 8], 24)
    assert params["do_remote_prefill"] is False
    # vLLM calls again after the load: nothing more happens.
    plan.after_alloc("d1", params, [7, 8, 9], 0)
    step = plan.build()
    assert len(step.recv) == 1
    (recv,) = step.recv
    assert (recv.request_id, recv.room, recv.blocks, recv.problem, recv.release_only) == (
        "d1",
        "P/p1",
        ((7, 8),),
        None,
        False,
    )
    assert recv.source is not None and recv.source.block_ids == ((0, 1, 2),)
    assert plan.decode.status("d1") is KVPoll.WaitingForInput
    assert plan.notices(None, {"d1"}) == (set(), {"d1"})
    assert plan.decode.stats.final_states[KVPoll.Success] == 1


def test_a_second_load_of_the_same_prefill_request_waits() -> None:
    plan = half()
    first, second = decode_params(), decode_params()
    plan.after_alloc("d1", first, [1], 16)
    assert plan.matched_tokens(second, 16, 0) == (None, False)
    assert plan.stats.deferred_lookups == 1
    plan.build()
    plan.notices(None, {"d1"})
    assert plan.matched_tokens(second, 16, 0) == (16, True)


def test_max_inflight_loads_asks_vllm_to_retry() -> None:
    plan = half(max_inflight_loads=1)
    plan.after_alloc("d1", decode_params("a"), [1], 16)
    assert plan.matched_tokens(decode_params("b"), 16, 0) == (None, False)
    plan.build()
    plan.notices(None, {"d1"})
    assert plan.matched_tokens(decode_params("b"), 16, 0) == (16, True)


def test_loads_stopped_by_a_dead_prefill_do_not_defer_the_other_requests() -> None:
    """A dead prefill's loads wait, quarantined, for proof of drain: they must not fill `max_inflight_loads`.

    On the old count (every open load), once two loads of a dead prefill
    were quarantined, every other request was deferred until an operator
    released them.
    """
    plan = half(max_inflight_loads=2)
    plan.after_alloc("d1", decode_params("a"), [1], 16)
    plan.after_alloc("d2", decode_params("b"), [2], 16)
    plan.build()
    assert plan.matched_tokens(decode_params("c"), 16, 0) == (None, False)
    stopped = {"d1": "PEER_LOST in Transferring: no heartbeat", "d2": "PEER_LOST in Transferring: no heartbeat"}
    plan.loads_stopped(stopped)
    plan.loads_stopped(stopped)  # the workers repeat it every step until the loads drain
    assert plan.stats.stopped_loads == 2
    assert plan.matched_tokens(decode_params("c"), 16, 0) == (16, True)
    assert plan.matched_tokens(decode_params("a"), 16, 0) == (None, False)  # the same prefill request still waits
    assert {"d1", "d2"} <= plan.held  # vLLM has not heard of them: their blocks stay held
    assert plan.notices(None, set(), failed_recving=set()) == (set(), set())
    _, recving = plan.notices(None, {"d1"}, failed_recving={"d1"})
    assert recving == {"d1"} and "d1" not in plan.held
    assert not plan.decode.holds_pages("d1")  # the workers' report is the proof: nothing kept after close


def test_a_failed_load_leaves_nothing_held_in_the_scheduler() -> None:
    """The scheduler's room of a failed load is a mirror: the workers' report proves its drain (no leak)."""
    plan = half()
    for index in range(50):
        plan.after_alloc(f"d{index}", decode_params(f"r{index}"), [1], 16)
    plan.build()
    _, recving = plan.notices(None, {f"d{index}" for index in range(50)}, failed_recving={"d0", "d1"})
    assert len(recving) == 50
    assert not any(plan.decode.holds_pages(f"d{index}") for index in range(50))


def test_a_stopped_notice_for_an_unknown_or_unhanded_load_changes_nothing() -> None:
    plan = half(max_inflight_loads=1)
    plan.after_alloc("d1", decode_params("a"), [1], 16)  # not handed to the workers yet (no build)
    plan.loads_stopped({"d1": "forged", "nobody": "forged"})
    assert plan.stats.stopped_loads == 0
    assert plan.matched_tokens(decode_params("c"), 16, 0) == (None, False)


def test_a_full_local_hit_releases_the_prefills_blocks() -> None:
    plan = half()
    plan.after_alloc("d1", decode_params(), [], 0)
    (recv,) = plan.build().recv
    assert recv.release_only and recv.blocks == ((),) and recv.room == "P/p1"
    assert "d1" not in plan.decode and plan.stats.releases == 1


def test_an_early_abort_releases_the_prefills_blocks() -> None:
    plan = half()
    params = decode_params()
    assert plan.request_finished("d1", params, finished_ok=False, block_ids=[]) == (False, None)
    (recv,) = plan.build().recv
    assert recv.release_only and params["do_remote_prefill"] is False


def test_a_prefill_of_a_tp_size_the_workers_cannot_map_is_released_at_once_never_left_pinned() -> None:
    # Issue 20: the decode computed locally and sent no release; the prefill's blocks stayed
    # pinned until its hold deadline (480 s).
    plan = half()
    other = {**decode_params(), "tp_size": 4}
    assert plan.matched_tokens(other, 40, 0) == (0, False)
    plan.after_alloc("d1", other, [], 0)
    (recv,) = plan.build().recv
    assert recv.release_only and recv.room == "P/p1"
    assert plan.stats.refused_tp == 1 and plan.stats.invalid_params == 0
    report = plan.report()
    assert report is not None and report["refused_tp"] == 1


def test_unusable_params_compute_locally_or_fail_the_parked_load() -> None:
    plan = half()
    bad = {**decode_params(), "remote_port": "x"}
    assert plan.matched_tokens(bad, 40, 0) == (0, False)
    plan.after_alloc("d1", bad, [], 0)
    assert not plan.build() and plan.stats.invalid_params == 1
    # If vLLM parked it anyway (another connector matched tokens), the load must still end.
    plan.after_alloc("d2", {**decode_params(), "remote_host": ""}, [3], 16)
    (recv,) = plan.build().recv
    assert recv.problem is not None and "remote_host" in recv.problem and recv.source is None


def test_an_abort_while_loading_reaches_the_workers_and_the_notice_still_frees() -> None:
    plan = half()
    plan.after_alloc("d1", decode_params(), [1, 2], 32)
    plan.build()
    assert plan.request_finished("d1", {"do_remote_prefill": False}, finished_ok=False, block_ids=[]) == (False, None)
    assert plan.build().abort == [AbortSpec("d1", "vLLM finished the request before its KV arrived")]
    assert plan.decode.failure("d1") is not None
    # Finishing again (vLLM calls once, but never mind) queues nothing more.
    plan.request_finished("d1", {"do_remote_prefill": False}, finished_ok=False, block_ids=[])
    assert not plan.build()
    assert plan.notices(None, {"d1"}) == (set(), {"d1"})
    # The late "success" did not overwrite the abort.
    assert plan.decode.stats.final_states == {KVPoll.Success: 0, KVPoll.Failed: 1}
    assert plan.decode.stats.failure_kinds[FailureKind.ABORTED] == 1


def test_failed_loads_end_failed() -> None:
    plan = half()
    plan.after_alloc("d1", decode_params("a"), [1, 2], 32)
    plan.after_alloc("d2", decode_params("b"), [3], 16)
    plan.build()
    assert plan.notices(None, {"d1", "d2"}, failed_recving={"d1"}, invalid_block_ids={3}) == (set(), {"d1", "d2"})
    assert plan.decode.stats.final_states == {KVPoll.Success: 0, KVPoll.Failed: 2}


def test_unknown_notices_are_dropped_not_raised() -> None:
    plan = half()
    assert plan.notices({"never"}, {"nor-this"}) == (set(), set())
    assert plan.stats.absorbed_notices == 2


def test_a_notice_from_before_the_hand_off_is_not_genuine() -> None:
    plan = half()
    plan.after_alloc("d1", decode_params(), [1], 16)
    plan.request_finished("r1", {"do_remote_decode": True}, finished_ok=True, block_ids=[4])
    # No worker was told of either yet.
    assert plan.notices({"r1"}, {"d1"}) == (set(), set())
    assert plan.stats.absorbed_notices == 2
    plan.build()
    assert plan.notices({"r1"}, {"d1"}) == ({"r1"}, {"d1"})


def test_a_recv_spec_is_plain_data() -> None:
    spec = RecvSpec("d", "P/p", None, (1,), problem="x")
    assert spec == RecvSpec("d", "P/p", None, (1,), problem="x")


# -- every interleaving ---------------------------------------------------------------------

REQUESTS = st.sampled_from([f"r{i}" for i in range(6)])


class SchedulerHalfMachine(RuleBasedStateMachine):
    """vLLM's scheduler and hostile workers in any order: each held request gets exactly one notice."""

    def __init__(self) -> None:
        super().__init__()
        self.plan = half()
        self.held: set[str] = set()  # what the model says the connector holds
        self.used: set[str] = set()  # request ids vLLM already used (ids are not reused)
        self.passed: list[str] = []

    @precondition(lambda self: len(self.used) < 6)
    @rule(request=REQUESTS, ok=st.booleans(), blocks=st.integers(0, 3))
    def prefill_finishes(self, request: str, ok: bool, blocks: int) -> None:
        if request in self.used:
            return
        self.used.add(request)
        hold, _ = self.plan.request_finished(
            request, {"do_remote_decode": True}, finished_ok=ok, block_ids=list(range(blocks))
        )
        assert hold == (ok and blocks > 0)
        if hold:
            self.held.add(request)

    @precondition(lambda self: len(self.used) < 6)
    @rule(request=REQUESTS, tokens=st.integers(0, 3))
    def decode_parks(self, request: str, tokens: int) -> None:
        if request in self.used:
            return
        self.used.add(request)
        params = decode_params(f"src-{request}")
        count, is_async = self.plan.matched_tokens(params, 48, 48 - 16 * tokens)
        if count is None:
            return
        self.plan.after_alloc(request, params, list(range(tokens)), count)
        if count > 0:
            assert is_async
            self.held.add(request)

    @rule(request=REQUESTS)
    def request_ends(self, request: str) -> None:
        self.plan.request_finished(request, {"do_remote_prefill": False}, finished_ok=False, block_ids=[])

    @rule()
    def build(self) -> None:
        self.plan.build()

    @rule(requests=st.lists(REQUESTS, max_size=4), failed=st.lists(REQUESTS, max_size=2), sending=st.booleans())
    def workers_report(self, requests: list[str], failed: list[str], sending: bool) -> None:
        notices = set(requests)
        premature = {r for r in notices & self.held if r in self.plan.prefill or r in self.plan.decode}
        premature = {
            r
            for r in premature
            if (self.plan.prefill.get(r) if r in self.plan.prefill else self.plan.decode.get(r)).state
            is KVPoll.Bootstrapping
        }
        if sending:
            sent, recvd = self.plan.notices(notices, None)
            kept = sent
        else:
            sent, recvd = self.plan.notices(None, notices, failed_recving=set(failed))
            kept = recvd
        assert not (sent and recvd)
        assert kept <= self.held, "a notice for a request the connector does not hold reached vLLM"
        assert not kept & premature, "a notice from before the hand-off reached vLLM"
        self.held -= kept
        self.passed.extend(kept)

    @invariant()
    def each_request_freed_once(self) -> None:
        assert len(self.passed) == len(set(self.passed))

    @invariant()
    def the_model_agrees(self) -> None:
        assert self.plan.held == frozenset(self.held)
        assert len(self.plan.prefill) + len(self.plan.decode) == len(self.held)


TestSchedulerHalfMachine = SchedulerHalfMachine.TestCase
