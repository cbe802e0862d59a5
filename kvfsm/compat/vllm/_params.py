"""`kv_transfer_params`: what a prefill tells its decode, and how the decode reads it.

vLLM hands each finished prefill request's `kv_transfer_params` back to
the client (a router or proxy), which forwards them with the request to a
decode engine. The keys are NIXL's, so the proxies written for vLLM's
NixlConnector forward kvfsm's unchanged:

    do_remote_prefill / do_remote_decode   which side still has work
    remote_engine_id, remote_request_id    who holds the blocks (the room)
    remote_block_ids                       the prefill's blocks, one list per KV cache group
    remote_host, remote_port               where the prefill's rank 0 listens
    tp_size                                the prefill's tensor-parallel size

The room both sides open for one transfer is `room_id(engine, request)`:
the prefill's engine id and request id, so two prefill engines reusing a
request id never share a room. Both come from clients, of any length, so
the pair is mapped to a room id that fits (`kvfsm.compat._room_ids`: itself
when it fits, else its SHA-256), the same on both sides. Parsing is strict and returns the problem
as text (vLLM's scheduler must not crash on a client's malformed params;
the request then fails its load with that message instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._room_ids import fit_text

__all__ = ["RemoteSource", "room_id", "parse_source", "prefill_params", "flat_block_ids"]


def room_id(engine_id: str, request_id: str) -> str:
    """The room of one transfer: the prefill engine's id and its request id (mapped when too long)."""
    return fit_text(f"{engine_id}/{request_id}")


@attrs.frozen(slots=True)
class RemoteSource:
    """Where a decode request's KV lives: the prefill engine, request, address and blocks."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int

    @property
    def room(self) -> str:
        return room_id(self.engine_id, self.request_id)


def flat_block_ids(value: object) -> tuple[int, ...] | str:
    """One KV cache group's block ids from `[[...]]` (vLLM's per-group lists) or `[...]`; else the problem."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return f"remote_block_ids must be a list of block ids (or one list per KV cache group); got {value!r:.80}"
    groups: Sequence[Any] = value
    if groups and all(isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in groups):
        if len(groups) != 1:
            return (
                f"remote_block_ids has {len(groups)} KV cache groups; the kvfsm connector moves one "
                "(hybrid KV caches are not supported: run both engines with --disable-hybrid-kv-cache-manager)"
            )
        groups = groups[0]
    blocks = []
    for block in groups:
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            return f"remote_block_ids must hold block ids (ints >= 0); got {block!r:.40}"
        blocks.append(block)
    return tuple(blocks)


def parse_source(params: Mapping[str, Any], *, tp_size: int) -> RemoteSource | str:
    """The prefill a decode request names, or the reason its params cannot be used."""
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
    if remote_tp != tp_size:
        return (
            f"the prefill runs tensor parallel size {remote_tp} and this decode {tp_size}: "
            "heterogeneous TP is not supported by the kvfsm connector"
        )
    blocks = flat_block_ids(params.get("remote_block_ids", []))
    if isinstance(blocks, str):
        return blocks
    assert isinstance(engine, str) and isinstance(request, str) and isinstance(host, str)
    return RemoteSource(engine, request, host, port, blocks, remote_tp)


def prefill_params(
    *, engine_id: str, request_id: str, host: str, port: int, block_ids: Sequence[int], tp_size: int
) -> dict[str, Any]:
    """The `kv_transfer_params` a finished prefill request returns for its decode."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(block_ids)],
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }
