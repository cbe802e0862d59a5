"""Native libraries' stderr lines, routed into Python's `logging`.

Mooncake Transfer Engine logs through glog straight to file descriptor 2:
about ten lines per engine at start-up, at glog's INFO, WARNING and ERROR
levels, including `E... Local segment descriptor not found`, which every
engine prints while it registers itself (its metadata has no entry for its
own segment yet) and which means nothing is wrong. A `kvfsm simulate`
child process calls `capture_native_stderr()`: descriptor 2 then feeds a
pipe read by a thread that parses each glog line (`I1201 08:59:18.034 ...
file.cpp:120] message`) and logs its message on the logger `kvfsm.native`
at the matching level, so `-v` / `-vv` show them like kvfsm's own records
and the default shows only errors. Lines known to be harmless are logged
at DEBUG. Anything else written to descriptor 2 (another library's text)
passes through unchanged. Python's own `sys.stderr` keeps writing to the
original stream.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading

__all__ = ["capture_native_stderr", "NativeStderr", "route_line", "HARMLESS"]

logger = logging.getLogger("kvfsm.native")

_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]]+)\] ?(.*)$")
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}

#: Messages that native engines print on every healthy start (logged at DEBUG).
HARMLESS = (
    "Local segment descriptor not found",
    "Logging before InitGoogleLogging() is written to STDERR",
    "No RDMA devices found",
    "Using default malloc/free for protocol",
)


def route_line(line: str, passthrough: io.TextIOBase | None = None) -> None:
    """Log one line from descriptor 2 (or write it to `passthrough` if it is not glog's)."""
    text = line.rstrip("\n")
    if not text:
        return
    match = _GLOG.match(text)
    if match is None:
        if text.startswith("WARNING: Logging before InitGoogleLogging()"):
            logger.debug("%s", text)
        elif passthrough is not None:
            passthrough.write(text + "\n")
            passthrough.flush()
        return
    letter, where, message = match.groups()
    level = logging.DEBUG if any(harmless in message for harmless in HARMLESS) else _LEVELS[letter]
    logger.log(level, "%s (%s)", message, where)


class NativeStderr:
    """Descriptor 2 redirected into a pipe whose lines go to `route_line`; `close()` restores it."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        # Python's writes (tracebacks, progress, logging) keep the real stream.
        self.stream = io.TextIOWrapper(io.FileIO(os.dup(self._saved), "w"), line_buffering=True)
        sys.stderr = self.stream
        self._reader = open(read_fd, encoding="utf-8", errors="replace", closefd=True)  # noqa: SIM115
        self._thread = threading.Thread(target=self._pump, name="kvfsm-native-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._reader:
            # A log line must never kill the process.
            with contextlib.suppress(Exception):
                route_line(line, self.stream)

    def close(self, timeout: float = 2.0) -> None:
        """Put descriptor 2 back and log what is still in the pipe."""
        os.dup2(self._saved, 2)  # closes the pipe's last write end: the reader sees EOF
        self._thread.join(timeout)
        os.close(self._saved)
        self.stream.flush()


def capture_native_stderr() -> NativeStderr:
    """Route descriptor 2 into `logging` until the returned object's `close()`."""
    return NativeStderr()
