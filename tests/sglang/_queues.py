"""SGLang 0.5.23's real scheduler queues, on the minimal stand-ins its own CPU tests use.

What runs is SGLang's code: `PrefillBootstrapQueue.add/pop_bootstrapped`,
the prefill mixin's `send_kv_chunk`, `resolve_waiting_queue_bootstrap`,
`process_disagg_prefill_inflight_queue` and failure handlers,
`DecodePreallocQueue.add/pop_preallocated`, `DecodeTransferQueue.extend/
pop_transferred/resolve_deferred_releases`, and `Scheduler.abort_request`
itself for aborts. Polls go through SGLang's `poll_and_all_reduce*` over a
real one-rank gloo group, and the metadata slots are SGLang's own
`MetadataBuffers` and `ReqToMetadataIdxAllocator`.

Stood in (as SGLang's tests under test/registered/unit/disaggregation/ do,
with `Queue.__new__` and plain attributes): the scheduler object, the
request (`Req` below: the fields these paths read), the token pools (a
`req_to_token` table and page bookkeeping), the radix cache
(`finish`/`unlock` recorded), KV-cache release (`release_kv_cache`
recorded instead of freeing pages) and the allocator's admission arithmetic
(`_pre_alloc`, the token budgets). Everything the queues do to a request
lands in `World.log`: popped, failed, streamed (with the finish reason),
released, metadata slots taken and freed; two runs are compared by their
logs.

`classes` picks the transfer classes SGLang's `get_kv_class` hands out for
`TransferBackend.FAKE` (and, with `mooncake`, for `TransferBackend.MOONCAKE`),
exactly where the migration guide patches it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from tests.sglang._sglang import module

base_conn = module("sglang.srt.disaggregation.base.conn")
utils = module("sglang.srt.disaggregation.utils")
prefill_mod = module("sglang.srt.disaggregation.prefill")
decode_mod = module("sglang.srt.disaggregation.decode")
hicache_mod = module("sglang.srt.disaggregation.decode_hicache_mixin")
scheduler_mod = module("sglang.srt.managers.scheduler")
schedule_batch = module("sglang.srt.managers.schedule_batch")
io_struct = module("sglang.srt.managers.io_struct")
runtime_context = module("sglang.srt.runtime_context")
server_args_mod = module("sglang.srt.server_args")

KVPoll = base_conn.KVPoll
TransferBackend = utils.TransferBackend
KVClassType = utils.KVClassType
FAKE_HOST = utils.FAKE_BOOTSTRAP_HOST
HiCacheRestoreResult = decode_mod.HiCacheRestoreResult
FINISH_ABORT = schedule_batch.FINISH_ABORT

VOCAB = 1000
MAX_TOKENS = 64
POOL_ROWS = 16


# -- process-wide set-up --------------------------------------------------------------


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_group: Any = None


def gloo_group() -> Any:
    """A real one-rank gloo process group (created once per process)."""
    global _group
    if _group is None:
        dist = torch.distributed
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        _group = dist.new_group(ranks=[0], backend="gloo")
    return _group


def tp_group(rank: int, size: int, port: int) -> Any:
    """A real gloo process group of `size` processes (one TP group), this process being `rank`; created once."""
    global _group
    if _group is None:
        dist = torch.distributed
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        _group = dist.new_group(ranks=list(range(size)), backend="gloo")
    return _group


@contextlib.contextmanager
def sglang_context(rank: int = 0, **server_args: Any) -> Iterator[None]:
    """SGLang's runtime context published from ServerArgs, with this process as TP rank `rank` (0 of PP)."""
    runtime_context.reset_context()
    runtime_context.publish(server_args_mod.ServerArgs(model_path="dummy", **server_args), role="tokenizer")
    try:
        with runtime_context.get_parallel().override(tp_rank=rank, pp_rank=0, attn_tp_rank=rank):
            yield
    finally:
        runtime_context.reset_context()


