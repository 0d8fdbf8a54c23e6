"""Folding a mesh's replies, and answering through ports: an `Accumulator` sums a
counter over every actor; an explicit response port lets a queue answer a ``get`` later,
from the ``put`` that brings the item; a `Channel` gathers what actors report.

Run: python examples/accumulator.py
"""

import operator

from palatine import (
    Accumulator,
    Actor,
    Channel,
    Port,
    current_rank,
    endpoint,
    this_host,
)


class Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def incr(self, by: int) -> int:
        self.n += by * (1 + current_rank().rank)  # type: ignore[attr-defined]
        return self.n

    @endpoint
    def report(self, port: Port[tuple[int, int]]) -> None:
        port.send((current_rank().rank, self.n))  # type: ignore[attr-defined]


class Queue(Actor):
    def __init__(self) -> None:
        self.items: list[str] = []
        self.waiting: list[Port[str]] = []

    @endpoint(explicit_response_port=True)
    def get(self, port: Port[str]) -> None:
        if self.items:
            port.send(self.items.pop(0))
        else:
            self.waiting.append(port)  # answered by a later put

    @endpoint
    def put(self, item: str) -> None:
        if self.waiting:
            self.waiting.pop(0).send(item)
        else:
            self.items.append(item)


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 4})
    counters = procs.spawn("counter", Counter)
    total = Accumulator(counters.incr, 0, operator.add)
    print("sum after incr(1):", total.accumulate(1).get())  # 1 + 2 + 3 + 4
    print("sum after incr(1):", total.accumulate(1).get())  # twice that

    port, receiver = Channel.open()
    counters.report.broadcast(port)
    print("reports:", sorted(receiver.recv(timeout=30).get() for _ in range(4)))

    queue = procs.spawn("queue", Queue).slice(procs=0)
    pending = queue.get.call_one()  # nothing queued yet: the reply waits
    queue.put.broadcast("first item")
    print("got:", pending.get(timeout=30))
    procs.stop().get()


if __name__ == "__main__":
    main()
