"""Actors on a local mesh of 4 OS processes: call, slice, broadcast, stream.

Run: python examples/actors.py
"""

from palatine import Actor, endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    @endpoint
    async def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def where(self) -> str:
        import os

        return f"pid {os.getpid()}"


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 4})
    counters = procs.spawn("counter", Counter, 0)
    print("call:", counters.incr.call(1).get().values())
    print("call_one on procs=2:", counters.slice(procs=2).incr.call_one(10).get())
    counters.incr.broadcast(100)
    print("stream:", sorted(counters.incr.stream(0)))
    print("where:", counters.where.call().get().values())
    procs.stop().get()
    print("stopped")


if __name__ == "__main__":
    main()
