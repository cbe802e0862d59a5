"""Soak: thousands of requests, random aborts, failures and stalls, several threads."""

from __future__ import annotations

import io

import pytest

from kvfsm.tools.simulate import default_args, simulate


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "fake"])
def test_soak_keeps_every_verification_at_zero(backend: str) -> None:
    args = default_args(
        backend=backend,
        requests=2500 if backend == "local" else 4000,
        pages=4,
        page_size=1024,
        chunks=3,
        concurrency=6,
        workers=3,
        abort_rate=0.25,
        fail_rate=0.02,
        stall_rate=0.002,
        transfer_timeout=0.2,
        seed=11,
        no_progress=True,
    )
    summary = simulate(args, out=io.StringIO(), err=io.StringIO())
    assert summary["verification"] == dict.fromkeys(summary["verification"], 0)
    assert summary["ok"]
    # A fake receiver succeeds as soon as it posts its pages; the sender side shows the aborts.
    finals = summary["final_states"]["receiver" if backend == "local" else "sender"]
    assert sum(finals.values()) == args.requests
    assert finals["Failed"] > args.requests * 0.1  # aborts really raced the transfers
    assert finals["Success"] > args.requests * 0.5
    if backend == "local":
        assert summary["pages_checked"] == 4 * finals["Success"]
        assert summary["metrics"]["receiver"]["closed"] == args.requests
