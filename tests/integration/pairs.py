"""A prefill and a decode endpoint of one backend, wired up for a test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

import kvfsm
from kvfsm.backends import KVPools
from kvfsm.backends.local import Faults, LocalBackend, LocalFabric

LAYERS = 2
PAGES = 32
SLOTS = 4
ROW = 64  # bfloat16 elements per page per region: 128 bytes


def make_pools(
    fill: bool, *, pages: int = PAGES, row: int = ROW, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """K and V as [layers, pages, row] tensors of a 2-byte `dtype`, plus aux slots."""
    shape = (LAYERS, pages, row)
    if fill:
        generator = torch.Generator().manual_seed(1234)
        k = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(dtype)
        v = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(dtype)
        aux = torch.arange(SLOTS * 4, dtype=torch.int64).view(SLOTS, 4) + 100
    else:
        k = torch.zeros(shape, dtype=dtype)
        v = torch.zeros(shape, dtype=dtype)
        aux = torch.zeros((SLOTS, 4), dtype=torch.int64)
    return {"k": k, "v": v, "aux": aux}


@attrs.define
class LocalPair:
    sender: kvfsm.TransferManager
    receiver: kvfsm.TransferManager
    sb: LocalBackend
    rb: LocalBackend
    src: dict[str, Any]
    dst: dict[str, Any]

    def open(self, room: int | str) -> tuple[kvfsm.TransferHandle, kvfsm.TransferHandle]:
        """Open and bootstrap `room` on both sides (sender still waits for expect)."""
        send, recv = self.sender.open(room), self.receiver.open(room)
        self.rb.bootstrap(recv, self.sb.address)
        self.sb.bootstrap(send, self.sb.address)
        return send, recv

    def same_pages(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        for name in ("k", "v"):
            a = self.src[name][:, src_pages].contiguous().view(torch.int16)
            b = self.dst[name][:, dst_pages].contiguous().view(torch.int16)
            if not torch.equal(a, b):
                return False
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.dst.items()}


@contextmanager
def local_pair(
    *,
    faults: Faults | None = None,
    timeouts: kvfsm.Timeouts | None = None,
    clock: Callable[[], float] = time.monotonic,
    workers: int = 2,
    src_pools: dict[str, Any] | None = None,
    dst_pools: dict[str, Any] | None = None,
) -> Iterator[LocalPair]:
    faults = Faults() if faults is None else faults
    timeouts = kvfsm.Timeouts() if timeouts is None else timeouts
    fabric = LocalFabric()
    sender = kvfsm.TransferManager("sender", timeouts=timeouts, clock=clock)
    receiver = kvfsm.TransferManager("receiver", timeouts=timeouts, clock=clock)
    sb = LocalBackend(sender, fabric=fabric, workers=workers, faults=faults)
    rb = LocalBackend(receiver, fabric=fabric, audit=True)
    src = make_pools(True) if src_pools is None else src_pools
    dst = make_pools(False) if dst_pools is None else dst_pools
    sb.register_pools(KVPools.from_tensors(src["k"], src["v"], src["aux"]))
    rb.register_pools(KVPools.from_tensors(dst["k"], dst["v"], dst["aux"]))
    try:
        yield LocalPair(sender, receiver, sb, rb, src, dst)
    finally:
        sb.close()
        rb.close()


def wait_until(predicate: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Wait for a background worker; fails (does not hang) if it never happens."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def poll_until(endpoint: Any, wanted: kvfsm.KVPoll, timeout: float = 10.0) -> kvfsm.KVPoll:
    """Poll an SGLang-style sender or receiver until it reports `wanted` or ends; the state it reached."""
    deadline = time.monotonic() + timeout
    while True:
        state = kvfsm.KVPoll(endpoint.poll())
        if state is wanted or state in (kvfsm.KVPoll.Success, kvfsm.KVPoll.Failed):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{endpoint!r} never reached {wanted.name} (is {state.name})")
        time.sleep(0.005)
