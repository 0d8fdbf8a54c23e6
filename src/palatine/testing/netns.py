"""A multi-node test bed on one machine: network namespaces joined by a bridge.

`TestBed(nodes)` makes ``nodes`` network namespaces, each with one end of a veth pair
whose other end is on a bridge in the root namespace. Addresses come from 198.18.0.0/15,
the range set aside for network test beds, and from nowhere else: the bridge is
``198.18.K.1/24`` (K from this process's id, so two test beds do not collide) and node
``i`` is ``198.18.K.(10+i)``. A process started behind `prefix` runs inside node ``i``
and sees only its loopback and that address, as it would on a machine of its own; the
root namespace plays the machine the client and the system run on.

`cut` takes a node's link down (`heal` brings it back): a partition, with no process
told. `close` removes every namespace, veth and the bridge; the context manager does it
whatever happens. Needs root and the ``ip`` tool (iproute2); `unavailable` says why a
test bed cannot be made here, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from typing import Self

__all__ = ["TestBed", "unavailable"]

_IP_TIMEOUT_S = 10.0


def unavailable() -> str | None:
    """Why no test bed can be made on this machine (None: one can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the ip tool (iproute2) or nsenter (util-linux) is not installed"
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}")


class TestBed:
    """``nodes`` network namespaces on one bridge (see the module docstring)."""

    __test__ = False  # not a pytest test class

    def __init__(self, nodes: int) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"a test bed has 1 to 200 nodes, not {nodes}")
        self.nodes = nodes
        self.tag = f"pl{os.getpid() % 100000}"
        self.subnet = f"198.18.{os.getpid() % 250 + 1}"
        self.bridge = f"{self.tag}br"
        self.root_ip = f"{self.subnet}.1"
        self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
        self._made: list[str] = []  # namespaces made so far (for close)
        self._bridge_made = False

    def node_ip(self, i: int) -> str:
        """The address of node ``i``."""
        return f"{self.subnet}.{10 + i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node ``i``'s network namespace.

        Only the network namespace: ``ip netns exec`` would also mount a fresh ``/sys``,
        without the cgroup tree that daemons such as ``slurmd`` need.
        """
        return ["nsenter", f"--net=/run/netns/{self.namespaces[i]}", "--"]

    def start(self) -> Self:
        """Make the bridge and the nodes (undone by `close` if anything fails)."""
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                _ip("netns", "add", ns)
                self._made.append(ns)
                outside, inside = f"{self.tag}v{i}", f"{self.tag}p{i}"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("addr", "add", f"{self.node_ip(i)}/24", "dev", inside, netns=ns)
                _ip("link", "set", inside, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, i: int) -> None:
        """Take node ``i``'s link down: nothing reaches it, nothing leaves it."""
        _ip("link", "set", f"{self.tag}v{i}", "down")

    def heal(self, i: int) -> None:
        """Bring node ``i``'s link back up."""
        _ip("link", "set", f"{self.tag}v{i}", "up")

    def leftovers(self) -> list[str]:
        """The namespaces and links of this test bed that still exist."""
        names = subprocess.run(
            ["ip", "netns", "list"],
            capture_output=True,
            text=True,
            timeout=_IP_TIMEOUT_S,
            check=False,
        ).stdout
        links = subprocess.run(
            ["ip", "-o", "link"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        ).stdout
        found = [ns for ns in self.namespaces if ns in names.split()]
        found += [
            word.rstrip(":").split("@")[0] for word in links.split() if word.startswith(self.tag)
        ]
        return found

    def _kill_inside(self, ns: str) -> None:
        """SIGKILL what still runs in ``ns`` (a job step whose daemon was stopped, say):
        a namespace lives on, unnamed, as long as a process is in it."""
        try:
            done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                  timeout=_IP_TIMEOUT_S, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return
        for pid in done.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        """Kill what still runs in the namespaces, then remove the veth pairs, the
        namespaces and the bridge; idempotent."""
        problems = []
        for ns in reversed(self._made):
            self._kill_inside(ns)
            i = self.namespaces.index(ns)
            try:  # the pair goes at once, even while a process still lives in the namespace
                _ip("link", "del", f"{self.tag}v{i}")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # never made, or gone with its namespace
            try:
                _ip("netns", "del", ns)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                problems.append(str(e))
        self._made.clear()
        if self._bridge_made:
            try:
                _ip("link", "del", self.bridge)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                problems.append(str(e))
            self._bridge_made = False
        if problems:
            raise RuntimeError("test bed cleanup: " + "; ".join(problems))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
