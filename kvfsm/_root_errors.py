"""The root of kvfsm's exceptions, and the one error the vocabulary itself raises.

They live apart from `_errors.py` so the bottom layer can raise them:
`_states.py` (roles, timeouts) rejects bad settings with `ConfigError`, and
`_errors.py`, whose room errors name states and reasons, imports `_states`.
Each module imports only from below. Import them from `kvfsm`.
"""

from __future__ import annotations

__all__ = ["KVFSMError", "ConfigError"]


class KVFSMError(Exception):
    """Root of every error kvfsm raises on purpose."""


class ConfigError(KVFSMError, ValueError):
    """A setting (role, timeout, interval, ...) has a value that cannot work."""
