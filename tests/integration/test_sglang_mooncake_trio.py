"""kvfsm's SGLang Mooncake trio in one process, over real Mooncake (no SGLang needed).

The scheduler-queue test of the same classes, across two processes and
inside SGLang's own queues, is tests/sglang/test_sglang_mooncake_queues.py;
this one checks the trio's own promises where SGLang is not installed:
SGLang's KVArgs buffers registered as pools, the bootstrap rendezvous, bytes
and metadata slot moved, the deferred-release gate, SGLang's reason for a
lost prefill, and clear errors for what it cannot do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from kvfsm import ConfigError, FailureKind, KVPoll
from kvfsm.backends.base import BackendError
from kvfsm.compat import sglang

torch = pytest.importorskip("torch", reason="the KV buffers are torch tensors")
pytest.importorskip("zmq", reason="pyzmq is needed for kvfsm's control plane")
pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine is needed (mooncake-transfer-engine-non-cuda)")

from kvfsm.backends.remote import RemoteBackend  # noqa: E402
from kvfsm.compat.sglang import _mooncake  # noqa: E402

from .pairs import poll_until as wait  # noqa: E402

WAIT = 10.0


class Buffers:
    """One side's KV buffers (two, token rows of 8 floats, pages of 2 tokens) and 4 metadata slots."""

    def __init__(self, fill: float = 0.0) -> None:
        self.kv = [torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + fill + 1000 * i for i in range(2)]
        if not fill:
            for buffer in self.kv:
                buffer.zero_()
        self.aux = torch.zeros(4, 16, dtype=torch.int64)

    def kv_args(self) -> sglang.KVArgs:
        args = sglang.KVArgs(engine_rank=0, pp_rank=0, system_dp_rank=0, page_size=2, kv_cache_dtype_str="auto")
        args.kv_data_ptrs = [b.data_ptr() for b in self.kv]
        args.kv_data_lens = [b.nbytes for b in self.kv]
        args.kv_item_lens = [b[0].nbytes * 2 for b in self.kv]
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [self.aux.data_ptr()], [self.aux.nbytes], [128]
        return args


class Pair:
    def __init__(self) -> None:
        self.server = sglang.MooncakeKVBootstrapServer("127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self.server.port}"
        server_args = SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=self.server.port)
        self.source, self.destination = Buffers(fill=0.5), Buffers()
        self.prefill = sglang.MooncakeKVManager(self.source.kv_args(), sglang.DisaggregationMode.PREFILL, server_args)
        self.decode = sglang.MooncakeKVManager(
            self.destination.kv_args(), sglang.DisaggregationMode.DECODE, server_args
        )

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()
        self.server.close()

    def connect(self, room: int, pages: list[int], slot: int) -> tuple[Any, Any]:
        """SGLang's order; first its decode scheduler's retried look-up of the prefill's layout (`_ensure_prefill_info`)."""
        wait_until(lambda: self.decode.try_ensure_parallel_info(self.addr))
        receiver = sglang.MooncakeKVReceiver(self.decode, self.addr, room)
        sender = sglang.MooncakeKVSender(self.prefill, self.addr, room)
        receiver.init(0)
        wait(receiver, KVPoll.WaitingForInput)
        receiver.send_metadata(pages, slot, [], 0)
        wait(sender, KVPoll.WaitingForInput)
        return sender, receiver


