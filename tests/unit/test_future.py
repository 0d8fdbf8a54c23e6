"""`palatine.Future`: one result, waited for from threads and event loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from palatine.core.future import Future


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_result_reaches_every_waiting_thread(loop) -> None:
    f: Future[int] = Future(loop)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(f.get(timeout=5))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # let them park (the result must still reach every one)
    f.set_result(7)
    for t in threads:
        t.join(5)
    assert got == [7, 7, 7, 7] and f.done()


def test_first_completion_wins_and_exceptions_raise(loop) -> None:
    f: Future[int] = Future(loop)
    f.set_exception(ValueError("boom"))
    f.set_result(1)
    with pytest.raises(ValueError, match="boom"):
        f.result()
    assert isinstance(f.exception(), ValueError)


def test_timeout_bounds_only_the_wait(loop) -> None:
    f: Future[int] = Future(loop)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        f.get(timeout=0.05)
    assert 0.04 <= time.monotonic() - t0 < 2
    f.set_result(3)
    assert f.get(timeout=0) == 3


def test_callbacks_run_once_before_or_after_completion(loop) -> None:
    f: Future[int] = Future(loop)
    seen: list[int] = []
    f.add_done_callback(lambda x: seen.append(x.result()))
    f.set_result(4)
    f.add_done_callback(lambda x: seen.append(x.result() + 1))
    assert seen == [4, 5]


def test_chain_from_asyncio_cancellation_and_transform(loop) -> None:
    a = loop.create_future()
    f = Future.from_asyncio(a, transform=lambda v: v * 2)
    a.set_result(21)
    loop.run_until_complete(asyncio.sleep(0))
    assert f.result() == 42
    c = loop.create_future()
    g = Future.from_asyncio(c)
    c.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    with pytest.raises(concurrent.futures.CancelledError):
        g.result()


def test_await_from_another_loop_completed_by_a_thread(loop) -> None:
    f: Future[str] = Future(loop)

    async def main() -> str:
        threading.Timer(0.05, lambda: f.set_result("done")).start()
        return await asyncio.wait_for(f, 5)

    assert asyncio.run(main()) == "done"
