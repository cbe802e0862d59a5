"""The vLLM bugs of issue 14, each replayed against the kvfsm connector.

| bug | what went wrong in vLLM | here |
|---|---|---|
| #46283 (PR #46289) | a decode request aborted in WAITING_FOR_REMOTE_KVS held its blocks until KV ran out: they are freed only on `finished_recving`, which never came once the prefill stopped answering | `test_46283_*` |
| PR #25067 | a `finished_sending` for a request the scheduler had already freed crashed the engine (`KeyError`, today `assert req_id in self.requests`) | `test_25067_*`, also run on vLLM's NixlConnector (strict xfail: it crashes) |
| #58222 (PR #50789) | expired prefill leases were never reclaimed: the reaper stopped at the first unexpired entry, and heartbeats renew entries in place | `test_58222_*`, also run on the pre-fix reaper (`vllm_reference`, strict xfail) |
| PR #50754 | push mode: the prefill failed to post a write and only logged it; the decode waited for the lease to expire holding half-written blocks | `test_50754_*` |

The in-process tests run two real vLLM 0.33.0 schedulers (`harness.Engine`)
on kvfsm's LocalBackend with an injected clock: a test that passes only
because a deadline fired advances it, the others keep it frozen. The
same bugs across processes (a killed prefill, peer aborts) are in
`test_two_process.py`. Not shown on vLLM's own connector, because it needs
NIXL agents and a second engine rather than a scheduler: #46283 and
PR #50754 (vLLM 0.33.0 has the fixes of both; the pre-fix code paths are
not reachable from its scheduler alone).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from kvfsm import FailureKind, KVPoll
from kvfsm.compat.vllm._config import ConnectorConfig
from kvfsm.compat.vllm._plan import RecvSpec, SendSpec, StepPlan

from . import _env
from .vllm_reference import PreFixLeaseReaper

_ids = itertools.count()


@pytest.fixture
def harness() -> ModuleType:
    """The vLLM engine harness; skips (saying why) where vLLM is not installed."""
    missing = _env.vllm_missing()
    if missing:
        pytest.skip(missing)
    from . import harness

    return harness


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engines(harness: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Clock, Callable[..., Any]]]:
    """(clock, make): engines whose worker deadlines run on `clock`."""
    from kvfsm.compat.vllm import KVFSMConnector

    clock = Clock()
    monkeypatch.setattr(KVFSMConnector, "clock", clock)
    made: list[Any] = []

    def make(kv_role: str, **kwargs: Any) -> Any:
        engine = harness.Engine(kv_role, f"{kv_role}-{next(_ids)}", **kwargs)
        made.append(engine)
        return engine

    yield clock, make
    for engine in made:
        engine.shutdown()


def prefill(harness: ModuleType, engine: Any, request_id: str, tokens: list[int]) -> dict[str, Any]:
    engine.add(harness.make_request(request_id, tokens, max_tokens=1, params={"do_remote_decode": True}))
    for _ in range(10):
        for output in engine.step():
            if output.request_id == request_id and output.kv_transfer_params is not None:
                return dict(output.kv_transfer_params)
    raise AssertionError("the prefill did not finish")


def parked_decode(harness: ModuleType, make: Callable[..., Any], **decode: Any) -> tuple[Any, Any, Any]:
    """A prefill holding a request and a decode parked waiting for it; the prefill's worker never steps again."""
    p = make("kv_producer", extra={"backend": "local"})
    d = make("kv_consumer", extra={"backend": "local"}, **decode)
    tokens = list(range(64, 64 + 40))
    params = prefill(harness, p, "p1", tokens)
    p.step()  # its worker holds the room; from now on the prefill is hung: it sends nothing
    request = d.add(harness.make_request("d1", tokens, max_tokens=4, params=params))
    for _ in range(3):
        d.step()
    from vllm.v1.request import RequestStatus

    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    return p, d, request


# -- vllm #46283: an aborted (or never-fed) load holds its blocks forever ------------------------


