"""Prefill and decode of different tensor-parallel sizes, in two processes, KV over Mooncake.

Issue 20: with prefill TP != decode TP the decode computed locally and
sent no release, so the prefill's blocks stayed pinned until
`hold_timeout`. Now a decode merges the heads of a prefill of k times its
TP size (each of its ranks loads its heads' pages from k prefill ranks,
`WorkerHalf._sources`), and a decode of k times the prefill's TP size
loads each rank's slice of one prefill rank's heads (the decode's lease
renewals announce its TP size; the prefill rank then holds its heads in k
slice rooms), checked head by head. The prefill (one vLLM scheduler, a
worker connector per rank, `tp_engine.TPEngine`) runs in a child process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from ..integration.remote_peer import engine_missing, free_port  # noqa: E402
from .tp_engine import BLOCK, TPChild, TPEngine  # noqa: E402

_ids = itertools.count()
#: Leases longer than any wait here: a hold must be freed by the decode's release, not by its lease.
COMMON = {"backend": "mooncake", "heartbeat_interval": 0.2, "lease_duration": 300}


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TPChild, TPEngine]]:
    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)
    prefill_tp, decode_tp = request.param
    engine = f"prefill-tp-{next(_ids)}"
    prefill = TPChild("kv_producer", engine, prefill_tp, {**COMMON, "port": free_port(), "hold_timeout": 120})
    decode = None
    try:
        prefill.ready()
        decode = TPEngine("kv_consumer", f"decode-tp-{next(_ids)}", decode_tp, dict(COMMON))
        yield prefill, decode
    finally:
        if decode is not None:
            decode.shutdown()
        prefill.stop()


def _load(prefill: TPChild, decode: TPEngine, name: str, tokens: list[int]) -> tuple[str, list[int] | None]:
    """Run a transfer; the decode request's id and the blocks it found wrong when its load ended."""
    params = prefill.call("prefill", f"p-{name}", tokens)
    request_id = f"d-{name}"
    decode.add(request_id, tokens, 2, params)
    prefill.post("run", 20.0)
    wrong = None
    # Both engines step until the prefill's run ends (it ends once it holds nothing): the decode
    # tells the prefill of blocks it does not need from its own steps.
    for _ in range(200000):
        decode.step()
        if wrong is None and request_id in decode.loaded:
            wrong = decode.wrong_blocks(request_id)  # before any forward touches the loaded blocks
        if decode.requests[request_id].is_finished() and prefill.answered():
            break
        time.sleep(0.001)
    assert decode.requests[request_id].is_finished()
    assert prefill.result(timeout=60) == 0, "the prefill frees every block it held"
    return request_id, wrong


@pytest.mark.parametrize("pair", [(2, 1)], indirect=True)
def test_a_decode_merges_the_heads_of_two_prefill_ranks(pair: tuple[TPChild, TPEngine]) -> None:
    prefill, decode = pair
    tokens = list(range(200, 200 + 3 * BLOCK + 5))
    request_id, wrong = _load(prefill, decode, "a", tokens)
    assert request_id in decode.loaded and request_id not in decode.failed
    assert wrong == []
    worker = decode.workers[0].worker_half
    assert worker is not None and worker.stats.loaded == 1 and worker.page_heads == 4


@pytest.mark.parametrize("pair", [(1, 2)], indirect=True)
def test_two_decode_ranks_each_load_their_slice_of_one_prefill_ranks_heads(pair: tuple[TPChild, TPEngine]) -> None:
    # The decode's lease renewals announce its TP size; the prefill rank then holds its heads in
    # two slices, one room each, and each decode rank claims its own.
    prefill, decode = pair
    tokens = list(range(300, 300 + 2 * BLOCK + 7))
    request_id, wrong = _load(prefill, decode, "b", tokens)
    assert request_id in decode.loaded and request_id not in decode.failed
    assert wrong == []
    for rank in decode.workers:
        worker = rank.worker_half
        assert worker is not None and worker.stats.loaded == 1 and worker.page_heads == 2
