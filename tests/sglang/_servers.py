"""Real SGLang 0.5.23 servers for tests/sglang: a tiny model, the launcher, and a client.

`test_sglang_servers.py` starts `python -m sglang.launch_server`, unmodified,
as a single instance and as prefill/decode pairs on 127.0.0.1, with kvfsm's
Mooncake trio selected by the migration guide's `get_kv_class` patch, and
talks to them over HTTP as a client and SGLang's router would. What runs is
SGLang's own server: its HTTP front end, tokenizer manager, scheduler with
its PD queues, detokenizer, model runner and KV pools. What is stood in,
and why:

* **The model.** No model hub here, and random dummy weights
  (`--load-format dummy`) make degenerate tokens (every prompt the same
  few ids), which cannot tell right KV from wrong. `write_model` writes a
  tiny Llama (2 layers, 4 attention heads, 4 or 2 KV heads, vocabulary 256)
  as a `config.json` and a `model.safetensors` of seeded Gaussian weights;
  two seeds are two different models (the negative control).
* **`vllm._custom_ops`** (`standins/vllm/_custom_ops.py`): off CUDA, SGLang's
  rotary layer imports vLLM's kernel as a fallback it never calls on CPU.
* **The guide's patch** (`standins/sitecustomize.py`): SGLang's installed
  `get_kv_class` is compiled with the migration guide's two edits in every
  server process; the files of the installed SGLang are not touched.
* **The tokenizer.** `--skip-tokenizer-init`: requests carry `input_ids`
  and answers carry `output_ids` (the tiny model has no tokenizer).
* **The CPU flags** (`CPU_FLAGS`): SGLang on a CPU without its CPU engine
  (`SGLANG_USE_CPU_ENGINE`, which needs sgl-kernel's CPU build) runs with
  the torch-native attention backend, the PyTorch sampler, no CUDA graphs,
  and on the decode `--disaggregation-decode-retraction-backup cpu_tensor`
  (the default backup pins host memory with CUDA). And
  `--disable-overlap-schedule`: a CPU has no streams to overlap, and SGLang
  0.5.23's overlap loop crashes the prefill there (`maybe_send_cached_prefix_chunk`
  records a `torch.cuda.Event` when a chunked prompt's next chunk starts,
  "expected stream to be a torch.Stream": seen with a 100-token prompt).

Everything a test starts it stops: each server runs in a process group of
its own, stopped with SIGTERM and then SIGKILL, also when a test fails.
Waits are bounded and say what they waited for, with the server's log.
"""

from __future__ import annotations

import array
import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

STANDINS = Path(__file__).with_name("standins")
#: How long a server may take to answer /health with 200 (two cores shared by four servers: about 100 s).
START_TIMEOUT_S = 420.0
#: How long one generate request may take.
REQUEST_TIMEOUT_S = 120.0

#: The tiny model: small enough for two CPU cores, big enough that greedy tokens depend on every KV byte.
HIDDEN = 64
LAYERS = 2
HEADS = 4
VOCAB = 256
INTERMEDIATE = 128

#: SGLang on CPU without its CPU engine (see the module docstring).
CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    "--disable-overlap-schedule",
)
#: Small pools and pages of four tokens; a prefill chunk of 32 tokens, so a long prompt goes in several chunks.
PAGE_SIZE = 4
CHUNK_TOKENS = 32
POOL_FLAGS = (
    "--max-total-tokens",
    "4096",
    "--page-size",
    str(PAGE_SIZE),
    "--chunked-prefill-size",
    str(CHUNK_TOKENS),
    "--max-running-requests",
    "16",
)


#: What `python -m sglang.launch_server` imports beyond what tests/sglang's queue tests need
#: (module name: PyPI name); .ci/run installs them in the SGLang venv.
SERVER_MODULES = {
    "uvloop": "uvloop",
    "jsonschema": "jsonschema",
    "xgrammar": "xgrammar",
    "soundfile": "soundfile",
    "multipart": "python-multipart",
    "mooncake.engine": "mooncake-transfer-engine-non-cuda",
    "sglang_router": "sglang-router",
}
#: Set by .ci/run: a missing server dependency fails the run instead of skipping the servers' tests.
REQUIRE_ENV = "KVFSM_REQUIRE_SGLANG_SERVERS"
#: Set to keep the servers' logs and models after the run (their path is printed).
KEEP_ENV = "KVFSM_KEEP_SERVER_LOGS"