def test_46283_an_abort_while_waiting_for_a_hung_prefill_frees_the_blocks(
    harness: ModuleType, engines: tuple[Clock, Callable[..., Any]]
) -> None:
    from vllm.v1.request import RequestStatus

    _clock, make = engines
    _p, d, request = parked_decode(harness, make)
    d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert d.scheduler.requests, "vLLM keeps an aborted request's blocks until finished_recving"
    for _ in range(3):
        d.step()
    assert d.empty(), "the clock never moved: no deadline freed these blocks, the abort did"
    assert request.status is RequestStatus.FINISHED_ABORTED


def test_46283_a_load_whose_prefill_never_sends_ends_at_its_deadline(
    harness: ModuleType, engines: tuple[Clock, Callable[..., Any]]
) -> None:
    from vllm.v1.request import RequestStatus

    clock, make = engines
    _p, d, request = parked_decode(harness, make)
    for _ in range(20):
        d.step()
    assert not d.empty()
    clock.now += ConnectorConfig().waiting_timeout + 1
    for _ in range(3):
        d.step()
    assert d.empty() and request.status is RequestStatus.FINISHED_ERROR
    decode = d.worker.worker_half
    assert decode.decode.stats.failure_kinds[FailureKind.TIMEOUT] == 1


# -- vllm PR #25067: a late finished_sending for a freed request crashes the scheduler ---------------

CONNECTORS = [
    pytest.param(("KVFSMConnector", "kvfsm.compat.vllm"), id="kvfsm"),
    pytest.param(
        ("NixlConnector", None),
        id="vllm-nixl",
        marks=pytest.mark.xfail(
            strict=True, raises=AssertionError, reason="vLLM's scheduler asserts on a notice for a freed request"
        ),
    ),
]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("late", ["again-after-free", "never-held"])
def test_25067_a_late_finished_sending_is_absorbed(harness: ModuleType, connector: tuple[str, Any], late: str) -> None:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    name, module = connector
    scheduler = harness.scheduler("kv_producer", connector=name, module=module)
    tokens = list(range(40))
    held = harness.make_request("p1", tokens, max_tokens=1, params={"do_remote_decode": True})
    aborted = harness.make_request("p2", tokens, max_tokens=1, params={"do_remote_decode": True})
    scheduler.add_request(held)
    scheduler.add_request(aborted)
    output = scheduler.schedule()
    # The client gives up on p2 while its prefill runs: vLLM frees it at once, nothing is held.
    scheduler.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, harness.model_output(scheduler, output))
    assert held.status is RequestStatus.FINISHED_LENGTH_CAPPED and "p1" in scheduler.requests
    # A client abort after the request finished: a no-op since PR #25067.
    scheduler.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    scheduler.update_from_output(
        output, harness.model_output(scheduler, output, KVConnectorOutput(finished_sending={"p1"}))
    )
    assert harness.scheduler_empty(scheduler)
    # The late notice: the same one again (a stale worker, an expiry racing the decode's read),
    # or one for the request that was never held.
    stale = "p1" if late == "again-after-free" else "p2"
    output = scheduler.schedule()
    scheduler.update_from_output(
        output, harness.model_output(scheduler, output, KVConnectorOutput(finished_sending={stale}))
    )
    assert harness.scheduler_empty(scheduler)
    assert scheduler.connector.scheduler_half.stats.absorbed_notices == 1


# -- vllm #58222: expired leases stranded behind a renewed one --------------------------------------


class KvfsmPrefill:
    """The kvfsm prefill worker: a renewed lease is a room the decode claimed (a later phase)."""

    def __init__(self, clock: Clock) -> None:
        from kvfsm.backends.local import Faults

        from .local_pair import Pair

        # The claimed room's bytes stall in flight, so it stays held, like a renewed lease.
        self.pair = Pair(
            clock,  # type: ignore[arg-type]
            hold_timeout=30,
            transfer_timeout=600,
            backend_options={"faults": Faults(stall_rate=1.0)},
        )
        self.freed: set[str] = set()

    def hold(self, request_id: str) -> None:
        room = f"{self.pair.engine}/{request_id}"
        self.pair.prefill.start(StepPlan(send=[SendSpec(request_id, room, (1,))]))

    def renew(self, request_id: str) -> None:
        room = f"{self.pair.engine}/{request_id}"
        source = self.pair.source(request_id, (1,))
        self.pair.decode.start(StepPlan(recv=[RecvSpec(f"d-{request_id}", room, source, (2,))]))
        self.pair.decode.poll()

    def reap(self) -> set[str]:
        freed, _, _ = self.pair.prefill.poll()
        self.pair.decode.poll()
        return freed

    def close(self) -> None:
        self.pair.close()


