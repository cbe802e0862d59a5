"""The bootstrap server kvfsm's Mooncake trio uses: registration, look-up, bounds, hostile input."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

from kvfsm.compat.sglang import _bootstrap
from kvfsm.compat.sglang._bootstrap import KVBootstrapServer, fetch_prefill_ranks, register_prefill_rank


@pytest.fixture
def server() -> Iterator[KVBootstrapServer]:
    started = KVBootstrapServer("127.0.0.1", 0)
    try:
        yield started
    finally:
        started.close()


def addr(server: KVBootstrapServer) -> str:
    return f"127.0.0.1:{server.port}"


def request(server: KVBootstrapServer, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def rank(tp: int, address: str, **layout: Any) -> dict[str, Any]:
    return {"address": address, "dp_rank": 0, "tp_rank": tp, "pp_rank": 0, **layout}


def test_ranks_register_and_decode_reads_them(server: KVBootstrapServer) -> None:
    assert fetch_prefill_ranks(addr(server), timeout=2) is None  # nobody registered yet (503)
    register_prefill_rank(addr(server), rank(1, "tcp://h:2", attn_tp_size=2), timeout=2)
    register_prefill_rank(addr(server), rank(0, "tcp://h:1", attn_tp_size=2, page_size=16), timeout=2)
    found = fetch_prefill_ranks(addr(server), timeout=2)
    assert found == {
        "layout": {"attn_tp_size": 2, "page_size": 16},
        "ranks": [{"rank": [0, 0, 0], "address": "tcp://h:1"}, {"rank": [0, 1, 0], "address": "tcp://h:2"}],
    }
    assert request(server, "GET", "/health") == (200, "OK")


def test_a_restarted_rank_replaces_its_address(server: KVBootstrapServer) -> None:
    register_prefill_rank(addr(server), rank(0, "tcp://old:1"), timeout=2)
    register_prefill_rank(addr(server), rank(0, "tcp://new:1"), timeout=2)
    found = fetch_prefill_ranks(addr(server), timeout=2)
    assert found is not None
    assert found["ranks"] == [{"rank": [0, 0, 0], "address": "tcp://new:1"}]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"dp_rank": 0, "tp_rank": 0, "pp_rank": 0}).encode(), "address"),
        (json.dumps(rank(-1, "tcp://h:1")).encode(), "tp_rank"),
        (json.dumps({**rank(0, "tcp://h:1"), "pp_rank": True}).encode(), "pp_rank"),
        (json.dumps(rank(0, "x" * 600)).encode(), "address"),
        (b"[" * 60_000, "not JSON"),
    ],
    ids=["not-json", "array", "no-address", "negative-rank", "bool-rank", "long-address", "deep-nesting"],
)
def test_malformed_registrations_are_refused(server: KVBootstrapServer, body: bytes, problem: str) -> None:
    status, reply = request(server, "PUT", "/kvfsm/prefill", body)
    assert status == 400
    assert problem in reply["error"]
    assert fetch_prefill_ranks(addr(server), timeout=2) is None


def test_bodies_and_the_rank_table_are_bounded(server: KVBootstrapServer) -> None:
    status, reply = request(server, "PUT", "/kvfsm/prefill", b"{" + b" " * (_bootstrap.MAX_BODY + 1) + b"}")
    assert status == 400
    assert "Content-Length" in reply["error"]
    with mock.patch.object(_bootstrap, "MAX_RANKS", 2):
        register_prefill_rank(addr(server), rank(0, "tcp://h:1"), timeout=2)
        register_prefill_rank(addr(server), rank(1, "tcp://h:2"), timeout=2)
        register_prefill_rank(addr(server), rank(1, "tcp://h:2b"), timeout=2)  # a known rank may re-register
        third = {**rank(0, "tcp://h:3"), "dp_rank": 1}
        status, reply = request(server, "PUT", "/kvfsm/prefill", json.dumps(third).encode())
        assert status == 507
        assert "full" in reply["error"]
    assert request(server, "GET", "/nowhere")[0] == 404
    assert request(server, "PUT", "/nowhere", b"{}")[0] == 404


def test_a_server_that_is_down_is_not_an_error_for_lookups() -> None:
    started = KVBootstrapServer("127.0.0.1", 0)
    port = started.port
    started.close()
    assert fetch_prefill_ranks(f"127.0.0.1:{port}", timeout=1) is None
    with pytest.raises(OSError, match=r"[Rr]efused"):
        register_prefill_rank(f"127.0.0.1:{port}", rank(0, "tcp://h:1"), timeout=1)
