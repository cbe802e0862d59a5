"""The commit marker (rule 14) on every backend that moves data: the same answers everywhere.

Issue 22, item 3, measured on the in-process, Mooncake and local backends:

* aux named early: `expect(r, pages, aux_index=1)`, then `send(s, [..], aux_index=2)`,
  then `send(s, [..], last=True)` reached Success with aux slot 1 never written,
  though `send()` says the slot may be named "with the last chunk (or earlier)";
* aux never named: a decode that posted an aux slot and a prefill that named none
  ended in Success too;
* `expect()` twice: a second call with other pages was silently ignored on the
  remote backends (the KV landed in the first pages), while the local one refused it.

Each story runs over the local backend (two endpoints in this process) and the
remote backend's production code over the simulated network (tests/wire_sim.py).
All three fail on the code before the fix; the conformance kit
(`kvfsm.testing.BackendConformance`) checks the same for any pair given aux hooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

pytest.importorskip("torch", reason="torch is needed for the KV pools")

import torch

import kvfsm
from kvfsm import KVPoll
from kvfsm.backends.base import TransferInputError
from tests.integration.pairs import local_pair
from tests.wire_sim import World


class Story(Protocol):
    """One sender room and one receiver room, bootstrapped, and the bytes on both sides."""

    sender: kvfsm.TransferHandle
    receiver: kvfsm.TransferHandle

    def expect(self, pages: list[int], aux: int | None) -> None: ...

    def send(self, pages: list[int], last: bool, aux: int | None) -> None: ...

    def settle(self) -> None: ...

    def aux_landed(self, src: int, dst: int) -> bool: ...

    def pages_landed(self, src: list[int], dst: list[int]) -> bool: ...


class LocalStory:
    def __init__(self, pair: Any) -> None:
        self.pair = pair
        self.sender, self.receiver = pair.open(7)

    def expect(self, pages: list[int], aux: int | None) -> None:
        self.pair.rb.expect(self.receiver, pages, aux_index=aux)

    def send(self, pages: list[int], last: bool, aux: int | None) -> None:
        self.pair.sb.send(self.sender, pages, last=last, aux_index=aux)

    def settle(self) -> None:
        for _ in range(2000):
            if self.receiver.is_terminal and self.sender.is_terminal:
                return
            time.sleep(0.001)

    def aux_landed(self, src: int, dst: int) -> bool:
        return bool(torch.equal(self.pair.src["aux"][src], self.pair.dst["aux"][dst]))

    def pages_landed(self, src: list[int], dst: list[int]) -> bool:
        return bool(self.pair.same_pages(src, dst))


class RemoteStory:
    def __init__(self, world: World) -> None:
        self.world = world
        for tensor in (world.prefill_pools.k, world.prefill_pools.v):
            tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape) + 1)
        world.prefill_pools.aux.copy_(
            torch.arange(world.prefill_pools.aux.numel()).reshape(world.prefill_pools.aux.shape)
        )
        self.sender = world.prefill_manager.open(7)
        self.receiver = world.decode_managers[0].open(7)
        world.prefill.bootstrap(self.sender, "sim://prefill")
        world.decodes[0].bootstrap(self.receiver, "sim://prefill")
        world.settle()

    def expect(self, pages: list[int], aux: int | None) -> None:
        self.world.decodes[0].expect(self.receiver, pages, aux_index=aux)
        self.world.settle()

    def send(self, pages: list[int], last: bool, aux: int | None) -> None:
        self.world.prefill.send(self.sender, pages, last=last, aux_index=aux)

    def settle(self) -> None:
        self.world.settle()

    def aux_landed(self, src: int, dst: int) -> bool:
        return bool(torch.equal(self.world.prefill_pools.aux[src], self.world.decode_pools[0].aux[dst]))

    def pages_landed(self, src: list[int], dst: list[int]) -> bool:
        sent, got = self.world.prefill_pools, self.world.decode_pools[0]
        return all(
            bool(torch.equal(sent.k[s], got.k[d]) and torch.equal(sent.v[s], got.v[d]))
            for s, d in zip(src, dst, strict=True)
        )


@pytest.fixture(params=["local", "remote"])
def story(request: pytest.FixtureRequest) -> Iterator[Story]:
    if request.param == "local":
        with local_pair() as pair:
            yield LocalStory(pair)
        return
    world = World(decodes=1)
    try:
        yield RemoteStory(world)
    finally:
        for endpoint in world.endpoints:
            endpoint.close()


def test_an_aux_slot_named_early_is_the_one_written(story: Story) -> None:
    story.expect([4, 5], 1)
    story.send([1], False, 2)
    story.send([2], True, None)
    story.settle()
    assert story.receiver.state is KVPoll.Success
    assert story.aux_landed(2, 1), "Success without the commit marker: aux slot 1 was never written"
    assert story.pages_landed([1, 2], [4, 5])


def test_a_last_chunk_that_never_named_the_posted_aux_slot_is_refused(story: Story) -> None:
    story.expect([4, 5], 1)
    story.send([1], False, None)
    with pytest.raises(TransferInputError, match="aux slot 1"):
        story.send([2], True, None)
    story.settle()
    assert story.sender.state is KVPoll.Failed
    assert story.receiver.state is KVPoll.Failed, "the decode must not succeed without its commit marker"


def test_a_second_expect_on_a_live_room_is_refused(story: Story) -> None:
    story.expect([4, 5], 1)
    with pytest.raises(TransferInputError, match="already called"):
        story.expect([6, 7], 1)
    story.settle()
    assert story.receiver.state is KVPoll.Failed
    assert story.receiver.reason is not None and "already called" in story.receiver.reason.message
