"""Mooncake's default write budget per decode is half its per-peer TCP queue, read from Mooncake's own setting."""

from __future__ import annotations

import pytest

from kvfsm.backends import mooncake


@pytest.mark.parametrize(
    ("setting", "budget"),
    [(None, 512), ("64", 32), ("16384", 8192), ("1", 1), ("0", 1), ("lots", 512)],
)
def test_the_budget_is_half_the_queue_mooncake_is_told(
    setting: str | None, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if setting is None:
        monkeypatch.delenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", raising=False)
    else:
        monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", setting)
    assert mooncake._per_peer_budget() == budget
