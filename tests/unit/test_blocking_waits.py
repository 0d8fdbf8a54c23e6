"""Bounded waits of the blocking channel side (`palatine.fastpath.blocking.Waiter`), as the
heartbeat thread uses them: any deadline, however far, is waited out in pieces the OS
takes, and a stop interrupts the wait at once."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from palatine.fastpath.blocking import Stopped, Waiter

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("far", [1e7, 1e308, float("inf")])
def test_a_wait_with_a_far_deadline_sleeps_until_stopped(far: float) -> None:
    stop = threading.Event()
    wake_r, wake_w = socket.socketpair()
    waiter = Waiter(stop, wake_r)
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(waiter.wait(None, 0, time.monotonic() + far))
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not outcome  # still sleeping: no OverflowError
    t0 = time.monotonic()
    stop.set()
    wake_w.send(b"x")
    t.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], Stopped)
    assert time.monotonic() - t0 < 1
    waiter.close()
    wake_r.close()
    wake_w.close()
