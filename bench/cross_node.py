"""Across nodes: the same figures between network namespaces as within one machine.

Needs root (a namespace test bed, `palatine.testing.netns`): the system, the controller
and the caller run in the root namespace, one ``palatine host`` in each of two node
namespaces, traffic crosses a veth pair and a bridge. Run with the project's
interpreter::

    .venv/bin/python bench/cross_node.py [--only METRIC] [--reps N]

* ``cross_node_1_1_calls_unix``: ``1_1_actor_calls_sync`` on this machine, over unix
  sockets (``bench/actor_calls.py``, run here so that the ratios compare one moment).
* ``cross_node_1_1_calls_tcp`` / ``_tls``: the same loop (``call_one(i).get()`` one at a
  time) to an actor on a proc of the other node, over TCP / mutual TLS; each line has
  ``ratio_to_unix`` (goal ≥ 0.7).
* ``cross_node_bare_echo_unix_us`` / ``_tcp_us`` / ``_tls_us``: the median round trip of
  a bare echo (``bench/_echo.py``: palatine's serving loop and a lane's socket, with
  nothing of palatine in between) over unix on this machine, and over TCP / mutual TLS to
  the other node. What the transport alone adds to a call; from them the tcp and tls
  lines get ``ceiling_ratio``, the ratio to unix that a call would reach if the
  transport's extra cost were all it paid.
* ``cross_node_fetch_64MiB_GBps``: a 64 MiB tensor made on a worker of the other node
  and fetched by the client (goal ≥ 1 GB/s); ``cross_node_fetch_64MiB_tls_GBps``: the
  same over mutual TLS (no goal of its own).
* ``cross_node_detect_sigkill_s``: a worker on the other node SIGKILLed under a pending
  fetch, until the client's `DeviceException` (goal ≤ 0.5 s).
* ``cross_node_detect_link_cut_s``: the other node's link cut under a pending fetch,
  until the client's `DeviceException`, with a 3 s heartbeat timeout and a 0.5 s
  interval (goal ≤ 3.5 s: the timeout plus one interval).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cloudpickle  # noqa: E402
from _common import parse_args, rate_rep, run_metric  # noqa: E402
from _echo import median_rtts_us  # noqa: E402

from palatine import Actor, DeviceException, endpoint, fetch, inspect, remote  # noqa: E402
from palatine.job.jobhosts import JobHosts  # noqa: E402
from palatine.tensor.client.local import connect  # noqa: E402
from palatine.testing.bedroles import roles_on_bed  # noqa: E402
from palatine.testing.netns import TestBed, unavailable  # noqa: E402

IMPL = "palatine"
VERSION = metadata.version("palatine")
UPDATE_TIMEOUT_S = 3.0
INTERVAL_S = 0.5
FAULT_REPS = 3

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x


def make_tensor(nbytes: int) -> Any:
    import torch

    return torch.ones(nbytes, dtype=torch.uint8)


def sleep_long() -> int:
    time.sleep(120)
    return 0


def unix_calls(args: Any) -> tuple[list[float], dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("actor_calls.py")), "--only",
         "1_1_actor_calls_sync", "--reps", str(args.reps), "--rep-seconds", str(args.rep_seconds)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("value") is not None:
                return list(rec["reps"]), {}
    raise RuntimeError(f"bench/actor_calls.py gave no figure: {done.stderr[-500:]}")


def bare_echo(
    args: Any, bed: TestBed, transport: str, pki: dict[str, dict[str, str]] | None = None
) -> tuple[list[float], dict[str, Any]]:
    count = 10_000
    if transport == "unix":
        with tempfile.TemporaryDirectory() as d:
            return median_rtts_us("unix", f"{d}/echo.sock", args.reps, count), {}
    where = bed.node_ip(0)
    env = pki[where] if pki else None
    return median_rtts_us(transport, where, args.reps, count, bed.prefix(0), env), {}


def remote_calls(
    args: Any,
    bed: TestBed,
    tls: dict[str, dict[str, str]] | None,
    unix: float | None,
    bare_extra_us: float | None = None,
) -> tuple[list[float], dict[str, Any]]:
    with roles_on_bed(bed, tls=tls) as roles:
        hosts = JobHosts(roles.system_addr, roles.token, "hostworker", bed.nodes, sys.executable)
        try:
            echo = hosts.spawn_procs({"procs": 1}).spawn("echo", Echo).slice(hosts=1, procs=0)
            for i in range(200):  # warm: connections made, code paths hot
                echo.ping.call_one(i).get()
            reps = [
                rate_rep(lambda: echo.ping.call_one(1).get(), args.rep_seconds)
                for _ in range(args.reps)
            ]
        finally:
            hosts.close()
    extra: dict[str, Any] = {}
    if unix:
        extra["ratio_to_unix"] = round(sorted(reps)[len(reps) // 2] / unix, 3)
        extra["target_value"] = round(0.7 * unix, 1)  # the goal: 70 % of this run's unix
        if bare_extra_us is not None:  # a call that paid only the transport's extra cost
            unix_us = 1e6 / unix
            extra["ceiling_ratio"] = round(unix_us / (unix_us + bare_extra_us), 3)
    return reps, extra


def fetch_rate(
    args: Any, bed: TestBed, tls: dict[str, dict[str, str]] | None = None
) -> tuple[list[float], dict[str, Any]]:
    nbytes = 64 << 20
    with roles_on_bed(bed, per_host=1, tls=tls) as roles:
        with connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token) as mesh:
            value = remote(make_tensor)(nbytes)
            where = {"host": 1, "proc": 0}
            fetch(value, shard=where).result()  # warm
            reps = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                got = fetch(value, shard=where).result()
                reps.append(nbytes / (time.perf_counter() - t0) / 1e9)
                assert got.numel() == nbytes
            del mesh
    return reps, {"bytes": nbytes}


def detect(bed: TestBed, fault: str) -> tuple[list[float], dict[str, Any]]:
    reps = []
    for _ in range(FAULT_REPS):
        with roles_on_bed(
            bed, per_host=1, update_timeout_s=UPDATE_TIMEOUT_S, interval_s=INTERVAL_S
        ) as roles:
            with connect(roles.system_addr, "worker", timeout_s=90, _token=roles.token) as mesh:
                where = {"host": 1, "proc": 0}
                pid = inspect(remote(os.getpid)(), shard=where)
                pending = fetch(remote(sleep_long)(), shard=where)
                time.sleep(0.2)  # the call is running
                t0 = time.perf_counter()
                if fault == "sigkill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    bed.cut(1)
                try:
                    pending.result(timeout=60)
                    raise AssertionError("the fetch returned after the fault")
                except DeviceException:
                    reps.append(time.perf_counter() - t0)
                finally:
                    bed.heal(1)
                del mesh
    return reps, {"fault": fault}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    why = unavailable()
    bed = None
    if why is None:
        bed = TestBed(2)
        try:
            bed.start()
        except RuntimeError as e:
            why, bed = str(e), None

    def need_bed() -> TestBed:
        if bed is None:
            raise RuntimeError(f"no namespace test bed here: {why}")
        return bed

    unix: list[float] = []

    def measure_unix() -> tuple[list[float], dict[str, Any]]:
        reps, extra = unix_calls(args)
        unix.extend(reps)
        return reps, extra

    def unix_median() -> float | None:
        return sorted(unix)[len(unix) // 2] if unix else None

    bare: dict[str, float] = {}  # transport -> median bare round trip (µs)

    def measure_bare(transport: str, pki: dict[str, dict[str, str]] | None = None) -> Any:
        reps, extra = bare_echo(args, need_bed(), transport, pki)
        bare[transport] = sorted(reps)[len(reps) // 2]
        return reps, extra

    def bare_extra(transport: str) -> float | None:
        if transport in bare and "unix" in bare:
            return bare[transport] - bare["unix"]
        return None

    def with_pki(measure: Any) -> tuple[list[float], dict[str, Any]]:
        """``measure(bed, pki)`` with one certificate per machine of the bed, this
        machine's in the environment meanwhile."""
        from palatine.testing.certs import make_node_pki

        b = need_bed()
        with tempfile.TemporaryDirectory() as d:
            pki = make_node_pki(d, [b.root_ip, *(b.node_ip(i) for i in range(b.nodes))])
            with patch.dict(os.environ, pki[b.root_ip]):
                return measure(b, pki)  # type: ignore[no-any-return]

    try:
        run_metric(args, "cross_node_1_1_calls_unix", IMPL, "calls/s", True, VERSION, measure_unix)
        run_metric(args, "cross_node_bare_echo_unix_us", IMPL, "µs", False, VERSION,
                   lambda: measure_bare("unix"))  # fmt: skip
        run_metric(args, "cross_node_bare_echo_tcp_us", IMPL, "µs", False, VERSION,
                   lambda: measure_bare("tcp"))  # fmt: skip
        run_metric(args, "cross_node_bare_echo_tls_us", IMPL, "µs", False, VERSION,
                   lambda: with_pki(lambda b, pki: measure_bare("tls", pki)))  # fmt: skip
        run_metric(args, "cross_node_1_1_calls_tcp", IMPL, "calls/s", True, VERSION,
                   lambda: remote_calls(args, need_bed(), None, unix_median(), bare_extra("tcp")))  # fmt: skip
        run_metric(args, "cross_node_1_1_calls_tls", IMPL, "calls/s", True, VERSION,
                   lambda: with_pki(lambda b, pki: remote_calls(
                       args, b, pki, unix_median(), bare_extra("tls"))))  # fmt: skip
        run_metric(args, "cross_node_fetch_64MiB_GBps", IMPL, "GB/s", True, VERSION,
                   lambda: fetch_rate(args, need_bed()))  # fmt: skip
        run_metric(args, "cross_node_fetch_64MiB_tls_GBps", IMPL, "GB/s", True, VERSION,
                   lambda: with_pki(lambda b, pki: fetch_rate(args, b, pki)))  # fmt: skip
        run_metric(args, "cross_node_detect_sigkill_s", IMPL, "s", False, VERSION,
                   lambda: detect(need_bed(), "sigkill"))  # fmt: skip
        run_metric(args, "cross_node_detect_link_cut_s", IMPL, "s", False, VERSION,
                   lambda: detect(need_bed(), "cut"))  # fmt: skip
    finally:
        if bed is not None:
            bed.close()


if __name__ == "__main__":
    main()
