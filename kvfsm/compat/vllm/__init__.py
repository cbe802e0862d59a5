"""kvfsm as vLLM's KV connector: every prefill/decode transfer is a kvfsm room.

vLLM (v1) loads third-party connectors by module path::

    --kv-transfer-config '{"kv_connector": "KVFSMConnector",
                           "kv_connector_module_path": "kvfsm.compat.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"backend": "mooncake"}}'

`KVFSMConnector` (in `_connector`, the only module here that imports vLLM)
hands vLLM's hooks to two halves that do not import it: the scheduler's
(`_plan`: which requests' blocks the connector holds, as rooms) and the
workers' (`_worker`: each transfer a room moved by a kvfsm backend).
Settings are `_config.ConnectorConfig`; the `kv_transfer_params` a prefill
returns for its decode are `_params`' (NIXL's keys, so vLLM's proxies
forward them unchanged).

Importing this package does not import vLLM: the connector class is
resolved on first use (which is how vLLM's factory asks for it), so
`import kvfsm` and `import kvfsm.compat` stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._connector import KVFSMConnector, KVFSMConnectorMetadata

__all__ = ["KVFSMConnector", "KVFSMConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _connector

        return getattr(_connector, name)
    raise AttributeError(f"module 'kvfsm.compat.vllm' has no attribute {name!r}")
