"""A cluster on 127.0.0.1: 4 prefill and 16 decode processes, rooms crossing every pair (issue 22).

Each process is one endpoint (tests/integration/fleet.py runs its rooms on
its own). Rooms start spread over two seconds; meanwhile one decode is
SIGSTOPped for longer than the heartbeat window (a hung host) and one
prefill is killed (a crashed one). Then:

* every room between a healthy prefill and a healthy decode succeeds, with
  every byte and its aux slot right, within its deadlines;
* no decode room succeeds with wrong bytes, and no page is written after
  it was released (released pages are poisoned and checked at the end;
  without a drain deadline, release needs a proof);
* the rooms of the stopped decode and of the killed prefill end (succeeded
  or failed, never left in flight);
* every process ends, and the whole run is bounded.

On Mooncake and on NIXL; about a minute each on two cores.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from .fleet import Fleet, plan_pairs, summarize
from .test_engines import ENGINES, _skip_if_missing

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")

PREFILLS, DECODES, ROOMS_PER_PAIR = 4, 16, 3
CONFIG = {"heartbeat_interval": 0.2, "heartbeat_misses": 3}  # a 0.6 s window
STOPPED, KILLED = 5, 2
STOP_AT, KILL_AT, STOP_FOR = 0.6, 1.0, 1.5  # seconds after the rooms start; 1.5 s > the window
#: Each phase's deadline (a room of the stopped decode that it failed before claiming waits it out
#: on its prefill, which no one told); the whole run is bounded by LIMIT.
DEADLINE = 8.0
LIMIT = 30.0


def _healthy(room: dict[str, Any]) -> bool:
    prefill, decode = int(room["room"][1 : room["room"].index("d")]), int(room["room"].split("d")[1].split("e")[0])
    return prefill != KILLED and decode != STOPPED


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_four_prefills_sixteen_decodes_one_stopped_one_killed(engine: str) -> None:
    _skip_if_missing(engine)
    began = time.monotonic()
    prefills = [Fleet(engine, "sender", 1, CONFIG, deadline=DEADLINE) for _ in range(PREFILLS)]
    decodes = [Fleet(engine, "receiver", 1, CONFIG, deadline=DEADLINE) for _ in range(DECODES)]
    fleets = [*prefills, *decodes]
    stopped_pid = None
    try:
        addresses = [fleet.addresses()[0] for fleet in prefills]
        for fleet in decodes:
            fleet.addresses()  # ready
        prefill_plans, decode_plans = plan_pairs(addresses, [1] * DECODES, ROOMS_PER_PAIR, spread=2.0)
        t0 = time.time() + 0.5
        for fleet, plan in zip([*prefills, *decodes], [*prefill_plans, *decode_plans], strict=True):
            fleet.start(plan, t0, LIMIT)
        time.sleep(max(0.0, t0 + STOP_AT - time.time()))
        stopped_pid = decodes[STOPPED].process.pid
        assert stopped_pid is not None
        os.kill(stopped_pid, signal.SIGSTOP)
        time.sleep(max(0.0, t0 + KILL_AT - time.time()))
        prefills[KILLED].kill()
        time.sleep(max(0.0, t0 + STOP_AT + STOP_FOR - time.time()))
        os.kill(stopped_pid, signal.SIGCONT)
        stopped_pid = None
        reports: dict[str, dict[str, Any]] = {}
        for index, fleet in enumerate(prefills):
            if index != KILLED:
                reports[f"prefill{index}"] = fleet.collect(LIMIT + 30)
        for index, fleet in enumerate(decodes):
            reports[f"decode{index}"] = fleet.collect(LIMIT + 30)
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        for fleet in fleets:
            fleet.stop()
    elapsed = time.monotonic() - began
    assert all(fleet.process.exitcode is not None for fleet in fleets), "a process did not end"
    decode_rooms = [room for side, report in reports.items() if side.startswith("decode") for room in report["rooms"]]
    prefill_rooms = {
        room["room"]: room for side, report in reports.items() if side.startswith("prefill") for room in report["rooms"]
    }
    assert len(decode_rooms) == PREFILLS * DECODES * ROOMS_PER_PAIR
    summary = summarize({"decodes": {"rooms": decode_rooms}, "prefills": {"rooms": list(prefill_rooms.values())}})
    print(f"\n{engine}: {len(decode_rooms)} rooms in {elapsed:.1f} s; {summary}")
    for room in decode_rooms:
        if room["state"] == "Success":
            assert room.get("bytes_ok"), f"Success with wrong bytes: {room}"
        assert room.get("poison_intact", True), f"a page was written after it was released: {room}"
        assert room["state"] in ("Success", "Failed"), f"a room never ended: {room}"
        if _healthy(room):
            assert room["state"] == "Success", f"a room between healthy peers failed: {room}"
            assert prefill_rooms[room["room"]]["state"] == "Success", prefill_rooms[room["room"]]
    for room in prefill_rooms.values():
        assert room["state"] in ("Success", "Failed"), f"a prefill room never ended: {room}"
