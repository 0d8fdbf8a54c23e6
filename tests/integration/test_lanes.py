"""Lanes (`palatine.fastpath.lane`): a plain thread's blocking calls over its own connection.

Each test runs a script in a fresh interpreter (one default client per process) against
real worker procs started by ``this_host().spawn_procs``. The scripts check that calls
really take a lane (the thread's lane table), and that results, errors, timeouts,
per-sender order and peer death read exactly as on the ordinary path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

PRELUDE = textwrap.dedent(
    """
    import asyncio, os, signal, sys, threading, time
    from palatine import Actor, endpoint, this_host, RemoteException, config
    from palatine.fastpath import lane
    from palatine.errors import CallTimeout, DeliveryError, PeerGoneError

    class Acc(Actor):
        def __init__(self):
            self.total = 0
            self.marks = 0

        @endpoint
        def add(self, x):
            self.total += x
            return self.total

        @endpoint
        def get_total(self):
            return self.total

        @endpoint
        def mark(self):
            self.marks += 1
            return self.marks

        @endpoint
        def marks_seen(self):
            return self.marks

        @endpoint
        def boom(self):
            raise ValueError("boom on purpose")

        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def nap(self, s):
            time.sleep(s)
            return s

        @endpoint
        def blob(self, n):
            return b"x" * n

        @endpoint
        def pattern(self, n):
            return (bytes(range(251)) * (n // 251 + 1))[:n]

        @endpoint
        def open_lanes(self):
            return len(self.cx.proc._lanes)

        @endpoint(timeout=0.3)
        def slow(self, s):
            time.sleep(s)
            return s

    def lanes_of_this_thread():
        st = getattr(lane._tls, "state", None)
        return 0 if st is None else len([l for l in st.lanes.values() if not l.broken])

    def lane_frames():  # requests this thread has written on its lanes
        st = getattr(lane._tls, "state", None)
        return 0 if st is None else sum(l.seq for l in st.lanes.values())

    def marks_once_still(acc):  # its marks once they stop moving (> 0), read by another thread
        seen = [-1]
        def watch():
            for _ in range(100):  # at most 10 s
                time.sleep(0.1)
                n = acc.marks_seen.call_one().get()
                if n == seen[-1] and n > 0:
                    return
                seen.append(n)
        t = threading.Thread(target=watch); t.start(); t.join()
        return seen[-1]

    procs = this_host().spawn_procs(per_host={"procs": 2})
    mesh = procs.spawn("acc", Acc)
    one = mesh.slice(procs=0)
    """
)


def run(body: str, env: dict[str, str] | None = None) -> dict[str, str]:
    script = PRELUDE + textwrap.dedent(body) + "\nprocs.stop().get(timeout=20)\nprint('DONE')\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, **(env or {})},
    )
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    assert "DONE" in out, proc.stdout + proc.stderr
    return out


def test_blocking_calls_take_a_lane_with_the_same_results_and_errors() -> None:
    out = run(
        """
        print("FIRST", one.add.call_one(1).get(), lanes_of_this_thread())
        vals = [one.add.call_one(1).get() for _ in range(200)]
        print("LANE", lanes_of_this_thread(), vals[-1], vals == list(range(2, 202)))
        try:
            one.boom.call_one().get()
        except RemoteException as e:
            print("REMOTE", e.type_name, e.message)
        print("AFTER_ERROR", one.add.call_one(0).get())
        print("BIG", len(one.blob.call_one(3_000_000).get()))
        want = lambda n: (bytes(range(251)) * (n // 251 + 1))[:n]
        fs = [one.pattern.call_one(3_000_000), one.add.call_one(0), one.pattern.call_one(700_001)]
        got = [f.get() for f in fs]  # big replies read straight into their frame's buffer
        print("BIG_EXACT", got[0] == want(3_000_000), got[1], got[2] == want(700_001))
        from palatine.mesh.actor_mesh import ActorRef
        ref = ActorRef(mesh.gang.actor(1), Acc)  # a direct reference, not a mesh slice
        print("REF", ref.add.call_one(5).get(), ref.add.call_one(5).get(), lanes_of_this_thread())
        """
    )
    assert out["FIRST"] == "1 0"  # the first call to a proc goes through the loop
    assert out["LANE"] == "1 201 True"
    assert out["REMOTE"] == "ValueError boom on purpose"
    assert out["AFTER_ERROR"] == "201"
    assert out["BIG"] == "3000000"
    assert out["BIG_EXACT"] == "True 201 True"
    assert out["REF"] == "5 10 2"  # its second call took a lane to the other proc


def test_lane_keeps_per_sender_order_with_one_way_sends() -> None:
    out = run(
        """
        one.add.call_one(0).get()
        one.add.call_one(0).get()  # now on the lane
        for i in range(300):
            one.add.broadcast(1)       # through the loop ...
        print("SEEN", one.get_total.call_one().get())  # ... all delivered before this call
        for i in range(50):
            one.add.broadcast(1)
            one.get_total.call_one().get()
        print("FINAL", one.get_total.call_one().get(), lanes_of_this_thread())
        """
    )
    assert out["SEEN"] == "300"
    assert out["FINAL"] == "350 1"


def test_untouched_and_otherwise_used_futures_are_still_sent() -> None:
    out = run(
        """
        one.mark.call_one().get()
        one.mark.call_one().get()
        f = one.mark.call_one()  # never waited on by this thread for a while
        time.sleep(0.3)
        seen = []
        t = threading.Thread(target=lambda: seen.append(one.marks_seen.call_one().get()))
        t.start(); t.join()
        print("SWEPT", seen[0], f.get())
        g = one.mark.call_one()
        got = []
        g.add_done_callback(lambda fut: got.append(fut.result()))
        print("CALLBACK", g.get(), got)
        h = one.mark.call_one()
        while not h.done():
            time.sleep(0.001)
        print("POLLED", h.get())
        async def main():
            return await one.mark.call_one()
        print("AWAITED", asyncio.run(main()))
        k = one.mark.call_one()
        th = threading.Thread(target=lambda: got.append(k.get()))
        th.start(); th.join()
        print("OTHER_GOT", got[-1])
        print("SHORT_WAIT", one.mark.call_one().get(timeout=30))
        """
    )
    assert out["SWEPT"] == "3 3"
    assert out["CALLBACK"] == "4 [4]"
    assert out["POLLED"] == "5"
    assert out["AWAITED"] == "6"
    assert out["OTHER_GOT"] == "7"
    assert out["SHORT_WAIT"] == "8"


def test_timeout_on_a_lane_then_the_lane_still_serves() -> None:
    # Calls that must succeed use `nap` (the default timeout): `slow`'s 0.3 s deadline is
    # for the one call whose timeout is under test.
    out = run(
        """
        one.nap.call_one(0).get()
        one.nap.call_one(0).get()  # now on the lane
        t = time.monotonic()
        try:
            one.slow.call_one(5.0).get()
        except CallTimeout as e:
            print("TIMEOUT", round(time.monotonic() - t, 3), "timed out: no reply within 0.3 s" in str(e))
        # The late reply arrives on the lane (after the 5 s the call takes) and is skipped.
        time.sleep(max(0.0, t + 6.0 - time.monotonic()))
        print("NEXT", one.nap.call_one(0.01).get(), lanes_of_this_thread())
        """
    )
    took, named = out["TIMEOUT"].split()
    assert 0.3 <= float(took) < 3.0 and named == "True"  # the timeout, not the 5 s the call takes
    assert out["NEXT"] == "0.01 1"


def test_peer_death_during_a_lane_call_is_reported_with_the_proc() -> None:
    out = run(
        """
        pid = one.pid.call_one().get()
        one.pid.call_one().get()
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        t = time.monotonic()
        try:
            one.nap.call_one(30).get()
        except PeerGoneError as e:
            print("GONE", time.monotonic() - t < 5, e.details["pid"] == pid, e.details["exit_signal"], str(e).startswith("peer gone: mesh0[0]"))
        """
    )
    assert out["GONE"] == "True True 9 True"


def test_a_lane_ends_with_its_thread_and_the_server_forgets_it() -> None:
    out = run(
        """
        def worker():
            for i in range(5):
                one.add.call_one(1).get()
            print("THREAD_LANES", lanes_of_this_thread())
        t = threading.Thread(target=worker)
        t.start(); t.join()
        import gc; gc.collect()
        deadline = time.monotonic() + 5
        # A wait shorter than the call's timeout never takes a lane (main has none).
        while one.open_lanes.call_one().get(timeout=60) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("SERVER_LANES", one.open_lanes.call_one().get(timeout=60), lanes_of_this_thread())
        print("STILL_SERVES", one.add.call_one(1).get())
        """
    )
    assert out["THREAD_LANES"] == "1"
    assert out["SERVER_LANES"] == "0 0"
    assert out["STILL_SERVES"] == "6"


def test_mesh_calls_gather_over_lanes_in_rank_order_with_the_same_errors() -> None:
    out = run(
        """
        class Ranked(Acc):  # pid and nap come from Acc
            def __init__(self):
                super().__init__()
                self.n = 0

            @endpoint
            def bump(self, by):
                self.n += by
                return (self.rank, self.n)

            @endpoint
            def fail_odd(self):
                if self.rank % 2:
                    raise KeyError(f"rank {self.rank}")
                return self.rank

            @property
            def rank(self):
                return self.cx.rank["procs"]

        more = this_host().spawn_procs(per_host={"procs": 4})
        ranked = more.spawn("ranked", Ranked)
        ranked.bump.call(0).get()
        vm = ranked.bump.call(1).get()
        print("LANES", lanes_of_this_thread(), vm.values())
        ranked.bump.broadcast(10)
        print("ORDERED", ranked.bump.call(0).get().values())
        try:
            ranked.fail_odd.call().get()
        except RemoteException as e:
            print("ERR", e.type_name, e.message, e.__notes__)
        print("HALF", ranked.slice(procs=slice(0, 2)).bump.call(0).get().values())
        pids = ranked.pid.call().get().values()
        ranked.pid.call().get()
        threading.Timer(0.3, os.kill, (pids[2], signal.SIGKILL)).start()
        try:
            ranked.nap.call(1.0).get()  # the others answer; rank 2 is reported
        except PeerGoneError as e:
            print("GONE", e.details["pid"] == pids[2], e.details["rank"])
        more.stop().get(timeout=20)
        """
    )
    assert out["LANES"] == "4 [(0, 1), (1, 1), (2, 1), (3, 1)]"
    assert out["ORDERED"] == "[(0, 11), (1, 11), (2, 11), (3, 11)]"
    assert out["ERR"] == "KeyError 'rank 1' ['call fail_odd failed on ranks 1, 3']"
    assert out["HALF"] == "[(0, 11), (1, 11)]"
    assert out["GONE"] == "True 2"


def test_a_lane_that_cannot_connect_falls_back_to_the_loop() -> None:
    out = run(
        """
        def refuse(*a, **k):
            raise ConnectionRefusedError(111, "refused on purpose")
        lane.LaneConn.open = refuse
        vals = [one.add.call_one(1).get() for _ in range(5)]
        print("FALLBACK", vals, lanes_of_this_thread())
        """
    )
    assert out["FALLBACK"] == "[1, 2, 3, 4, 5] 0"


def test_lanes_off_by_environment() -> None:
    out = run(
        """
        vals = [one.add.call_one(1).get() for _ in range(20)]
        print("NOLANE", lanes_of_this_thread(), vals[-1])
        """,
        env={"PALATINE_LANES": "0"},
    )
    assert out["NOLANE"] == "0 20"


def test_an_endless_call_timeout_works_on_lanes() -> None:
    # PALATINE_CALL_TIMEOUT=inf: every wait on a lane (a read's SO_RCVTIMEO, a poll) is
    # taken a day at a time instead of failing to convert infinity.
    out = run(
        """
        one.add.call_one(0).get()
        got = [one.add.call_one(1).get()]
        fs = [one.add.call_one(1) for _ in range(5)]
        got += [f.get() for f in fs]
        got.append(len(one.blob.call_one(8 << 20).get()))
        print("ENDLESS", got, lanes_of_this_thread(), one.add._timeout())
        """,
        env={"PALATINE_CALL_TIMEOUT": "inf"},
    )
    assert out["ENDLESS"] == f"[1, 2, 3, 4, 5, 6, {8 << 20}] 1 inf"


def test_calls_made_before_waiting_go_out_as_one_batch_in_order() -> None:
    out = run(
        """
        one.add.call_one(0).get()
        one.add.call_one(0).get()  # the lane is open
        futs = [one.add.call_one(1) for _ in range(1000)]
        print("BATCH", [f.get() for f in futs] == list(range(1, 1001)), lanes_of_this_thread())
        fs = [one.add.call_one(1) for _ in range(10)]
        one.add.broadcast(100)  # through the loop: the unsent batch goes first, in order
        print("ORDER", [f.get() for f in fs], one.get_total.call_one().get())
        fs = [one.add.call_one(1) for _ in range(5)]
        print("DONE_FIRST", fs[2].done() or fs[2].get(), [f.get() for f in fs])
        fs = [one.add.call_one(1) for _ in range(5)]
        got = []
        th = threading.Thread(target=lambda: got.append(fs[3].get()))
        th.start(); th.join()
        print("OTHER_THREAD", got, [f.get() for f in fs])
        fs = [one.add.call_one(1) for _ in range(3)]
        other = mesh.slice(procs=1).add.call_one(7)  # another proc: not this batch
        print("TWO_PROCS", [f.get() for f in fs], other.get())
        fs = [one.add.call_one(1) for _ in range(3)]
        time.sleep(0.3)  # never waited on for a while: the batch is swept through the loop
        seen = []
        t = threading.Thread(target=lambda: seen.append(one.get_total.call_one().get()))
        t.start(); t.join()
        print("SWEPT", seen, [f.get() for f in fs])
        """
    )
    assert out["BATCH"] == "True 1"
    assert out["ORDER"] == "[1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010] 1110"
    assert out["DONE_FIRST"] in (
        "1113 [1111, 1112, 1113, 1114, 1115]",
        "False [1111, 1112, 1113, 1114, 1115]",
    )
    assert out["OTHER_THREAD"] == "[1119] [1116, 1117, 1118, 1119, 1120]"
    assert out["TWO_PROCS"] == "[1121, 1122, 1123] 7"
    assert out["SWEPT"] == "[1126] [1124, 1125, 1126]"


def test_a_batch_reports_each_members_own_outcome() -> None:
    out = run(
        """
        one.add.call_one(0).get()
        one.add.call_one(0).get()  # now on the lane
        t = time.monotonic()
        fs = [one.add.call_one(1), one.slow.call_one(2.0), one.boom.call_one(), one.add.call_one(1)]
        print("LAST", fs[3].get(), round(time.monotonic() - t, 3))
        for name, f in zip(["first", "slow", "boom"], fs[:3]):
            try:
                print("MEMBER_" + name, f.get())
            except CallTimeout as e:
                print("MEMBER_" + name, "timeout", "no reply within 0.3 s" in str(e))
            except RemoteException as e:
                print("MEMBER_" + name, e.type_name, e.message)
        print("NEXT", one.add.call_one(1).get(), lanes_of_this_thread())
        pid = one.pid.call_one().get()
        fs = [one.nap.call_one(30), one.add.call_one(1)]
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        for f in fs:
            try:
                f.get()
            except PeerGoneError as e:
                print("GONE", e.details["pid"] == pid, e.details["exit_signal"])
        """
    )
    last, took = out["LAST"].split()
    assert (
        last == "2" and 2.0 <= float(took) < 4.0
    )  # the actor answers in order: after the slow call ran
    assert out["MEMBER_first"] == "1"
    assert out["MEMBER_slow"] == "timeout True"
    assert out["MEMBER_boom"] == "ValueError boom on purpose"
    assert out["NEXT"] == "3 1"
    assert out["GONE"] == "True 9"


def test_a_batch_larger_than_the_socket_buffer_waits_for_the_peer_to_read() -> None:
    out = run(
        """
        class Sizer(Acc):
            @endpoint
            def size(self, b):
                return len(b)

        sizer = procs.spawn("sizer", Sizer).slice(procs=0)
        sizer.size.call_one(b"").get()
        sizer.size.call_one(b"").get()
        # The first call blocks the proc's loop for 0.5 s: 32 MB of requests cannot all
        # be written meanwhile (more than a unix send buffer holds), so the caller
        # waits to write (and to read) in turn.
        fs = [sizer.nap.call_one(0.5)] + [sizer.size.call_one(b"x" * 65536) for _ in range(500)]
        print("BIG_BATCH", fs[-1].get(), all(f.get() == 65536 for f in fs[1:]), fs[0].get())
        print("AFTER", sizer.size.call_one(b"abc").get(), lanes_of_this_thread())
        """
    )
    assert out["BIG_BATCH"] == "65536 True 0.5"
    assert out["AFTER"] == "3 1"  # one lane: the sizer shares the proc with the accumulator


def test_a_batch_member_over_the_frame_limit_fails_alone_and_the_rest_keep_their_order() -> None:
    # A batch goes out in chunks (`palatine.fastpath.lane`): the first chunk has left when
    # member 20 (in the second) turns out to be over the frame limit. That member gets
    # the ordinary path's size error; every other member its own reply, in call order.
    out = run(
        """
        one.add.call_one(0).get()
        one.add.call_one(0).get()  # now on the lane
        fs = [one.add.call_one(1) for _ in range(20)] + [one.add.call_one(b"x" * 300_000)]
        fs += [one.add.call_one(1) for _ in range(20)]
        outs = []
        for f in fs:
            try:
                outs.append(f.get())
            except Exception as e:
                outs.append(type(e).__name__ + ": " + str(e))
        print("VALUES", outs[:20] + outs[21:] == list(range(1, 41)))
        print("OVER", outs[20])
        print("NEXT", one.add.call_one(1).get(), lanes_of_this_thread())
        """,
        env={"PALATINE_MAX_FRAME_BYTES": "200000"},
    )
    assert out["VALUES"] == "True"
    assert (
        out["OVER"].startswith("DeliveryError: ") and "exceeds max frame size 200000" in out["OVER"]
    )
    assert out["NEXT"] == "41 1"


def test_a_request_that_bounces_fails_at_once_on_its_lane() -> None:
    out = run(
        """
        from palatine.ids import ActorId
        from palatine.mesh.actor_mesh import ActorRef
        from palatine.errors import DeliveryError
        one.add.call_one(0).get()
        ghost = ActorRef(ActorId(mesh.gang.actor(0).proc, "nosuch", 0), Acc)
        t = time.monotonic()
        try:
            ghost.add.call_one(1).get()
        except DeliveryError as e:
            print("BOUNCED", round(time.monotonic() - t, 3), "no actor mesh0[0].nosuch[0]" in str(e), lanes_of_this_thread())
        print("STILL", one.add.call_one(1).get())
        """
    )
    took, named, lanes = out["BOUNCED"].split()
    # Bounced at once, not timed out (the default call timeout is 30 s).
    assert float(took) < 2.0 and (named, lanes) == ("True", "1")
    assert out["STILL"] == "1"


def test_a_batch_sent_by_another_thread_stays_ahead_of_the_owners_next_call() -> None:
    out = run(
        """
        one.mark.call_one().get()
        one.mark.call_one().get()
        fs = [one.mark.call_one() for _ in range(3000)]
        batch = fs[0]._batch
        t2 = threading.Thread(target=fs[0].done)  # another thread: the batch goes through the loop
        t2.start()
        while batch.claim == 0:
            pass
        g = one.mark.call_one()  # made while the other thread may still be posting the batch
        t2.join()
        vals = [f.get(timeout=60) for f in fs]
        print("AHEAD", vals == list(range(3, 3003)), g.get(timeout=60))
        """
    )
    assert out["AHEAD"] == "True 3003"


def test_an_interrupt_while_a_lane_opens_leaves_no_call_waiting() -> None:
    out = run(
        """
        one.mark.call_one().get()
        real_open = lane.LaneConn.open
        def interrupted(*a, **k):
            raise KeyboardInterrupt
        lane.LaneConn.open = interrupted
        fs = [one.mark.call_one() for _ in range(3)]
        try:
            fs[0].get()
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        lane.LaneConn.open = real_open
        print("ALL", [f.get(timeout=10) for f in fs])
        """
    )
    assert "INTERRUPTED" in out
    assert out["ALL"] == "[2, 3, 4]"


def test_a_lane_call_to_a_proc_that_stopped_reading_times_out() -> None:
    out = run(
        """
        class Sizer(Acc):
            @endpoint(timeout=0.5)
            def size(self, b):
                return len(b)

            @endpoint
            def length(self, b):  # the default timeout: for the calls that must succeed
                return len(b)

        sizer = procs.spawn("sizer", Sizer).slice(procs=0)
        pid = sizer.pid.call_one().get()
        sizer.length.call_one(b"").get()  # now on the lane
        os.kill(pid, signal.SIGSTOP)  # reads nothing: 32 MB cannot all be written
        t = time.monotonic()
        try:
            sizer.size.call_one(b"x" * 32_000_000).get()
        except CallTimeout as e:
            print("TIMED_OUT", round(time.monotonic() - t, 3), "no reply within 0.5 s" in str(e))
        os.kill(pid, signal.SIGCONT)
        print("AFTER", sizer.length.call_one(b"abc").get(timeout=3600))
        """
    )
    took, named = out["TIMED_OUT"].split()
    assert (
        0.5 <= float(took) < 3.0 and named == "True"
    )  # the timeout, though the write never finished
    assert out["AFTER"] == "3"


def test_an_error_caught_from_get_is_not_also_logged_as_never_retrieved() -> None:
    script = PRELUDE + textwrap.dedent(
        """
        import gc
        for f in (lambda: mesh.boom.call().get(timeout=10), lambda: one.boom.call_one().get(timeout=10),
                  lambda: one.boom.call_one().get(timeout=10)):
            try:
                f()
            except RemoteException as e:
                print("CAUGHT", e.type_name)
        gc.collect()
        procs.stop().get(timeout=20)
        gc.collect()
        print("DONE")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert proc.stdout.count("CAUGHT ValueError") == 3 and "DONE" in proc.stdout, proc.stderr
    assert "never retrieved" not in proc.stderr


def test_a_lane_whose_caller_stops_reading_is_not_served_further_until_it_reads() -> None:
    # A caller that writes 300 requests for 1 MiB replies and reads none: the proc writes
    # replies until the connection backs up, then reads no more of that lane's requests
    # (instead of buffering 300 MiB). Once the caller reads, every reply arrives in order.
    out = run(
        """
        from palatine.mesh import actor_mesh as M
        from palatine.fastpath.lane import LaneConn
        from palatine.wire.codec import dumps

        class Big(Acc):
            @endpoint
            def big(self, i):
                self.marks += 1
                return i.to_bytes(4, "big") + b"x" * (1 << 20)

        big = procs.spawn("big", Big).slice(procs=0)
        big.marks_seen.call_one().get()
        mb = M.default_client().mailbox
        dest = big.gang.actor(0)
        addr = mb.proc.router.lookup(dest)
        lane = LaneConn.open(addr, mb.proc.proc_id)
        calls = [M._RefCall(dest, dumps(("big", (i,), {}))[0], [], "call big", 60.0) for i in range(300)]
        data, ports = lane.encode(300, lambda i, rt: calls[i].envelope(mb, -1, rt))
        lane.sock.sendall(data)  # ≈ 45 KB of requests: the socket takes them all
        ran = marks_once_still(big)
        print("HANDLED_UNREAD", ran < 300, ran > 0)
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < 300 and time.monotonic() < deadline:
            for port, value in lane.read(deadline):
                got[port] = value
        ok = [int.from_bytes(got[p.port][:4], "big") for p in ports] == list(range(300))
        print("ALL_READ", len(got), ok, big.marks_seen.call_one().get())
        lane.close()
        """
    )
    assert out["HANDLED_UNREAD"] == "True True"
    assert out["ALL_READ"] == "300 True 300"


def test_late_replies_that_back_up_do_not_block_the_threads_next_large_request() -> None:
    # A batch whose calls all time out leaves 48 MiB of late replies for the lane; the proc
    # writes until the connection backs up, then stops reading the lane. The thread's next
    # request, larger than a socket buffer, is written while those replies are read off.
    out = run(
        """
        class Late(Acc):
            @endpoint(timeout=0.3)
            def late(self, s, n):
                time.sleep(s)
                self.marks += 1
                return b"x" * n

            @endpoint(timeout=20)
            def length(self, b):
                return len(b)

        late = procs.spawn("late", Late).slice(procs=0)
        late.length.call_one(b"").get()
        late.length.call_one(b"").get()  # now on the lane
        for attempt in range(1, 6):
            before = lane_frames()
            fs = [late.late.call_one(0.6, 1 << 20)] + [late.late.call_one(0, 1 << 20) for _ in range(47)]
            timed_out = 0
            for f in fs:
                try:
                    f.get()
                except CallTimeout:
                    timed_out += 1
            batch_frames = lane_frames() - before
            if batch_frames == 48:
                break  # (else this thread stalled past the sweep: the batch went by the loop)
        ran = marks_once_still(late)
        t = time.monotonic()
        n = late.length.call_one(b"y" * (8 << 20)).get()
        took = round(time.monotonic() - t, 3)
        ran_after = late.marks_seen.call_one().get() - 48 * (attempt - 1)
        print("NEXT", timed_out, batch_frames, ran, n, took, ran_after, lanes_of_this_thread())
        """
    )
    timed_out, frames, ran_before, n, took, ran_after, lanes = out["NEXT"].split()
    assert (timed_out, frames, n, ran_after, lanes) == ("48", "48", str(8 << 20), "48", "1")
    assert 0 < int(ran_before) <= 48 * 5
    assert float(took) < 10.0


def test_replies_sent_before_the_proc_died_keep_their_values_when_a_batch_write_fails() -> None:
    # The proc answers the first members (its replies are flushed), then exits while the
    # caller is still encoding and writing 32 MB of later requests: the write fails, yet
    # the replies that came first are read and keep their values.
    out = run(
        """
        class Dies(Acc):
            @endpoint
            def die(self):
                os._exit(3)

            @endpoint
            def size(self, b):
                return len(b)

        dies = procs.spawn("dies", Dies).slice(procs=0)
        dies.add.call_one(0).get()
        dies.add.call_one(0).get()  # now on the lane
        payload = b"x" * 65536
        fs = ([dies.add.call_one(5)] + [dies.add.call_one(0) for _ in range(40)] + [dies.die.call_one()]
              + [dies.size.call_one(payload) for _ in range(500)])
        outcomes = []
        for f in fs:
            try:
                outcomes.append(f.get())
            except (DeliveryError, PeerGoneError) as e:
                outcomes.append(("gone", "exited with code 3" in str(e)))
        print("FIRST", outcomes[0], lane_frames() > 2)  # (the batch went on the lane)
        print("ANSWERED", outcomes.index(("gone", True)) >= 16)  # the first chunk at least
        print("OUTCOMES", sorted(set(map(repr, outcomes))))
        print("DIE", outcomes[41])
        """
    )
    assert out["FIRST"] == "5 True"
    assert out["ANSWERED"] == "True"
    assert out["OUTCOMES"] == "[\"('gone', True)\", '5']"
    assert out["DIE"] == "('gone', True)"
