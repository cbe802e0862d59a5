"""A prefill and a decode worker half of the vLLM connector, in one process (no vLLM).

On kvfsm's LocalBackend by default; `backend="mooncake"` (with a free
`port`) runs both endpoints over Mooncake on 127.0.0.1.

`Pair` plans rooms on both halves the way the scheduler half would and
collects what each reports per poll, failing if a room is reported twice;
`Clock` is the injectable clock of their deadlines.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfsm.compat.vllm._config import ConnectorConfig
from kvfsm.compat.vllm._params import RemoteSource
from kvfsm.compat.vllm._plan import RecvSpec, SendSpec, StepPlan
from kvfsm.compat.vllm._worker import WorkerHalf

BLOCKS = 16
LAYERS = ("layers.0", "layers.1")
_engines = itertools.count()


def new_engine_id() -> str:
    """A prefill engine id no other test of this process uses (the local registry is global)."""
    return f"prefill-{next(_engines)}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def caches(seed: int | None = None) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (BLOCKS, 2, 4, 2, 8)
    return {
        name: (torch.randn(shape, generator=generator) if generator is not None else torch.zeros(shape))
        for name in LAYERS
    }


class Pair:
    """A prefill and a decode worker half, one rank each."""

    def __init__(self, clock: Clock, tp_rank: int = 0, engine: str | None = None, **extra: Any) -> None:
        self.engine = engine or new_engine_id()
        config = self.config = ConnectorConfig.from_extra({"backend": "local", **extra})
        common: dict[str, Any] = {"tp_rank": tp_rank, "num_blocks": BLOCKS, "clock": clock}
        self.prefill = WorkerHalf(config, engine_id=self.engine, producer=True, consumer=False, **common)
        self.decode = WorkerHalf(config, engine_id="decode", producer=False, consumer=True, **common)
        self.p_kv, self.d_kv = caches(seed=tp_rank + 1), caches()
        self.prefill.register(self.p_kv)
        self.decode.register(self.d_kv)
        self.sent: set[str] = set()
        self.recvd: set[str] = set()
        self.failed: set[str] = set()
        self.errors: set[int] = set()

    def source(self, request: str, blocks: tuple[int, ...]) -> RemoteSource:
        return RemoteSource(self.engine, request, self.config.host, self.config.port, blocks, 1)

    def plan(self, request: str, src: tuple[int, ...], dst: tuple[int, ...], **recv: Any) -> None:
        room = f"{self.engine}/{request}"
        self.prefill.start(StepPlan(send=[SendSpec(request, room, src)]))
        self.decode.start(StepPlan(recv=[RecvSpec("d-" + request, room, self.source(request, src), dst, **recv)]))

    def step(self) -> None:
        sent, _, _ = self.prefill.poll()
        _, recvd, failed = self.decode.poll()
        assert not (sent & self.sent) and not (recvd & self.recvd), "a room was reported twice"
        self.sent |= sent
        self.recvd |= recvd
        self.failed |= failed
        self.errors |= self.decode.take_load_errors()

    def until(self, done: Callable[[], bool], steps: int = 3000) -> None:
        for _ in range(steps):
            if done():
                return
            self.step()
            time.sleep(0.001)
        raise AssertionError("not done in time")

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


def block(kv: dict[str, Any], index: int) -> list[Any]:
    """Block `index` of every layer."""
    return [kv[name][index] for name in LAYERS]


def same(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
