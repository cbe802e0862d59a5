"""SGLang's disaggregation classes, with kvfsm underneath.

SGLang's scheduler talks to a KV-transfer backend through the classes of
`sglang/srt/disaggregation/base/conn.py`: a manager per process, a sender
per prefill request, a receiver per decode request, a fake trio for warmup
requests, and (for real backends) a bootstrap server. This package offers
the same classes, constructor arguments, methods and attributes, matched
against SGLang 0.5.23's scheduler code (`SGLANG_VERSION`; tests/sglang runs
SGLang's own queues over them), so a server swaps them in through
`get_kv_class` without other edits, while every status they report is a
kvfsm room's state.

One module per job:

* `_types`: SGLang's value types (`KVArgs`, `KVTransferMetric`,
  `DisaggregationMode`, `PrefillServerInfo`, ...), its error type with the
  attributes the scheduler reads, and its environment knobs.
* `_manager`: `KVManager`, one `kvfsm.TransferManager` plus what the
  scheduler reads off a manager (deferred release, prefill servers, role
  switch); `_legacy_status` turns old integer status writes into events.
* `_endpoint`: `KVSender` / `KVReceiver`, one request's view of its room.
* `_rooms`: where dropped endpoints' rooms and fake requests' rooms live.
* `_fake`: `FakeKVManager` / `FakeKVSender` / `FakeKVReceiver`.
* `_mooncake`: `MooncakeKVManager` / `MooncakeKVSender` /
  `MooncakeKVReceiver` / `MooncakeKVBootstrapServer`, SGLang's Mooncake
  backend rebuilt on `kvfsm.backends.MooncakeBackend` (imported on first
  use: it needs pyzmq and Mooncake); `_heads`: which ranks of unequal
  attention TP sizes pair, and the head-slice writes between them.

Nothing here imports SGLang: the interface is matched from its source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._states import KVPoll
from ._endpoint import REQUEST_VIEW, KVReceiver, KVSender, RequestView
from ._fake import FakeKVManager, FakeKVReceiver, FakeKVSender
from ._manager import KVManager
from ._types import (
    ABORT_MESSAGE,
    BOOTSTRAP_TIMEOUT_ENV,
    DEFERRED_RELEASE_ENV,
    PROPAGATED_MESSAGE,
    SGLANG_VERSION,
    WAITING_TIMEOUT_ENV,
    DisaggregationMode,
    KVArgs,
    KVTransferDestination,
    KVTransferError,
    KVTransferMetric,
    PrefillServerInfo,
)

if TYPE_CHECKING:
    from ._mooncake import MooncakeKVBootstrapServer, MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender

__all__ = [
    "RequestView",
    "REQUEST_VIEW",
    "SGLANG_VERSION",
    "KVPoll",
    "KVArgs",
    "KVTransferMetric",
    "KVTransferError",
    "KVTransferDestination",
    "DisaggregationMode",
    "PrefillServerInfo",
    "KVManager",
    "KVSender",
    "KVReceiver",
    "FakeKVManager",
    "FakeKVSender",
    "FakeKVReceiver",
    "MooncakeKVManager",
    "MooncakeKVSender",
    "MooncakeKVReceiver",
    "MooncakeKVBootstrapServer",
    "ABORT_MESSAGE",
    "PROPAGATED_MESSAGE",
    "BOOTSTRAP_TIMEOUT_ENV",
    "WAITING_TIMEOUT_ENV",
    "DEFERRED_RELEASE_ENV",
]

_LAZY = {"MooncakeKVManager", "MooncakeKVSender", "MooncakeKVReceiver", "MooncakeKVBootstrapServer"}


def __getattr__(name: str) -> Any:
    # The Mooncake trio pulls in pyzmq and the engine: only when asked for.
    if name in _LAZY:
        from . import _mooncake

        return getattr(_mooncake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
