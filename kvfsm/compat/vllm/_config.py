"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Everything a deployment may tune lives in one frozen `ConnectorConfig`,
parsed once when vLLM builds a connector (both halves parse the same dict,
so they agree). Unknown keys and bad values are refused with a
`kvfsm.ConfigError` naming the key, what it must be and what arrived: a
misspelt timeout must not silently fall back to a default that leaks KV
blocks for eight minutes.

No vLLM import here: the settings are plain data, tested without vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from ..._errors import ConfigError
from ..._lifecycle import Timeouts
from ..._release import DRAIN_POLICIES

__all__ = ["ConnectorConfig", "DEFAULT_PORT"]

#: vLLM's `KVTransferConfig.kv_port` default; the prefill's first rank listens there.
DEFAULT_PORT = 14579


def _seconds_or_none(key: str, value: object) -> float | None:
    return None if value is None else _seconds(key, value, "a positive number of seconds or null")


def _seconds(key: str, value: object, what: str = "a positive number of seconds") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be {what}; got {value!r}")
    return float(value)


def _int(key: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an int {bound}; got {value!r}")
    return value


@attrs.frozen(slots=True)
class ConnectorConfig:
    """How the kvfsm connector moves KV and how long it waits at each phase.

    `backend`: the kvfsm backend moving the bytes ("mooncake", "nixl", or
    "local" when both halves share one process). `host`/`port`: where this
    engine's prefill workers listen (rank r on `port + r`); a decode learns
    them from the request's `kv_transfer_params`. Deadlines, in seconds:
    `hold_timeout` bounds how long a prefill keeps a finished request's
    blocks for a decode that never comes, and `lease_duration` (null: no
    lease) how long it keeps them without a renewal from the decode, which
    renews every `lease_duration / 6` seconds while it intends to load them
    (`_leases`); `bootstrap_timeout` the decode's
    handshake with its prefill; `waiting_timeout` the wait for the first
    bytes once both sides know each other; `transfer_timeout` the transfer
    itself (null: none); `drain_timeout` how long a failed room's blocks
    wait for the peer's proof that its writes stopped (ABORT_ACK, or a
    fence) before they are quarantined: still held, counted in the
    managers' `stats.quarantined` and the metrics' quarantine gauges, and
    reported to vLLM only once a proof arrives (or an operator calls
    `release_quarantined`). `on_drain_deadline: "release"` frees them at
    the deadline instead, as kvfsm did before: opt-in, because a peer that
    was only slow then writes into blocks vLLM gave to another request. A decode asks
    vLLM to retry later (`None` from `get_num_new_matched_tokens`) while
    `max_inflight_loads` loads are running (null: no limit).
    `backend_options` go to the backend's constructor as keyword arguments.
    `shared_key` (a string of 16 characters or more, the same on every
    prefill and decode) authenticates the cross-process handshake
    (`RemoteConfig.shared_key`); without it any process that reaches a
    control port may open a session (see the docs' threat model).
    """

    backend: str = "mooncake"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    hold_timeout: float = 480.0
    lease_duration: float | None = 30.0
    bootstrap_timeout: float = 60.0
    waiting_timeout: float = 300.0
    transfer_timeout: float | None = 120.0
    drain_timeout: float = 30.0
    on_drain_deadline: str = "quarantine"
    heartbeat_interval: float = 1.0
    heartbeat_misses: int = 3
    max_inflight_loads: int | None = None
    backend_options: Mapping[str, Any] = attrs.field(factory=dict)
    shared_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, *, kv_port: int = DEFAULT_PORT) -> ConnectorConfig:
        """Parse `kv_connector_extra_config`; `kv_port` is vLLM's `--kv-port` (the default port)."""
        extra = dict(extra or {})
        defaults = cls()
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kvfsm connector setting(s) {', '.join(map(repr, unknown))} in kv_connector_extra_config; "
                f"known: {', '.join(sorted(known))}"
            )
        backend = extra.get("backend", defaults.backend)
        if not isinstance(backend, str) or not backend:
            raise ConfigError(f"kv_connector_extra_config['backend'] must be a backend name; got {backend!r}")
        host = extra.get("host", defaults.host)
        if not isinstance(host, str) or not host:
            raise ConfigError(f"kv_connector_extra_config['host'] must be a host name or address; got {host!r}")
        options = extra.get("backend_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"kv_connector_extra_config['backend_options'] must be a mapping; got {options!r}")
        inflight = extra.get("max_inflight_loads")
        key = extra.get("shared_key")
        if key is not None and (not isinstance(key, str) or len(key) < 16):
            raise ConfigError("kv_connector_extra_config['shared_key'] must be a string of at least 16 characters")

        def seconds(key: str) -> float:
            return _seconds(key, extra.get(key, getattr(defaults, key)))

        return cls(
            backend=backend,
            host=host,
            port=_int("port", extra.get("port", kv_port), 1, 65535),
            hold_timeout=seconds("hold_timeout"),
            lease_duration=_seconds_or_none("lease_duration", extra.get("lease_duration", defaults.lease_duration)),
            bootstrap_timeout=seconds("bootstrap_timeout"),
            waiting_timeout=seconds("waiting_timeout"),
            transfer_timeout=_seconds_or_none(
                "transfer_timeout", extra.get("transfer_timeout", defaults.transfer_timeout)
            ),
            drain_timeout=seconds("drain_timeout"),
            on_drain_deadline=_drain_policy(extra.get("on_drain_deadline", defaults.on_drain_deadline)),
            heartbeat_interval=seconds("heartbeat_interval"),
            heartbeat_misses=_int("heartbeat_misses", extra.get("heartbeat_misses", defaults.heartbeat_misses), 1),
            max_inflight_loads=None if inflight is None else _int("max_inflight_loads", inflight, 1),
            backend_options=dict(options),
            shared_key=key,
        )

    @property
    def prefill_timeouts(self) -> Timeouts:
        """A prefill room: held for its decode, then sending."""
        return Timeouts(
            bootstrap=self.hold_timeout,
            waiting=self.waiting_timeout,
            transferring=self.transfer_timeout,
            drain=self.drain_timeout,
        )

    @property
    def decode_timeouts(self) -> Timeouts:
        """A decode room: handshake, waiting for the first bytes, receiving."""
        return Timeouts(
            bootstrap=self.bootstrap_timeout,
            waiting=self.waiting_timeout,
            transferring=self.transfer_timeout,
            drain=self.drain_timeout,
        )


def _drain_policy(value: object) -> str:
    if value not in DRAIN_POLICIES:
        raise ConfigError(
            f"kv_connector_extra_config['on_drain_deadline'] must be one of {', '.join(map(repr, DRAIN_POLICIES))}; "
            f"got {value!r}"
        )
    return str(value)
