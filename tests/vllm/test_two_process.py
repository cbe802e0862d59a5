"""A prefill and a decode vLLM engine in two processes, KV moved over Mooncake on CPU tensors.

Each process runs vLLM 0.33.0's scheduler with the kvfsm connector on both
roles and a fake model runner (`engine_peer.EnginePeer`); the KV bytes go
through kvfsm's MooncakeBackend (TCP on 127.0.0.1) and the decode checks
them block by block before its forward touches them. Then an abort on
each side and a killed prefill: every request ends, both engines end
empty, and nothing waits longer than the deadline that applies. Every
wait is bounded; every process is stopped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from ..integration.remote_peer import engine_missing, free_port  # noqa: E402
from .engine_peer import EnginePeer  # noqa: E402

WAIT = 30.0
DRAIN = 2.0
#: Both sides' connector settings, unless a test says otherwise.
SETTINGS: dict[str, Any] = {
    "backend": "mooncake",
    "heartbeat_interval": 0.1,
    "heartbeat_misses": 3,
    "drain_timeout": DRAIN,
    "waiting_timeout": 60,
}
_ids = itertools.count()


class PD:
    """A prefill and a decode engine process."""

    def __init__(self, hold_timeout: float = 60.0, **extra: Any) -> None:
        self.engine_id = f"prefill-{next(_ids)}"
        common: dict[str, Any] = {**SETTINGS, **extra}
        self.prefill = EnginePeer(
            "kv_producer", self.engine_id, {**common, "port": free_port(), "hold_timeout": hold_timeout}
        )
        self.decode = EnginePeer("kv_consumer", f"decode-{next(_ids)}", common)
        try:
            self.prefill.ready()
            self.decode.ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def mooncake() -> None:
    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)


@pytest.fixture(scope="module")
def pd(mooncake: None) -> Iterator[PD]:
    pair = PD(hold_timeout=3.0)
    yield pair
    pair.stop()


def new_failures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Failure kinds counted on a worker between two `info()` snapshots."""
    kinds = after["failure_kinds"]
    grown = {kind: n - before["failure_kinds"].get(kind, 0) for kind, n in kinds.items()}
    return {kind: n for kind, n in grown.items() if n}


def tokens_for(seed: int, blocks: float) -> list[int]:
    return [seed * 1000 + i for i in range(int(16 * blocks))]


def test_kv_moves_between_processes_byte_exact(pd: PD) -> None:
    tokens = tokens_for(1, 3.5)
    params = pd.prefill.prefill("p1", tokens)
    assert len(params["remote_block_ids"][0]) == 4
    pd.decode.add("d1", tokens, params, 3)
    sending = pd.prefill.start("run", "empty", None, WAIT, timeout=WAIT + 10)
    loaded = pd.decode.run("finished", "d1", WAIT, timeout=WAIT + 10)
    sent = sending.result()
    assert loaded["load"] == {"failed": False, "wrong_blocks": [], "errors": 0}
    assert loaded["status"] == "FINISHED_LENGTH_CAPPED" and loaded["empty"]
    assert sent["reached"] and sent["final_states"] == {"Success": 1}


def test_a_decode_abort_frees_both_sides(pd: PD) -> None:
    tokens = tokens_for(2, 2.5)
    params = pd.prefill.prefill("p2", tokens)
    pd.decode.add("d2", tokens, params, 3)
    p_before, d_before = pd.prefill.info(), pd.decode.info()
    # The prefill's engine does not step: it holds the room and sends nothing.
    assert pd.decode.run("parked", "d2", WAIT)["reached"]
    assert pd.decode.abort("d2") == "FINISHED_ABORTED"
    decode = pd.decode.run("empty", "d2", WAIT)
    # Freed once the prefill proved (ABORT_ACK from its control plane) that nothing can land.
    assert decode["reached"] and new_failures(d_before, decode) == {"aborted": 1}
    assert decode["load"]["failed"]
    assert decode["drain_deadline_releases"] == d_before["drain_deadline_releases"]
    prefill = pd.prefill.run("empty", None, WAIT)
    assert prefill["reached"] and new_failures(p_before, prefill) == {"aborted": 1}


def test_a_prefill_that_gave_up_fails_the_late_decode_at_once(pd: PD) -> None:
    tokens = tokens_for(3, 2.5)
    params = pd.prefill.prefill("p3", tokens)
    p_before, d_before = pd.prefill.info(), pd.decode.info()
    # No decode comes within the prefill's 3 s hold: its blocks come back.
    prefill = pd.prefill.run("empty", None, 3.0 + WAIT)
    assert prefill["reached"] and new_failures(p_before, prefill) == {"timeout": 1}
    # The decode that comes late hears so from the prefill (an ABORT carrying the room's
    # own failure, its hold TIMEOUT: PEER_FAILED here), not from its own 60 s deadline.
    pd.decode.add("d3", tokens, params, 3)
    decode = pd.decode.run("empty", "d3", WAIT)
    assert decode["reached"] and decode["status"] == "FINISHED_ERROR"
    assert decode["load"]["failed"] and decode["load"]["errors"] == 3
    assert new_failures(d_before, decode) == {"peer_failed": 1}


