"""SGLang's scheduler call sequence, through kvfsm.compat.sglang, over the shipped backends.

The calls and their order are those of SGLang's prefill.py / decode.py:
decode creates the receiver, `init(dp_rank)`, polls until
WaitingForInput, `send_metadata(pages, aux)`; prefill creates the sender,
polls until WaitingForInput, `init(num_pages, aux)`, `send` per chunk
(checking `should_send_kv_chunk`), then both poll until Success and
`clear()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvfsm import FailureKind, KVPoll, TransferManager
from kvfsm.compat import sglang

torch = pytest.importorskip("torch", reason="the local backend moves torch tensors")

from kvfsm.backends.base import KVPools  # noqa: E402
from kvfsm.backends.fake import FakeBackend  # noqa: E402
from kvfsm.backends.local import LocalBackend, LocalFabric  # noqa: E402

PREFILL = "prefill-0:8998"
PAGES = 16


class LocalPools:
    """One endpoint's K/V pages as torch tensors, for a LocalBackend."""

    def __init__(self) -> None:
        self.k = torch.zeros(2, PAGES, 8, dtype=torch.float32)
        self.v = torch.zeros(2, PAGES, 8, dtype=torch.float32)
        self.aux = torch.zeros(4, 16, dtype=torch.int64)

    def backend(self, fabric: LocalFabric) -> Callable[[TransferManager], LocalBackend]:
        def build(manager: TransferManager) -> LocalBackend:
            backend = LocalBackend(manager, fabric=fabric, workers=1)
            backend.register_pools(KVPools.from_tensors(self.k, self.v, self.aux))
            return backend

        return build


def settle(manager: sglang.KVManager) -> None:
    """Wait until the backend's worker ran every chunk queued so far (LocalBackend: one worker)."""
    pool = getattr(manager.backend, "_pool", None)
    if pool is not None:
        pool.submit(lambda: None).result()


def wait_for(poller: Any, wanted: KVPoll, limit: int = 1000) -> KVPoll:
    """Poll as the scheduler loop does until `wanted` or a terminal state."""
    settle(poller.kv_mgr)
    for _ in range(limit):
        state = poller.poll()
        if state is wanted or state in (KVPoll.Success, KVPoll.Failed):
            return KVPoll(state)
    raise AssertionError(f"{poller!r} never reached {wanted.name}")


@pytest.fixture(params=["fake", "local"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[sglang.KVManager, sglang.KVManager, Any, Any]]:
    if request.param == "fake":
        prefill = sglang.KVManager(sglang.KVArgs(), "prefill", reaper=False, backend=FakeBackend)
        decode = sglang.KVManager(sglang.KVArgs(), "decode", reaper=False, backend=FakeBackend)
        source = destination = None
    else:
        fabric = LocalFabric()
        source, destination = LocalPools(), LocalPools()
        # SGLang's bootstrap_addr names the prefill server; in one process it is the sender endpoint.
        addresses: dict[str, str] = {}

        def prefill_endpoint(_bootstrap_addr: str) -> str:
            return addresses["prefill"]

        prefill = sglang.KVManager(
            sglang.KVArgs(), "prefill", reaper=False, backend=source.backend(fabric), peer_address=prefill_endpoint
        )
        assert prefill.backend is not None
        addresses["prefill"] = prefill.backend.address
        decode = sglang.KVManager(
            sglang.KVArgs(), "decode", reaper=False, backend=destination.backend(fabric), peer_address=prefill_endpoint
        )
    yield prefill, decode, source, destination
    prefill.shutdown()
    decode.shutdown()


def test_a_chunked_transfer_end_to_end(pair: tuple[sglang.KVManager, sglang.KVManager, Any, Any]) -> None:
    prefill, decode, source, destination = pair
    src_pages, dst_pages = [3, 4, 5, 9, 10], [0, 7, 8, 2, 1]
    if source is not None:
        for position, page in enumerate(src_pages):
            source.k[:, page] = position + 1.0
            source.v[:, page] = -(position + 1.0)

    receiver = sglang.KVReceiver(mgr=decode, bootstrap_addr=PREFILL, bootstrap_room=77)
    receiver.init(0)
    assert wait_for(receiver, KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    receiver.send_metadata(dst_pages, 1, None, decode_prefix_len=0)

    sender = sglang.KVSender(mgr=prefill, bootstrap_addr=PREFILL, bootstrap_room=77, dest_tp_ranks=[0], pp_rank=0)
    assert wait_for(sender, KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    sender.init(len(src_pages), 2)
    for chunk, last in ((src_pages[:2], False), (src_pages[2:], False), ([], True)):
        if sender.should_send_kv_chunk(len(chunk), last):
            sender.send(chunk, None)

    assert wait_for(sender, KVPoll.Success) is KVPoll.Success
    assert wait_for(receiver, KVPoll.Success) is KVPoll.Success
    assert sender.conclude_state is receiver.conclude_state is KVPoll.Success
    metric = receiver.get_transfer_metric()
    assert metric.transfer_total_bytes is not None
    assert metric.transfer_total_bytes > 0
    if destination is not None:
        for position, page in enumerate(dst_pages):
            assert torch.all(destination.k[:, page] == position + 1.0)
            assert torch.all(destination.v[:, page] == -(position + 1.0))
    sender.clear()
    receiver.clear()
    assert len(prefill.transfer_manager) == len(decode.transfer_manager) == 0


@pytest.mark.parametrize("pair", ["local"], indirect=True)
def test_abort_on_decode_reaches_prefill_through_the_backend(
    pair: tuple[sglang.KVManager, sglang.KVManager, Any, Any],
) -> None:
    prefill, decode, _source, _destination = pair
    receiver = sglang.KVReceiver(decode, PREFILL, 78)
    receiver.init(0)
    wait_for(receiver, KVPoll.WaitingForInput)
    receiver.send_metadata([0, 1], None)
    sender = sglang.KVSender(prefill, PREFILL, 78, [0], 0)
    wait_for(sender, KVPoll.WaitingForInput)
    receiver.abort()
    assert decode.check_status(78) is KVPoll.Failed
    assert wait_for(sender, KVPoll.Failed) is KVPoll.Failed
    with pytest.raises(sglang.KVTransferError) as caught:
        sender.failure_exception()
    assert caught.value.is_from_another_rank
    assert caught.value.reason is not None
    assert caught.value.reason.kind is FailureKind.ABORTED
    assert receiver.release_safe


def test_a_backend_refusal_fails_the_request_instead_of_raising() -> None:
    fabric = LocalFabric()
    prefill = sglang.KVManager(
        sglang.KVArgs(),
        "prefill",
        reaper=False,
        backend=LocalPools().backend(fabric),
        peer_address=lambda _: "local://nowhere",
    )
    with prefill:
        sender = sglang.KVSender(prefill, PREFILL, 5, [0], 0)
        assert sender.poll() is KVPoll.Failed
        with pytest.raises(sglang.KVTransferError, match="local://nowhere"):
            sender.failure_exception()
