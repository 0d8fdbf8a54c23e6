"""Ping-pong between two actor meshes: each ping actor calls its partner in the pong
mesh, which calls back before it answers (a re-entrant call: the ping endpoint is
concurrent, so the ping actor serves the call-back while its ping waits).

Run: python examples/ping_pong.py
"""

from palatine import Actor, ActorMesh, concurrent_endpoint, current_rank, endpoint, this_host


class Ping(Actor):
    def __init__(self) -> None:
        self.volleys = 0

    @concurrent_endpoint
    def serve(self, pongs: ActorMesh, me: ActorMesh) -> str:
        rank = current_rank().rank  # type: ignore[attr-defined]
        partner = pongs.slice(procs=rank)
        return partner.hit.call_one(me.slice(procs=rank), rank).get()

    @endpoint
    def volley(self) -> int:
        self.volleys += 1
        return self.volleys


class Pong(Actor):
    @endpoint
    def hit(self, ping: ActorMesh, n: int) -> str:
        count = ping.volley.call_one().get()
        return f"pong {n} after {count} volley"


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 2})
    pings = procs.spawn("ping", Ping)
    pongs = procs.spawn("pong", Pong)
    for reply in pings.serve.call(pongs, pings).get().values():
        print(reply)
    procs.stop().get()


if __name__ == "__main__":
    main()