def wait_until(condition: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def pair() -> Iterator[Pair]:
    started = Pair()
    try:
        yield started
    finally:
        started.close()


def test_bytes_and_the_metadata_slot_move(pair: Pair) -> None:
    assert pair.decode.enable_deferred_decode_kv_release
    sender, receiver = pair.connect(5, [3, 4, 5], 2)
    info = pair.decode.prefill_info_table[pair.addr]
    assert (info.dp_size, info.attn_tp_size, info.page_size, len(info.ranks)) == (1, 1, 2, 1)
    pair.source.aux[1, :] = 5  # what SGLang's MetadataBuffers.set_buf writes before the last chunk
    sender.init(3, 1)
    sender.send([10, 11], None)
    sender.send([12], [])
    assert wait(sender, KVPoll.Success) is wait(receiver, KVPoll.Success) is KVPoll.Success
    for src, dst in zip(pair.source.kv, pair.destination.kv, strict=True):
        assert torch.equal(dst[6:12], src[20:26])  # pages 3..5 of the decode hold pages 10..12 of the prefill
        assert not dst[:6].any()
    assert torch.equal(pair.destination.aux[2], pair.source.aux[1])
    metric = receiver.get_transfer_metric()
    assert metric.transfer_total_bytes == 3 * 2 * 64  # pages x buffers x bytes per page
    sender.clear()
    receiver.clear()
    assert pair.decode.room_prefill == {}


def test_an_aborted_decode_request_is_held_until_the_prefill_acks(pair: Pair) -> None:
    sender, receiver = pair.connect(6, [1, 2], 0)
    receiver.abort()
    assert receiver.abort_notified
    assert receiver.poll() is KVPoll.Failed
    wait_until(lambda: pair.decode.is_abort_release_safe(6, len(receiver.bootstrap_infos)))
    backend = pair.decode.backend
    assert isinstance(backend, RemoteBackend)
    assert backend.remote_stats.abort_acks_received == 1
    assert wait(sender, KVPoll.Failed) is KVPoll.Failed
    with pytest.raises(sglang.KVTransferError) as caught:
        sender.failure_exception()
    assert caught.value.is_from_another_rank  # the decode aborted it
    receiver.clear()


def test_a_prefill_that_goes_away_fails_its_rooms_and_is_looked_up_again(pair: Pair) -> None:
    """Shut down, the prefill fails its rooms and tells the decode; its address is then dead.

    (A prefill killed without a word, PEER_LOST and SGLang's "Lost connection
    with prefill instance" reason: tests/sglang/test_sglang_mooncake_queues.py.)
    """
    _sender, receiver = pair.connect(7, [1], 0)
    pair.prefill.shutdown()
    assert wait(receiver, KVPoll.Failed) is KVPoll.Failed
    with pytest.raises(sglang.KVTransferError) as caught:
        receiver.failure_exception()
    assert caught.value.reason is not None
    assert caught.value.reason.from_peer
    receiver.clear()
    assert pair.addr in pair.decode.prefill_info_table
    late = sglang.MooncakeKVReceiver(pair.decode, pair.addr, 8)
    late.init(0)  # to the dead address: lost (or never answered) within the heartbeat window
    assert wait(late, KVPoll.Success, timeout=WAIT) is KVPoll.Failed
    assert late.handle.failure is not None
    assert late.handle.failure.kind in (FailureKind.PEER_LOST, FailureKind.BOOTSTRAP_ERROR)
    wait_until(lambda: pair.addr not in pair.decode.prefill_info_table)  # the next request asks again
    late.clear()


def test_what_the_trio_cannot_do_fails_the_request_not_the_scheduler(pair: Pair) -> None:
    _sender, receiver = pair.connect(8, [1], 0)
    receiver.send_metadata([1], 0, [], decode_prefix_len=4)
    assert receiver.poll() is KVPoll.Failed
    assert receiver.handle.failure is not None
    assert "decode_prefix_len" in receiver.handle.failure.message
    receiver.clear()
    unknown = sglang.MooncakeKVReceiver(pair.decode, "127.0.0.1:1", 9)
    unknown.init(0)
    assert unknown.poll() is KVPoll.Failed  # no bootstrap server there
    assert unknown.handle.failure is not None
    assert "is healthy before, but now it is down" in unknown.handle.failure.message
    unknown.clear()
    with pytest.raises(TypeError, match="MooncakeKVManager"):
        sglang.MooncakeKVSender(sglang.KVManager(sglang.KVArgs(), "prefill", reaper=False), pair.addr, 10)


def test_bad_buffers_and_an_absent_bootstrap_server_are_clear_errors() -> None:
    broken = sglang.KVArgs(kv_data_ptrs=[1], kv_data_lens=[8], kv_item_lens=[])
    with pytest.raises(ConfigError, match="kv_item_lens"):
        sglang.MooncakeKVManager(broken, sglang.DisaggregationMode.DECODE)
    server = sglang.MooncakeKVBootstrapServer("127.0.0.1", 0)
    port = server.port
    server.close()
    buffers = Buffers()
    with mock.patch.object(_mooncake, "REGISTER_PATIENCE_S", 0.3), pytest.raises(BackendError, match=str(port)):
        sglang.MooncakeKVManager(
            buffers.kv_args(), sglang.DisaggregationMode.PREFILL, SimpleNamespace(disaggregation_bootstrap_port=port)
        )