@contextlib.contextmanager
def scratch_directory(prefix: str) -> Iterator[Path]:
    """A fresh directory, removed afterwards unless KVFSM_KEEP_SERVER_LOGS=1."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if os.environ.get(KEEP_ENV) == "1":
            print(f"kept the servers' logs and models in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def require_server_stack() -> None:
    """Skip the calling module unless everything a real server imports is installed (fail in CI instead)."""
    missing = []
    for name, package in SERVER_MODULES.items():
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            missing.append(package)
    if not missing:
        return
    reason = f"a real SGLang server here needs {', '.join(missing)} (.ci/run installs them in the SGLang venv)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def write_model(directory: Path, seed: int, kv_heads: int = HEADS) -> Path:
    """A tiny Llama with seeded weights: `config.json` and `model.safetensors` (float32)."""
    directory.mkdir(parents=True, exist_ok=True)
    head_dim = HIDDEN // HEADS
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], array.array[float]]] = {}

    def gaussian(name: str, rows: int, cols: int, scale: float) -> None:
        values = array.array("f", (rng.gauss(0.0, scale) for _ in range(rows * cols)))
        tensors[name] = ([rows, cols], values)

    def ones(name: str, size: int) -> None:
        tensors[name] = ([size], array.array("f", [1.0] * size))

    # Scales chosen so that activations neither vanish nor saturate: the logits of
    # different prompts then pick different tokens (seen: no two prompts alike).
    gaussian("model.embed_tokens.weight", VOCAB, HIDDEN, 1.0)
    gaussian("lm_head.weight", VOCAB, HIDDEN, 1.0 / math.sqrt(HIDDEN))
    ones("model.norm.weight", HIDDEN)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        projection = 1.0 / math.sqrt(HIDDEN)
        gaussian(prefix + "self_attn.q_proj.weight", HEADS * head_dim, HIDDEN, 4 * projection)
        gaussian(prefix + "self_attn.k_proj.weight", kv_heads * head_dim, HIDDEN, 4 * projection)
        gaussian(prefix + "self_attn.v_proj.weight", kv_heads * head_dim, HIDDEN, projection)
        gaussian(prefix + "self_attn.o_proj.weight", HIDDEN, HEADS * head_dim, projection)
        gaussian(prefix + "mlp.gate_proj.weight", INTERMEDIATE, HIDDEN, projection)
        gaussian(prefix + "mlp.up_proj.weight", INTERMEDIATE, HIDDEN, projection)
        gaussian(prefix + "mlp.down_proj.weight", HIDDEN, INTERMEDIATE, 1.0 / math.sqrt(INTERMEDIATE))
        ones(prefix + "input_layernorm.weight", HIDDEN)
        ones(prefix + "post_attention_layernorm.weight", HIDDEN)
    _write_safetensors(directory / "model.safetensors", tensors)
    return directory


def _write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array.array[float]]]) -> None:
    """The safetensors format by hand: an 8-byte little-endian header size, a JSON header, the raw data."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this writer assumes a little-endian host")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, (shape, values) in tensors.items():
        data = values.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for data in blobs:
            out.write(data)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server: the stand-ins first on the path, then what the test sets."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(STANDINS) + (os.pathsep + path if path else "")
    env.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    if extra:
        env.update(extra)
    return env


