"""SGLang's `bootstrap_room` is any int its client chose: the compat classes take every one (issue 22, item 4).

SGLang's own classes take 2**64 and -2**63-1; the kvfsm compat constructors
raised `InvalidRoomId` for both (a kvfsm room id is an int of 64 bits). Now
the room id is mapped (`kvfsm.compat._room_ids.fit_room_id`) on every
method, the same on both sides, so the whole call sequence of SGLang's
scheduler runs, bytes included, over the local backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvfsm import KVPoll
from kvfsm.compat import sglang

torch = pytest.importorskip("torch", reason="the local backend moves torch tensors")

from kvfsm.backends.local import LocalFabric  # noqa: E402

from .test_sglang_over_backends import PREFILL, LocalPools, wait_for  # noqa: E402

ROOMS = [2**64, -(2**63) - 1, 10**400, -(10**5000)]


@pytest.fixture
def pair() -> Iterator[tuple[sglang.KVManager, sglang.KVManager, Any, Any]]:
    fabric = LocalFabric()
    source, destination = LocalPools(), LocalPools()
    addresses: dict[str, str] = {}
    prefill = sglang.KVManager(
        sglang.KVArgs(), "prefill", reaper=False, backend=source.backend(fabric), peer_address=lambda _: addresses["p"]
    )
    assert prefill.backend is not None
    addresses["p"] = prefill.backend.address
    decode = sglang.KVManager(
        sglang.KVArgs(),
        "decode",
        reaper=False,
        backend=destination.backend(fabric),
        peer_address=lambda _: addresses["p"],
    )
    yield prefill, decode, source, destination
    prefill.shutdown()
    decode.shutdown()


@pytest.mark.parametrize("room", ROOMS, ids=["2**64", "-2**63-1", "10**400", "-10**5000"])
def test_a_room_beyond_64_bits_transfers_like_any(
    room: int, pair: tuple[sglang.KVManager, sglang.KVManager, Any, Any]
) -> None:
    prefill, decode, source, destination = pair
    source.k[:, 3] = 7.0
    source.v[:, 3] = -7.0
    receiver = sglang.KVReceiver(mgr=decode, bootstrap_addr=PREFILL, bootstrap_room=room)
    receiver.init(0)
    assert wait_for(receiver, KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    receiver.send_metadata([5], 1, None, decode_prefix_len=0)
    sender = sglang.KVSender(mgr=prefill, bootstrap_addr=PREFILL, bootstrap_room=room, dest_tp_ranks=[0], pp_rank=0)
    assert wait_for(sender, KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    sender.init(1, 2)
    sender.send([3], None)
    assert wait_for(sender, KVPoll.Success) is KVPoll.Success
    assert wait_for(receiver, KVPoll.Success) is KVPoll.Success
    assert torch.all(destination.k[:, 5] == 7.0) and torch.all(destination.v[:, 5] == -7.0)
    # The manager's own surface takes SGLang's int too.
    assert decode.check_status(room) is KVPoll.Success
    assert decode.is_abort_release_safe(room)
    assert decode.failure_message(room) is None
    sender.clear()
    receiver.clear()
    assert len(prefill.transfer_manager) == len(decode.transfer_manager) == 0


@pytest.mark.parametrize("room", ROOMS[:2], ids=["2**64", "-2**63-1"])
def test_fake_endpoints_take_any_int_too(room: int) -> None:
    with sglang.FakeKVManager(sglang.KVArgs(), "prefill", reaper=False) as manager:
        sender = sglang.FakeKVSender(manager, PREFILL, room)
        sender.init(1, 0)
        sender.send([0], None)
        assert sender.poll() in (KVPoll.WaitingForInput, KVPoll.Success)
        sender.clear()
