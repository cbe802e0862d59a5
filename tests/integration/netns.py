"""Hosts with a real link between them: Linux network namespaces, a bridge and veth pairs.

`Topology(["a", "b"])` makes a namespace for the prefill (with a bridge
holding its address) and one per decode, each decode joined to the bridge
by a veth pair, addresses only inside those namespaces: one real link per
decode. `down("a")` takes decode a's end of its link down: its established
TCP connections then neither fail nor deliver (the kernel keeps
retransmitting), and new connections fail once ARP gives up, as on a
partitioned network (a SIGSTOP does not show that). `up("a")` heals it.
Everything is removed on `close()` (or leaving the `with` block): deleting
a namespace deletes its interfaces. Names carry this process's id, so
concurrent runs never meet.

`unavailable()` says why namespaces cannot be made here (not root, no `ip`,
a kernel without them), for the test's skip reason. A child process enters
its namespace with `enter(path)` before it opens any socket (tests/
integration/fleet.py does, first thing).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from types import TracebackType

__all__ = ["Topology", "enter", "unavailable"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE, _MNT_DETACH = 0x4000, 0x40000, 2
_SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"kvfsm{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def enter(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at `path` (a child calls it first).

    As `ip netns exec` does, it also mounts a sysfs of that namespace on
    /sys, in a mount namespace of its own: engines (UCX) find their network
    devices there, and would otherwise see the host's.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    fd = os.open(path, os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    libc.umount2(b"/sys", _MNT_DETACH)
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


class Topology:
    """A prefill namespace with a bridge, and one namespace per decode on a link of its own."""

    def __init__(self, decodes: list[str]) -> None:
        tag = f"kv{os.getpid() % 100000}"
        self.prefix = tag
        self.prefill_ns = f"{tag}p"
        self.prefill_ip = f"{_SUBNET}.1"
        self.decode_ns = {name: f"{tag}{name}" for name in decodes}
        self.decode_ip = {name: f"{_SUBNET}.{10 + i}" for i, name in enumerate(decodes)}
        self._links = {name: f"{tag}{name}d" for name in decodes}  # the decode's end of its veth
        self._made: list[str] = []
        try:
            self._build(decodes)
        except BaseException:
            self.close()
            raise

    def _build(self, decodes: list[str]) -> None:
        p = self.prefill_ns
        _ip("netns", "add", p)
        self._made.append(p)
        _ip("-n", p, "link", "set", "lo", "up")
        _ip("-n", p, "link", "add", "br0", "type", "bridge")
        _ip("-n", p, "addr", "add", f"{self.prefill_ip}/24", "dev", "br0")
        _ip("-n", p, "link", "set", "br0", "up")
        for name in decodes:
            ns, link = self.decode_ns[name], self._links[name]
            port = f"{self.prefix}{name}p"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", link, "type", "veth", "peer", "name", port)
            _ip("link", "set", link, "netns", ns)
            _ip("link", "set", port, "netns", p)
            _ip("-n", p, "link", "set", port, "master", "br0")
            _ip("-n", p, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.decode_ip[name]}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")

    def path(self, namespace: str) -> str:
        return f"/var/run/netns/{namespace}"

    def down(self, name: str) -> None:
        _ip("-n", self.decode_ns[name], "link", "set", self._links[name], "down")

    def up(self, name: str) -> None:
        _ip("-n", self.decode_ns[name], "link", "set", self._links[name], "up")

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Topology:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
