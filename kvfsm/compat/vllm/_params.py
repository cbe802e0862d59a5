"""`kv_transfer_params`: what a prefill tells its decode, and how the decode reads it.

vLLM hands each finished prefill request's `kv_transfer_params` back to
the client (a router or proxy), which forwards them with the request to a
decode engine. The keys are NIXL's, so the proxies written for vLLM's
NixlConnector forward kvfsm's unchanged:

    do_remote_prefill / do_remote_decode   which side still has work
    remote_engine_id, remote_request_id    who holds the blocks (the room)
    remote_block_ids                       the prefill's blocks, one list per KV cache group
    remote_host, remote_port               where the prefill's rank 0 listens (its DP rank's ports)
    tp_size                                the prefill's tensor-parallel size

The room both sides open for one transfer is `room_id(engine, request)`:
the prefill's engine id and request id, so two prefill engines reusing a
request id never share a room. Both come from clients, of any length, so
the pair is mapped to a room id that fits (`kvfsm.compat._room_ids`: itself
when it fits, else its SHA-256), the same on both sides. A hybrid KV cache
(several KV cache groups: full attention, sliding window, Mamba state)
moves each group in a room of its own (`group_room`), since each group has
its own block ids and only the two ends of a group's room know how many of
its blocks the decode still needs. Block ids are kept per group everywhere
(`Blocks`). Parsing is strict and returns the problem
as text (vLLM's scheduler must not crash on a client's malformed params;
the request then fails its load with that message instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._room_ids import fit_text

__all__ = [
    "Blocks",
    "RemoteSource",
    "as_groups",
    "flat_block_ids",
    "group_block_ids",
    "group_room",
    "parse_source",
    "prefill_params",
    "room_id",
    "slice_room",
]

#: Block ids per KV cache group (one tuple per group, in vLLM's group order).
Blocks = tuple[tuple[int, ...], ...]


def room_id(engine_id: str, request_id: str) -> str:
    """The room of one transfer: the prefill engine's id and its request id (mapped when too long)."""
    return fit_text(f"{engine_id}/{request_id}")


def group_room(room: str, group: int) -> str:
    """The room that moves KV cache group `group` of transfer `room` (group 0: the room itself)."""
    return room if group == 0 else f"{room}#g{group}"


def slice_room(room: str, index: int, count: int) -> str:
    """The room of slice `index` of `count` of a prefill rank's heads (a decode of `count` times its TP size)."""
    return f"{room}@{index}/{count}"


def as_groups(blocks: Sequence[int] | Sequence[Sequence[int]]) -> Blocks:
    """Block ids per group from per-group lists, or from one flat list (one group)."""
    items: list[Any] = list(blocks)
    if not items:
        return ((),)
    if all(isinstance(b, int) and not isinstance(b, bool) for b in items):
        return (tuple(int(b) for b in items),)
    return tuple(tuple(int(b) for b in group) for group in items)


@attrs.frozen(slots=True)
class RemoteSource:
    """Where a decode request's KV lives: the prefill engine, request, address and blocks."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: Blocks = attrs.field(converter=as_groups)
    tp_size: int = 1

    @property
    def room(self) -> str:
        return room_id(self.engine_id, self.request_id)


def group_block_ids(value: object, groups: int | None = None) -> Blocks | str:
    """Block ids per group from `[[...], ...]` (vLLM's per-group lists) or `[...]` (one group); else the problem.

    `groups`: the number of KV cache groups this engine has. More lists
    than that cannot be matched group by group; fewer (vLLM's own tests give
    one flat list to hybrid engines) leave the missing groups empty, and a
    load that needs blocks of a group the prefill did not list fails in the
    worker, with that reason.
    """
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return f"remote_block_ids must be a list of block ids (or one list per KV cache group); got {value!r:.80}"
    items: Sequence[Any] = value
    nested = bool(items) and all(isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in items)
    lists: list[Sequence[Any]] = list(items) if nested else [items]
    if groups is not None and len(lists) > groups and any(lists):
        return (
            f"remote_block_ids has {len(lists)} KV cache group(s) and this engine {groups}: "
            "prefill and decode must run the same model with the same KV cache layout"
        )
    result = []
    for group in lists:
        blocks = []
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int) or block < 0:
                return f"remote_block_ids must hold block ids (ints >= 0); got {block!r:.40}"
            blocks.append(block)
        result.append(tuple(blocks))
    if groups is not None and len(result) < groups:
        result += [()] * (groups - len(result))  # nothing listed at all: no group has blocks
    return tuple(result)


def flat_block_ids(value: object) -> tuple[int, ...] | str:
    """One KV cache group's block ids from `[[...]]` or `[...]`; else the problem (one-group engines)."""
    blocks = group_block_ids(value, 1)
    return blocks if isinstance(blocks, str) else blocks[0]


def parse_source(params: Mapping[str, Any], *, groups: int = 1) -> RemoteSource | str:
    """The prefill a decode request names, or the reason its params cannot be used.

    `groups` is this engine's number of KV cache groups. A prefill of
    another tensor-parallel size is not refused here: the scheduler half
    decides what it can do with one (`RemoteSource.tp_size`).
    """
    engine, request = params.get("remote_engine_id"), params.get("remote_request_id")
    host, port = params.get("remote_host"), params.get("remote_port")
    for key, value in (("remote_engine_id", engine), ("remote_request_id", request), ("remote_host", host)):
        if not isinstance(value, str) or not value:
            return f"kv_transfer_params[{key!r}] must be a non-empty string; got {value!r:.80}"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return f"kv_transfer_params['remote_port'] must be a port number; got {port!r:.40}"
    remote_tp = params.get("tp_size", 1)
    if isinstance(remote_tp, bool) or not isinstance(remote_tp, int) or remote_tp < 1:
        return f"kv_transfer_params['tp_size'] must be an int >= 1; got {remote_tp!r:.40}"
    blocks = group_block_ids(params.get("remote_block_ids", []), groups)
    if isinstance(blocks, str):
        return blocks
    assert isinstance(engine, str) and isinstance(request, str) and isinstance(host, str)
    return RemoteSource(engine, request, host, port, blocks, remote_tp)


def prefill_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[int] | Sequence[Sequence[int]],
    tp_size: int,
) -> dict[str, Any]:
    """The `kv_transfer_params` a finished prefill request returns for its decode."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(group) for group in as_groups(block_ids)],
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }
