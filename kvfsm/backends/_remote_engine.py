"""The engine below a cross-process backend: what Mooncake and NIXL plug in.

`RemoteBackend` keeps the lifecycle; an engine only registers memory,
describes its session, and submits and polls writes. This module holds
that interface (`EngineAdapter`, the `EngineJob` it returns, `PartialSubmit`
for a submit that failed half-way) and the byte-level helpers both halves
of an endpoint share (`Write`, `coalesce_runs`). It imports no engine, so
a third-party engine and the scripted engine of the unit tests build on it
without Mooncake or NIXL installed.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any

from ._errors import BackendError
from .memory import MemoryRegion

__all__ = ["EngineAdapter", "EngineBusy", "EngineJob", "PartialSubmit", "Write", "coalesce_runs", "page_writes"]

#: One write: (source address, destination address, length in bytes).
Write = tuple[int, int, int]


def coalesce_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Group page pairs into runs contiguous on both sides: (src_start, dst_start, count)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def page_writes(
    mine: Sequence[MemoryRegion], theirs: Sequence[MemoryRegion], runs: Iterable[tuple[int, int, int]]
) -> list[Write]:
    """The writes of page runs (src_start, dst_start, count): one per run and region pair, runs outermost."""
    # Every 4 MiB room makes hundreds of these: the regions' fields are read once, not per write.
    regions = [(s.ptr, s.page_nbytes, d.ptr, d.page_nbytes) for s, d in zip(mine, theirs, strict=True)]
    return [
        (s_ptr + src * s_page, d_ptr + dst * d_page, count * s_page)
        for src, dst, count in runs
        for s_ptr, s_page, d_ptr, d_page in regions
    ]


class EngineJob(abc.ABC):
    """Writes submitted to an engine as one unit, polled until they end."""

    @abc.abstractmethod
    def poll(self) -> str:
        """ "done", "pending", "failed" or "timeout" (slow; may still complete)."""

    def cancel(self) -> bool:
        """Try to stop the writes; True when none of them can land any more."""
        return False

    def release(self) -> None:
        """Free engine resources once the job ended (or was cancelled)."""
        return

    #: What the job moves, for messages.
    detail: str = ""
    #: Set when the job ended in a way that does not prove its writes stopped
    #: (a synchronous batch that gave up on a timeout): its room is then never
    #: reported drained; the drain deadline decides.
    may_still_land: bool = False


class PartialSubmit(BackendError):
    """Submitting failed after `submitted` writes went out; `job` holds those, to be waited for."""

    def __init__(self, job: EngineJob, message: str, submitted: int = 0) -> None:
        super().__init__(message)
        self.job = job
        self.submitted = submitted


class EngineBusy(BackendError):
    """The engine cannot take these writes now (its queue is full): try again later, do not fail.

    When some writes went out first, `job` holds them and `submitted`
    counts them; the rest are handed back.
    """

    def __init__(self, message: str, job: EngineJob | None = None, submitted: int = 0) -> None:
        super().__init__(message)
        self.job = job
        self.submitted = submitted


class EngineAdapter(abc.ABC):
    """The engine-specific part of a cross-process backend."""

    name: str = "?"
    #: Writes into one peer this engine takes in flight without refusing any (the writer's
    #: default per-session budget; `RemoteConfig.max_writes_in_flight` overrides it).
    max_writes_in_flight: int = 1024
    #: True when writes into this (receiving) endpoint only progress while it polls its
    #: engine (NIXL without its progress thread): the decode then calls `progress()` often
    #: while a prefill may be writing into it.
    receiver_progress: bool = False
    #: True when the engine carries short notifications to a peer (NIXL's `send_notif`): a
    #: decode with completion markers on then hears each room's commit marker as one
    #: (`notify`, returned by the decode's `progress()`) instead of having it written into
    #: its memory, which this engine would not move along once the room is done.
    notifies: bool = False

    @abc.abstractmethod
    def register(self, regions: list[MemoryRegion]) -> None:
        """Register the endpoint's memory."""

    def register_host(self, regions: list[MemoryRegion]) -> None:
        """Register kvfsm's own host buffers (commit markers), whatever memory the pools are in."""
        self.register(regions)

    @abc.abstractmethod
    def session(self) -> tuple[dict[str, Any], bytes | None]:
        """What a peer needs to reach this engine: JSON fields and an optional blob."""

    @abc.abstractmethod
    def add_peer(self, session: dict[str, Any], blob: bytes | None) -> Any:
        """Open the peer's engine session; returns what `submit` needs to target it."""

    def remove_peer(self, target: Any) -> None:
        return

    @abc.abstractmethod
    def submit(self, target: Any, writes: list[Write]) -> EngineJob:
        """Start writes into the peer's memory; the job tells when they ended."""

    def submit_host(self, target: Any, writes: list[Write]) -> EngineJob:
        """Start writes between host buffers (`register_host`'s, and aux slots in host memory)."""
        return self.submit(target, writes)

    def progress(self) -> list[tuple[str, bytes]]:
        """Let the engine move incoming writes along (see `receiver_progress`).

        Returns the notifications that arrived meanwhile (`notifies`): the
        sending peer's engine id and the message, unchecked.
        """
        return []

    def notify(self, target: Any, message: bytes) -> None:
        """Send `message` to the peer of `target` after everything submitted to it before (`notifies`)."""
        raise BackendError(f"engine {self.name!r} carries no notifications")

    def close(self) -> None:
        return
