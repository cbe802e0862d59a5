"""A real partition, not only a stopped process: two decode hosts on links of their own (issue 22).

The prefill and decodes A and B each run in a network namespace of their
own (tests/integration/netns.py), addresses only there: hosts with a real
link each. Rooms run on both pairs throughout, while A's link is taken down
for shorter than the heartbeat window, then for longer, then brought back.
While it is down, A's TCP connections neither fail nor deliver: writes hang
(which a SIGSTOP does not show). Then:

* no wrong bytes: every room that succeeded holds exactly its prefill's
  bytes and aux slot, and no released page was written afterwards;
* nothing released without proof (no drain deadline: a failed room's pages
  are released only on the prefill's ABORT_ACK or when nothing could land);
* B's rooms are unaffected: every one succeeds;
* the short outage costs A nothing: its sessions survive and its rooms
  succeed; the long one fails what was in flight, and after the heal A's
  new rooms succeed on new sessions;
* everything ends within its deadlines, every process ends, the namespaces
  are removed.

On Mooncake and on NIXL. Skipped, with the reason, where namespaces cannot
be made (not root, no `ip`).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from . import netns
from .fleet import Fleet
from .test_engines import ENGINES, _skip_if_missing

pytest.importorskip("zmq", reason="pyzmq is needed for the control plane")

CONFIG: dict[str, Any] = {"heartbeat_interval": 0.2, "heartbeat_misses": 5}  # a 1 s window
DEADLINE = 6.0
LIMIT = 30.0
SHORT = (1.0, 1.4)  # A's link down from 1.0 s to 1.4 s: shorter than the window
LONG = (2.6, 5.1)  # then from 2.6 s to 5.1 s: much longer
ROOMS_AT = [0.2, 0.4, 0.6, 0.9, 1.05, 1.15, 1.3, 1.6, 2.0, 2.55, 2.7, 3.0, 3.5, 5.6, 6.0, 6.4]


#: UCX finds each namespace's devices itself (netns.enter mounts its sysfs), but leaves a bridge
#: (the prefill's) out unless told.
_ENV = {"UCX_TCP_BRIDGE_ENABLE": "y"}


def _during(at: float, window: tuple[float, float]) -> bool:
    return window[0] - 0.2 <= at <= window[1]


def _plans(prefill_ip: str, port: int) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    prefill: list[dict[str, Any]] = []
    decodes: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    address = f"tcp://{prefill_ip}:{port}"
    page = 0
    for index, at in enumerate(ROOMS_AT):
        for name in ("a", "b"):
            room = f"{name}{index}"
            pages = [2 * index, 2 * index + 1]
            prefill.append({"ep": 0, "room": room, "peer": address, "pages": [page, page + 1], "aux": page, "at": at})
            decodes[name].append({"ep": 0, "room": room, "peer": address, "pages": pages, "aux": 2 * index, "at": at})
            page += 2
    return prefill, decodes


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_partitioned_decode_fails_alone_and_recovers_after_the_heal(engine: str) -> None:
    why = netns.unavailable()
    if why is not None:
        print(f"\nskipped: {why}")
        pytest.skip(why)
    _skip_if_missing(engine)
    from .remote_peer import free_port

    with netns.Topology(["a", "b"]) as net:
        port = free_port()
        prefill = Fleet(
            engine,
            "sender",
            1,
            {**CONFIG, "host": net.prefill_ip, "port": port},
            deadline=DEADLINE,
            netns=net.path(net.prefill_ns),
            options={"hostname": net.prefill_ip} if engine == "mooncake" else {},
            env=_ENV,
        )
        decodes = {
            name: Fleet(
                engine,
                "receiver",
                1,
                {**CONFIG, "host": net.decode_ip[name]},
                deadline=DEADLINE,
                netns=net.path(net.decode_ns[name]),
                options={"hostname": net.decode_ip[name]} if engine == "mooncake" else {},
                env=_ENV,
            )
            for name in ("a", "b")
        }
        fleets = [prefill, *decodes.values()]
        try:
            for fleet in fleets:
                fleet.addresses()
            prefill_plan, decode_plans = _plans(net.prefill_ip, port)
            t0 = time.time() + 0.5
            prefill.start(prefill_plan, t0, LIMIT)
            for name, fleet in decodes.items():
                fleet.start(decode_plans[name], t0, LIMIT)
            for down, up in (SHORT, LONG):
                time.sleep(max(0.0, t0 + down - time.time()))
                net.down("a")
                time.sleep(max(0.0, t0 + up - time.time()))
                net.up("a")
            reports = {name: fleet.collect(LIMIT + 30)["rooms"] for name, fleet in decodes.items()}
            prefill_rooms = {room["room"]: room for room in prefill.collect(LIMIT + 30)["rooms"]}
        finally:
            for fleet in fleets:
                fleet.stop()
        assert all(fleet.process.exitcode is not None for fleet in fleets), "a process did not end"
    rooms = {room["room"]: room for rooms in reports.values() for room in rooms}
    print(f"\n{engine}: " + ", ".join(f"{r['room']}={r['state']}/{r.get('kind')}" for r in rooms.values()))
    for room in rooms.values():
        assert room["state"] in ("Success", "Failed"), f"a room never ended: {room}"
        if room["state"] == "Success":
            assert room.get("bytes_ok"), f"Success with wrong bytes: {room}"
        assert room.get("poison_intact", True), f"a page was written after it was released: {room}"
    for index, at in enumerate(ROOMS_AT):
        healthy = rooms[f"b{index}"]
        assert healthy["state"] == "Success", f"B's room failed while only A was cut off: {healthy}"
        assert prefill_rooms[f"b{index}"]["state"] == "Success", prefill_rooms[f"b{index}"]
        partitioned = rooms[f"a{index}"]
        if not _during(at, LONG):
            # Before the long outage (the short one included) and after the heal: A's rooms succeed too.
            assert partitioned["state"] == "Success", (
                f"A's room at {at} s failed outside the long outage: {partitioned}"
            )
        elif partitioned["state"] == "Failed" and partitioned.get("release_safe"):
            # Released only with a proof: the prefill must have said so, or nothing was ever claimed.
            assert partitioned.get("kind") in ("peer_lost", "bootstrap_error", "peer_failed", "timeout", "aborted")
