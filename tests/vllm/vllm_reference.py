"""vLLM's pre-fix NIXL lease reaper, as vllm #58222 quotes it: the reference a regression test fails on.

vLLM up to 0.27.1 (`nixl/base_worker.py`, `NixlConnectorWorker`) kept the
prefill's held requests in `_reqs_to_send: dict[req_id, expiry]` in
insertion order, renewed a lease in place on each decode heartbeat
(`max(old, now + extension)`), and reaped from the head, stopping at the
first entry not yet expired ("sorted dict, oldest requests are put first
so we can exit early"). A renewed head entry therefore hides every expired
entry behind it. vLLM 0.33.0 scans the whole dict instead (PR #50789), so
its own connector no longer shows the bug; this model of the old code is
what the regression test is shown failing against.
"""

from __future__ import annotations

from collections.abc import Callable


class PreFixLeaseReaper:
    """The prefill's held requests and their leases, reaped the pre-#50789 way."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._reqs_to_send: dict[str, float] = {}

    def hold(self, request_id: str, lease: float) -> None:
        self._reqs_to_send[request_id] = self._clock() + lease

    def heartbeat(self, request_id: str, extension: float) -> None:
        if request_id in self._reqs_to_send:
            old = self._reqs_to_send[request_id]
            self._reqs_to_send[request_id] = max(old, self._clock() + extension)

    def reap(self) -> set[str]:
        """The requests whose blocks are freed this step."""
        now = self._clock()
        freed: set[str] = set()
        while self._reqs_to_send:
            request_id, expires = next(iter(self._reqs_to_send.items()))
            if now < expires:
                break
            freed.add(request_id)
            del self._reqs_to_send[request_id]
        return freed
