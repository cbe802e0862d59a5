"""`FakeBackend`: instant transfers for warmup and health-check requests.

SGLang's fake sender and receiver skip the data plane: the handshake is
instant, the transfer is instant, and nothing is copied. Here the same
semantics run through the lifecycle machine, so a fake request is aborted,
timed out and counted exactly like a real one:

* `bootstrap` -> `bootstrapped()` at once (no peer is contacted; `peer`
  is only recorded).
* receiver `expect(pages)` -> `transfer_started`, `chunk_done`,
  `transfer_done` at once (SGLang's fake receiver succeeds on `init`).
* sender `send(pages, last=...)` -> `transfer_started` on the first call,
  `chunk_done` per call, `transfer_done` on the last one.
* A sender that never sends stays `WaitingForInput` until the manager's
  `Timeouts.waiting` deadline fails it (`TIMEOUT`): nothing hangs.
* Abort (or any failure) stops nothing, since nothing is in flight, and
  reports writes drained at once, so pages are release-safe immediately.

Byte counts are `pages * pools.page_nbytes`; without registered pools a
virtual pool of 2**28 pages of 4 KiB and 2**20 aux slots is assumed (no memory
is allocated).
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from .._manager import TransferHandle, TransferManager
from .._states import KVPoll
from .base import KVBackend, KVPools, MemoryRegion

__all__ = ["FakeBackend", "VIRTUAL_POOLS"]

#: What a FakeBackend registers when given no pools: address space only.
VIRTUAL_POOLS = KVPools(
    [MemoryRegion(ptr=0, nbytes=4096 << 28, page_nbytes=4096, name="virtual")],
    [MemoryRegion(ptr=0, nbytes=64 << 20, page_nbytes=64, name="virtual-aux")],
)

_ids = itertools.count(1)


class FakeBackend(KVBackend):
    """An endpoint that completes every transfer instantly without moving data."""

    name: ClassVar[str] = "fake"

    def __init__(self, manager: TransferManager, pools: KVPools | None = None) -> None:
        super().__init__(manager)
        self._address = f"fake://{self.role.value}/{next(_ids)}"
        self.register_pools(VIRTUAL_POOLS if pools is None else pools)

    @property
    def address(self) -> str:
        return self._address

    def _register_pools(self, pools: KVPools) -> None:
        return

    def _bootstrap(self, handle: TransferHandle, peer: str) -> None:
        handle.bootstrapped()

    def _expect(self, handle: TransferHandle, pages: list[int], aux_index: int | None) -> None:
        assert self.pools is not None
        if handle.state is KVPoll.Bootstrapping:
            handle.bootstrapped()
        handle.transfer_started()
        handle.chunk_done(len(pages) * self.pools.page_nbytes, last=True)
        handle.transfer_done()

    def _send(self, handle: TransferHandle, pages: list[int], last: bool, aux_index: int | None) -> None:
        assert self.pools is not None
        if handle.state is KVPoll.WaitingForInput:
            handle.transfer_started()
        handle.chunk_done(len(pages) * self.pools.page_nbytes, last=last)
        if last:
            handle.transfer_done()

    def _stop(self, handle: TransferHandle) -> None:
        handle.writes_drained()
