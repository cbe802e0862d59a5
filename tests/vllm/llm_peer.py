"""One real vLLM engine (`vllm.LLM`) in its own process, driven over a pipe.

The child builds vLLM 0.33.0's offline engine exactly as a user would
(`LLM(model=..., kv_transfer_config=...)`), in-process engine core and
worker (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), on the CPU platform, with the
kvfsm connector when `kv_role` is given. What is not vLLM's own:

* the model is `_env.TINY` (a two-layer OPT, config only) with dummy
  weights, re-drawn from `seed` in every process (`_reseed`), so two
  processes with one seed hold the same model and another seed another;
* prompts are token ids (no tokenizer);
* the compiled CPU ops are pure-torch stand-ins (`cpu_ops`), whose attention
  reads every key and value back from the KV cache blocks.

`generate` runs greedy requests to their end and returns, per request, its
token ids, finish reason and `kv_transfer_params`; `info` the connector's
counters. Between calls the child keeps stepping its engine while the
scheduler holds requests (a prefill's held blocks wait for their decode),
as `vllm serve`'s engine-core loop does; the offline `LLM` steps only
inside `generate`. A child never runs the interpreter's exit handlers.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from typing import Any

from tests.pipe_child import PipeChild, answer, build_or_exit, exit_child

#: KV cache memory of each engine (the CPU worker otherwise claims most of the host's).
KV_BYTES = 16 << 20
BLOCK_SIZE = 32  # the CPU attention backend's block sizes are multiples of 32


class LLMPeer(PipeChild):
    """A child process running one `vllm.LLM`; `peer.name(...)` calls `name` there."""

    def __init__(
        self,
        label: str,
        *,
        seed: int,
        kv_role: str | None = None,
        extra: dict[str, Any] | None = None,
        policy: str = "fail",
        engine_id: str | None = None,
    ) -> None:
        super().__init__(_child_main, (seed, kv_role, extra or {}, policy, engine_id or label), label)

    def ready(self, timeout: float = 300.0) -> None:
        """Wait until the child built its engine (importing vLLM and building it take a while)."""
        self._receive("start-up", timeout)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, timeout=120.0: self._call(name, *args, timeout=timeout)


def _child_main(
    conn: Connection, seed: int, kv_role: str | None, extra: dict[str, Any], policy: str, engine_id: str
) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{engine_id}] %(levelname)s %(name)s: %(message)s")
    endpoint = build_or_exit(conn, lambda: _Endpoint(seed, kv_role, extra, policy, engine_id))
    conn.send((True, "ready"))
    while True:
        try:
            if not conn.poll(0.005):
                endpoint.pump()
                continue
            name, args = conn.recv()
        except (EOFError, OSError):
            break
        if name == "exit":
            break
        answer(conn, endpoint, name, args)
    exit_child(endpoint.close)


def _reseed(model: Any, seed: int) -> None:
    """Every weight drawn from one generator seeded with `seed`, in parameter-name order."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


class _Endpoint:
    def __init__(self, seed: int, kv_role: str | None, extra: dict[str, Any], policy: str, engine_id: str) -> None:
        from . import _env

        _env.prepare()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from . import cpu_ops

        cpu_ops.install()
        from vllm import LLM
        from vllm.config import KVTransferConfig

        transfer = None
        if kv_role is not None:
            transfer = KVTransferConfig(
                kv_connector="KVFSMConnector",
                kv_connector_module_path="kvfsm.compat.vllm",
                kv_role=kv_role,  # type: ignore[arg-type,unused-ignore]
                engine_id=engine_id,
                kv_connector_extra_config=extra,
                kv_load_failure_policy=policy,  # type: ignore[arg-type,unused-ignore]
            )
        self.llm = LLM(
            model=_env.TINY,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=512,
            block_size=BLOCK_SIZE,
            seed=seed,
            kv_cache_memory_bytes=KV_BYTES,
            enable_prefix_caching=True,
            kv_transfer_config=transfer,
        )
        self.llm.collective_rpc(_reseed_worker, args=(seed,))

    def generate(self, requests: list[tuple[list[int], int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
        """Greedy generation of `(prompt token ids, max tokens, kv_transfer_params)` requests, to their end."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(tokens)) for tokens, _, _ in requests]
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args=None if transfer is None else {"kv_transfer_params": dict(transfer)},
            )
            for _, max_tokens, transfer in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            {
                "tokens": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "kv_transfer_params": out.kv_transfer_params,
            }
            for out in outputs
        ]

    def pump(self) -> None:
        """One engine step while the scheduler still holds requests (the engine core's busy loop)."""
        core = self.llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined,unused-ignore]
        if core.scheduler.has_requests():
            core.step()

    def info(self) -> dict[str, Any]:
        """The connector's counters: scheduler and worker halves, and vLLM's connector stats payload."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        worker = get_kv_transfer_group().worker_half
        core = self.llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined,unused-ignore]
        scheduler = core.scheduler.connector.scheduler_half
        return {
            "worker": None if worker is None else _attrs_dict(worker.stats),
            "scheduler": None if scheduler is None else _attrs_dict(scheduler.stats),
            "page_heads": None if worker is None else worker.page_heads,
        }

    def close(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            get_kv_transfer_group().shutdown()


def _reseed_worker(worker: Any, seed: int) -> None:
    _reseed(worker.model_runner.model, seed)


def _attrs_dict(value: Any) -> dict[str, Any]:
    import attrs

    return {k: v for k, v in attrs.asdict(value).items() if isinstance(v, (int, float, str))}
