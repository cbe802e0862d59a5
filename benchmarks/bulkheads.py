"""The figures of issue 22 (bulkheads), each from one run on 127.0.0.1.

* ``stuck``: one prefill, decodes D1 and D2 in processes of their own. D1
  claims 4 rooms and is SIGSTOPped before the prefill's first write to it;
  then the prefill sends D1's rooms and D2's 8. The figure is the time D2's
  8 rooms take to succeed while D1 is stopped (D1 stays stopped for
  ``--stop`` seconds at most).
* ``admission``: N decode endpoints (``--decodes``, in processes of 32)
  bootstrap towards one prefill at the same instant, default settings, with
  and without a shared key (``--key``), one room each: rooms ok of N, and the
  time the last one took.
* ``cluster``: the many-process test's run (4 prefill and 16 decode
  processes, rooms crossing every pair, one decode SIGSTOPped past the
  window, one prefill killed): rooms, time, failures by reason.

Run from the project root: ``PYTHONPATH=. python benchmarks/bulkheads.py
stuck|admission|cluster [--engine mooncake|nixl]``; ``--json`` prints one
JSON object. It uses the harnesses of the test suite
(tests/integration/remote_peer.py and fleet.py), so it runs the same code
before and after a change: check out the old ``kvfsm/`` into another tree
and run the same command there. Every process it starts ends with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())

from tests.integration.fleet import Fleet, plan_pairs, summarize
from tests.integration.remote_peer import PeerProcess


def stuck(engine: str, stop_for: float) -> dict[str, Any]:
    prefill, d1, d2 = PeerProcess(engine, "sender"), PeerProcess(engine, "receiver"), PeerProcess(engine, "receiver")
    resumed = False
    pid = d1.process.pid
    assert pid is not None
    try:
        for peer in (prefill, d1, d2):
            assert peer.address

        def connect(decode: PeerProcess, room: int, page: int) -> None:
            prefill.open(room)
            decode.open(room)
            prefill.bootstrap(room, prefill.address)
            decode.bootstrap(room, prefill.address)
            assert decode.wait(room, ["WaitingForInput"], 10.0)["state"] == "WaitingForInput"
            decode.expect(room, [page], None)
            assert prefill.wait(room, ["WaitingForInput"], 10.0)["state"] == "WaitingForInput"

        for i in range(4):
            connect(d1, 100 + i, i)
        for i in range(8):
            connect(d2, 200 + i, i)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        for i in range(4):
            prefill.send(100 + i, [i], True, None)
        for i in range(8):
            prefill.send(200 + i, [i + 8], True, None)
        states = []
        for i in range(8):
            left = max(0.1, stop_for - (time.monotonic() - start))
            states.append(d2.wait(200 + i, ["Success", "Failed"], left)["state"])
        took = time.monotonic() - start
        os.kill(pid, signal.SIGCONT)
        resumed = True
        return {"engine": engine, "d2_ok": states.count("Success"), "d2_rooms": 8, "d2_seconds": round(took, 3)}
    finally:
        if not resumed:
            os.kill(pid, signal.SIGCONT)
        for peer in (d2, d1, prefill):
            peer.stop()


def admission(engine: str, decodes: int, key: bool, per_process: int = 32) -> dict[str, Any]:
    config: dict[str, Any] = {"shared_key": "k" * 32} if key else {}
    prefill = Fleet(engine, "sender", 1, config, pages=2 * decodes + 8)
    counts = [min(per_process, decodes - i) for i in range(0, decodes, per_process)]
    fleets = [Fleet(engine, "receiver", count, config) for count in counts]
    try:
        (address,) = prefill.addresses()
        for fleet in fleets:
            fleet.addresses()
        prefill_plans, decode_plans = plan_pairs([address], counts, 1, spread=0.0)
        t0 = time.time() + 1.0
        prefill.start(prefill_plans[0], t0, 60.0)
        for fleet, plan in zip(fleets, decode_plans, strict=True):
            fleet.start(plan, t0, 60.0)
        rooms = [room for fleet in fleets for room in fleet.collect(90.0)["rooms"]]
        prefill.collect(90.0)
    finally:
        for fleet in (*fleets, prefill):
            fleet.stop()
    ok = [room for room in rooms if room["state"] == "Success" and room.get("bytes_ok")]
    failed: dict[str, int] = {}
    for room in rooms:
        if room["state"] != "Success":
            failed[str(room.get("kind"))] = failed.get(str(room.get("kind")), 0) + 1
    last = max((room.get("ended", 0.0) for room in rooms), default=0.0)
    return {
        "engine": engine,
        "decodes": decodes,
        "key": key,
        "rooms_ok": len(ok),
        "rooms": len(rooms),
        "failures": failed,
        "last_ended_s": round(last, 2),
        "messages": sorted({str(room.get("message"))[:160] for room in rooms if room["state"] != "Success"})[:3],
    }


def cluster(engine: str) -> dict[str, Any]:
    from tests.integration import test_many_processes as spec

    began = time.monotonic()
    prefills = [Fleet(engine, "sender", 1, spec.CONFIG, deadline=spec.DEADLINE) for _ in range(spec.PREFILLS)]
    decodes = [Fleet(engine, "receiver", 1, spec.CONFIG, deadline=spec.DEADLINE) for _ in range(spec.DECODES)]
    pid = decodes[spec.STOPPED].process.pid
    assert pid is not None
    stopped = False
    try:
        addresses = [fleet.addresses()[0] for fleet in prefills]
        for fleet in decodes:
            fleet.addresses()
        started = time.monotonic()
        prefill_plans, decode_plans = plan_pairs(addresses, [1] * spec.DECODES, spec.ROOMS_PER_PAIR, spread=2.0)
        t0 = time.time() + 0.5
        for fleet, plan in zip([*prefills, *decodes], [*prefill_plans, *decode_plans], strict=True):
            fleet.start(plan, t0, spec.LIMIT)
        time.sleep(max(0.0, t0 + spec.STOP_AT - time.time()))
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        time.sleep(max(0.0, t0 + spec.KILL_AT - time.time()))
        prefills[spec.KILLED].kill()
        time.sleep(max(0.0, t0 + spec.STOP_AT + spec.STOP_FOR - time.time()))
        os.kill(pid, signal.SIGCONT)
        stopped = False
        decode_rooms = [room for fleet in decodes for room in fleet.collect(spec.LIMIT + 30)["rooms"]]
        prefill_rooms = [
            room
            for index, fleet in enumerate(prefills)
            if index != spec.KILLED
            for room in fleet.collect(spec.LIMIT + 30)["rooms"]
        ]
        run = time.monotonic() - started
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        for fleet in (*decodes, *prefills):
            fleet.stop()
    healthy = [room for room in decode_rooms if spec._healthy(room)]
    return {
        "engine": engine,
        "rooms": len(decode_rooms),
        "healthy_rooms": len(healthy),
        "healthy_ok": sum(room["state"] == "Success" for room in healthy),
        "wrong_bytes": sum(room["state"] == "Success" and not room.get("bytes_ok") for room in decode_rooms),
        "written_after_release": sum(not room.get("poison_intact", True) for room in decode_rooms),
        "run_s": round(run, 1),
        "with_start_s": round(time.monotonic() - began, 1),
        **summarize({"decodes": {"rooms": decode_rooms}, "prefills": {"rooms": prefill_rooms}}),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["stuck", "admission", "cluster"])
    parser.add_argument("--engine", default="mooncake", choices=["mooncake", "nixl"])
    parser.add_argument("--stop", type=float, default=10.0, help="stuck: the longest D1 stays stopped (s)")
    parser.add_argument("--decodes", type=int, nargs="*", default=[64, 256], help="admission: how many decodes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    if args.figure == "stuck":
        results.append(stuck(args.engine, args.stop))
    elif args.figure == "admission":
        for decodes in args.decodes:
            for key in (False, True):
                results.append(admission(args.engine, decodes, key))
    else:
        results.append(cluster(args.engine))
    for result in results:
        print(json.dumps(result) if args.json else result, flush=True)


if __name__ == "__main__":
    main()
