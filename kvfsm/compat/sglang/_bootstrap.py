"""The bootstrap server SGLang's decode asks where a prefill server's ranks listen.

In SGLang, every prefill server runs a bootstrap server on
`--disaggregation-bootstrap-port`; requests name it (`bootstrap_host`,
`bootstrap_port`), each prefill rank registers there at start-up, and decode
asks it for the prefill's parallel layout and its ranks' addresses before
the first request to that prefill (`try_ensure_parallel_info`). kvfsm's
Mooncake trio needs the same rendezvous for one more thing: each rank's
kvfsm control-plane address (where its `MooncakeBackend` listens).

This is a small HTTP server on the standard library (one daemon thread,
JSON bodies), with two routes and SGLang's health check:

* `PUT /kvfsm/prefill`: a prefill rank registers `{address, dp_rank,
  tp_rank, pp_rank}` and the server's layout (`attn_tp_size`,
  `attn_cp_size`, `total_kv_heads`, `dp_size`, `pp_size`, `page_size`,
  `kv_cache_dtype`, `decode_allocation_policy`, `prefill_http_port`);
* `GET /kvfsm/prefill`: the layout and every registered rank (503 until
  one registered);
* `GET /health`: 200.

Bodies are bounded (`MAX_BODY` bytes) and so is the rank table
(`MAX_RANKS`); a malformed registration is refused with 400 naming the
field. Only one process per prefill server talks to it, so no
authentication is attempted: it carries addresses, not KV.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..._errors import ConfigError

__all__ = ["KVBootstrapServer", "LAYOUT_FIELDS", "register_prefill_rank", "fetch_prefill_ranks"]

logger = logging.getLogger("kvfsm.compat.sglang")

ROUTE = "/kvfsm/prefill"
MAX_BODY = 64 * 1024
MAX_RANKS = 4096
#: The prefill server's layout, as registered by each rank (the last registration wins).
LAYOUT_FIELDS = (
    "attn_tp_size",
    "attn_cp_size",
    "total_kv_heads",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_cache_dtype",
    "decode_allocation_policy",
    "prefill_http_port",
)
_RANK_FIELDS = ("dp_rank", "tp_rank", "pp_rank")


def _check_registration(body: Any) -> str | None:
    """Why `body` is not a valid registration, or None."""
    if not isinstance(body, dict):
        return f"the body must be a JSON object; got {type(body).__name__}"
    address = body.get("address")
    if not isinstance(address, str) or not address or len(address) > 512:
        return f"address must be a non-empty string of at most 512 characters; got {address!r:.80}"
    for name in _RANK_FIELDS:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_RANKS:
            return f"{name} must be an int in [0, {MAX_RANKS}); got {value!r:.40}"
    return None


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("kvfsm bootstrap server: " + format, *args)

    def _reply(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, "OK")
        elif self.path == ROUTE:
            with self.server.lock:
                ranks = [{"rank": list(key), "address": address} for key, address in sorted(self.server.ranks.items())]
                layout = dict(self.server.layout)
            if not ranks:
                self._reply(503, {"error": "no prefill rank registered yet"})
            else:
                self._reply(200, {"layout": layout, "ranks": ranks})
        else:
            self._reply(404, {"error": f"no route {self.path!r}"})

    def do_PUT(self) -> None:
        if self.path != ROUTE:
            self._reply(404, {"error": f"no route {self.path!r}"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 < length <= MAX_BODY:
            self._reply(400, {"error": f"Content-Length must be in 1..{MAX_BODY}"})
            return
        try:
            body = json.loads(self.rfile.read(length))
        except (ValueError, RecursionError) as error:
            self._reply(400, {"error": f"the body is not JSON: {error}"})
            return
        problem = _check_registration(body)
        if problem is not None:
            self._reply(400, {"error": problem})
            return
        key = tuple(int(body[name]) for name in _RANK_FIELDS)
        with self.server.lock:
            if key not in self.server.ranks and len(self.server.ranks) >= MAX_RANKS:
                self._reply(507, {"error": f"the rank table is full ({MAX_RANKS} ranks)"})
                return
            self.server.ranks[key] = body["address"]
            self.server.layout.update({name: body[name] for name in LAYOUT_FIELDS if name in body})
        self._reply(200, {"registered": list(key)})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.lock = threading.Lock()
        self.ranks: dict[tuple[int, ...], str] = {}
        self.layout: dict[str, Any] = {}


class KVBootstrapServer:
    """The bootstrap server of one prefill server: `KVBootstrapServer(host, port)` serves at once.

    `port=0` picks a free port (read `.port`). `close()` stops it.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        try:
            self._server = _Server((host, port))
        except OSError as error:
            raise ConfigError(f"the bootstrap server cannot listen on {host}:{port}: {error}") from error
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="kvfsm-bootstrap", daemon=True
        )
        self._thread.start()

    def run(self) -> None:
        """SGLang's servers start in the constructor too; kept for the same call sites."""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __repr__(self) -> str:
        return f"<KVBootstrapServer {self.host}:{self.port}>"


def _url(bootstrap_addr: str) -> str:
    host, _, port = bootstrap_addr.rpartition(":")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}{ROUTE}"


def register_prefill_rank(bootstrap_addr: str, registration: dict[str, Any], timeout: float) -> None:
    """PUT one prefill rank's registration; raises `OSError`/`urllib.error.URLError` if it did not land."""
    request = urllib.request.Request(
        _url(bootstrap_addr),
        data=json.dumps(registration).encode(),
        headers={"Content-Type": "application/json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=timeout):
        return


def fetch_prefill_ranks(bootstrap_addr: str, timeout: float) -> dict[str, Any] | None:
    """The bootstrap server's layout and ranks, or None if it cannot answer (not up, no rank yet)."""
    try:
        with urllib.request.urlopen(_url(bootstrap_addr), timeout=timeout) as response:
            payload = json.loads(response.read(MAX_BODY * 64))
    except (OSError, ValueError) as error:
        logger.debug("kvfsm: bootstrap server %s did not answer: %s", bootstrap_addr, error)
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("ranks"), list):
        return None
    return payload