def test_a_killed_prefill_fails_the_waiting_load_and_frees_it_after_the_drain_deadline(mooncake: None) -> None:
    # A killed prefill proves nothing: by default its decode room is quarantined at the drain
    # deadline (tests/unit/test_release_phase.py checks that on the worker half). This test runs
    # the opt-in timer release, the only way such a load ends without a fence or an operator.
    pair = PD(on_drain_deadline="release")
    try:
        tokens = tokens_for(4, 2.5)
        params = pair.prefill.prefill("p4", tokens)
        pair.decode.add("d4", tokens, params, 3)
        assert pair.decode.run("parked", "d4", WAIT)["reached"]
        pair.prefill.kill()
        decode = pair.decode.run("empty", "d4", WAIT)
        # No ABORT_ACK can come from a dead prefill: its writes might still land until the drain deadline.
        assert decode["reached"] and decode["status"] == "FINISHED_ERROR"
        assert decode["failure_kinds"] == {"peer_lost": 1}
        assert decode["load"]["failed"] and decode["drain_deadline_releases"] == 1
    finally:
        pair.stop()


def test_a_waiting_decode_keeps_its_prefills_hold_by_lease_and_a_killed_one_frees_it_in_a_lease(
    mooncake: None,
) -> None:
    # Issue 20 / vLLM #41383: a hold for a dead decode was pinned for hold_timeout (480 s).
    lease = 3.0  # renewed every 0.5 s: a decode stalled that long by a busy host still renews in time
    engine = f"prefill-{next(_ids)}"
    # A 3 s heartbeat window: the stuck load must stay live (and counted) for four leases. With 0.3 s,
    # a loaded CI machine lost the prefill once (PEER_LOST), and a failed load no longer takes the slot.
    common: dict[str, Any] = {
        "backend": "mooncake",
        "heartbeat_interval": 0.1,
        "heartbeat_misses": 30,
        "lease_duration": lease,
    }
    prefill = EnginePeer("kv_producer", engine, {**common, "port": free_port(), "hold_timeout": 120})
    decode = EnginePeer("kv_consumer", f"decode-{next(_ids)}", {**common, "max_inflight_loads": 1})
    try:
        prefill.ready()
        decode.ready()
        tokens = tokens_for(5, 2.5)
        params = prefill.prefill("p5", tokens)
        # The decode's one load slot is taken by a load of a request the prefill never held (its
        # claim waits for a hold that never comes), so the request for p5 waits in vLLM's queue:
        # the decode intends to load it, and renews its lease.
        nowhere = {**params, "remote_request_id": "never-held"}
        decode.add("d-stuck", tokens_for(6, 1.5), nowhere, 2)
        decode.add("d5", tokens, params, 2)
        stepping = decode.start("run", "never", None, 4 * lease, timeout=4 * lease + 30)
        held = prefill.run("never", None, 4 * lease, timeout=4 * lease + 30)
        assert not held["empty"] and held["failure_kinds"] == {}, "renewed: still held after four leases"
        stepping.result()
        decode.kill()
        freed = prefill.run("empty", None, 3 * lease + 10, timeout=3 * lease + 40)
        assert freed["reached"] and freed["failure_kinds"] == {"timeout": 1}
        assert "expired_leases=1" in str(freed["scheduler"])
    finally:
        decode.stop()
        prefill.stop()


def test_a_killed_prefills_quarantined_load_does_not_hold_up_another_prefills_request(mooncake: None) -> None:
    """Bulkhead (DESIGN.md: one peer must never hold up another), with the default quarantine.

    The decode runs one load at a time (`max_inflight_loads: 1`). Its load
    from prefill A waits; A is killed, so the load fails and its blocks stay
    quarantined (nothing proves A's writes drained). The request from live
    prefill B must still load. On the old count (every open load), it waited
    in vLLM's queue for as long as the quarantine lasted: until an operator.
    """
    # A 3 s heartbeat window, so that only the killed prefill is lost (the lease test says why).
    common: dict[str, Any] = {**SETTINGS, "heartbeat_misses": 30}
    dead = EnginePeer("kv_producer", f"prefill-{next(_ids)}", {**common, "port": free_port(), "hold_timeout": 60})
    live = EnginePeer("kv_producer", f"prefill-{next(_ids)}", {**common, "port": free_port(), "hold_timeout": 60})
    decode = EnginePeer("kv_consumer", f"decode-{next(_ids)}", {**common, "max_inflight_loads": 1})
    try:
        for peer in (dead, live, decode):
            peer.ready()
        tokens_a, tokens_b = tokens_for(7, 2.5), tokens_for(8, 2.5)
        params_a = dead.prefill("pa", tokens_a)
        params_b = live.prefill("pb", tokens_b)
        decode.add("d-a", tokens_a, params_a, 3)
        assert decode.run("parked", "d-a", WAIT)["reached"]  # A holds the room and never sends
        decode.add("d-b", tokens_b, params_b, 3)
        dead.kill()
        sending = live.start("run", "empty", None, WAIT + DRAIN, timeout=WAIT + DRAIN + 10)
        loaded = decode.run("finished", "d-b", WAIT + DRAIN, timeout=WAIT + DRAIN + 10)
        assert loaded["reached"], f"the live prefill's request was held up: {loaded}"
        assert loaded["status"] == "FINISHED_LENGTH_CAPPED"
        assert loaded["load"] == {"failed": False, "wrong_blocks": [], "errors": 0}
        assert sending.result()["reached"]
        stuck = decode.info("d-a")
        assert stuck["status"] not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"), stuck
        assert stuck["failure_kinds"] == {"peer_lost": 1}
        assert "stopped_loads=1" in str(stuck["scheduler"])
    finally:
        decode.stop()
        live.stop()
        dead.stop()
