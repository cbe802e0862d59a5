"""Unequal attention TP through SGLang 0.5.23's own queues: prefill TP 2 to decode TP 1, and TP 1 to TP 2.

Real SGLang servers cannot run `--tp 2` on a CPU without SGLang's CPU
engine (sgl-kernel's CPU build): `--device cpu` with two TP ranks builds a
pynccl communicator and fails ("Expected a cuda device, but got: cpu").
So the TP group is built the way SGLang's scheduler sees it: each rank is a
process running SGLang's PD queues (tests/sglang/_mooncake_peer.py), the
ranks of one server all-reduce their polls over a real two-rank gloo group
(SGLang's `poll_and_all_reduce*`, as over its attention TP CPU group), and
they run in lockstep: every rank gets every request before the next
iteration, as SGLang's broadcast of requests to its TP ranks ensures.
Each rank's KV buffers hold its share of the 4 KV heads in SGLang's MHA
layout; the prefill writes a value per (request, token, buffer, head) and
each decode rank checks every head of every token it received, and the
first output token through its metadata slot.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.sglang._sglang import sglang_or_skip

sglang_or_skip()

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is needed (mooncake-transfer-engine-non-cuda)")

from tests.sglang._mooncake_peer import PeerProcess, step_all  # noqa: E402

Figures = Callable[[str], None]
ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "10",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
}
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Deployment:
    """A prefill server and a decode server of the given TP sizes; the larger one runs stepped."""

    def __init__(self, prefill_tp: int, decode_tp: int) -> None:
        self.prefills: list[PeerProcess] = []
        self.decodes: list[PeerProcess] = []
        try:
            group, self.port = free_port(), free_port()
            for rank in range(prefill_tp):
                # Rank 0 serves the prefill server's bootstrap server on `self.port`; the other ranks register there.
                self.prefills.append(
                    PeerProcess(
                        "prefill",
                        ENV,
                        self.port,
                        tp_size=prefill_tp,
                        tp_rank=rank,
                        group_port=group,
                        stepped=prefill_tp > 1,
                    )
                )
            for peer in self.prefills:
                peer.ready()
        except BaseException:
            self.stop()
            raise

    def start_decodes(self, decode_tp: int) -> None:
        group = free_port()
        for rank in range(decode_tp):
            self.decodes.append(
                PeerProcess(
                    "decode", ENV, self.port, tp_size=decode_tp, tp_rank=rank, group_port=group, stepped=decode_tp > 1
                )
            )
        for peer in self.decodes:
            peer.ready()

    def stop(self) -> None:
        for peer in [*self.decodes, *self.prefills]:
            peer.stop()

    def run_until(self, done: Callable[[], bool], what: str) -> float:
        """Iterate the stepped groups (the others run on their own) until `done()`; seconds it took."""
        start = time.monotonic()
        groups = [group for group in (self.prefills, self.decodes) if len(group) > 1]
        while not done():
            for group in groups:
                step_all(group, 5)
            if time.monotonic() - start > WAIT_S:
                raise TimeoutError(f"{what} did not happen within {WAIT_S:.0f}s")
        return time.monotonic() - start


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=lambda p: f"prefill-tp{p[0]}-decode-tp{p[1]}")
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    prefill_tp, decode_tp = request.param
    started = Deployment(prefill_tp, decode_tp)
    try:
        # With a prefill's bootstrap server ready, prefill ranks registered (a rank registers in its constructor).
        started.start_decodes(decode_tp)
        yield started
    finally:
        started.stop()


def _add_everywhere(deployment: Deployment, rid: str, length: int, room: int, hold: bool = False) -> None:
    """Add the request on every rank of both servers (`hold`: the prefill keeps it in its waiting queue)."""
    for peer in deployment.prefills:
        peer.post("add", rid, length, room, hold)
    for peer in deployment.prefills:
        peer.answer(f"add({rid})")
    for peer in deployment.decodes:
        peer.post("add", rid, length, room)
    for peer in deployment.decodes:
        peer.answer(f"add({rid})")


def test_every_head_of_every_token_reaches_its_decode_rank(deployment: Deployment, figures: Figures) -> None:
    requests = [("a", 7, 501), ("b", 12, 502), ("c", 3, 503)]
    for rid, length, room in requests:
        _add_everywhere(deployment, rid, length, room)

    def transferred() -> bool:
        return all(
            ("transferred", rid, 1) in peer.log() for peer in deployment.decodes for rid, _length, _room in requests
        )

    took = deployment.run_until(transferred, "every decode rank receiving every request")
    deployment.run_until(
        lambda: all(
            ("inflight-done", rid, "FINISH_LENGTH") in peer.log()
            for peer in deployment.prefills
            for rid, _length, _room in requests
        ),
        "every prefill rank concluding every request",
    )
    tokens = 0
    for peer in deployment.decodes:
        for rid, length, _room in requests:
            assert peer.call("kv_matches", rid), f"decode rank {peer.tp_rank}: {rid}'s KV is not the prefill's"
            assert peer.call("first_token", rid) == 7
            tokens += length
        assert [e for e in peer.log() if e[0] == "stream"] == []  # nothing failed or was aborted
    prefill_tp, decode_tp = len(deployment.prefills), len(deployment.decodes)
    figures(
        f"prefill TP {prefill_tp} -> decode TP {decode_tp}: {len(requests)} requests, {tokens} token rows x 2 "
        f"buffers x {4 // decode_tp} heads per decode rank checked, in {took:.1f}s of stepping"
    )


def test_an_abort_on_one_decode_rank_fails_the_request_everywhere(deployment: Deployment) -> None:
    """Only decode rank 0 aborts (SGLang aborts on every rank): the other ranks of both servers must learn it.

    The prefill holds the request in its waiting queue, so nothing is
    computed; the decode's ranks agree through their all-reduce, the
    prefill's ranks through the ABORT each of their rooms receives.
    """
    _add_everywhere(deployment, "x", 6, 601, hold=True)
    deployment.run_until(
        lambda: all(("bootstrapped", "x") in peer.log() for peer in deployment.prefills), "the prefill bootstrapping"
    )
    deployment.run_until(
        lambda: all(("preallocated", "x") in peer.log() for peer in deployment.decodes), "the decode preallocating"
    )
    first = deployment.decodes[0]
    first.post("abort", "x")
    first.answer("abort(x)")
    deployment.run_until(
        lambda: all(("release", "x") in peer.log() for peer in deployment.decodes), "every decode rank releasing x"
    )
    deployment.run_until(
        lambda: all(("dropped-from-waiting", "x") in peer.log() for peer in deployment.prefills),
        "every prefill rank dropping x",
    )
    for peer in deployment.decodes:
        log = peer.log()
        assert ("stream", (("x", "FINISH_ABORT"),)) in log, log
        assert ("transferred", "x", 1) not in log
    for peer in deployment.prefills:
        assert ("stream", (("x", "FINISH_ABORT"),)) in peer.log()
