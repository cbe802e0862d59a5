"""The connector's settings and the kv_transfer_params it writes and reads (no vLLM needed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfsm import ConfigError, Timeouts
from kvfsm.compat.vllm._config import DEFAULT_PORT, ConnectorConfig
from kvfsm.compat.vllm._params import (
    RemoteSource,
    flat_block_ids,
    group_room,
    parse_source,
    prefill_params,
    room_id,
)


def test_defaults_and_the_timeouts_each_side_gets() -> None:
    config = ConnectorConfig.from_extra({})
    assert config.backend == "mooncake" and config.port == DEFAULT_PORT
    assert config.prefill_timeouts == Timeouts(bootstrap=480.0, waiting=300.0, transferring=120.0, drain=30.0)
    assert config.decode_timeouts == Timeouts(bootstrap=60.0, waiting=300.0, transferring=120.0, drain=30.0)
    assert ConnectorConfig.from_extra(None, kv_port=20000).port == 20000


def test_settings_are_read() -> None:
    config = ConnectorConfig.from_extra(
        {
            "backend": "local",
            "host": "10.0.0.2",
            "port": 30000,
            "hold_timeout": 5,
            "transfer_timeout": None,
            "max_inflight_loads": 4,
            "backend_options": {"workers": 3},
        }
    )
    assert (config.backend, config.host, config.port, config.hold_timeout) == ("local", "10.0.0.2", 30000, 5.0)
    assert config.transfer_timeout is None and config.max_inflight_loads == 4
    assert config.backend_options == {"workers": 3}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hold_timout": 5}, "unknown kvfsm connector setting(s) 'hold_timout'"),
        ({"hold_timeout": 0}, "'hold_timeout'] must be a positive number of seconds; got 0"),
        ({"drain_timeout": None}, "'drain_timeout'] must be a positive number of seconds; got None"),
        ({"waiting_timeout": float("inf")}, "'waiting_timeout'] must be a positive number"),
        ({"transfer_timeout": True}, "'transfer_timeout'] must be a positive number of seconds or null"),
        ({"port": 70000}, "'port'] must be an int in 1..65535; got 70000"),
        ({"heartbeat_misses": 0}, "'heartbeat_misses'] must be an int >= 1"),
        ({"max_inflight_loads": 0}, "'max_inflight_loads'] must be an int >= 1"),
        ({"backend": ""}, "'backend'] must be a backend name"),
        ({"host": 5}, "'host'] must be a host name"),
        ({"backend_options": [1]}, "'backend_options'] must be a mapping"),
    ],
)
def test_bad_settings_are_refused_by_name(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ConnectorConfig.from_extra(extra)
    assert message in str(caught.value)


def _params(**override: Any) -> dict[str, Any]:
    params = prefill_params(engine_id="P", request_id="r1", host="h", port=14579, block_ids=[3, 4], tp_size=1)
    params.update(override)
    return params


def test_prefill_params_round_trip_into_the_decodes_source() -> None:
    params = _params()
    assert params["remote_block_ids"] == [[3, 4]]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    source = parse_source(params)
    assert source == RemoteSource("P", "r1", "h", 14579, (3, 4), 1)
    assert isinstance(source, RemoteSource) and source.room == room_id("P", "r1") == "P/r1"


def test_nixl_style_params_are_read_too() -> None:
    # vLLM's own tests (and NIXL proxies) give flat block lists and no tp_size at times.
    source = parse_source(
        {
            "do_remote_prefill": True,
            "remote_engine_id": "e",
            "remote_request_id": "x",
            "remote_block_ids": [0, 1, 2],
            "remote_host": "my-host",
            "remote_port": 1234,
        },
    )
    assert isinstance(source, RemoteSource) and source.block_ids == ((0, 1, 2),)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"remote_engine_id": ""}, "'remote_engine_id'] must be a non-empty string"),
        ({"remote_request_id": None}, "'remote_request_id'] must be a non-empty string"),
        ({"remote_host": 7}, "'remote_host'] must be a non-empty string"),
        ({"remote_port": "80"}, "'remote_port'] must be a port number"),
        ({"remote_port": 0}, "'remote_port'] must be a port number"),
        ({"tp_size": 0}, "'tp_size'] must be an int >= 1"),
        ({"remote_block_ids": [[1], [2]]}, "2 KV cache group(s) and this engine 1"),
        ({"remote_block_ids": [1, -2]}, "block ids (ints >= 0)"),
        ({"remote_block_ids": "12"}, "must be a list of block ids"),
        ({"remote_block_ids": [True]}, "block ids (ints >= 0)"),
    ],
)
def test_unusable_params_say_why(override: dict[str, Any], message: str) -> None:
    problem = parse_source(_params(**override))
    assert isinstance(problem, str) and message in problem


def test_a_prefill_of_another_tp_size_parses_its_size_is_the_schedulers_to_judge() -> None:
    source = parse_source(_params(tp_size=2))
    assert isinstance(source, RemoteSource) and source.tp_size == 2


def test_hybrid_block_ids_stay_per_group() -> None:
    params = prefill_params(engine_id="P", request_id="r", host="h", port=1, block_ids=[[1, 2], [], [9]], tp_size=1)
    assert params["remote_block_ids"] == [[1, 2], [], [9]]
    source = parse_source(params, groups=3)
    assert isinstance(source, RemoteSource) and source.block_ids == ((1, 2), (), (9,))
    # A decode with fewer groups cannot match them group by group; with more, the missing are empty.
    problem = parse_source(params, groups=2)
    assert isinstance(problem, str) and "3 KV cache group(s) and this engine 2" in problem
    more = parse_source(params, groups=4)
    assert isinstance(more, RemoteSource) and more.block_ids == ((1, 2), (), (9,), ())
    # No blocks at all (a prefill that held none) fits any number of groups.
    empty = parse_source({**params, "remote_block_ids": [[]]}, groups=3)
    assert isinstance(empty, RemoteSource) and empty.block_ids == ((), (), ())
    assert group_room("P/r", 0) == "P/r" and group_room("P/r", 2) == "P/r#g2"


def test_block_id_forms() -> None:
    assert flat_block_ids([]) == ()
    assert flat_block_ids([[]]) == ()
    assert flat_block_ids(((5, 6),)) == (5, 6)


def test_importing_kvfsm_and_the_connector_package_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvfsm, kvfsm.compat, kvfsm.compat.vllm, kvfsm.compat.vllm._plan\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'zmq') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert kvfsm.compat.vllm.__all__ == ['KVFSMConnector', 'KVFSMConnectorMetadata']\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_vllm_extra_brings_the_default_backend_and_the_control_plane() -> None:
    import configparser
    from pathlib import Path

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).parents[2] / "setup.cfg")
    extra = [line.split(">")[0].split("=")[0].strip() for line in setup["options.extras_require"]["vllm"].split("\n")]
    assert ConnectorConfig().backend == "mooncake"
    assert {"mooncake-transfer-engine-non-cuda", "pyzmq"} <= set(extra)


def test_a_missing_default_backend_says_which_install_brings_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvfsm.backends import BackendError
    from kvfsm.compat.vllm import _worker

    def missing(self: Any, manager: Any, port: int) -> Any:
        raise BackendError("MooncakeBackend needs Mooncake Transfer Engine")

    monkeypatch.setattr(_worker.WorkerHalf, "_make_backend", missing)
    half = _worker.WorkerHalf(ConnectorConfig(), engine_id="E", tp_rank=0, num_blocks=2, producer=True, consumer=False)
    with pytest.raises(BackendError, match=r"pip install 'kvfsm\[vllm\]'"):
        half.register({"l": torch.zeros(2, 4)})


def test_the_lease_is_thirty_seconds_by_default_configurable_and_can_be_switched_off() -> None:
    assert ConnectorConfig.from_extra({}).lease_duration == 30.0
    assert ConnectorConfig.from_extra({"lease_duration": 5}).lease_duration == 5.0
    assert ConnectorConfig.from_extra({"lease_duration": None}).lease_duration is None
    for bad in (0, -1, "30", True, float("inf")):
        with pytest.raises(ConfigError, match="'lease_duration'"):
            ConnectorConfig.from_extra({"lease_duration": bad})
