"""kvfsm's Mooncake trio inside SGLang 0.5.23's queues: a prefill process and a decode process.

The prefill child runs SGLang's bootstrap/waiting/inflight processing and the
bootstrap server; the decode child runs SGLang's prealloc/transfer queues;
`get_kv_class(TransferBackend.MOONCAKE, ...)` answers kvfsm's classes in both
(tests/sglang/_mooncake_peer.py). Real Mooncake Transfer Engine (TCP,
P2PHANDSHAKE) moves CPU tensors over 127.0.0.1. Checked: requests end to end
with every KV byte and the first output token (SGLang's metadata slot)
landed, an abort on each side reaching the other, and a killed prefill:
decode's requests fail with SGLang's reason and their pages are held,
quarantined at the drain deadline (a dead peer cannot ACK), until an
operator releases them.
Bounded in time: every wait has a deadline, both children are stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.sglang._sglang import sglang_or_skip

sglang_or_skip()

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is needed (mooncake-transfer-engine-non-cuda)")

from tests.sglang._mooncake_peer import PeerProcess  # noqa: E402

DRAIN_S = 3.0
ENV = {
    # A lost prefill is noticed within 0.6 s, and its rooms' pages wait DRAIN_S for writes that cannot be acked.
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DRAIN_S),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
}


class Pair:
    def __init__(self) -> None:
        self.prefill = PeerProcess("prefill", ENV)
        self.decode: PeerProcess | None = None
        try:
            port = self.prefill.ready()["bootstrap_port"]
            self.decode = PeerProcess("decode", ENV, bootstrap_port=port)
            assert self.decode.ready()["deferred_release"] is True
        except BaseException:
            self.stop()
            raise

    @property
    def d(self) -> PeerProcess:
        assert self.decode is not None
        return self.decode

    def stop(self) -> None:
        if self.decode is not None:
            self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    started = Pair()
    try:
        yield started
    finally:
        started.stop()


def test_requests_end_to_end_with_every_byte(pair: Pair) -> None:
    for rid, length, room in (("a", 7, 101), ("b", 4, 102), ("c", 12, 103)):
        pair.prefill.call("add", rid, length, room)
        pair.d.call("add", rid, length, room)
    for rid in ("a", "b", "c"):
        pair.d.wait_for(("transferred", rid, 1))
        pair.prefill.wait_for(("inflight-done", rid, "FINISH_LENGTH"))
        assert pair.d.call("kv_matches", rid), f"{rid}: the decode's pages do not hold the prefill's KV"
        assert pair.d.call("first_token", rid) == 7  # the prefill's first output token, via the metadata slot
    decode_log = pair.d.log()
    assert [e for e in decode_log if e[0] == "stream"] == []
    assert ("slot-", 0) in decode_log


def test_an_abort_on_decode_reaches_the_prefill(pair: Pair) -> None:
    pair.prefill.call("add", "d-abort", 6, 201, True)  # the prefill holds it in its waiting queue
    pair.d.call("add", "d-abort", 6, 201)
    pair.prefill.wait_for(("bootstrapped", "d-abort"))  # decode's pages arrived: the handshake is done
    pair.d.call("abort", "d-abort")
    decode_log = pair.d.wait_for(("release", "d-abort"))
    assert ("stream", (("d-abort", "FINISH_ABORT"),)) in decode_log
    assert pair.d.call("held") == []
    prefill_log = pair.prefill.wait_for(("dropped-from-waiting", "d-abort"))
    assert ("stream", (("d-abort", "FINISH_ABORT"),)) in prefill_log
    assert ("inflight-done", "d-abort", "FINISH_LENGTH") not in prefill_log


def test_an_abort_on_prefill_reaches_the_decode(pair: Pair) -> None:
    pair.prefill.call("add", "p-abort", 6, 202, True)
    pair.d.call("add", "p-abort", 6, 202)
    pair.prefill.wait_for(("bootstrapped", "p-abort"))
    pair.prefill.call("abort", "p-abort")  # from the waiting queue: SGLang's release_aborted_prefill_waiting_req
    pair.prefill.wait_for(("abort-output", "p-abort"))
    decode_log = pair.d.wait_for(("release", "p-abort"))
    assert ("stream", (("p-abort", "FINISH_ABORT"),)) in decode_log
    assert ("transferred", "p-abort", 1) not in decode_log
    message = pair.d.call("finish_message", "p-abort")
    assert message is not None
    assert "Aborted by AbortReq." in message


def test_a_killed_prefill_fails_decode_requests_and_holds_their_pages(pair: Pair) -> None:
    """A dead prefill cannot prove its writes stopped: the pages are held, quarantined at the drain deadline.

    SGLang's own deferred-release deadline is set past the test (60 s, see
    `_DecodePeer`), so only kvfsm's gate decides: the pages stay held after
    the drain deadline, reported quarantined, until an operator releases
    them (`release_quarantined`); then SGLang frees them.
    """
    pair.prefill.call("add", "lost", 6, 301, True)
    pair.d.call("add", "lost", 6, 301)
    pair.prefill.wait_for(("bootstrapped", "lost"))
    pair.d.wait_for(("preallocated", "lost"))
    pair.prefill.kill()
    killed_at = time.monotonic()
    decode_log = pair.d.wait_for(("stream", (("lost", "FINISH_ABORT"),)), timeout=20.0)
    noticed = time.monotonic() - killed_at
    message = pair.d.call("finish_message", "lost")
    assert message is not None
    assert "Lost connection with prefill instance" in message
    assert ("release", "lost") not in decode_log
    assert pair.d.call("held") == ["lost"]
    deadline = time.monotonic() + DRAIN_S + 20.0
    while pair.d.call("quarantined") != [301]:
        assert time.monotonic() < deadline, f"room 301 not quarantined {DRAIN_S + 20.0}s after its failure"
        time.sleep(0.05)
    quarantined_at = time.monotonic() - killed_at
    assert quarantined_at >= DRAIN_S * 0.9, (
        f"quarantined {quarantined_at:.2f}s after the kill, before the drain deadline"
    )
    time.sleep(1.0)  # held, not freed, after the deadline
    decode_log = pair.d.log()
    assert ("release", "lost") not in decode_log
    assert pair.d.call("held") == ["lost"]
    assert pair.d.call("release_quarantined", 301, "the prefill's host was rebooted (test)") == 1
    decode_log = pair.d.wait_for(("release", "lost"), timeout=20.0)
    assert pair.d.call("held") == []
    assert pair.d.call("quarantined") == []
    assert ("transferred", "lost", 1) not in decode_log
    assert noticed < 20.0
    slots = [e for e in decode_log if e[0] in ("slot+", "slot-")]
    assert sum(1 for e in slots if e[0] == "slot+") == sum(1 for e in slots if e[0] == "slot-")
