"""Where the compat endpoints' rooms live when nobody clears them.

Two structures the managers and endpoints share:

* `Orphanage`: rooms whose sender or receiver was garbage-collected
  without `clear()`. SGLang's scheduler drops requests without clearing
  them on some paths (a bootstrap failure on prefill, for one). A
  finalizer may run in any thread at any allocation, even one made while a
  manager's lock is held, so it must not close the room itself: it only
  appends the handle (atomic, lock-free), and the owner closes orphans at
  its next safe point (`collect_orphans()`, opening a room, a status read).
* `FakeRooms`: the managers fake (warmup) requests live on. SGLang's fake
  classes are often paired with a real backend's manager and read their
  timeout from the environment per request, so they cannot share that
  manager's rooms or deadlines. Rooms get private ids: warmup requests may
  share a bootstrap room, and a fake receiver may have none.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from ..._errors import UnknownRoom
from ..._lifecycle import Timeouts
from ..._manager import TransferHandle, TransferManager
from ..._observe import StateChange
from ..._states import KVPoll, Role
from .._room_ids import room_text

__all__ = ["Orphanage", "FakeRooms", "fake_rooms_for"]


class Orphanage:
    """Handles of dropped endpoints, closed later at a safe point by `close_all`."""

    def __init__(self, close: Callable[[TransferHandle], None]) -> None:
        self.close = close
        self._queue: deque[TransferHandle] = deque()

    def adopt(self, handle: TransferHandle) -> None:
        self._queue.append(handle)

    def close_all(self) -> int:
        """Close every adopted room still open; how many were closed."""
        closed = 0
        while True:
            try:
                handle = self._queue.popleft()
            except IndexError:
                return closed
            if not handle.closed:
                with contextlib.suppress(UnknownRoom):
                    self.close(handle)
                closed += 1


def _drain_failed_fakes(manager: TransferManager) -> Callable[[StateChange], None]:
    """An observer that opens the release gate of failed fake rooms at once.

    Fake transfers write nothing, so nothing can still be landing in their
    pages; without this a failed warmup request would hold its pages until
    the drain deadline.
    """
    ref = weakref.ref(manager)

    def observe(change: StateChange) -> None:
        target = ref()
        if target is None or change.dest is not KVPoll.Failed:
            return
        try:
            handle = target.get(change.room)
        except UnknownRoom:
            return
        if handle.generation == change.generation:
            handle.writes_drained()

    return observe


class FakeRooms:
    """The managers fake requests live on, one per (role, waiting deadline)."""

    def __init__(self, clock: Callable[[], float], reaper: bool) -> None:
        self.clock = clock
        self._reaper = reaper
        self._lock = threading.Lock()
        self._managers: dict[tuple[Role, float | None], TransferManager] = {}
        self._ids = itertools.count(1)
        self.orphans = Orphanage(TransferHandle.close)

    def open(self, role: Role, waiting: float | None, bootstrap_room: object) -> TransferHandle:
        self.orphans.close_all()
        key = (role, waiting)
        with self._lock:
            manager = self._managers.get(key)
            if manager is None:
                manager = TransferManager(
                    role,
                    timeouts=Timeouts(bootstrap=None, waiting=waiting, transferring=None),
                    clock=self.clock,
                    remember_closed=0,
                )
                manager.subscribe(_drain_failed_fakes(manager))
                if self._reaper:
                    manager.start_reaper()
                self._managers[key] = manager
            # Named after SGLang's room (shortened: a client's int may have thousands of digits).
            room_id = f"fake:{room_text(bootstrap_room)}:{next(self._ids)}"
        return manager.open(room_id)

    def managers(self) -> list[TransferManager]:
        with self._lock:
            return list(self._managers.values())

    def live(self) -> int:
        """Fake rooms open right now (all roles and deadlines)."""
        return sum(len(manager) for manager in self.managers())

    def fail_live(self, reason: str) -> None:
        """Abort every fake room still in flight (a manager being torn down)."""
        for manager in self.managers():
            for handle in manager:
                if not handle.is_terminal and not handle.closed:
                    handle.abort(reason)

    def stop(self) -> None:
        for manager in self.managers():
            manager.stop_reaper()


_shared: FakeRooms | None = None
_shared_lock = threading.Lock()


def fake_rooms_for(mgr: object) -> FakeRooms:
    """The fake rooms of a kvfsm manager, or the process-wide ones for any other manager.

    Any manager works: SGLang pairs fake endpoints with whatever manager
    the real backend built (or `None` in its unit tests).
    """
    own = getattr(mgr, "fake_rooms", None)
    if isinstance(own, FakeRooms):
        return own
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = FakeRooms(time.monotonic, reaper=True)
        return _shared
