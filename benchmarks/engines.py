"""Cross-process engines next to the local backend: throughput and lifecycle overhead.

For each page size (64 KiB and 1 MiB by default) and each engine:

* throughput: `--requests` transfers of about 4 MiB each (2 chunks, 4 in
  flight), prefill and decode in two processes for Mooncake and NIXL
  (loopback TCP: Mooncake's "tcp" protocol, NIXL with `UCX_TLS=tcp`), both
  endpoints in one process for the local backend;
* lifecycle: `--latency-requests` one-page transfers one after another;
  the wall time per request covers open, bootstrap, expect, send, both
  sides terminal, release-safe and close;
* raw engine: the same one-page write done with the engine's own API, no
  kvfsm (Mooncake `transfer_sync_write`; NIXL WRITE, poll to DONE, wait for
  the notification), in one process over the same transport. The
  difference to the lifecycle figure is what kvfsm's lifecycle and control
  plane add per request;
* control round trip (`--control-requests`, remote engines): rooms with no
  page at all, one after another, timed on the decode from `expect()` to
  Success: the claim (ROOM) to the prefill, its scheduler's empty last
  chunk, and DONE back; no engine write. It runs on the public API only,
  so the same file measures an older kvfsm tree too (`PYTHONPATH=OLD`).

Every figure comes from this one run; ratios are against the local backend
of the same run. No data checks here (`kvfsm simulate` does those).

    PYTHONPATH=. python benchmarks/engines.py [--requests 40] [--latency-requests 200]
        [--control-requests 200] [--control-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

REQUEST_BYTES = 4 << 20


def _settings(engine: str, page_size: int, requests: int, pages: int, chunks: int, concurrency: int) -> dict[str, Any]:
    return {
        "backend": engine,
        "requests": requests,
        "pages": pages,
        "page_size": page_size,
        "chunks": chunks,
        "concurrency": concurrency,
        "abort_rate": 0.0,
        "fail_rate": 0.0,
        "seed": 0,
        "progress": False,
        "verify": False,
        "heartbeat": 0.5,
        "log_level": 40,
    }


def _run_case(settings: dict[str, Any]) -> dict[str, Any]:
    """One measured run; remote engines in two processes, local in one child process."""
    from kvfsm import simulate_remote

    if settings["backend"] in simulate_remote.REMOTE_BACKENDS:
        args = argparse.Namespace(
            **{k: v for k, v in settings.items() if k not in ("progress", "heartbeat", "log_level")}
        )
        args.no_progress = True
        args.json = None
        with open(os.devnull, "w") as sink:
            return simulate_remote.simulate_remote(args, out=sink)
    return _in_child(_local_case, settings)


def _local_case(settings: dict[str, Any]) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from kvfsm import simulate_remote

    sender = simulate_remote._Side("sender", settings)
    receiver = simulate_remote._Side("receiver", settings)
    address = sender.backend.address
    start = time.perf_counter()
    # One pool per side, as two processes would have: a side never waits for threads the other holds.
    with (
        ThreadPoolExecutor(settings["concurrency"]) as send_pool,
        ThreadPoolExecutor(settings["concurrency"]) as recv_pool,
    ):
        sends = [send_pool.submit(sender.sender_request, room, address) for room in range(settings["requests"])]
        recvs = [recv_pool.submit(receiver.receiver_request, room, address) for room in range(settings["requests"])]
        reports = {
            "sender": {"results": [f.result() for f in sends], "left_open": len(sender.manager), "late_events": 0},
            "receiver": {"results": [f.result() for f in recvs], "left_open": len(receiver.manager), "late_events": 0},
        }
    elapsed = time.perf_counter() - start
    return simulate_remote._summary(settings, reports, elapsed)


def _raw_case(engine: str, page_size: int, count: int) -> dict[str, Any]:
    """Per-write latency of one page with the engine's own API (two endpoints, one process)."""
    import torch

    src = torch.ones(page_size, dtype=torch.uint8)
    dst = torch.zeros(page_size, dtype=torch.uint8)
    times: list[float] = []
    if engine == "mooncake":
        from mooncake.engine import TransferEngine

        a, b = TransferEngine(), TransferEngine()
        for te in (a, b):
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        a.register_memory(src.data_ptr(), page_size)
        b.register_memory(dst.data_ptr(), page_size)
        target = f"127.0.0.1:{b.get_rpc_port()}"
        for _ in range(count + 5):
            t0 = time.perf_counter()
            assert a.transfer_sync_write(target, src.data_ptr(), dst.data_ptr(), page_size) == 0
            times.append(time.perf_counter() - t0)
    else:
        from nixl._api import nixl_agent, nixl_agent_config

        a = nixl_agent("raw-a", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        b = nixl_agent("raw-b", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        a.register_memory(src)
        b.register_memory(dst)
        name = a.add_remote_agent(b.get_agent_metadata())
        name = name.decode() if isinstance(name, bytes) else name
        local = a.get_xfer_descs([(src.data_ptr(), page_size, 0)], "DRAM")
        remote = a.get_xfer_descs([(dst.data_ptr(), page_size, 0)], "DRAM")
        for i in range(count + 5):
            t0 = time.perf_counter()
            handle = a.initialize_xfer("WRITE", local, remote, name, f"n{i}".encode())
            state = a.transfer(handle)
            notified = False
            # Without progress threads each side progresses when polled: poll both.
            while state == "PROC" or not notified:
                if state == "PROC":
                    state = a.check_xfer_state(handle)
                notified = notified or bool(b.get_new_notifs())
            assert state == "DONE", state
            a.release_xfer_handle(handle)
            times.append(time.perf_counter() - t0)
    times = times[5:]  # the first writes open connections
    return {"median_s": statistics.median(times), "p99_s": sorted(times)[int(0.99 * (len(times) - 1))]}


def _control_side(role: str, engine: str, count: int, conn: Connection) -> None:
    """One endpoint of the control round trip; the prefill sends its address, the decode its timings."""
    import torch

    import kvfsm
    from kvfsm.backends import get_backend
    from kvfsm.backends.base import KVPools
    from kvfsm.backends.remote import RemoteConfig

    manager = kvfsm.TransferManager(role)
    backend = get_backend(engine)(manager, RemoteConfig(heartbeat_interval=0.5))  # type: ignore[call-arg]
    backend.register_pools(KVPools.from_tensors(torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), torch.zeros(2, 8)))
    deadline = 10.0

    def wait(handle: Any, states: tuple[kvfsm.KVPoll, ...]) -> None:
        start = time.perf_counter()
        while handle.state not in states:
            if time.perf_counter() - start > deadline:
                raise RuntimeError(f"room {handle.room} stuck in {handle.state.name}")
            time.sleep(0.00005)

    done = (kvfsm.KVPoll.Success, kvfsm.KVPoll.Failed)
    if role == "sender":
        conn.send(backend.address)
        for room in range(count + 10):
            handle = manager.open(room)
            backend.bootstrap(handle, backend.address)
            wait(handle, (kvfsm.KVPoll.WaitingForInput, kvfsm.KVPoll.Failed))
            backend.send(handle, [], last=True)
            wait(handle, done)
            manager.close(room)
        conn.send("done")
    else:
        prefill = conn.recv()
        times = []
        for room in range(count + 10):
            handle = manager.open(room)
            backend.bootstrap(handle, prefill)
            wait(handle, (kvfsm.KVPoll.WaitingForInput, kvfsm.KVPoll.Failed))
            start = time.perf_counter()
            backend.expect(handle, [])
            wait(handle, done)
            if handle.state is not kvfsm.KVPoll.Success:
                raise RuntimeError(f"room {room} failed: {handle.reason}")
            times.append(time.perf_counter() - start)
            manager.close(room)
        conn.send(times[10:])  # the first rooms open the connection and warm up
    conn.recv()  # stay up until the parent says both ended
    backend.close()
    os._exit(0)


def _control_case(engine: str, count: int) -> dict[str, Any]:
    """Median and p90 of the control round trip (see the module docstring), two processes."""
    ctx = multiprocessing.get_context("spawn")
    ends = [ctx.Pipe() for _ in range(2)]
    processes = [
        ctx.Process(target=_control_side, args=(role, engine, count, child), daemon=True)
        for role, (_parent, child) in zip(("sender", "receiver"), ends, strict=True)
    ]
    for process in processes:
        process.start()
    prefill_conn, decode_conn = ends[0][0], ends[1][0]
    try:
        if not prefill_conn.poll(120):
            raise RuntimeError("the prefill did not start")
        decode_conn.send(prefill_conn.recv())
        if not decode_conn.poll(600):
            raise RuntimeError("the control round trip did not finish")
        times = decode_conn.recv()
        prefill_conn.poll(60)
        for conn in (prefill_conn, decode_conn):
            conn.send("exit")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    times.sort()
    return {"median_s": statistics.median(times), "p90_s": times[int(0.9 * (len(times) - 1))]}


def _child(conn: Connection, function: Any, args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, function(*args)))
    except BaseException:
        conn.send((False, traceback.format_exc()))
    conn.close()
    sys.stdout.flush()
    os._exit(0)  # NIXL's bundled libraries may crash in interpreter teardown