def kv_classes(classes: dict[Any, dict[Any, Any]]) -> Callable[[Any, Any], Any]:
    """SGLang's `get_kv_class`, with some backends' classes replaced (the migration guide's patch)."""
    original = utils.get_kv_class

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        mapping = classes.get(transfer_backend)
        if mapping is not None and class_type in mapping:
            return mapping[class_type]
        return original(transfer_backend, class_type)

    return get_kv_class


def kv_args(**fields: Any) -> Any:
    """SGLang's own KVArgs, filled as the queues' `_init_kv_manager` fills it (the fields the classes read)."""
    args = base_conn.KVArgs()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.kv_cache_dtype_str = "auto"
    args.kv_layout = None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = [], [], []
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.state_types = []
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.page_size = 1
    args.ib_device = None
    args.gpu_id = 0
    for name, value in fields.items():
        setattr(args, name, value)
    return args


# -- stand-ins ----------------------------------------------------------------------------


class Req:
    """The fields of SGLang's `Req` that the PD queue paths read and write."""

    def __init__(self, rid: str, prompt_len: int, room: int | None, host: str = FAKE_HOST, port: int = 0) -> None:
        self.rid = rid
        self.bootstrap_host = host
        self.bootstrap_port = port
        self.bootstrap_room = room
        self.disagg_prefill_dp_rank: int | None = None
        self.origin_input_ids = list(range(1, prompt_len + 1))
        self.output_ids: list[int] = []
        self.sampling_params = SimpleNamespace(max_new_tokens=4)
        self.metadata_buffer_index = -1
        self.pending_bootstrap = False
        self.time_stats = mock.MagicMock()
        self.finished_reason: Any = None
        self.to_finish: Any = None
        self.discard_output_reason = None
        self.return_logprob = False
        self.return_routed_experts = False
        self.return_sampling_mask = False
        self.start_send_idx = 0
        self.disagg_decode_prefix_len = 0
        self.extend_end = 0
        self.kv = SimpleNamespace(
            req_pool_idx=None, holds_kv=False, holds_mamba=False, retraction_backup=None, cache_protected_len=0
        )
        self.is_retracted = False
        self.prefill_attempt_count = 0
        self.arrival_processed_tokens = 0
        self.cache_request_handle = None
        self.cached_tokens = self.cached_tokens_device = self.cached_tokens_host = self.cached_tokens_storage = 0
        self.hidden_states_tensor = None
        self.session = None
        self.lock = None
        self.vocab_size = VOCAB
        self.priority = None
        self.is_rebootstrap = False
        self.pd_rebootstrap_forced_output_id = None
        self.inflight_middle_chunks = 0

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def release_mm_inputs_on_abort(self) -> None:
        pass

    def finished(self) -> bool:
        return self.finished_reason is not None

    def __repr__(self) -> str:
        return f"<Req {self.rid}>"


def outcome(req: Any) -> str:
    reason = req.finished_reason
    return "-" if reason is None else type(reason).__name__


_Allocator: Any = utils.ReqToMetadataIdxAllocator
_PrefillMixin: Any = prefill_mod.SchedulerDisaggregationPrefillMixin


class MetadataSlots(_Allocator):  # type: ignore[misc]
    """SGLang's metadata slot allocator, logging every slot taken and freed."""

    def __init__(self, size: int, log: list[tuple[Any, ...]]) -> None:
        super().__init__(size)
        self.log = log

    def alloc(self) -> Any:
        index = super().alloc()
        self.log.append(("slot+", index))
        return index

    def free(self, free_index: int) -> None:
        self.log.append(("slot-", free_index))
        super().free(free_index)


class Streamer:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def stream_output(self, reqs: list[Any], return_logprob: Any = False, *args: Any, **kwargs: Any) -> None:
        if reqs:
            self.log.append(("stream", tuple((req.rid, outcome(req)) for req in reqs)))


class TreeCache:
    """The radix cache: only what the PD paths call on it, recorded."""

    disable = True

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def finish(self, handle: Any, outcome: Any) -> None:
        self.log.append(("cache-finish", getattr(outcome, "name", str(outcome))))

    def unlock(self, lock: Any) -> None:
        pass

    def supports_mamba(self) -> bool:
        return False


