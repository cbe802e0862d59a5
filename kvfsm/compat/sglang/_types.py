"""SGLang's small value types, and the knobs it reads from the environment.

Everything here mirrors `sglang/srt/disaggregation/base/conn.py` and
`common/conn.py` of SGLang 0.5.23 (`SGLANG_VERSION`): the enums and data
classes the scheduler builds or reads, SGLang's error type with the
attribute names its scheduler reads, and the environment variables whose
defaults SGLang documents. Nothing here imports SGLang.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from ... import _errors
from ..._errors import ConfigError
from ..._states import FailureReason, Role, RoomId

__all__ = [
    "SGLANG_VERSION",
    "BOOTSTRAP_TIMEOUT_ENV",
    "WAITING_TIMEOUT_ENV",
    "DEFERRED_RELEASE_ENV",
    "ABORT_MESSAGE",
    "PROPAGATED_MESSAGE",
    "DisaggregationMode",
    "KVTransferDestination",
    "KVArgs",
    "KVTransferMetric",
    "KVTransferError",
    "PrefillServerInfo",
    "timeout_from_env",
    "flag_from_env",
    "role_of",
]

#: The SGLang release whose scheduler code this layer is tested against (tests/sglang).
SGLANG_VERSION = "0.5.23"

#: SGLang's environment knobs (seconds), read where SGLang reads them.
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
#: Whether decode holds an aborted request's pages until the prefill proves its writes drained (default on).
DEFERRED_RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
_DEFAULT_TIMEOUT_S = 300.0

#: The reason SGLang's scheduler-initiated abort records.
ABORT_MESSAGE = "Aborted by AbortReq."
#: What a rank reports when the all-reduce says Failed but its own room had not failed.
PROPAGATED_MESSAGE = "Failed due to an unknown reason from another rank"


class DisaggregationMode(enum.Enum):
    """SGLang's `DisaggregationMode`; any object whose `.value` is one of these works."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferDestination(str, enum.Enum):
    """Where decode wants a request's KV: device memory (kvfsm's only kind) or host memory."""

    DEVICE = "device"
    HOST = "host"


class KVArgs:
    """SGLang's `KVArgs`: a bag of attributes describing the KV buffers.

    Created empty and filled by attribute assignment, as SGLang does; the
    annotations list the attributes kvfsm's adapters read. `state_types`
    defaults to empty (no mamba/SWA state), as it is for a plain MHA model.
    """

    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    ib_device: str
    gpu_id: int
    page_size: int
    pp_rank: int
    system_dp_rank: int
    kv_cache_dtype_str: str
    #: MHA/GQA only (SGLang leaves them unset for MLA): KV heads on this rank and in all; the
    #: Mooncake trio pairs unequal attention TP sizes with them.
    kv_head_num: int
    total_kv_head_num: int

    def __init__(self, **attributes: Any) -> None:
        self.state_types: list[Any] = []
        for name, value in attributes.items():
            setattr(self, name, value)


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's per-request transfer metric; None where a backend cannot tell."""

    transfer_latency_s: float | None = None
    alloc_latency_s: float | None = None
    transfer_total_bytes: int | None = None


class KVTransferError(_errors.KVTransferError):
    """`kvfsm.KVTransferError` with the attribute names SGLang's code reads.

    `bootstrap_room`, `failure_reason` (a str) and `is_from_another_rank`
    are SGLang's; `room` and `reason` (the structured `FailureReason`) are
    kvfsm's. It is an `Exception`, so `except Exception` in the scheduler
    catches it as before. `failure_reason` is the text SGLang would show:
    a subclass may pass `message` to word it as its SGLang backend did.
    """

    def __init__(self, room: RoomId, reason: FailureReason | None = None, message: str | None = None) -> None:
        super().__init__(room, reason)
        self._message = message

    @property
    def bootstrap_room(self) -> RoomId:
        return self.room

    @property
    def failure_reason(self) -> str:
        if self._message is not None:
            return self._message
        if self.reason is None:
            return "no reason recorded"
        return self.reason.message or str(self.reason)

    def __str__(self) -> str:
        # SGLang's form (its scheduler puts it in the client's abort message).
        detail = self._message if self._message is not None else (self.reason or "no reason recorded")
        return f"KVTransferError(bootstrap_room={self.room!r}): {detail}"


@dataclasses.dataclass
class PrefillServerInfo:
    """What decode knows about a prefill server (SGLang's `PrefillServerInfo`).

    The decode scheduler reads `dp_size` and `follow_bootstrap_room` to pick
    the prefill DP rank of a request, and `prefill_http_port` to re-run a
    retracted request's prefill. `ranks` and `addresses` are kvfsm's: the
    control-plane address of each prefill rank, in rank order and by
    `(dp_rank, tp_rank, pp_rank)`.
    """

    attn_tp_size: int = 1
    attn_cp_size: int = 1
    #: kvfsm's: the model's KV heads over all TP ranks (None for MLA), to pair unequal attention TP sizes.
    total_kv_heads: int | None = None
    dp_size: int = 1
    pp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True
    decode_allocation_policy: str = "early"
    prefill_http_port: int | None = None
    ranks: list[str] = dataclasses.field(default_factory=list)
    addresses: dict[tuple[int, int, int], str] = dataclasses.field(default_factory=dict)


def timeout_from_env(name: str, default: float = _DEFAULT_TIMEOUT_S) -> float:
    """A positive number of seconds from the environment (SGLang's knobs)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds; got {text!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds; got {text!r}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def flag_from_env(name: str, default: bool) -> bool:
    """A boolean knob, spelled as SGLang's `EnvBool` accepts it."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name} must be a boolean (1/0, true/false); got {text!r}")


def role_of(disaggregation_mode: object) -> Role | None:
    """The kvfsm role of an SGLang `DisaggregationMode` (or its value), None for NULL."""
    value = getattr(disaggregation_mode, "value", disaggregation_mode)
    if value == DisaggregationMode.PREFILL.value:
        return Role.SENDER
    if value == DisaggregationMode.DECODE.value:
        return Role.RECEIVER
    return None
