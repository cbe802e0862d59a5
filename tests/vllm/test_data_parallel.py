"""Data parallelism: DP ranks on one host each take their own ports, and decodes find each.

vLLM runs one engine core per DP rank, each with the same
`kv_transfer_config` (it only appends `_dp<rank>` to the engine id). With
one `port` for all, every DP rank's prefill workers would bind `port +
tp_rank` (issue 20). Each DP rank now takes `tp_size + 1` ports from
`port + dp_index * (tp_size + 1)`: its TP ranks', then its lease port; its
prefill params name its own. Two prefill DP ranks here (vLLM's scheduler,
the kvfsm connector, KV over Mooncake on 127.0.0.1) and one decode loading
from both, byte-exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from . import _env

_missing = _env.vllm_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.compat.vllm._connector import dp_port  # noqa: E402

from ..integration.remote_peer import engine_missing, free_port  # noqa: E402
from .harness import BLOCK_SIZE, Engine, make_request, run_until  # noqa: E402

_ids = itertools.count()


@pytest.fixture
def made() -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.shutdown()


def test_two_dp_ranks_on_one_host_listen_apart_and_a_decode_loads_from_each(made: list[Engine]) -> None:
    missing = engine_missing("mooncake")
    if missing:
        pytest.skip(missing)
    port = free_port()
    extra: dict[str, Any] = {"backend": "mooncake", "port": port, "heartbeat_interval": 0.2}
    engine = f"prefill-{next(_ids)}"
    ranks = [Engine("kv_producer", f"{engine}_dp{i}", extra=extra, dp_index=i) for i in (0, 1)]
    made.extend(ranks)
    decode = Engine("kv_consumer", f"decode-{next(_ids)}", extra={"backend": "mooncake", "heartbeat_interval": 0.2})
    made.append(decode)
    assert [dp_port(port, r.config) for r in ranks] == [port, port + 2]  # TP 1: a TP port and a lease port each
    for index, prefill in enumerate(ranks):
        tokens = list(range(1000 * (index + 1), 1000 * (index + 1) + 2 * BLOCK_SIZE + 3))
        request_id = f"p{index}"
        prefill.add(make_request(request_id, tokens, max_tokens=1, params={"do_remote_decode": True}))
        params = None
        for _ in range(10):
            for output in prefill.step():
                if output.kv_transfer_params is not None:
                    params = dict(output.kv_transfer_params)
            if params is not None:
                break
        assert params is not None and params["remote_port"] == port + 2 * index
        request = decode.add(make_request(f"d{index}", tokens, max_tokens=2, params=params))
        run_until([prefill, decode], lambda request=request: any(request.request_id in r[1] for r in decode.reports))  # type: ignore[misc]
        assert not any(request.request_id in r[2] for r in decode.reports)
        assert decode.check_blocks(request.request_id, tokens) == []
        run_until([prefill, decode], lambda request=request, p=prefill: request.is_finished() and p.empty())  # type: ignore[misc]
        assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
