"""Transfer engines behind one adapter protocol, found by name.

`get_backend("local")` returns the adapter class registered under that
name; `BACKENDS` maps each name to "module:Class" and imports it only when
asked, so `import kvfsm.backends` pulls in neither torch nor any engine.
`import kvfsm` never imports this package.

The protocol every adapter implements is `kvfsm.backends.base.KVBackend`
(see that module's docstring). Third-party engines plug in with
`register_backend("name", "package.module:Class")`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import BackendError, KVBackend, KVPools, MemoryRegion, TransferInputError

if TYPE_CHECKING:  # the real imports are lazy (see __getattr__)
    from .fake import FakeBackend
    from .local import LocalBackend

__all__ = [
    "BACKENDS",
    "get_backend",
    "register_backend",
    "KVBackend",
    "KVPools",
    "MemoryRegion",
    "BackendError",
    "TransferInputError",
    "FakeBackend",
    "LocalBackend",
    "MooncakeBackend",
    "NixlBackend",
]

#: name -> "module:Class", imported on first use.
BACKENDS: dict[str, str] = {
    "fake": "kvfsm.backends.fake:FakeBackend",
    "local": "kvfsm.backends.local:LocalBackend",
    "mooncake": "kvfsm.backends.mooncake:MooncakeBackend",
    "nixl": "kvfsm.backends.nixl:NixlBackend",
}

_CLASS_NAMES = {target.rpartition(":")[2]: name for name, target in BACKENDS.items()}


def register_backend(name: str, target: str) -> None:
    """Make `get_backend(name)` import `target` ("module:Class") on demand."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend name must be a non-empty str; got {name!r}")
    if not isinstance(target, str) or ":" not in target:
        raise TypeError(f"backend target must be 'module:Class'; got {target!r}")
    BACKENDS[name] = target


def get_backend(name: str) -> type[KVBackend]:
    """The adapter class registered as `name`; `BackendError` if unknown or not importable."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"backend {name!r} is not available: importing {module_name} failed: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVBackend)):
        raise BackendError(f"backend {name!r}: {target} is not a KVBackend subclass")
    return cls


def __getattr__(attribute: str) -> Any:
    # Lazy: `from kvfsm.backends import LocalBackend` imports torch only then.
    name = _CLASS_NAMES.get(attribute)
    if name is None:
        raise AttributeError(f"module 'kvfsm.backends' has no attribute {attribute!r}")
    return get_backend(name)