class Server:
    """One `python -m sglang.launch_server` in a process group of its own."""

    def __init__(
        self,
        name: str,
        model: Path,
        logs: Path,
        *,
        role: str | None = None,
        port: int | None = None,
        bootstrap_port: int | None = None,
        extra_flags: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.role = role
        self.port = port if port is not None else free_port()
        self.bootstrap_port = bootstrap_port
        if role == "prefill" and self.bootstrap_port is None:
            self.bootstrap_port = free_port()
        self.log_path = logs / f"{name}.log"
        self._env = server_env(env)
        self._flags = list(extra_flags)
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS, *POOL_FLAGS]
        if self.role is not None:
            args += ["--disaggregation-mode", self.role, "--disaggregation-transfer-backend", "mooncake"]
        if self.role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.role == "decode":
            args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return args + self._flags

    def start(self) -> Server:
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,  # its own process group: stop() reaches every process it spawns
            )
        self.started_at = time.monotonic()
        self.ready_after = None
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until /health answers 200 (SGLang answers 503 until its warmup request went through)."""
        assert self.process is not None, f"{self.name} was not started"
        deadline = self.started_at + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"server {self.name} exited with {code} while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(self.url + "/health", 2.0)[0] == 200:
                    self.ready_after = time.monotonic() - self.started_at
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"server {self.name} did not answer /health with 200 in {timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a crash, nothing gets to say goodbye."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10.0)

    def terminate(self) -> None:
        """SIGTERM the process group (SGLang's launcher then stops its schedulers); `reap` finishes the job."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait until the process group is gone or `deadline` (monotonic) passed, then SIGKILL what is left."""
        if self.process is None:
            return
        pgid = self.process.pid
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        self.kill()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds."""
        self.terminate()
        self.reap(time.monotonic() + grace)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def loads(self) -> dict[str, Any]:
        """The scheduler's own report of its load (`GET /v1/loads`, computed live from its pools and queues)."""
        status, body = _get(self.url + "/v1/loads", 10.0)
        if status != 200:
            raise RuntimeError(f"{self.name}: /v1/loads answered {status}: {body[:300]!r}")
        load: dict[str, Any] = json.loads(body)["loads"][0]
        return load

    def kv_usage(self) -> KVUsage:
        return KVUsage.of(self.loads())

    def generate(self, payload: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        return post_generate(self.url, payload, timeout)

    def __repr__(self) -> str:
        return f"<Server {self.name} {self.role or 'single'} :{self.port}>"


class KVUsage:
    """What a server reports of its KV pool and queues (from /v1/loads)."""

    def __init__(self, used: int, running: int, waiting: int, queues: dict[str, int]) -> None:
        self.used, self.running, self.waiting, self.queues = used, running, waiting, queues

    @classmethod
    def of(cls, load: dict[str, Any]) -> KVUsage:
        disagg = load.get("disaggregation") or {}
        queues = {key: int(value) for key, value in disagg.items() if key.endswith("_reqs")}
        return cls(int(load["num_used_tokens"]), int(load["num_running_reqs"]), int(load["num_waiting_reqs"]), queues)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and not any(self.queues.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVUsage) and (self.used, self.idle) == (other.used, other.idle)

    def __hash__(self) -> int:
        return hash((self.used, self.idle))

    def __repr__(self) -> str:
        busy = {key: value for key, value in self.queues.items() if value}
        return f"KVUsage(used={self.used} tokens, running={self.running}, waiting={self.waiting}, queues={busy})"


def wait_usage(server: Server, expected: KVUsage, timeout: float, what: str) -> tuple[KVUsage, float]:
    """Poll the server's report until it equals `expected`; (what it said, seconds it took)."""
    start = time.monotonic()
    while True:
        usage = server.kv_usage()
        if usage == expected:
            return usage, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(
                f"{server.name}: {what}: KV usage is {usage} {timeout:.0f}s later; expected {expected}"
            )
        time.sleep(0.1)


def post_generate(url: str, payload: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST /generate; the answer's JSON (an HTTP error's JSON too), its status under "status"."""
    data = json.dumps(payload).encode()
    request = urllib.request.Request(
        url + "/generate", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
            answer["status"] = response.status
            return answer
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            failed: dict[str, Any] = json.loads(body)
        except ValueError:
            failed = {"text": body.decode(errors="replace")}
        failed["status"] = error.code
        return failed
    except (OSError, http.client.HTTPException) as error:  # reset, refused, timed out: an answer too
        return {"status": None, "error": repr(error)}


def get_json(url: str, timeout: float = 10.0) -> Any:
    status, body = _get(url, timeout)
    if status != 200:
        raise AssertionError(f"GET {url} answered {status}: {body[:300]!r}")
    return json.loads(body)


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def request(
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    prefill: Server | None = None,
    room: int | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """A greedy /generate payload; with `prefill`, the bootstrap fields SGLang's router adds for a PD pair."""
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": stream,
    }
    if prefill is not None:
        assert room is not None
        payload.update(
            {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
        )
    return payload


class PDAnswer:
    """The two answers of one request sent to a prefill and a decode, as SGLang's router does."""

    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
        self.prefill, self.decode = prefill, decode

    @property
    def tokens(self) -> list[int]:
        if self.decode.get("status") != 200 or "output_ids" not in self.decode:
            raise AssertionError(f"the decode did not answer with tokens: {self.decode}")
        ids: list[int] = self.decode["output_ids"]
        return ids


_rooms = iter(range(10_000 + os.getpid() % 1000 * 100_000, 1 << 62))


def new_room() -> int:
    """A bootstrap room no other request of this run uses (the router draws random ones)."""
    return next(_rooms)


def pd_generate(
    prefill: Server, decode: Server, input_ids: Sequence[int], max_new_tokens: int, room: int | None = None
) -> PDAnswer:
    """Send one request to both servers at once with the same bootstrap room; both answers."""
    room = new_room() if room is None else room
    payload = request(input_ids, max_new_tokens, prefill=prefill, room=room)
    answers: dict[str, dict[str, Any]] = {}

    def post(server: Server, key: str) -> None:
        answers[key] = server.generate(payload)

    threads = [threading.Thread(target=post, args=(s, k)) for s, k in ((prefill, "prefill"), (decode, "decode"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 10)
    return PDAnswer(answers.get("prefill", {"status": None}), answers.get("decode", {"status": None}))


class StreamingClient:
    """A streaming /generate whose client goes away on demand (`disconnect()`), as a closed browser tab does.

    SGLang aborts a streaming request as soon as its client disconnects
    (the response's background task), where a non-streaming one is only
    noticed at its next 4-second check.
    """

    def __init__(self, server: Server, payload: dict[str, Any]) -> None:
        self.server = server
        self.connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
        body = json.dumps({**payload, "stream": True})
        self.connection.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        self.sent_at = time.monotonic()

    def disconnect(self) -> None:
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.connection.close()


class Router:
    """`sglang-router` in PD mode (`python -m sglang_router.launch_router --pd-disaggregation`), one prefill and one decode."""

    def __init__(self, prefill: Server, decode: Server, logs: Path) -> None:
        self.port = free_port()
        self.log_path = logs / "router.log"
        self.command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(prefill.bootstrap_port),
            "--decode",
            decode.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.version = importlib.metadata.version("sglang-router")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until the router answers /health (it registers its workers a little later: see `generate`)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"sglang-router exited with {self.process.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                if _get(f"http://127.0.0.1:{self.port}/health", 2.0)[0] == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router not healthy in {timeout:.0f}s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def generate(self, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """POST /generate through the router; retried while it has not registered its workers yet (503)."""
        deadline = time.monotonic() + timeout
        while True:
            answer = post_generate(f"http://127.0.0.1:{self.port}", payload)
            selecting = answer.get("status") == 503 and "No available servers" in json.dumps(answer)
            if not selecting or time.monotonic() > deadline:
                return answer
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10.0)
                return


@contextlib.contextmanager
def running(servers: Sequence[Server]) -> Iterator[Sequence[Server]]:
    """Start the servers together, wait until each is ready; stop them all on the way out, whatever happened."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        # All at once: SGLang takes a few seconds to stop, and nothing here needs a clean stop.
        for server in servers:
            server.terminate()
        deadline = time.monotonic() + 5.0
        for server in servers:
            server.reap(deadline)
