"""SGLang's fake (warmup) trio, with every request a kvfsm room.

SGLang routes warmup and health-check requests (`bootstrap_host ==
FAKE_BOOTSTRAP_HOST`) and the whole `--disaggregation-transfer-backend fake`
through `FakeKVManager` / `FakeKVSender` / `FakeKVReceiver`: no data moves
and no peer exists, but the scheduler drives them through the same queues
as real requests. These classes answer poll for poll as SGLang 0.5.23's
`fake/conn.py` (the property tests and tests/sglang compare them on every
call sequence and inside SGLang's own queues), while each request is a room
on a kvfsm manager (`KVManager.fake_rooms`, or a process-wide set when the
fake is paired with another manager), so warmup requests can be aborted,
time out even when nobody polls, and are counted like any other.
"""

from __future__ import annotations

from typing import Any

from ..._states import FailureKind, FailureReason, KVPoll, Role
from ._endpoint import KVReceiver, KVSender
from ._manager import KVManager
from ._rooms import fake_rooms_for
from ._types import WAITING_TIMEOUT_ENV, KVTransferMetric, role_of, timeout_from_env

__all__ = ["FakeKVManager", "FakeKVSender", "FakeKVReceiver"]


class FakeKVManager(KVManager):
    """SGLang's `FakeKVManager`: any mode is accepted (its rooms are fake anyway)."""

    @classmethod
    def _role_for(cls, disaggregation_mode: object) -> Role:
        return role_of(disaggregation_mode) or Role.SENDER


class FakeKVSender(KVSender):
    """SGLang's warmup sender: no data moves, but the request is a kvfsm room.

    Poll for poll as SGLang's `FakeKVSender`: `WaitingForInput` until a
    `send()`, then `Success` on the next poll; `Failed` after `abort()`; and
    once `init()` was called, the waiting deadline
    (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s, read when the sender is
    built) starts at the first poll after it. Its room leaves
    `Bootstrapping` at that poll (the fake has no handshake, so `poll()`
    reports the instantly finished handshake as `WaitingForInput` before),
    moves through `Transferring` on `send()` and to `Success` on the next
    poll.

    `waiting_since` is SGLang's: when the deadline started (on the fake
    rooms' clock), None before. Moving it back brings the deadline
    forward, checked by the next `poll()`; the room's own deadline (armed
    when it started waiting, enforced by every event and the reaper)
    stays as the backstop.
    """

    def _open(self, mgr: Any, bootstrap_room: int) -> None:
        """Set SGLang's fake attributes and open a fake room (the constructor is `KVSender`'s)."""
        self.has_sent = False
        self.inited = False
        # Per request, from the environment, as SGLang does: a fake sender is
        # often paired with a real backend's manager.
        self.waiting_timeout = timeout_from_env(WAITING_TIMEOUT_ENV)
        self._waiting_since: float | None = None
        fake_rooms = fake_rooms_for(mgr)
        self._clock = fake_rooms.clock
        handle = fake_rooms.open(Role.SENDER, self.waiting_timeout, bootstrap_room)
        self._bind(handle, fake_rooms.orphans)

    @property
    def waiting_since(self) -> float | None:
        return self._waiting_since

    @waiting_since.setter
    def waiting_since(self, value: float | None) -> None:
        self._waiting_since = value

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        self.inited = True

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.has_sent = True
        self.curr_idx += len(kv_indices)
        handle = self.handle
        if handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        handle.chunk_done(0)

    def poll(self) -> KVPoll:
        state = super().poll()
        handle = self.handle
        if state is KVPoll.Bootstrapping:
            if self.inited and not handle.closed:
                # The first poll after init() starts the waiting deadline.
                self._waiting_since = self._clock()
                handle.bootstrapped()
                return handle.state
            return KVPoll.WaitingForInput
        if state is KVPoll.WaitingForInput and self._waiting_since is not None:
            elapsed = self._clock() - self._waiting_since
            if elapsed >= self.waiting_timeout and not handle.closed:
                handle.fail(
                    FailureReason(
                        FailureKind.TIMEOUT,
                        f"FakeKVSender for room {self.bootstrap_room!r} timed out after {elapsed:.1f}s in "
                        "KVPoll.WaitingForInput; no KV chunk was ever sent",
                        KVPoll.WaitingForInput,
                    )
                )
                return handle.state
        if state is KVPoll.Transferring:
            handle.transfer_done()
            return handle.state
        return state

    def mark_prefill_complete(self) -> None:
        """Nothing to announce: a warmup request has no decode peer (as SGLang's fake)."""

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()


class FakeKVReceiver(KVReceiver):
    """SGLang's warmup receiver: no data moves, but the request is a kvfsm room.

    Poll for poll as SGLang's `FakeKVReceiver`: `Bootstrapping` until
    `init()`, then `WaitingForInput` (no deadline, by design: waiting for KV
    space is not a stalled transfer) until `send_metadata()` has also been
    called, then `Success`; `Failed` after `abort()`. No prefill rank holds
    its pages, so `abort_notified` stays false and an aborted warmup
    request's pages are released at once.
    """

    def _open(self, mgr: Any, bootstrap_room: int | None) -> None:
        """Set SGLang's fake attributes and open a fake room (the constructor is `KVReceiver`'s)."""
        self.bootstrap_done = False
        self.has_sent_metadata = False
        fake_rooms = fake_rooms_for(mgr)
        handle = fake_rooms.open(Role.RECEIVER, None, bootstrap_room)
        self._bind(handle, fake_rooms.orphans)

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = prefill_dp_rank
        self.bootstrap_done = True
        handle = self.handle
        if handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()
        if self.has_sent_metadata and handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
        **kwargs: Any,
    ) -> None:
        self.has_sent_metadata = True
        handle = self.handle
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()

    def poll(self) -> KVPoll:
        state = super().poll()
        if state is KVPoll.Transferring:
            self.handle.transfer_done()
            return self.handle.state
        return state

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()