class TokenPool:
    """`req_to_token` rows and a free list of token slots (page size `page_size`)."""

    def __init__(self, page_size: int, slots: int = 4096) -> None:
        self.page_size = page_size
        self.req_to_token = torch.zeros((POOL_ROWS, MAX_TOKENS), dtype=torch.int64)
        self._rows = list(range(POOL_ROWS))
        self._pages = list(range(1, slots // page_size))

    def available_size(self) -> int:
        return len(self._rows)

    def place(self, req: Any, length: int) -> torch.Tensor:
        """Give `req` a row and `length` token slots (whole pages); returns the slots."""
        row = self._rows.pop(0)
        pages = [self._pages.pop(0) for _ in range(-(-length // self.page_size))]
        slots = torch.tensor([p * self.page_size + i for p in pages for i in range(self.page_size)][:length])
        self.req_to_token[row, :length] = slots
        req.kv.req_pool_idx = row
        req.kv.holds_kv = True
        return slots


def metadata_buffers(slots: int) -> Any:
    """SGLang's own metadata slots (first output token, cached tokens, room, ...), on CPU."""
    return utils.MetadataBuffers(
        size=max(slots, 1), hidden_size=8, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=1
    )


def _release_recorder(log: list[tuple[Any, ...]]) -> Callable[..., None]:
    def release_kv_cache(req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
        if req.kv.holds_kv:
            log.append(("release", req.rid))
        req.kv.holds_kv = False

    return release_kv_cache


class _Host:
    """What the scheduler object carries for the mixins and `Scheduler.abort_request`."""

    abort_request = scheduler_mod.Scheduler.abort_request
    _release_aborted_request = scheduler_mod.Scheduler._release_aborted_request

    def __init__(self, log: list[tuple[Any, ...]], group: Any) -> None:
        self.log = log
        self.chunked_req = None
        self._pending_chunked_abort_req = None
        self.mm_receiver = None
        self.dllm_config = None
        self.waiting_queue: list[Any] = []
        self.beam_coordinator = mock.MagicMock()
        self.grammar_manager = mock.MagicMock()
        self.tree_cache = TreeCache(log)
        self.output_streamer = Streamer(log)
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.metrics_collector = mock.MagicMock()
        self.enable_hisparse = False
        self.enable_overlap = False
        self.enable_staging = False
        self.scheduler_stage_metrics = None
        self.attn_cp_cpu_group = self.attn_tp_cpu_group = group
        self.running_batch = SimpleNamespace(reqs=[])
        self.processed_tokens_counter = 0

    def send_abort_output(self, abort_req: Any, req: Any) -> None:
        self.log.append(("abort-output", req.rid))

    def collect_inflight_reqs(self) -> set[Any]:
        return set()

    def abort(self, rid: str) -> None:
        """A client's abort, through SGLang's own `Scheduler.abort_request`."""
        self.log.append(("abort", rid))
        self.abort_request(io_struct.AbortReq(rid=rid))


class PrefillHost(_Host, _PrefillMixin):  # type: ignore[misc]
    """The prefill scheduler: SGLang's prefill mixin methods on stand-in state."""

    def __init__(self, log: list[tuple[Any, ...]], group: Any, page_size: int) -> None:
        super().__init__(log, group)
        self.disaggregation_mode = utils.DisaggregationMode.PREFILL
        self.disagg_prefill_inflight_queue: list[Any] = []
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.kv_checksum_computer = None
        self.token_to_kv_pool_allocator = SimpleNamespace(
            page_size=page_size, translate_kv_indices_for_transfer=lambda x: x
        )
        self.pool = TokenPool(page_size)
        self.req_to_token_pool = self.pool


class DecodeHost(_Host):
    """The decode scheduler's state the decode queues and `abort_request` read."""

    def __init__(self, log: list[tuple[Any, ...]], group: Any) -> None:
        super().__init__(log, group)
        self.disaggregation_mode = utils.DisaggregationMode.DECODE
        self.enable_priority_scheduling = False
        self.enable_lora = False
        self.enable_decode_hicache = False
        self.kv_checksum_computer = None
        self.spec_algorithm = SimpleNamespace(is_none=lambda: True)
        self.batch_result_processor = mock.MagicMock()
        self.disagg_decode_prealloc_queue: Any = None
        self.disagg_decode_transfer_queue: Any = None


# -- the worlds ------------------------------------------------------------------------------


class PrefillWorld:
    """A prefill scheduler's bootstrap queue, waiting queue and inflight queue, on SGLang's code."""

    def __init__(
        self,
        *,
        manager: Any = None,
        log: list[tuple[Any, ...]],
        group: Any,
        page_size: int,
        slots: int,
        pp_size: int = 1,
    ) -> None:
        self.log = log
        self.host = host = PrefillHost(log, group, page_size)
        self.metadata_buffers = metadata_buffers(slots)
        host.disagg_metadata_buffers = self.metadata_buffers
        host.req_to_metadata_buffer_idx_allocator = MetadataSlots(slots, log)
        queue = prefill_mod.PrefillBootstrapQueue.__new__(prefill_mod.PrefillBootstrapQueue)
        queue.token_to_kv_pool = None
        queue.draft_token_to_kv_pool = None
        queue.is_mla_backend = False
        queue.metadata_buffers = self.metadata_buffers
        queue.req_to_metadata_buffer_idx_allocator = host.req_to_metadata_buffer_idx_allocator
        queue.tp_rank, queue.pp_rank, queue.pp_size = 0, 0, pp_size
        queue.gpu_id = 0
        queue.bootstrap_port = 8998
        queue.queue = []
        queue.scheduler = host
        queue.scheduler_stage_metrics = None
        queue.max_total_num_tokens = queue.max_input_len = MAX_TOKENS
        queue.transfer_backend = TransferBackend.FAKE
        queue.pp_poll_sync_work_list = []
        queue.kv_checksum_signature = 0
        host.disagg_prefill_bootstrap_queue = queue
        host.pp_group = SimpleNamespace(send_object=lambda *a, **k: [], recv_object=lambda *a, **k: None)
        host.tree_cache = TreeCache(log)
        self.queue = queue
        self.set_manager(manager)
        self.reqs: dict[str, Any] = {}
        #: Called with (request, token slots) once its prefill computed its KV (a test writes the KV there).
        self.computed: Callable[[Any, torch.Tensor], None] = lambda req, slots: None

    def set_manager(self, manager: Any) -> None:
        """The KV manager the queue's `_init_kv_manager` would have built (it may need `metadata_buffers`)."""
        self.manager = manager
        self.queue.kv_manager = manager

    def add(self, rid: str, prompt_len: int, room: int | None, host: str = FAKE_HOST, port: int = 0) -> Any:
        req = Req(rid, prompt_len, room, host, port)
        self.reqs[rid] = req
        self.queue.add(req, num_kv_heads=1)
        return req

    def pop_bootstrapped(self) -> None:
        popped = self.queue.pop_bootstrapped()
        for req in popped:
            self.log.append(("bootstrapped", req.rid))
        self.host.waiting_queue.extend(popped)

    def resolve_waiting(self) -> None:
        before = [req.rid for req in self.host.waiting_queue]
        self.host.resolve_waiting_queue_bootstrap()
        after = {req.rid for req in self.host.waiting_queue}
        self.log.extend(("dropped-from-waiting", rid) for rid in before if rid not in after)

    def forward(self, rid: str, chunk_ends: tuple[int, ...] = ()) -> None:
        """Prefill `rid` from the waiting queue: each middle chunk is sent as it completes, then the last."""
        req = self.reqs[rid]
        self.host.waiting_queue.remove(req)
        slots = self.host.pool.place(req, len(req.origin_input_ids))
        self.computed(req, slots)
        for end in chunk_ends:
            req.extend_end = end
            self.host.send_kv_chunk(req)
        req.extend_end = len(req.origin_input_ids)
        req.output_ids.append(7)
        # process_batch_result_disagg_prefill: checkpoint, inflight queue, last chunk.
        self.host.disagg_prefill_inflight_queue.append(req)
        self.host.send_kv_chunk(req, last_chunk=True)
        self.log.append(("forwarded", rid))

    def process_inflight(self) -> None:
        for req in self.host.process_disagg_prefill_inflight_queue():
            self.log.append(("inflight-done", req.rid, outcome(req)))

    def snapshot(self) -> tuple[Any, ...]:
        host = self.host
        return (
            [req.rid for req in self.queue.queue],
            [req.rid for req in host.waiting_queue],
            [req.rid for req in host.disagg_prefill_inflight_queue],
            host.req_to_metadata_buffer_idx_allocator.available_size(),
        )


class DecodeWorld:
    """A decode scheduler's prealloc and transfer queues, on SGLang's code."""

    def __init__(
        self,
        *,
        manager: Any = None,
        log: list[tuple[Any, ...]],
        group: Any,
        page_size: int,
        slots: int,
        deferred_release: bool = False,
        pp_size: int = 1,
    ) -> None:
        self.log = log
        self.host = host = DecodeHost(log, group)
        self.metadata_buffers = metadata_buffers(slots)
        self.slots = MetadataSlots(slots, log)
        self.pool = TokenPool(page_size)

        transfer = decode_mod.DecodeTransferQueue.__new__(decode_mod.DecodeTransferQueue)
        transfer.queue = []
        transfer.gloo_group = group
        transfer.req_to_metadata_buffer_idx_allocator = self.slots
        transfer.tp_rank = 0
        transfer.metadata_buffers = self.metadata_buffers
        transfer.scheduler = host
        transfer.enable_host_receive = False
        transfer.tree_cache = host.tree_cache
        transfer.spec_algorithm = host.spec_algorithm
        transfer._skipped_checksum_signatures = set()
        transfer.enable_staging = False
        transfer.staging_handler = None
        transfer.enable_deferred_kv_release = deferred_release
        transfer.deferred_kv_release_timeout = 30.0
        transfer._deferred_releases = []

        prealloc = decode_mod.DecodePreallocQueue.__new__(decode_mod.DecodePreallocQueue)
        prealloc.req_to_token_pool = self.pool
        prealloc.token_to_kv_pool_allocator = SimpleNamespace(
            page_size=page_size, translate_kv_indices_for_transfer=lambda x: x
        )
        prealloc.token_to_kv_pool = SimpleNamespace(page_size=page_size)
        prealloc.draft_token_to_kv_pool = None
        prealloc.is_mla_backend = False
        prealloc.metadata_buffers = self.metadata_buffers
        prealloc.req_to_metadata_buffer_idx_allocator = self.slots
        prealloc.scheduler = host
        prealloc.transfer_queue = transfer
        prealloc.tree_cache = host.tree_cache
        prealloc.host_pool = None
        prealloc.gloo_group = group
        prealloc._num_published_destinations = 0
        prealloc.tp_rank = 0
        prealloc.gpu_id = 0
        prealloc.bootstrap_port = 8998
        prealloc.max_total_num_tokens = 4096
        prealloc.pp_rank, prealloc.pp_size = 0, pp_size
        prealloc.num_reserved_decode_tokens = 0
        prealloc.transfer_backend = TransferBackend.FAKE
        prealloc.queue = []
        prealloc.retracted_queue = []
        prealloc.pending_reqs = []
        prealloc._prefill_dp_rank_queries = {}
        prealloc._ensure_retry_count = {}
        prealloc._max_ensure_retries = 15
        prealloc._ensure_last_attempt_time = {}
        prealloc._ensure_retry_interval = 1.0
        prealloc.held_rebootstrap_reqs = []
        prealloc.enable_staging = False
        prealloc.kv_checksum_signature = 0
        prealloc.scheduler_stage_metrics = None
        # The allocator's admission arithmetic (SWA, hisparse, radix budgets) is out of scope here.
        prealloc._check_if_req_exceed_kv_capacity = lambda req: False
        prealloc._uses_swa_tail_prealloc = lambda: False
        prealloc._uses_swa_reservation = lambda: False
        prealloc._allocatable_token_budgets = lambda **kwargs: 1 << 20
        prealloc._prealloc_reservation_fits = lambda *args, **kwargs: True
        prealloc._pre_alloc = self._pre_alloc
        host.disagg_decode_prealloc_queue = prealloc
        host.disagg_decode_transfer_queue = transfer
        self.prealloc = prealloc
        self.transfer = transfer
        self.set_manager(manager)
        self.reqs: dict[str, Any] = {}

    def set_manager(self, manager: Any) -> None:
        """The KV manager the queue's `_init_kv_manager` would have built (it may need `metadata_buffers`)."""
        self.manager = manager
        self.prealloc.kv_manager = manager

    def _pre_alloc(self, req: Any, prefix_indices: Any = None, prefix_len: int = 0, total_prefix_len: int = 0) -> Any:
        self.log.append(("prealloc", req.rid))
        return self.pool.place(req, len(req.origin_input_ids))

    def add(self, rid: str, prompt_len: int, room: int | None, host: str = FAKE_HOST, port: int = 0) -> Any:
        req = Req(rid, prompt_len, room, host, port)
        self.reqs[rid] = req
        self.prealloc.add(req)
        return req

    def decode_req(self, rid: str) -> Any:
        for decode_req in (*self.prealloc.queue, *self.transfer.queue):
            if decode_req.req.rid == rid:
                return decode_req
        raise KeyError(rid)

    def pop_preallocated(self, **kwargs: Any) -> None:
        preallocated, failed = self.prealloc.pop_preallocated(**kwargs)
        self.log.extend(("preallocated", dr.req.rid) for dr in preallocated)
        self.log.extend(("prealloc-failed", dr.req.rid, outcome(dr.req)) for dr in failed)
        self.transfer.extend(preallocated)

    def pop_transferred(self) -> None:
        self.transfer.resolve_deferred_releases()
        for req in self.transfer.pop_transferred():
            self.log.append(("transferred", req.rid, len(req.output_ids)))
            self.host.waiting_queue.append(req)

    def snapshot(self) -> tuple[Any, ...]:
        return (
            [dr.req.rid for dr in self.prealloc.queue],
            [dr.req.rid for dr in self.transfer.queue],
            [entry[0].req.rid for entry in self.transfer._deferred_releases],
            [req.rid for req in self.host.waiting_queue],
            self.slots.available_size(),
        )


@contextlib.contextmanager
def patched_sglang(log: list[tuple[Any, ...]], classes: dict[Any, dict[Any, Any]]) -> Iterator[None]:
    """Route SGLang's class lookup to `classes` and record KV-cache releases."""
    release = _release_recorder(log)
    get_kv_class = kv_classes(classes)
    with contextlib.ExitStack() as stack:
        for target in (prefill_mod, decode_mod):
            stack.enter_context(mock.patch.object(target, "get_kv_class", get_kv_class))
        for target in (prefill_mod, decode_mod, scheduler_mod):
            stack.enter_context(mock.patch.object(target, "release_kv_cache", release))
        stack.enter_context(mock.patch.object(prefill_mod, "checkpoint_kv_cache", return_value=None))
        stack.enter_context(mock.patch.object(decode_mod, "ensure_mamba_capacity", return_value=True))
        stack.enter_context(mock.patch.object(scheduler_mod, "_make_abort_req", return_value=None))
        yield


FAKE_CLASSES = {"manager": KVClassType.MANAGER, "sender": KVClassType.SENDER, "receiver": KVClassType.RECEIVER}


def fake_trio(implementation: str) -> dict[Any, Any]:
    """`get_kv_class(TransferBackend.FAKE, ...)`'s answers for 'sglang' (its own) or 'kvfsm'."""
    if implementation == "sglang":
        fake = module("sglang.srt.disaggregation.fake.conn")
        return {
            KVClassType.MANAGER: fake.FakeKVManager,
            KVClassType.SENDER: fake.FakeKVSender,
            KVClassType.RECEIVER: fake.FakeKVReceiver,
        }
    from kvfsm.compat import sglang as compat

    return {
        KVClassType.MANAGER: compat.FakeKVManager,
        KVClassType.SENDER: compat.FakeKVSender,
        KVClassType.RECEIVER: compat.FakeKVReceiver,
    }
