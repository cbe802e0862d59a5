"""kvfsm: the lifecycle layer for KV-cache transfers in disaggregated LLM serving.

Each transfer ("room") runs through an explicit state machine declared once
as a value (`kvfsm.Lifecycle`; `kvfsm.KV_LIFECYCLE` by default) and built
with `transitions`: Bootstrapping -> WaitingForInput -> Transferring ->
Success, or Failed from anywhere. `kvfsm.lifecycles` ships more. Backends only emit events on a room's
handle; the machine's hooks alone write the status table the scheduler
reads; abort is a guarded transition valid from every non-terminal state.

    >>> import kvfsm
    >>> manager = kvfsm.TransferManager("receiver")
    >>> room = manager.open(42)
    >>> room.bootstrapped(), room.transfer_started()
    (True, True)
    >>> room.abort("client went away")
    True
    >>> manager.status(42)
    <KVPoll.Failed: 0>
    >>> room.transfer_done()          # a late Success never overwrites Failed
    False
    >>> manager.stats.late_events
    1

This package imports neither torch nor zmq; the adapters under
`kvfsm.backends` do.
"""

from ._errors import (
    ConfigError,
    DuplicateRoom,
    InvalidRoomId,
    InvalidTransition,
    KVFSMError,
    KVTransferError,
    NotQuarantined,
    RoomNotFailed,
    UnknownRoom,
)
from ._lifecycle import (
    KV_LIFECYCLE,
    NON_TERMINAL,
    TERMINAL,
    EventArg,
    EventSpec,
    Lifecycle,
    LifecycleError,
    PhaseTimeouts,
    StateSpec,
    Timeouts,
    TransitionSpec,
)
from ._manager import TransferHandle, TransferManager
from ._observe import Observer, StateChange
from ._release import PagesState
from ._rows import Row, Table
from ._states import (
    MAX_REASON_CHARS,
    MAX_ROOM_ID_CHARS,
    FailureKind,
    FailureReason,
    KVPoll,
    Role,
    RoomId,
)
from ._status import ManagerStats
from ._table import EVENTS, TRANSITIONS

__version__ = "0.1.0"

__all__ = [
    "KVPoll",
    "TERMINAL",
    "NON_TERMINAL",
    "Role",
    "RoomId",
    "MAX_ROOM_ID_CHARS",
    "MAX_REASON_CHARS",
    "Timeouts",
    "FailureKind",
    "FailureReason",
    "TransferManager",
    "TransferHandle",
    "ManagerStats",
    "StateChange",
    "Observer",
    "TransitionSpec",
    "TRANSITIONS",
    "EVENTS",
    "Lifecycle",
    "KV_LIFECYCLE",
    "StateSpec",
    "EventSpec",
    "EventArg",
    "PhaseTimeouts",
    "LifecycleError",
    "PagesState",
    "NotQuarantined",
    "Row",
    "Table",
    "KVFSMError",
    "ConfigError",
    "KVTransferError",
    "InvalidTransition",
    "DuplicateRoom",
    "UnknownRoom",
    "InvalidRoomId",
    "RoomNotFailed",
    "__version__",
]
