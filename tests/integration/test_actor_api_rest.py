"""The rest of Monarch's actor API on real OS processes: `this_proc()`, an actor that
aborts itself, the procs' logging level, ``hosts`` as a per-host dimension of this
machine, blocking calls in a constructor, and ``__del__`` once the proc mesh stops."""

from __future__ import annotations

import pytest
from user_scripts import run_script

pytestmark = pytest.mark.timeout(120)


THIS_PROC = """
    import os
    from palatine import Actor, endpoint, this_host
    from palatine.job.hostmesh import this_proc

    class Here(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

    class Spawner(Actor):
        @endpoint
        def spawn_here(self):
            here = this_proc().spawn("here", Here)
            return os.getpid(), here.pid.call_one().get(timeout=20)

    here = this_proc().spawn("here", Here)
    print("SCRIPT", os.getpid(), here.pid.call_one().get(timeout=20))
    print("MESH", here.pid.call().get(timeout=20).values() == [os.getpid()], len(here))
    procs = this_host().spawn_procs(per_host={"procs": 1})
    outer, inner = procs.spawn("spawner", Spawner).spawn_here.call_one().get(timeout=30)
    print("ACTOR", outer == inner, outer != os.getpid())
    procs.stop().get(timeout=20)
"""


def test_this_proc_spawns_actors_in_the_callers_own_process() -> None:
    lines, _ = run_script(THIS_PROC)
    script, answered = lines["SCRIPT"].split()
    assert script == answered  # the actor runs in the script's own process
    assert lines["MESH"] == "True 1"
    assert lines["ACTOR"] == "True True"  # from an actor: in that actor's proc


ABORT = """
    import time
    from palatine import Actor, context, endpoint, set_unhandled_fault_hook, this_host

    got = []
    set_unhandled_fault_hook(got.append)

    class Aborter(Actor):
        @endpoint
        def abort(self, reason=None):
            context().actor_instance.abort(reason)
            return "returned"

    class Owner(Actor):
        def __init__(self):
            self.failures = []

        @endpoint
        def spawn_and_abort(self):
            procs = this_host().spawn_procs(per_host={"procs": 1})
            child = procs.spawn("child", Aborter)
            child.abort.call_one("owner, look").get(timeout=20)
            return "spawned"

        @endpoint
        def failures_seen(self):
            return [f.message for f in self.failures]

        def __supervise__(self, failure):
            self.failures.append(failure)
            return True

    def wait(cond):
        t0 = time.monotonic()
        while not cond() and time.monotonic() - t0 < 20:
            time.sleep(0.02)

    procs = this_host().spawn_procs(per_host={"procs": 2})
    actors = procs.spawn("aborter", Aborter)
    print("RETURNED", actors.slice(procs=0).abort.call_one("out of patience").get(timeout=20))
    wait(lambda: got)
    print("HOOK", got[0].actor_id, "|", got[0].message)
    actors.slice(procs=1).abort.call_one().get(timeout=20)
    wait(lambda: len(got) > 1)
    print("NOREASON", got[1].message)
    try:
        actors.slice(procs=0).abort.call_one().get(timeout=20)
    except Exception as e:
        print("LATER", type(e).__name__, "aborted: out of patience" in str(e))
    owner = procs.spawn("owner", Owner).slice(procs=0)
    owner.spawn_and_abort.call_one().get(timeout=60)
    wait(lambda: owner.failures_seen.call_one().get(timeout=20))
    print("OWNER", owner.failures_seen.call_one().get(timeout=20))
    procs.stop().get(timeout=20)
"""


def test_an_actor_that_aborts_itself_fails_after_the_call_and_its_owner_is_told_why() -> None:
    lines, _ = run_script(ABORT)
    assert lines["RETURNED"] == "returned"  # the call itself returns, as in Monarch
    actor, message = lines["HOOK"].split(" | ")
    assert actor == "mesh0[0].aborter[0]"
    assert message == "serving mesh0[0].aborter[0]: aborted: out of patience"
    assert lines["NOREASON"].endswith("aborted: no reason provided")
    assert lines["LATER"] == "DeliveryError True"  # later calls fail with the cause
    assert "aborted: owner, look" in lines["OWNER"]  # an owning actor's __supervise__


LOG_LEVEL = """
    import logging
    from palatine import Actor, endpoint, this_host

    class Talker(Actor):
        @endpoint
        def talk(self, tag):
            logging.getLogger("user.talk").info("informed-%s", tag)
            logging.getLogger("user.talk").warning("warned-%s", tag)
            return logging.getLogger().getEffectiveLevel()

    procs = this_host().spawn_procs(per_host={"procs": 2})
    talkers = procs.spawn("talker", Talker)
    print("DEFAULT", talkers.talk.call("default").get(timeout=20).values())
    procs.logging_option(aggregate_window_sec=0, level=logging.INFO)
    print("INFO", talkers.talk.call("shown").get(timeout=20).values())
    procs.logging_option(aggregate_window_sec=0, level=logging.ERROR)
    print("ERROR", talkers.talk.call("hidden").get(timeout=20).values())
    for bad in (-1, 256, "INFO"):
        try:
            procs.logging_option(level=bad)
        except ValueError as e:
            print("BAD", e)
    procs.stop().get(timeout=20)
"""


