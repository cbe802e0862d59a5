"""SGLang's own code, ported line for line, as the reference the compat layer is checked against.

Sources (sgl-project/sglang, python/sglang/srt/disaggregation/):

* `FakeKVSender` / `FakeKVReceiver`: fake/conn.py after #28652 (waiting
  timeout, `should_send_kv_chunk`). The only change: the clock and the
  timeout are injected instead of `time.monotonic()` and the environment.
* `LegacyFakeKVSender` / `LegacyFakeKVReceiver`: fake/conn.py before
  #25599 (no `abort`, no `conclude_state`), the fake backend of bug 3.
* `CommonStatusManager`: the status methods of `CommonKVManager`
  (common/conn.py, after #24539), verbatim: `max` on integers, `Failed`
  dropped for a missing room, no lock.
* `MooncakeStyleSender`: the sender poll/abort/clear/failure_exception of
  Mooncake and Common. `abort_syncs=False` gives the pre-fix abort that
  only set the local flag (bug 1).

Tests run the same scenario against these and against kvfsm: on these the
motivating bugs reproduce (the tests are marked xfail(strict=True) there),
on kvfsm they must not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvfsm import KVPoll


class FakeKVSender:
    def __init__(self, clock: Callable[[], float], waiting_timeout: float) -> None:
        self.has_sent = False
        self.conclude_state: KVPoll | None = None
        self.waiting_timeout = waiting_timeout
        self.inited = False
        self.waiting_since: float | None = None
        self._clock = clock

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.has_sent:
            timeout_result = self._check_waiting_timeout()
            if timeout_result is not None:
                return timeout_result
            return KVPoll.WaitingForInput
        self.conclude_state = KVPoll.Success
        return KVPoll.Success

    def _check_waiting_timeout(self) -> KVPoll | None:
        if not self.inited:
            return None
        if self.waiting_since is None:
            self.waiting_since = self._clock()
            return None
        elapsed = self._clock() - self.waiting_since
        if elapsed < self.waiting_timeout:
            return None
        self.conclude_state = KVPoll.Failed
        return KVPoll.Failed

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.inited = True

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None) -> None:
        self.has_sent = True

    def failure_exception(self) -> None:
        raise Exception("Fake KVSender Exception")

    def abort(self) -> None:
        self.conclude_state = KVPoll.Failed


class FakeKVReceiver:
    def __init__(self) -> None:
        self.abort_notified = False
        self.bootstrap_done = False
        self.has_sent_metadata = False
        self.require_staging = False
        self.conclude_state: KVPoll | None = None

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.bootstrap_done:
            return KVPoll.Bootstrapping
        if not self.has_sent_metadata:
            return KVPoll.WaitingForInput
        self.conclude_state = KVPoll.Success
        return KVPoll.Success

    def init(self, prefill_dp_rank: int) -> None:
        self.bootstrap_done = True

    def send_metadata(
        self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None, decode_prefix_len: Any = None
    ) -> None:
        self.has_sent_metadata = True

    def failure_exception(self) -> None:
        raise Exception("Fake KVReceiver Exception")

    def abort(self) -> None:
        self.conclude_state = KVPoll.Failed


class LegacyFakeKVSender:
    """Before #25599: no abort, nothing latched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.has_sent = False

    def poll(self) -> KVPoll:
        return KVPoll.Success if self.has_sent else KVPoll.WaitingForInput

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        pass

    def send(self, kv_indices: Any, state_indices: Any = None) -> None:
        self.has_sent = True


class LegacyFakeKVReceiver:
    """Before #25599: no abort, nothing latched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.bootstrap_done = False
        self.has_sent_metadata = False

    def poll(self) -> KVPoll:
        if not self.bootstrap_done:
            return KVPoll.Bootstrapping
        return KVPoll.Success if self.has_sent_metadata else KVPoll.WaitingForInput

    def init(self, prefill_dp_rank: int) -> None:
        self.bootstrap_done = True

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None) -> None:
        self.has_sent_metadata = True


class CommonStatusManager:
    """`CommonKVManager`'s status table and methods, verbatim."""

    def __init__(self) -> None:
        self.request_status: dict[int, KVPoll] = {}
        self.failure_records: dict[int, str] = {}
        self.failure_lock = threading.Lock()

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status[bootstrap_room]

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        if bootstrap_room not in self.request_status:
            if status == KVPoll.Failed:
                return
            self.request_status[bootstrap_room] = status
        else:
            if status == KVPoll.Failed:
                self.request_status[bootstrap_room] = KVPoll.Failed
            else:
                self.request_status[bootstrap_room] = max(self.request_status[bootstrap_room], status)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        with self.failure_lock:
            self.failure_records[bootstrap_room] = failure_reason


class KVTransferError(Exception):
    def __init__(self, bootstrap_room: int, failure_reason: str, is_from_another_rank: bool = False) -> None:
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank


class MooncakeStyleSender:
    """Common's constructor/clear/abort with Mooncake's poll and failure_exception."""

    abort_syncs = True

    def __init__(self, mgr: CommonStatusManager, bootstrap_addr: str, bootstrap_room: int, *args: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: KVPoll | None = None
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def poll(self) -> KVPoll:
        if self.conclude_state is None:
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
            return status
        return self.conclude_state

    def failure_exception(self) -> None:
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            failure_reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        is_propagated = failure_reason is None
        if is_propagated:
            failure_reason = "Failed due to an unknown reason from another rank"
        raise KVTransferError(self.bootstrap_room, str(failure_reason), is_from_another_rank=is_propagated)

    def clear(self) -> None:
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)

    def abort(self) -> None:
        if self.abort_syncs:
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed


class PreFixSender(MooncakeStyleSender):
    """Bug 1: an abort that only set the local flag."""

    abort_syncs = False
