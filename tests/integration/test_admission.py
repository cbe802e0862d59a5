"""256 decodes bootstrap towards one prefill at the same instant, default settings (issue 22, item 2).

On 7ddfcf8 the prefill kept 16 half-open sessions and read 64 queued HELLOs
per turn before any decode's confirmation: the evicted decodes believed
their sessions were up, their claims were dropped as unauthenticated, and
only 38-88 of 128 rooms succeeded with 64 decodes (36-62 of 200 with 200,
32-56 of 64 with a shared key and 32). Here every decode gets a session and
every room succeeds, with and without a shared key: 256 Mooncake decode
endpoints in 8 processes, one prefill process, one room each, all started
at once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from .fleet import Fleet, plan_pairs, summarize
from .test_engines import _skip_if_missing

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")

DECODES, PER_PROCESS = 256, 32
LIMIT = 60.0


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, "k" * 32], ids=["no key", "shared key"])
def test_256_decodes_bootstrapping_at_once_all_get_sessions(key: str | None) -> None:
    engine = "mooncake"
    _skip_if_missing(engine)
    config: dict[str, Any] = {} if key is None else {"shared_key": key}  # the defaults otherwise
    prefill = Fleet(engine, "sender", 1, config, pages=2 * DECODES + 8)
    decodes = [Fleet(engine, "receiver", PER_PROCESS, config) for _ in range(DECODES // PER_PROCESS)]
    try:
        (address,) = prefill.addresses()
        for fleet in decodes:
            fleet.addresses()
        prefill_plans, decode_plans = plan_pairs([address], [PER_PROCESS] * len(decodes), 1, spread=0.0)
        t0 = time.time() + 1.0
        prefill.start(prefill_plans[0], t0, LIMIT)
        for fleet, plan in zip(decodes, decode_plans, strict=True):
            fleet.start(plan, t0, LIMIT)
        decode_rooms = [room for fleet in decodes for room in fleet.collect(LIMIT + 30)["rooms"]]
        prefill_rooms = prefill.collect(LIMIT + 30)["rooms"]
        (stats,) = prefill.stats()
    finally:
        for fleet in (*decodes, prefill):
            fleet.stop()
    summary = summarize({"decodes": {"rooms": decode_rooms}, "prefill": {"rooms": prefill_rooms}})
    print(f"\n{DECODES} decodes at once, key={key is not None}: {summary}; prefill {stats}")
    assert len(decode_rooms) == DECODES
    assert [room for room in decode_rooms if room["state"] != "Success" or not room.get("bytes_ok")] == [], [
        room.get("message") for room in decode_rooms if room["state"] != "Success"
    ]
    assert [room for room in prefill_rooms if room["state"] != "Success"] == []
