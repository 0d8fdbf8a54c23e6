"""The idle spin (`palatine.channel.spin`): a poked loop keeps polling for a bounded
time and runs what arrives meanwhile at once; a waiting reader polls, then blocks."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import pytest

from palatine import config
from palatine.channel.spin import (
    MAX_WAIT_S,
    LoopSpin,
    loop_spin,
    poll_ms,
    poll_spinning,
    recv_spinning,
)

pytestmark = pytest.mark.timeout(30)


class _Counting(LoopSpin):
    turns = 0

    def _turn(self) -> None:
        self.turns += 1
        super()._turn()


def _cpu_while_idle(spin_s: float, idle_s: float) -> tuple[float, int]:
    """CPU seconds a loop uses while idle for ``idle_s`` after one poke, and its turns."""

    async def main() -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        spin = _Counting(loop, spin_s)
        c0 = time.thread_time()
        spin.poke()
        await asyncio.sleep(idle_s)
        assert not spin.spinning
        return time.thread_time() - c0, spin.turns

    return asyncio.run(main())


def test_a_poked_loop_spins_for_a_bounded_time_then_sleeps() -> None:
    cpu, turns = _cpu_while_idle(0.05, 0.4)
    assert turns > 1  # it did poll on its own for a while
    assert cpu < 0.25  # ... and then slept: 50 ms of spinning, not 400 ms


def test_zero_spin_never_polls() -> None:
    _cpu, turns = _cpu_while_idle(0.0, 0.05)
    assert turns == 0


def test_a_spinning_loop_serves_a_socket_at_once() -> None:
    """While it spins, the loop keeps polling its descriptors and runs their callbacks."""

    async def main() -> float:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        got: asyncio.Future[float] = loop.create_future()
        loop.add_reader(a.fileno(), lambda: got.done() or got.set_result(time.perf_counter()))
        spin = LoopSpin(loop, 2.0)
        spin.poke()
        await asyncio.sleep(0.01)
        assert spin.spinning
        sent = time.perf_counter()
        threading.Thread(target=b.send, args=(b"x",)).start()
        arrived = await asyncio.wait_for(got, 5)
        loop.remove_reader(a.fileno())
        a.close()
        b.close()
        return arrived - sent

    assert asyncio.run(main()) < 1.0  # not held back until the 2 s spin ends


def test_loop_spin_is_one_per_loop_and_follows_the_config() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert loop_spin(loop) is loop_spin(loop)
        with config.override(idle_spin_us=0):
            other = asyncio.new_event_loop()
            try:
                spin = loop_spin(other)
                spin.poke()
                assert not spin.spinning
            finally:
                other.close()

    asyncio.run(main())


def test_recv_spinning_takes_data_that_arrives_during_the_spin() -> None:
    a, b = socket.socketpair()
    with a, b:
        timer = threading.Timer(0.01, b.send, args=(b"reply",))
        timer.start()
        assert recv_spinning(a, 100, 5.0) == b"reply"
        timer.join()
        b.close()
        assert recv_spinning(a, 100, 1.0) == b""  # the end, as recv reports it


def test_recv_spinning_gives_up_after_the_spin() -> None:
    a, b = socket.socketpair()
    with a, b:
        t0 = time.perf_counter()
        assert recv_spinning(a, 100, 0.01) is None
        assert 0.01 <= time.perf_counter() - t0 < 1.0
        assert a.getblocking()  # the socket is left as it was


def test_poll_spinning_spins_then_blocks_for_the_rest() -> None:
    a, b = socket.socketpair()
    with a, b:
        poller = select.poll()
        poller.register(a.fileno(), select.POLLIN)
        t0 = time.perf_counter()
        assert poll_spinning(poller, 50, 0.01) == []
        assert time.perf_counter() - t0 >= 0.05
        b.send(b"x")
        assert poll_spinning(poller, 1000, 0.01) == [(a.fileno(), select.POLLIN)]
        assert poll_spinning(poller, 1000, 0.0) == [(a.fileno(), select.POLLIN)]


def test_poll_timeouts_are_whole_milliseconds_within_a_day() -> None:
    assert poll_ms(0.0) == 1 and poll_ms(0.0004) == 1 and poll_ms(0.25) == 250
    assert poll_ms(float("inf")) == poll_ms(1e300) == int(MAX_WAIT_S * 1000) < 2**31
