"""The idle spin: poll a little longer before sleeping, so the next message finds us awake.

A process that sleeps (``epoll_wait``, a blocking ``recv``) and is woken by a message
pays for the wake-up. On a virtual machine whose idle vCPUs halt at once (guest
halt-polling off, as on many cloud VMs) that costs 20-40 µs per wake-up, on each side
of a round trip: more than the rest of a small call. So:

* a loop that has just received a request on a lane (a thread's blocking call,
  `palatine.fastpath.lane`) keeps polling for ``idle_spin_us`` (config,
  ``PALATINE_IDLE_SPIN_US``) before it may sleep again, since that thread's next
  request usually follows its reply at once (`LoopSpin`, poked by the channel's read
  path), and
* a thread waiting for a reply on a lane polls its socket for as long before it
  blocks (`recv_spinning`, `poll_spinning`).

Other traffic does not spin: where more processes than cores take turns (a controller,
its client and four workers on two cores), spinning loops slowed the others more than
they gained.

Every round of polling yields the CPU (``sched_yield``), so any runnable process or
thread goes first: the spin uses only time the CPU would otherwise spend idle. It is
bounded: after ``idle_spin_us`` with nothing new the process sleeps as before. ``0``
turns it off.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
import weakref

from palatine import config

__all__ = [
    "LoopSpin",
    "loop_spin",
    "recv_spinning",
    "poll_spinning",
    "poll_ms",
    "spin_seconds",
    "MAX_WAIT_S",
]

_yield = getattr(os, "sched_yield", lambda: None)  # every Unix we know has it
_now = time.perf_counter


def spin_seconds() -> float:
    """The configured spin, in seconds (0.0: off)."""
    return config.get().idle_spin_us * 1e-6


class LoopSpin:
    """Keeps one event loop polling for ``spin_s`` after the last `poke`.

    While it spins, a callback of ours is always ready, so the loop polls its file
    descriptors without blocking on every turn and runs whatever becomes ready at once.
    """

    __slots__ = ("_loop", "_spin_s", "_until", "_armed", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float) -> None:
        self._loop = weakref.ref(loop)  # (the loop keys `_spins`: do not keep it alive)
        self._spin_s = spin_s
        self._until = 0.0
        self._armed = False

    @property
    def spinning(self) -> bool:
        return self._armed

    def poke(self) -> None:
        """Something arrived: stay awake for another ``spin_s``."""
        if not self._spin_s:
            return
        self._until = _now() + self._spin_s
        if not self._armed:
            loop = self._loop()
            if loop is not None:
                self._armed = True
                loop.call_soon(self._turn)

    def _turn(self) -> None:
        loop = self._loop()
        if loop is None or _now() >= self._until or loop.is_closed():
            self._armed = False
            return
        _yield()
        loop.call_soon(self._turn)


_spins: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSpin] = weakref.WeakKeyDictionary()


def loop_spin(loop: asyncio.AbstractEventLoop) -> LoopSpin:
    """The `LoopSpin` of ``loop`` (one per loop, made with the configured spin)."""
    spin = _spins.get(loop)
    if spin is None:
        spin = _spins[loop] = LoopSpin(loop, spin_seconds())
    return spin


def recv_spinning(sock: socket.socket, nbytes: int, spin_s: float) -> bytes | None:
    """``sock.recv(nbytes)`` if data (or the end) arrives within ``spin_s``; else None.

    Errors are raised as ``recv`` raises them.
    """
    until = _now() + spin_s
    recv = sock.recv
    flags = socket.MSG_DONTWAIT
    while True:
        try:
            return recv(nbytes, flags)
        except BlockingIOError:
            if _now() >= until:
                return None
            _yield()


MAX_WAIT_S = 86400.0  # one blocking wait at most (callers loop until their deadline)


def poll_ms(seconds: float) -> int:
    """A ``poll`` timeout for ``seconds`` left: at least 1 ms, at most `MAX_WAIT_S` (an
    infinite or huge timeout is not an int ``poll`` takes)."""
    return max(1, int(min(seconds, MAX_WAIT_S) * 1000))


def poll_spinning(poller: select.poll, timeout_ms: int, spin_s: float) -> list[tuple[int, int]]:
    """``poller.poll(timeout_ms)``, polling without blocking for the first ``spin_s``."""
    if spin_s:
        until = _now() + spin_s
        while True:
            events = poller.poll(0)
            if events:
                return events
            if _now() >= until:
                break
            _yield()
    return poller.poll(timeout_ms)
