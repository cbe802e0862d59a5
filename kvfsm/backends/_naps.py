"""Short naps that last what they say: the calling thread's timer slack set to 1 us.

Linux lets a sleeping thread wake up to its "timer slack" late (50 us by
default) so that wake-ups can be grouped. For a thread that polls an engine
in naps of tens of microseconds that slack is most of the nap: measured
here, `time.sleep(20e-6)` lasts 79 us by default and 29 us with a slack of
1 us. The writer and the control thread call `precise_naps()` once when
they start; elsewhere (another OS, no libc) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["precise_naps"]

_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
_SLACK_NS = 1000


def precise_naps() -> bool:
    """Set this thread's timer slack to 1 us (Linux); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