def test_logging_option_level_is_the_level_of_the_procs_forwarded_log_records() -> None:
    lines, err = run_script(LOG_LEVEL)
    # by default the console shows the procs' records from WARNING up
    assert "warned-default" in err and "informed-default" not in err
    assert lines["INFO"] == "[20, 20]"  # the procs' root logger
    assert err.count("INFO user.talk: informed-shown") == 2  # INFO records shown here now
    assert err.count("WARNING user.talk: warned-shown") == 2
    assert lines["ERROR"] == "[40, 40]"
    assert "warned-hidden" not in err and "informed-hidden" not in err
    assert " INFO palatine." not in err  # palatine's own records keep their level
    assert lines["BAD"].startswith("invalid logging level: 'INFO'")


HOSTS_PER_HOST = """
    import os
    from palatine import Actor, current_rank, current_size, endpoint, this_host

    class Where(Actor):
        @endpoint
        def where(self):
            return dict(current_rank()), current_size(), os.getpid()

    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 3})
    print("SIZES", procs.sizes, len(procs))
    answers = procs.spawn("where", Where).where.call().get(timeout=30)
    points = [p for p, _ in answers.items()]
    print("POINTS", [tuple(p.values()) for p in points])
    print("RANKS", [v[0] for v in answers.values()] == [dict(p) for p in points])
    print("SIZE", answers.values()[0][1], len({v[2] for v in answers.values()}))
    procs.stop().get(timeout=20)
"""


def test_this_host_takes_hosts_as_one_of_several_per_host_dimensions() -> None:
    lines, _ = run_script(HOSTS_PER_HOST)
    assert lines["SIZES"] == "{'hosts': 2, 'gpus': 3} 6"
    assert lines["POINTS"] == "[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]"
    assert lines["RANKS"] == "True"
    assert lines["SIZE"] == "{'hosts': 2, 'gpus': 3} 6"  # six procs of this machine


CONSTRUCTOR_SPAWNS = """
    import os
    import signal
    import time
    from palatine import Actor, endpoint, this_host

    class Leaf(Actor):
        @endpoint
        def value(self):
            return 7

        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def fail(self):
            raise RuntimeError("leaf broke")

    class Owner(Actor):
        def __init__(self):
            # blocking palatine calls in a constructor: spawn procs and actors, wait
            self.procs = this_host().spawn_procs(per_host={"procs": 2})
            self.leaves = self.procs.spawn("leaf", Leaf)
            self.first = sum(self.leaves.value.call().get(timeout=30).values())
            self.failures = []

        @endpoint
        def first_sum(self):
            return self.first

        @endpoint
        def more_leaves(self):
            more = self.procs.spawn("more", Leaf)
            return sum(more.value.call().get(timeout=30).values())

        @endpoint
        def break_one(self):
            self.leaves.slice(procs=1).fail.broadcast()

        @endpoint
        def seen(self):
            return [f.message for f in self.failures]

        @endpoint
        def kill_leaf(self):
            os.kill(self.leaves.slice(procs=0).pid.call_one().get(timeout=20), signal.SIGKILL)

        @endpoint
        def after_respawn(self):
            return self.respawned, self.leaves.slice(procs=0).value.call_one().get(timeout=30)

        def __supervise__(self, failure):
            self.failures.append(failure)
            if "its proc died" in failure.message:  # blocking calls here too
                self.respawned = self.procs.respawn().get(timeout=60)
            return True

    procs = this_host().spawn_procs(per_host={"procs": 1})
    owner = procs.spawn("owner", Owner)
    print("SUM", owner.first_sum.call_one().get(timeout=30))
    print("MORE", owner.more_leaves.call_one().get(timeout=30))
    owner.break_one.call_one().get(timeout=30)
    t0 = time.monotonic()
    seen = []
    while not seen and time.monotonic() - t0 < 20:
        seen = owner.seen.call_one().get(timeout=30)
        time.sleep(0.02)
    print("SEEN", seen)
    owner.kill_leaf.call_one().get(timeout=30)
    t0 = time.monotonic()
    while len(seen) < 2 and time.monotonic() - t0 < 20:
        seen = owner.seen.call_one().get(timeout=30)
        time.sleep(0.02)
    print("DIED", seen[1:])
    print("RESPAWNED", owner.after_respawn.call_one().get(timeout=60))
    procs.stop().get(timeout=30)
"""


def test_a_constructor_spawns_procs_and_actors_waits_on_them_and_supervises_them() -> None:
    # Before, the constructor failed: "blocking palatine call on the event loop thread".
    lines, err = run_script(CONSTRUCTOR_SPAWNS)
    assert lines["SUM"] == "14"
    assert lines["MORE"] == "14"  # and a plain def endpoint spawns too
    assert "leaf[0]: processing error: RuntimeError: leaf broke" in lines["SEEN"]
    assert "its proc died: killed by signal 9" in lines["DIED"]  # a proc of its mesh too
    assert lines["RESPAWNED"] == "([0], 7)"  # __supervise__ respawned it, blocking
    assert "Task was destroyed but it is pending" not in err  # its procs stop cleanly


DEL_ON_STOP = """
    from palatine import Actor, endpoint, this_host

    class Mortal(Actor):
        @endpoint
        def ping(self):
            return "pong"

        def __del__(self):
            print("MORTAL_DEL", flush=True)

    procs = this_host().spawn_procs(per_host={"procs": 2})
    mortals = procs.spawn("mortal", Mortal)
    print("PING", mortals.ping.call().get(timeout=20).values())
    procs.stop().get(timeout=20)
"""


def test_an_actors_del_runs_when_its_proc_mesh_stops() -> None:
    lines, err = run_script(DEL_ON_STOP)
    assert lines["PING"] == "['pong', 'pong']"
    # (the procs' output reaches the script's console by the time it has exited)
    assert err.count("MORTAL_DEL") == 2 or "[mesh0 0-1] MORTAL_DEL" in err, err[-3000:]