def _in_child(function: Any, *args: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_child, args=(child, function, args), daemon=True)
    process.start()
    if not parent.poll(600):
        process.kill()
        raise RuntimeError(f"{function.__name__}{args} did not finish in 600 s")
    ok, value = parent.recv()
    process.join(10)
    if not ok:
        raise RuntimeError(f"{function.__name__}{args} failed:\n{value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="local,mooncake,nixl")
    parser.add_argument("--sizes", default="65536,1048576", help="page sizes in bytes (over 2 layers x K,V)")
    parser.add_argument("--requests", type=int, default=40, help="throughput requests per case (about 4 MiB each)")
    parser.add_argument("--latency-requests", type=int, default=200, help="sequential one-page requests per case")
    parser.add_argument(
        "--control-requests", type=int, default=200, help="sequential page-less rooms per remote engine (0: skip)"
    )
    parser.add_argument("--control-only", action="store_true", help="measure only the control round trip")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    # Loopback TCP for NIXL too (UCX would otherwise pick shared memory between local processes).
    os.environ.setdefault("UCX_TLS", "tcp")
    engines = args.engines.split(",")
    rows: list[dict[str, Any]] = []
    control = {
        engine: _control_case(engine, args.control_requests)
        for engine in engines
        if engine != "local" and args.control_requests > 0
    }
    for engine, figures in control.items():
        print(
            f"control round trip, {engine}: median {figures['median_s'] * 1e6:.0f} us, "
            f"p90 {figures['p90_s'] * 1e6:.0f} us ({args.control_requests} page-less rooms)"
        )
    if args.control_only:
        return 0
    for page_size in (int(s) for s in args.sizes.split(",")):
        pages = max(1, REQUEST_BYTES // page_size)
        for engine in engines:
            thr = _run_case(_settings(engine, page_size, args.requests, pages, 2, 4))
            lat = _run_case(_settings(engine, page_size, args.latency_requests, 1, 1, 1))
            raw = None if engine == "local" else _in_child(_raw_case, engine, page_size, args.latency_requests)
            for summary in (thr, lat):
                if not summary["ok"] or summary["final_states"]["receiver"].get("Success") != summary["requests"]:
                    raise RuntimeError(
                        f"{engine} {page_size}: a benchmark run did not succeed: {summary['final_states']}"
                    )
            per_request = lat["elapsed_s"] / lat["requests"]
            rows.append(
                {
                    "engine": engine,
                    "page_bytes": page_size,
                    "throughput_gb_s": thr["throughput"]["gb_per_s"],
                    "throughput_req_s": thr["requests_per_s"],
                    "lifecycle_s": per_request,
                    "raw_write_s": raw["median_s"] if raw else None,
                    "overhead_s": per_request - raw["median_s"] if raw else None,
                }
            )
            print(f"done: {engine} {page_size} B pages", file=sys.stderr, flush=True)
    _print(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"cases": rows, "control": control}, fh, indent=2)
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    local = {r["page_bytes"]: r for r in rows if r["engine"] == "local"}
    print(
        f"{'engine':<9} {'page':>8} {'GB/s':>7} {'x local':>8} {'req/s':>8} "
        f"{'lifecycle/req':>14} {'x local':>8} {'raw write':>10} {'kvfsm adds':>11}"
    )
    for r in rows:
        base = local.get(r["page_bytes"])
        thr_ratio = r["throughput_gb_s"] / base["throughput_gb_s"] if base else float("nan")
        lat_ratio = r["lifecycle_s"] / base["lifecycle_s"] if base else float("nan")
        raw = f"{r['raw_write_s'] * 1e6:8.0f}us" if r["raw_write_s"] is not None else f"{'-':>10}"
        adds = f"{r['overhead_s'] * 1e6:9.0f}us" if r["overhead_s"] is not None else f"{'-':>11}"
        print(
            f"{r['engine']:<9} {r['page_bytes'] // 1024:>6}KB {r['throughput_gb_s']:7.3f} {thr_ratio:8.2f} "
            f"{r['throughput_req_s']:8.1f} {r['lifecycle_s'] * 1e6:12.0f}us {lat_ratio:8.2f} {raw} {adds}"
        )


if __name__ == "__main__":
    sys.exit(main())