class ReferencePrefill:
    """vLLM's pre-fix reaper: a renewed lease is a heartbeat extending it in place."""

    def __init__(self, clock: Clock) -> None:
        self.reaper = PreFixLeaseReaper(clock)

    def hold(self, request_id: str) -> None:
        self.reaper.hold(request_id, 30)

    def renew(self, request_id: str) -> None:
        self.reaper.heartbeat(request_id, 600)

    def reap(self) -> set[str]:
        return self.reaper.reap()

    def close(self) -> None:
        return


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(KvfsmPrefill, id="kvfsm"),
        pytest.param(
            ReferencePrefill,
            id="vllm-0.27-reaper",
            marks=pytest.mark.xfail(strict=True, reason="the reaper stops at the renewed head entry"),
        ),
    ],
)
def test_58222_every_expired_hold_is_reclaimed_whatever_the_order(make: Callable[[Clock], Any]) -> None:
    clock = Clock()
    prefill = make(clock)
    try:
        for request_id in ("r0", "r1", "r2"):
            prefill.hold(request_id)
        assert prefill.reap() == set()
        clock.now += 20
        prefill.renew("r0")  # the decode is busy with the oldest one
        assert prefill.reap() == set()
        clock.now += 11  # r1 and r2 expired; r0 did not
        freed = prefill.reap()
        assert freed == {"r1", "r2"}, f"expired holds not reclaimed: {sorted({'r1', 'r2'} - freed)}"
    finally:
        prefill.close()


def test_58222_the_renewed_hold_ends_at_its_own_deadline() -> None:
    clock = Clock()
    prefill = KvfsmPrefill(clock)
    try:
        prefill.hold("r0")
        prefill.renew("r0")
        assert prefill.reap() == set()
        clock.now += 601
        assert prefill.reap() == {"r0"}
        worker = prefill.pair.prefill.prefill
        assert worker is not None and worker.stats.failure_kinds[FailureKind.TIMEOUT] == 1
        assert worker.counts()[KVPoll.Transferring] == 0
    finally:
        prefill.close()


# -- vllm PR #50754: a write the prefill failed to post leaves the decode waiting for the lease ------


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_50754_a_failed_write_on_the_prefill_fails_the_decodes_load_at_once(
    harness: ModuleType, engines: tuple[Clock, Callable[..., Any]], policy: str
) -> None:
    from vllm.v1.request import RequestStatus

    from kvfsm.backends.local import Faults

    _clock, make = engines
    failing = {"backend": "local", "backend_options": {"faults": Faults(fail_rate=1.0, seed=1)}}
    p = make("kv_producer", extra=failing)
    d = make("kv_consumer", extra={"backend": "local"}, policy=policy)
    tokens = list(range(200, 240))
    params = prefill(harness, p, "p1", tokens)
    request = d.add(harness.make_request("d1", tokens, max_tokens=3, params=params))
    harness.run_until([p, d], lambda: any("d1" in report[2] for report in d.reports), steps=200)
    # The clock is frozen: no lease or deadline ended this load, the prefill's failure did.
    (failed_step,) = [report for report in d.reports if "d1" in report[2]]
    assert failed_step[3], "the failed load's blocks are reported to vLLM as load errors"
    harness.run_until([p, d], lambda: request.is_finished() and p.empty() and d.empty(), steps=200)
    if policy == "fail":
        assert request.status is RequestStatus.FINISHED_ERROR
    else:
        # Recomputed locally: the decode's own forward wrote every block.
        assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    decode = d.worker.worker_half
    assert decode.decode.stats.failure_kinds[FailureKind.PEER_FAILED] == 1
