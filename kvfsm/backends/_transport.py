"""What a remote endpoint needs of the bytes below it, with no transport in it.

The endpoint halves (`_remote_endpoint`, `_remote_receiver`,
`_remote_sender`, `_remote_writer`, `_sessions`) are sans-IO: they decide
what each frame means and hand frames to a `Transport`. ZeroMQ's
`ControlPlane` (`control.py`) is one transport and the test suite's
simulated hostile network is another; both count into `ControlStats`. So
this module, not `control.py`, is what the halves import: they, the wire
model test and anyone reading them need no pyzmq.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

__all__ = ["ControlStats", "Transport"]


@attrs.define
class ControlStats:
    """Counters of one endpoint's control plane (read them from any thread).

    `dropped` counts frames that never reached a room: malformed ones, other
    protocol versions, unknown types, oversized ones, and frames whose
    session id or secret is not one of this endpoint's sessions.
    """

    received: int = 0
    sent: int = 0
    malformed: int = 0
    bad_version: int = 0
    unknown_type: int = 0
    oversized: int = 0
    unauthenticated: int = 0
    handler_errors: int = 0
    #: Frames received but not handled yet when housekeeping last ran (their senders counted as heard).
    backlog: int = 0
    send_failures: int = 0
    heartbeats_sent: int = 0
    peers_lost: int = 0
    sessions_evicted: int = 0

    @property
    def dropped(self) -> int:
        return self.malformed + self.bad_version + self.unknown_type + self.oversized + self.unauthenticated


class Transport(Protocol):
    """What an endpoint needs from the bytes below it (`ControlPlane`, or a simulated network)."""

    address: str
    stats: ControlStats

    def connect(self, addr: str) -> Any: ...

    def send(self, channel: Any, frames: list[bytes]) -> bool: ...

    def close_channel(self, channel: Any, *, flush: bool = False) -> None:
        """Close a channel; `flush=True` lets what was just sent on it still go out (bounded)."""
        ...

    def wake(self) -> None: ...
