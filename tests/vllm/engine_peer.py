"""One vLLM engine (scheduler plus worker connector) in its own process, driven over a pipe.

The two-process tests start a prefill and a decode `EnginePeer`; each runs
a `harness.Engine` (vLLM 0.33.0's scheduler, the kvfsm connector on both
roles, a fake model runner) whose worker connector moves KV over
Mooncake on CPU tensors. Calls return plain data. `start()` sends a call
without waiting, so both engines step at the same time (`result()` waits);
`kill()` plays a crashed engine. A child never runs the interpreter's exit
handlers (engines' threads may still be about).
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection
from typing import Any

from tests.pipe_child import PipeChild, build_or_exit, exit_child, serve

CALL_TIMEOUT = 60.0


class Pending:
    """A call sent to a peer whose answer has not been read."""

    def __init__(self, peer: EnginePeer, name: str, timeout: float) -> None:
        self._peer, self._name, self._timeout = peer, name, timeout

    def result(self) -> Any:
        return self._peer._receive(f"call {self._name}", self._timeout)


class EnginePeer(PipeChild):
    """A child process running one engine; `peer.name(...)` calls `name` there."""

    def __init__(self, kv_role: str, engine_id: str, extra: dict[str, Any], policy: str = "fail") -> None:
        self.role = kv_role
        super().__init__(_child_main, (kv_role, engine_id, extra, policy), kv_role)

    def ready(self, timeout: float = 180.0) -> None:
        """Wait until the child built its engine (importing vLLM takes a while)."""
        Pending(self, "start-up", timeout).result()

    def start(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Pending:
        self._post(name, args)
        return Pending(self, name, timeout)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, timeout=CALL_TIMEOUT: self.start(name, *args, timeout=timeout).result()

    def stop(self, grace: float = 20.0) -> None:
        super().stop(grace)


# -- the child ----------------------------------------------------------------------------


def _child_main(conn: Connection, kv_role: str, engine_id: str, extra: dict[str, Any], policy: str) -> None:
    logging.basicConfig(level=logging.ERROR, format=f"[{kv_role}] %(levelname)s %(name)s: %(message)s")
    endpoint = build_or_exit(conn, lambda: _Endpoint(kv_role, engine_id, extra, policy))
    conn.send((True, "ready"))
    serve(conn, endpoint)
    exit_child(endpoint.engine.shutdown)


class _Endpoint:
    def __init__(self, kv_role: str, engine_id: str, extra: dict[str, Any], policy: str) -> None:
        from . import _env

        _env.prepare()
        from . import harness

        self.harness = harness
        self.engine = harness.Engine(kv_role, engine_id, extra=extra, policy=policy)
        self.requests: dict[str, Any] = {}
        self.loads: dict[str, dict[str, Any]] = {}

    def prefill(self, request_id: str, tokens: list[int]) -> dict[str, Any]:
        """Run a prefill request to its end; its kv_transfer_params (its blocks stay held)."""
        request = self.harness.make_request(request_id, tokens, max_tokens=1, params={"do_remote_decode": True})
        self.requests[request_id] = self.engine.add(request)
        for _ in range(20):
            for output in self.engine.step():
                if output.request_id == request_id and output.kv_transfer_params is not None:
                    self.engine.step()  # its worker holds the room from here
                    return dict(output.kv_transfer_params)
        raise AssertionError(f"prefill {request_id} did not finish")

    def add(self, request_id: str, tokens: list[int], params: dict[str, Any], max_tokens: int) -> str:
        request = self.harness.make_request(request_id, tokens, max_tokens=max_tokens, params=params)
        self.requests[request_id] = self.engine.add(request)
        return str(request.status.name)

    def run(self, goal: str, request_id: str | None, timeout: float) -> dict[str, Any]:
        """Step until `goal` ("loaded", "parked", "finished", "empty", "idle"); what happened."""
        deadline = time.monotonic() + timeout
        reached = False
        while time.monotonic() < deadline:
            if self._reached(goal, request_id):
                reached = True
                break
            self.engine.step()
            self._note_loads()
            time.sleep(0.001)
        return {"reached": reached or self._reached(goal, request_id), **self.info(request_id)}

    def _reached(self, goal: str, request_id: str | None) -> bool:
        request = self.requests.get(request_id) if request_id else None
        if goal == "loaded":
            return request_id in self.loads
        if goal == "parked":
            worker = self.engine.worker.worker_half
            return bool(worker is not None and worker.decode is not None and worker.decode.counts()[_waiting()])
        if goal == "finished":
            return request is not None and request.is_finished()
        if goal == "empty":
            return bool(self.engine.empty())
        return False

    def _note_loads(self) -> None:
        """When the worker reports a load, check its blocks before any forward touches them."""
        _, recvd, failed, errors = self.engine.reports[-1]
        for request_id in recvd:
            request = self.requests[request_id]
            tokens = list(request.prompt_token_ids or [])
            wrong = [] if request_id in failed else self.engine.check_blocks(request_id, tokens)
            self.loads[request_id] = {"failed": request_id in failed, "wrong_blocks": wrong, "errors": len(errors)}

    def abort(self, request_id: str) -> str:
        from vllm.v1.request import RequestStatus

        self.engine.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        return str(self.requests[request_id].status.name)

    def info(self, request_id: str | None = None) -> dict[str, Any]:
        worker = self.engine.worker.worker_half
        manager = None if worker is None else (worker.prefill if worker.prefill is not None else worker.decode)
        request = self.requests.get(request_id) if request_id else None
        stats = manager.stats if manager is not None else None
        return {
            "status": None if request is None else request.status.name,
            "load": self.loads.get(request_id or ""),
            "empty": bool(self.engine.empty()),
            "failure_kinds": {} if stats is None else {k.value: n for k, n in stats.failure_kinds.items() if n},
            "final_states": {} if stats is None else {k.name: n for k, n in stats.final_states.items() if n},
            "drain_deadline_releases": 0 if stats is None else stats.drain_deadline_releases,
            "quarantined": 0 if stats is None else stats.quarantined,
            "worker": None if worker is None else str(worker.stats),
            "scheduler": str(getattr(self.engine.connector.scheduler_half, "stats", None)),
        }


def _waiting() -> Any:
    from kvfsm import KVPoll

    return KVPoll.WaitingForInput
