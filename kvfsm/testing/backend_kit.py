"""`BackendConformance`: the rules against a backend adapter pair.

A backend author subclasses it and supplies `make_backends(sender,
receiver) -> BackendPair`; the kit moves real pages through the pair while
it aborts, fails, times out and releases rooms, and checks the bytes that
land and the release gate after every settle.

With aux hooks (`write_source_aux`, `read_destination_aux`) the kit also
checks the commit marker (rule 14): the sender names its aux slot with the
last chunk, an earlier one, or none at all; a receiver that posted an aux
slot reaches Success only with that slot written, and a last chunk that
leaves it unnamed is refused at the call (`TransferInputError`, the room
failed). A second `expect()` on a live room is refused the same way, on
every pair. Every backend must behave alike here (issue 22, item 3).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._errors import KVFSMError
from .._lifecycle import TERMINAL, Timeouts
from .._manager import TransferHandle, TransferManager
from .._states import FailureKind, FailureReason, KVPoll, Role
from ._checks import RoomLedger, check_agreement, check_deadlines, check_failure
from .strategies import ManualClock, failure_reasons

if TYPE_CHECKING:
    from ..backends.base import KVBackend

__all__ = ["BackendPair", "BackendConformance"]


@attrs.define
class BackendPair:
    """What `BackendConformance.make_backends` returns: two connected endpoints.

    `sender` / `receiver` are adapters built on the managers the kit passed
    in, pools registered. `peer` is the address both sides bootstrap with
    (the prefill endpoint's). `num_pages` is how many pages the kit may use
    (default: the receiver's pool). `write_source(page, token)` and
    `read_destination(page) -> token` let the kit check data integrity and
    the release gate: write a recognisable int into every byte group of a
    source page / read it back from a destination page (leave them None if
    the adapter moves no data). `write_source_aux(slot, token)` and
    `read_destination_aux(slot) -> token` do the same for aux slots: with
    them the kit checks the commit marker. `settle()` blocks until every operation
    the adapter started has finished (its worker threads are idle); leave
    it as is for synchronous adapters. `close()` releases everything.
    """

    sender: KVBackend
    receiver: KVBackend
    peer: str
    num_pages: int | None = None
    write_source: Callable[[int, int], None] | None = None
    read_destination: Callable[[int], int] | None = None
    write_destination: Callable[[int, int], None] | None = None
    write_source_aux: Callable[[int, int], None] | None = None
    read_destination_aux: Callable[[int], int] | None = None
    settle: Callable[[], None] = attrs.field(default=lambda: None)
    close: Callable[[], None] | None = None


_POISON = -1
#: Kinds a backend or peer may report (INVALID_EVENT is the manager's own verdict).
_REPORTED_KINDS = st.sampled_from([kind for kind in FailureKind if kind is not FailureKind.INVALID_EVENT])


def _can_expect(transfer: _Transfer) -> bool:
    return not transfer.expected and transfer.receiver.state is not KVPoll.Bootstrapping


def _can_send(transfer: _Transfer) -> bool:
    return (
        transfer.expected and transfer.sent < len(transfer.chunks) and transfer.sender.state is not KVPoll.Bootstrapping
    )


@attrs.define(eq=False)
class _Transfer:
    """One request in flight between the pair."""

    room: int
    sender: TransferHandle
    receiver: TransferHandle
    source: list[int]
    destination: list[int]
    chunks: list[list[int]]
    tokens: list[int]
    sent: int = 0
    expected: bool = False
    # The commit marker: the receiver's aux slot, the sender's, the chunk that names it (None: none does).
    dst_aux: int | None = None
    src_aux: int | None = None
    aux_at: int | None = None
    aux_token: int = 0
    refused: bool = False


class BackendConformance(RuleBasedStateMachine):
    """The rules of DESIGN.md against a backend adapter pair. Subclass and implement `make_backends`.

    The kit opens each request's room on a sender and a receiver manager
    (both on an injected `ManualClock`, with `timeouts_under_test`),
    bootstraps both through the adapters, registers the receiver's
    destination pages (`expect`), sends the source pages in random chunks,
    and meanwhile aborts either side in any state, fails rooms as a peer
    would, fires late events, jumps the clock past deadlines, settles the
    adapters and releases the pages of finished rooms.

    Every step that reaches the adapter ends with `settle()`, so the next
    step is chosen from a state no adapter thread can still change:
    hypothesis needs that to replay and shrink a failure. Within a step,
    adapter threads still race the kit (an abort against a completing
    transfer).
    """

    timeouts_under_test: ClassVar[Timeouts] = Timeouts(bootstrap=30.0, waiting=60.0, transferring=90.0, drain=3600.0)
    max_pages_per_request: ClassVar[int] = 4

    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        raise NotImplementedError(f"{type(self).__name__} must implement make_backends(sender, receiver)")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.sender_manager = TransferManager(Role.SENDER, timeouts=self.timeouts_under_test, clock=self.clock)
        self.receiver_manager = TransferManager(Role.RECEIVER, timeouts=self.timeouts_under_test, clock=self.clock)
        self.pair = self.make_backends(self.sender_manager, self.receiver_manager)
        pools = self.pair.receiver.pools
        num_pages = self.pair.num_pages if self.pair.num_pages is not None else (pools.num_pages if pools else 0)
        if num_pages < 1:
            raise ValueError(f"{type(self).__name__}.make_backends: the pair needs at least one page (got {num_pages})")
        self.free_source = list(range(num_pages))
        self.free_destination = list(range(num_pages))
        aux_slots = 0
        if self.pair.write_source_aux is not None and self.pair.read_destination_aux is not None:
            sender_pools = self.pair.sender.pools
            aux_slots = min(pools.num_aux_slots if pools else 0, sender_pools.num_aux_slots if sender_pools else 0)
        self.free_source_aux = list(range(aux_slots))
        self.free_destination_aux = list(range(aux_slots))
        self.poisoned: set[int] = set()
        self.transfers: list[_Transfer] = []
        self.finished: list[_Transfer] = []
        self.ledger = RoomLedger()
        self._rooms = itertools.count(1)
        self._tokens = itertools.count(1)

    # rules

    @precondition(lambda self: bool(self.free_source) and bool(self.free_destination))
    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        limit = min(self.max_pages_per_request, len(self.free_source), len(self.free_destination))
        count = data.draw(st.integers(0, limit), label="pages")
        source = data.draw(st.permutations(self.free_source), label="source pages")[:count]
        destination = data.draw(st.permutations(self.free_destination), label="destination pages")[:count]
        cuts = (
            sorted(data.draw(st.sets(st.integers(1, max(1, count - 1)), max_size=2), label="chunk cuts"))
            if count > 1
            else []
        )
        bounds = [0, *[c for c in cuts if 0 < c < count], count]
        chunks = [source[a:b] for a, b in itertools.pairwise(bounds)] or [[]]
        if count and data.draw(st.booleans(), label="empty last chunk"):
            chunks.append([])  # SGLang's pattern: the pages, then send([], last=True) for the aux slot
        for page in source:
            self.free_source.remove(page)
        for page in destination:
            self.free_destination.remove(page)
            self.poisoned.discard(page)
        tokens = [next(self._tokens) for _ in source]
        if self.pair.write_source is not None:
            for page, token in zip(source, tokens, strict=True):
                self.pair.write_source(page, token)
        room = next(self._rooms)
        sender = self.sender_manager.open(room)
        receiver = self.receiver_manager.open(room)
        transfer = _Transfer(room, sender, receiver, source, destination, chunks, tokens)
        marker = False
        if self.free_source_aux and self.free_destination_aux:
            marker = data.draw(st.booleans(), label="commit marker")
        if marker:
            transfer.src_aux = data.draw(st.sampled_from(self.free_source_aux), label="source aux slot")
            transfer.dst_aux = data.draw(st.sampled_from(self.free_destination_aux), label="destination aux slot")
            self.free_source_aux.remove(transfer.src_aux)
            self.free_destination_aux.remove(transfer.dst_aux)
            # Named with the last chunk, an earlier one, or (rarely) none: then the last chunk is refused.
            transfer.aux_at = data.draw(
                st.sampled_from([*range(len(chunks)), len(chunks) - 1, None]), label="chunk naming the aux slot"
            )
            transfer.aux_token = next(self._tokens)
            assert self.pair.write_source_aux is not None
            self.pair.write_source_aux(transfer.src_aux, transfer.aux_token)
        self.transfers.append(transfer)
        self.pair.receiver.bootstrap(receiver, self.pair.peer)
        self.pair.sender.bootstrap(sender, self.pair.peer)
        self.pair.settle()

    def _pick(self, data: st.DataObject) -> _Transfer:
        return data.draw(st.sampled_from(self.transfers), label="request")

    @precondition(lambda self: any(_can_expect(t) for t in self.transfers))
    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        """The receiver posts its destination pages (once its room left Bootstrapping)."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_expect(t)]), label="request")
        transfer.expected = True
        self.pair.receiver.expect(transfer.receiver, transfer.destination, transfer.dst_aux)
        self.pair.settle()

    @precondition(lambda self: any(t.expected for t in self.transfers))
    @rule(data=st.data())
    def expect_again(self, data: st.DataObject) -> None:
        """A second `expect()`: refused on a live room (which fails), nothing at all on an ended one."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if t.expected]), label="request")
        handle = transfer.receiver
        live = not handle.is_terminal
        before = handle.state
        refused = False
        try:
            self.pair.receiver.expect(handle, list(reversed(transfer.destination)), transfer.dst_aux)
        except KVFSMError:
            refused = True
        if live:
            assert refused, f"room {transfer.room}: a second expect() on a live room was taken"
            assert handle.state is KVPoll.Failed, f"room {transfer.room}: refused, yet {handle.state.name}"
        elif not refused:
            assert handle.state is before
        self.pair.settle()

    def _send_next(self, transfer: _Transfer) -> None:
        """Send the transfer's next chunk, naming its aux slot where it was drawn to; check a refusal."""
        index = transfer.sent
        chunk = transfer.chunks[index]
        transfer.sent += 1
        last = transfer.sent == len(transfer.chunks)
        aux = transfer.src_aux if transfer.aux_at == index else None
        unnamed = transfer.aux_at is None or transfer.aux_at > index
        must_refuse = last and transfer.dst_aux is not None and unnamed and not transfer.sender.is_terminal
        try:
            self.pair.sender.send(transfer.sender, chunk, last=last, aux_index=aux)
        except KVFSMError:
            assert must_refuse, f"room {transfer.room}: send() refused a chunk it must take"
            transfer.refused = True
            assert transfer.sender.state is KVPoll.Failed
            return
        if must_refuse and not transfer.sender.is_terminal:
            raise AssertionError(
                f"room {transfer.room}: the last chunk was taken although no chunk named the aux slot the "
                f"receiver posted ({transfer.dst_aux}): Success without the commit marker"
            )

    @precondition(lambda self: any(_can_send(t) for t in self.transfers))
    @rule(data=st.data())
    def send_chunk(self, data: st.DataObject) -> None:
        """The sender sends its next chunk (once the receiver posted pages and the sender left Bootstrapping)."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_send(t)]), label="request")
        self._send_next(transfer)
        self.pair.settle()

    @precondition(lambda self: any(_can_expect(t) or _can_send(t) for t in self.transfers))
    @rule(data=st.data())
    def run_to_completion(self, data: st.DataObject) -> None:
        """The happy path of one request in one step: post pages, send every chunk, settle."""
        transfer = data.draw(st.sampled_from([t for t in self.transfers if _can_expect(t) or _can_send(t)]))
        if _can_expect(transfer):
            transfer.expected = True
            self.pair.receiver.expect(transfer.receiver, transfer.destination, transfer.dst_aux)
            # A cross-process sender may leave Bootstrapping only once the posted pages
            # reach it: settled first, whether it can send is the same on every replay.
            self.pair.settle()
        while _can_send(transfer):
            self._send_next(transfer)
            self.pair.settle()
        self.settle()

    @precondition(lambda self: bool(self.transfers))
    @rule(data=st.data(), side=st.sampled_from(["sender", "receiver"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        """The server gives up on one side, in whatever state it is."""
        transfer = self._pick(data)
        handle = transfer.sender if side == "sender" else transfer.receiver
        manager = self.sender_manager if side == "sender" else self.receiver_manager
        if handle.abort("conformance kit abort"):
            # Rule 5: synchronous. When abort() returns, the table says Failed, with the reason.
            assert manager.status(handle.room) is KVPoll.Failed
            reason = handle.reason
            assert reason is not None
            assert reason.kind is FailureKind.ABORTED
        else:
            # It had already ended (maybe a moment ago, on an adapter thread): nothing changed.
            assert handle.is_terminal
        self.pair.settle()

    @precondition(lambda self: bool(self.transfers))
    @rule(data=st.data(), side=st.sampled_from(["sender", "receiver"]), reason=failure_reasons(_REPORTED_KINDS))
    def peer_fails(self, data: st.DataObject, side: str, reason: FailureReason) -> None:
        """The peer (or the engine) reports a failure on one side."""
        transfer = self._pick(data)
        handle = transfer.sender if side == "sender" else transfer.receiver
        if handle.fail(reason):
            recorded = handle.reason
            assert recorded is not None
            assert (recorded.kind, recorded.message) == (reason.kind, reason.message)
        assert handle.is_terminal
        self.pair.settle()

    @precondition(lambda self: any(t.sender.is_terminal or t.receiver.is_terminal for t in self.transfers))
    @rule(data=st.data(), event=st.sampled_from(["bootstrapped", "transfer_started", "transfer_done"]))
    def late_event(self, data: st.DataObject, event: str) -> None:
        ended = [h for t in self.transfers for h in (t.sender, t.receiver) if h.is_terminal]
        handle = data.draw(st.sampled_from(ended), label="ended room")
        before = handle.state
        assert not getattr(handle, event)(), "a late event reported a change"
        assert handle.state is before

    @rule(seconds=st.sampled_from([1.0, 29.0, 31.0, 61.0, 91.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.sender_manager.check_deadlines()
        self.receiver_manager.check_deadlines()
        self.pair.settle()

    @rule()
    def settle(self) -> None:
        self.pair.settle()
        for transfer in self.transfers:
            self._check_settled(transfer)
        self._check_poison()

    @precondition(lambda self: any(t.receiver.release_safe or t.receiver.closed for t in self.transfers))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Free a finished request's pages (only when the release gate says so) and close its rooms."""
        ready = [t for t in self.transfers if t.receiver.release_safe or t.receiver.closed]
        transfer = data.draw(st.sampled_from(ready), label="request")
        if transfer.receiver.state is KVPoll.Success:
            self.pair.settle()
            self._check_integrity(transfer)
        for handle, manager in ((transfer.sender, self.sender_manager), (transfer.receiver, self.receiver_manager)):
            if not handle.closed:
                manager.close(handle.room)
        # Closing a live room aborts it; an adapter may drain on its own thread.
        self.pair.settle()
        self.transfers.remove(transfer)
        self.finished.append(transfer)
        if transfer.sender.release_safe or transfer.sender.state is KVPoll.Success:
            self.free_source.extend(transfer.source)
            if transfer.src_aux is not None:
                self.free_source_aux.append(transfer.src_aux)
        if transfer.dst_aux is not None:
            self.free_destination_aux.append(transfer.dst_aux)
        # Source pages of a sender not yet drained stay out of circulation.
        # Released destination pages are poisoned: no write may land there any more.
        if self.pair.write_destination is not None:
            for page in transfer.destination:
                self.pair.write_destination(page, _POISON)
            self.poisoned.update(transfer.destination)
        self.free_destination.extend(transfer.destination)

    # invariants

    @invariant()
    def status_tables_agree(self) -> None:
        check_agreement(self.sender_manager, [t.sender for t in self.transfers])
        check_agreement(self.receiver_manager, [t.receiver for t in self.transfers])

    @invariant()
    def terminal_states_absorb(self) -> None:
        for transfer in [*self.transfers, *self.finished]:
            self.ledger.observe(transfer.sender)
            self.ledger.observe(transfer.receiver)

    @invariant()
    def failures_are_structured(self) -> None:
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                check_failure(handle)

    @invariant()
    def adapter_events_are_in_order(self) -> None:
        """The kit only fires events a state accepts; an INVALID_EVENT failure is the adapter's."""
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                reason = handle.reason
                if reason is not None:
                    assert reason.kind is not FailureKind.INVALID_EVENT, (
                        f"the adapter emitted an out-of-order event on room {handle.room!r} "
                        f"({handle._manager.role.value}): {reason.message}"
                    )

    @invariant()
    def deadlines_enforced(self) -> None:
        check_deadlines(self.sender_manager, self.clock, [t.sender for t in self.transfers])
        check_deadlines(self.receiver_manager, self.clock, [t.receiver for t in self.transfers])

    @invariant()
    def only_ended_rooms_are_release_safe(self) -> None:
        for transfer in self.transfers:
            for handle in (transfer.sender, transfer.receiver):
                safe = handle.release_safe
                state = handle.state  # read after: states only move forward
                if safe:
                    assert state in TERMINAL, f"rule 6 broken: room {handle.room!r} is release-safe while {state.name}"
                if state is KVPoll.Success:
                    assert handle.release_safe, "rule 6 broken: Success must be release-safe at once"

    # checks after settle

    def _check_settled(self, transfer: _Transfer) -> None:
        sender, receiver = transfer.sender, transfer.receiver
        # Once settled, a failed room's adapter has stopped writing: the gate is open (rule 6).
        for handle in (sender, receiver):
            if handle.state is KVPoll.Failed and not handle.closed:
                assert handle.release_safe, (
                    f"rule 6: room {handle.room!r} ({handle._manager.role.value}) failed and the adapter settled, "
                    f"but it never reported writes_drained()"
                )
        if sender.state is KVPoll.Success:
            assert transfer.sent == len(transfer.chunks), "the sender succeeded before its last chunk was sent"
        if receiver.state is KVPoll.Success:
            assert transfer.expected, "the receiver succeeded before its pages were expected"
            if self.pair.read_destination is not None:
                # An adapter that moves data cannot be done before the last chunk was sent.
                assert transfer.sent == len(transfer.chunks), "the receiver succeeded before every chunk was sent"
            self._check_integrity(transfer)
        everything_issued = transfer.expected and transfer.sent == len(transfer.chunks)
        if everything_issued and not sender.is_terminal and not receiver.is_terminal:
            both_bootstrapped = sender.state is not KVPoll.Bootstrapping and receiver.state is not KVPoll.Bootstrapping
            assert not both_bootstrapped, (
                f"room {transfer.room}: every chunk was sent and expected and the adapter settled, "
                f"yet sender is {sender.state.name} and receiver {receiver.state.name}"
            )

    def _check_integrity(self, transfer: _Transfer) -> None:
        read_aux = self.pair.read_destination_aux
        if transfer.receiver.state is KVPoll.Success and transfer.dst_aux is not None and read_aux is not None:
            found = read_aux(transfer.dst_aux)
            assert found == transfer.aux_token, (
                f"rule 14 broken: room {transfer.room} succeeded and its aux slot {transfer.dst_aux} holds {found}, "
                f"expected {transfer.aux_token} (the commit marker never landed)"
            )
        read = self.pair.read_destination
        if read is None:
            return
        for page, token in zip(transfer.destination, transfer.tokens, strict=True):
            assert read(page) == token, (
                f"room {transfer.room}: destination page {page} holds {read(page)}, expected {token}"
            )

    def _check_poison(self) -> None:
        read = self.pair.read_destination
        if read is None:
            return
        for page in self.poisoned:
            assert read(page) == _POISON, (
                f"rule 6 broken: destination page {page} was written after its failed room's pages were released"
            )

    def teardown(self) -> None:
        try:
            self.pair.settle()
        finally:
            for backend in (self.pair.sender, self.pair.receiver):
                backend.close()
            if self.pair.close is not None:
                self.pair.close()
            self.sender_manager.stop_reaper()
            self.receiver_manager.stop_reaper()
