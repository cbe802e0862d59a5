"""Lifecycles kvfsm ships, each a `kvfsm.Lifecycle` value: pass one to `TransferManager(lifecycle=...)`.

* `KV_LIFECYCLE`: one KV transfer from a prefill to a decode, the five
  states of SGLang's `KVPoll` (DESIGN.md).
* `STAGED_KV_LIFECYCLE`: the KV transfer with a staging phase between
  WaitingForInput and Transferring, as SGLang's staging buffer for unequal
  tensor parallelism has (the prefill writes into a staging buffer, the
  decode scatters it into its pages). `Staging` has its own deadline and
  reports `WaitingForInput`, so SGLang's scheduler (and its MIN
  all-reduce) sees exactly what it sees without staging. A room that needs
  no staging goes from WaitingForInput to Transferring directly, so every
  backend drives it unchanged.
* `KV_OFFLOAD_LIFECYCLE`: a KV offload to a storage tier (host memory,
  disk, a remote store), as HiCache and LMCache write KV out: queued ->
  writing -> stored, or failed. Each room is one block set written to the
  tier; `chunk_written` records progress; its pages are the device pages
  being read, released when stored, quarantined like any other failed
  room's until the tier proves its writes stopped.

Each is declared below and nothing else: its engines, handle methods,
status hooks, deadlines, `Timeouts` class, metrics, diagram
(`kvfsm diagram --lifecycle kvfsm.lifecycles:NAME`) and docs table derive
from the declaration. The guide "Declaring your own lifecycle" walks
through the offload one.
"""

from __future__ import annotations

from ._lifecycle import KV_LIFECYCLE, PROGRESS_ARGS, EventSpec, Lifecycle, StateSpec
from ._states import KVPoll

__all__ = ["KV_LIFECYCLE", "STAGED_KV_LIFECYCLE", "KV_OFFLOAD_LIFECYCLE", "SHIPPED"]

_PROGRESS = (PROGRESS_ARGS["nbytes"], PROGRESS_ARGS["last"])

STAGED_KV_LIFECYCLE = Lifecycle(
    "staged-kv",
    doc="A KV transfer with a staging phase (SGLang's staging buffer for unequal TP), reporting WaitingForInput.",
    states=(
        StateSpec("Bootstrapping", KVPoll.Bootstrapping, phase="bootstrap", timeout=300.0, doc="the sides meet"),
        StateSpec("WaitingForInput", KVPoll.WaitingForInput, phase="waiting", timeout=300.0, doc="waiting for the KV"),
        StateSpec(
            "Staging",
            KVPoll.WaitingForInput,
            phase="staging",
            timeout=60.0,
            doc="the KV lands in the decode's staging buffer (SGLang still sees WaitingForInput)",
        ),
        StateSpec("Transferring", KVPoll.Transferring, phase="transferring", doc="the KV is written into its pages"),
        StateSpec("Success", KVPoll.Success, terminal=True, doc="every page and the commit marker landed"),
        StateSpec("Failed", KVPoll.Failed, terminal=True, failure=True, doc="failed, timed out or aborted"),
    ),
    events=(
        EventSpec("bootstrapped", ("Bootstrapping",), "WaitingForInput", doc="handshake done"),
        EventSpec("staging_started", ("WaitingForInput",), "Staging", doc="the first write into the staging buffer"),
        EventSpec("chunk_staged", ("Staging",), None, _PROGRESS, doc="a chunk landed in the staging buffer"),
        EventSpec(
            "transfer_started",
            ("WaitingForInput", "Staging"),
            "Transferring",
            doc="the first write into the room's pages (after staging, or without it)",
        ),
        EventSpec("chunk_done", ("Transferring",), None, _PROGRESS, doc="one chunk landed in the pages"),
        EventSpec("transfer_done", ("Transferring",), "Success", doc="every chunk and the commit marker landed"),
    ),
    initial="Bootstrapping",
)

KV_OFFLOAD_LIFECYCLE = Lifecycle(
    "kv-offload",
    doc="A KV offload to a storage tier (host memory, disk, a remote store): queued, writing, stored.",
    states=(
        StateSpec(
            "Queued",
            KVPoll.WaitingForInput,
            phase="queued",
            timeout=30.0,
            doc="the offload waits for the tier's writer",
        ),
        StateSpec(
            "Writing",
            KVPoll.Transferring,
            phase="writing",
            timeout=60.0,
            doc="the tier reads the device pages and writes them out",
        ),
        StateSpec("Stored", KVPoll.Success, terminal=True, doc="every block is in the tier and readable"),
        StateSpec(
            "Failed", KVPoll.Failed, terminal=True, failure=True, doc="the write failed, timed out or was aborted"
        ),
    ),
    events=(
        EventSpec("write_started", ("Queued",), "Writing", doc="the tier's writer took the offload"),
        EventSpec("chunk_written", ("Writing",), None, _PROGRESS, doc="a chunk of blocks is in the tier"),
        EventSpec("stored", ("Writing",), "Stored", doc="the tier confirmed every block"),
    ),
    initial="Queued",
)

#: Every lifecycle this module ships, by name.
SHIPPED: dict[str, Lifecycle] = {
    lifecycle.name: lifecycle for lifecycle in (KV_LIFECYCLE, STAGED_KV_LIFECYCLE, KV_OFFLOAD_LIFECYCLE)
}
