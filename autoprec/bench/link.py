"""Two hosts on one machine: two Linux network namespaces joined by a veth pair, with a rate limit.

On one machine's loopback every gradient communication format costs the same; between hosts the
link's bandwidth decides. `Link` makes the link real: namespaces ``<prefix>a`` and ``<prefix>b``,
a veth pair between them (10.77.<n>.1 and .2), and, when ``rate_mbit`` is set, a token-bucket
filter (``tc qdisc ... tbf``) on each end, so every byte between the two ranks crosses a link of
that rate. A rank runs in its namespace through ``ip netns exec`` (`Link.popen`), and talks
``torch.distributed`` over TCP (gloo) to the other's address; the bytes each end sent are read
from the kernel's interface counters (`Link.tx_bytes`).

Needs root and ``ip`` / ``tc`` (iproute2). Everything is torn down on exit, also on an exception,
Ctrl-C or SIGTERM (`Link.__exit__`; deleting a namespace deletes its veth end), and links a killed
run left behind (their owner process gone) are removed when the next one starts. Costs: a few
``ip`` calls to build and tear down; nothing per byte but the kernel's own forwarding.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Any, Optional, Sequence

__all__ = ["Link", "LinkError", "links_available"]

PREFIX = "aplink"


class LinkError(RuntimeError):
    """A link could not be built (not root, no iproute2, a kernel without namespaces)."""


def links_available() -> Optional[str]:
    """None when `Link` can run here, else why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LinkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _remove_stale() -> None:
    """Delete namespaces of this module whose owner process is gone (a killed run's)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        try:
            owner = int(name[len(PREFIX):-1])
        except ValueError:
            continue
        if owner != os.getpid() and not os.path.exists(f"/proc/{owner}"):
            _ip("netns", "del", name, check=False)


class Link:
    """``with Link(rate_mbit=100) as link: link.popen("a", [...]); link.popen("b", [...])``.

    ``rate_mbit``: the link's rate in Mbit/s both ways (None: unlimited, the veth's own speed).
    ``addresses``: side -> its IPv4 address."""

    def __init__(self, rate_mbit: Optional[float] = None, subnet: int = 77):
        why = links_available()
        if why is not None:
            raise LinkError(why)
        if rate_mbit is not None and rate_mbit <= 0:
            raise LinkError(f"Link(rate_mbit={rate_mbit}): expected a positive rate in Mbit/s, or None for no limit")
        self.rate_mbit = rate_mbit
        tag = f"{PREFIX}{os.getpid()}"
        self.namespaces = {"a": f"{tag}a", "b": f"{tag}b"}
        self.devices = {"a": f"ap{os.getpid() % 100000}a", "b": f"ap{os.getpid() % 100000}b"}
        self.addresses = {"a": f"10.{subnet}.{os.getpid() % 250}.1", "b": f"10.{subnet}.{os.getpid() % 250}.2"}
        self._built = False
        self._old_term: Any = None  # the SIGTERM handler to restore

    def __enter__(self) -> "Link":
        _remove_stale()
        # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so __exit__ tears the link down.
        try:
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:  # not the main thread: only the main thread may set handlers
            self._old_term = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        a, b = self.namespaces["a"], self.namespaces["b"]
        self._built = True
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", self.devices["a"], "netns", a, "type", "veth", "peer", "name", self.devices["b"], "netns", b)
        for side in ("a", "b"):
            ns, dev = self.namespaces[side], self.devices[side]
            _ip("-n", ns, "addr", "add", f"{self.addresses[side]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is None:
            return
        # A token bucket at the link rate; its bucket holds 10 ms of the rate (at least 64 KB, so
        # a fast link is not held to one packet per timer tick) and its queue 200 ms: gloo's
        # bursts are delayed to the rate, not dropped.
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                               "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "200ms"], capture_output=True, text=True)
        if done.returncode != 0:
            raise LinkError(f"tc qdisc tbf on {dev}: {done.stderr.strip()} (the kernel needs sch_tbf)")

    def close(self) -> None:
        if self._built:
            for ns in self.namespaces.values():
                _ip("netns", "del", ns, check=False)
            self._built = False
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def popen(self, side: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside side ``"a"`` or ``"b"``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[side], *argv], **kwargs)

    def tx_bytes(self, side: str) -> int:
        """Bytes side ``"a"`` or ``"b"`` has sent over the link since it was built (the kernel's
        interface counter, headers included)."""
        done = subprocess.run(["ip", "netns", "exec", self.namespaces[side], "cat", f"/sys/class/net/{self.devices[side]}/statistics/tx_bytes"],
                              capture_output=True, text=True, check=True)
        return int(done.stdout)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
