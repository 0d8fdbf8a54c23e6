"""``palatine serve READ_FD WRITE_FD`` through real pipes.

Each test starts the server with two pipes (``pass_fds``), writes request lines and reads
``Finished`` lines with a deadline; the server's stdout carries the roles' ready lines.
Every process runs in its own session and its group is killed by the fixture.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from palatine.tensor.client.procs import RoleProcess, palatine_cmd

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).resolve().parent


class Server:
    """One ``palatine serve`` process and the launcher's ends of its pipes."""

    def __init__(self, env: dict[str, str]) -> None:
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        self.popen = subprocess.Popen(
            [*palatine_cmd(), "serve", str(req_r), str(resp_w)],
            pass_fds=(req_r, resp_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            start_new_session=True,
        )
        os.close(req_r)
        os.close(resp_w)
        self._resp = b""
        self._out = b""

    def send(self, request: Any) -> None:
        text = request if isinstance(request, str) else json.dumps(request)
        os.write(self.req_w, text.encode() + b"\n")

    def close_requests(self) -> None:
        if self.req_w >= 0:
            os.close(self.req_w)
            self.req_w = -1

    def _line(self, fd: int, buf: bytes, timeout_s: float) -> tuple[bytes, bytes]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no line within {timeout_s} s; stderr:\n{self.stderr()[-3000:]}"
                )
            r, _, _ = select.select([fd], [], [], min(left, 0.1))
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"EOF before a line; stderr:\n{self.stderr()[-3000:]}")
                buf += chunk
        line, rest = buf.split(b"\n", 1)
        return line, rest

    def finished(self, timeout_s: float = 15.0) -> str | None:
        """The next response, which must be ``{"Finished": {"error": ...}}``."""
        line, self._resp = self._line(self.resp_r, self._resp, timeout_s)
        obj = json.loads(line)
        assert list(obj) == ["Finished"] and list(obj["Finished"]) == ["error"], obj
        error = obj["Finished"]["error"]
        assert error is None or isinstance(error, str)
        return error

    def ready(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """The next ready line a role printed on the server's stdout."""
        assert self.popen.stdout is not None
        while True:
            line, self._out = self._line(self.popen.stdout.fileno(), self._out, timeout_s)
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("event") == "ready":
                return obj

    def no_response(self, wait_s: float) -> bool:
        """Nothing was written within ``wait_s`` (EOF counts as nothing)."""
        r, _, _ = select.select([self.resp_r], [], [], wait_s)
        data = os.read(self.resp_r, 65536) if r else b""
        return not data and b"\n" not in self._resp

    def stderr(self) -> str:
        if self.popen.poll() is None:
            return ""
        assert self.popen.stderr is not None
        return self.popen.stderr.read().decode(errors="replace")

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(5)
        self.close_requests()
        os.close(self.resp_r)


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    e = {
        "PALATINE_CLUSTER_TOKEN": secrets.token_hex(16),
        "PALATINE_LOG_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "PALATINE_CONTROLLER_WORKER_ACTOR_TYPE": "controller_fakes.FakeWorker",
    }
    yield e


@pytest.fixture
def server(env: dict[str, str]) -> Iterator[Server]:
    s = Server(env)
    try:
        yield s
    finally:
        s.kill()


def stop_system(addr: str, env: dict[str, str]) -> None:
    out = subprocess.run(
        [*palatine_cmd(), "stop", "--system-addr", addr],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr


def test_run_system_then_stop_finishes_with_null(server: Server, env: dict[str, str]) -> None:
    server.send(
        {
            "Run": {
                "System": {
                    "system_addr": "unix:",
                    "supervision_update_timeout_in_sec": 20,
                    "world_eviction_timeout_in_sec": 10,
                }
            }
        }
    )
    ready = server.ready()
    assert ready["role"] == "system" and ready["pid"] == server.popen.pid
    assert ready["addr"].startswith("unix:@")
    stop_system(ready["addr"], env)
    assert server.finished() is None
    server.send({"Exit": []})
    assert server.wait(10) == 0


def test_malformed_lines_are_answered_and_serving_continues(
    server: Server, env: dict[str, str]
) -> None:
    server.send("this is not json")
    error = server.finished()
    assert error is not None and error.startswith("invalid request: ")
    for bad, where in [
        ({"Launch": {}}, "unknown variant"),
        ({"Run": {"Worker": {}}}, "unknown role"),
        ({"Run": {"System": {}}}, "system_addr"),
        ({"Run": {"System": {"system_addr": "unix:", "bogus": 1}}}, "unknown field `bogus`"),
        (
            {"Run": {"Host": {"system_addr": "unix:@x", "host_world": "hw", "host_rank": "0"}}},
            "host_rank",
        ),
        ({"Run": {"System": {"system_addr": "nope:1"}}}, "nope:1"),
        (
            {"Run": {"Host": {"system_addr": "unix:@x", "host_world": "workers", "host_rank": 0}}},
            "host",
        ),
        (
            {
                "Run": {
                    "Controller": {
                        "worker_world": "w",
                        "system_addr": "unix:@x",
                        "world_size": 4,
                        "controller_actor_id": "controller[1].root",
                    }
                }
            },
            "controller-actor-id",
        ),
    ]:
        server.send(bad)
        error = server.finished()
        assert error is not None and error.startswith("invalid request: ") and where in error, (
            bad,
            error,
        )
    # a valid Run still works, with a float and omitted defaulted fields
    server.send({"Run": {"System": {"system_addr": "unix:", "world_eviction_timeout_in_sec": 0.5}}})
    ready = server.ready()
    stop_system(ready["addr"], env)
    assert server.finished() is None


@pytest.mark.parametrize("how", ["exit", "eof"])
def test_idle_server_exits_0(server: Server, how: str) -> None:
    if how == "exit":
        server.send({"Exit": []})
    else:
        server.close_requests()
    assert server.wait(10) == 0
    assert server.no_response(0.1)


def test_two_runs_on_the_same_fixed_address(server: Server, env: dict[str, str]) -> None:
    addr = f"unix:@palatine-serve-{secrets.token_hex(4)}"
    for _ in range(2):
        server.send({"Run": {"System": {"system_addr": addr}}})
        assert server.ready()["addr"] == addr
        stop_system(addr, env)
        assert server.finished() is None


def test_request_during_a_run_is_refused_and_exit_stops_the_run(
    server: Server, env: dict[str, str]
) -> None:
    server.send({"Run": {"System": {"system_addr": "unix:"}}})
    addr = server.ready()["addr"]
    server.send({"Run": {"System": {"system_addr": "unix:"}}})
    assert server.finished() == "invalid request: a Run is already in progress"
    # the active run is unaffected
    snap = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", addr, "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert snap.returncode == 0, snap.stderr
    t0 = time.monotonic()
    server.send({"Exit": []})
    assert server.finished() is None
    assert server.wait(10) == 0
    assert time.monotonic() - t0 < 10


def test_a_launcher_slow_to_read_responses_does_not_stall_the_role(
    server: Server, env: dict[str, str]
) -> None:
    # 4,000 bad lines: their answers (≈ 300 KB) are more than the response pipe holds,
    # and nobody reads them for now. The system the server runs keeps serving meanwhile,
    # and every answer arrives, in order, once the launcher reads.
    server.send({"Run": {"System": {"system_addr": "unix:"}}})
    addr = server.ready()["addr"]
    os.write(server.req_w, b"bad\n" * 4000)
    snap = subprocess.run(
        [*palatine_cmd(), "snapshot", "--system-addr", addr, "--json", "--timeout-in-sec", "10"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert snap.returncode == 0, snap.stderr
    errors = [server.finished() for _ in range(4000)]
    assert all(e is not None and e.startswith("invalid request: ") for e in errors)
    server.send({"Exit": []})
    assert server.finished() is None
    assert server.wait(10) == 0


def test_lines_over_the_limit_are_refused_whole_or_cut(server: Server) -> None:
    from palatine.cli.serving import MAX_LINE_BYTES

    # One line just over the limit that arrives whole, one that arrives in pieces, and a
    # line that only spells the refusal's own placeholder: each gets its own answer.
    line = json.dumps({"Run": {"System": {"system_addr": "unix:@" + "x" * MAX_LINE_BYTES}}})
    os.write(server.req_w, line.encode() + b"\n")
    assert server.finished() == f"invalid request: line longer than {MAX_LINE_BYTES} bytes"
    server.send("\x00too long")
    error = server.finished()
    assert (
        error is not None and error.startswith("invalid request: ") and "longer than" not in error
    )
    server.send({"Exit": []})
    assert server.wait(10) == 0


@pytest.mark.parametrize("fds", [["99", "1"], ["99999999999999999999", "1"], ["0", "-5"]])
def test_fds_that_are_not_open_exit_2_with_one_line(fds: list[str]) -> None:
    proc = subprocess.run(
        [*palatine_cmd(), "serve", *fds], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.startswith("palatine serve: error: ")
        and "is not an open file descriptor" in proc.stderr
    )
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_responses_on_stdout_keep_the_ready_line_whole_and_in_order(env: dict[str, str]) -> None:
    # `palatine serve 0 1`: responses and the ready line share one pipe. 2,000 answers
    # fill it before the Run's ready line is printed, and nobody reads for now: the ready
    # line still arrives, after them, as a whole line.
    addr = f"unix:@palatine-test-{secrets.token_hex(6)}"
    req_r, req_w = os.pipe()
    out_r, out_w = os.pipe()
    popen = subprocess.Popen(
        [*palatine_cmd(), "serve", "0", "1"],
        stdin=req_r,
        stdout=out_w,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
        start_new_session=True,
    )
    os.close(req_r)
    os.close(out_w)
    try:
        os.write(
            req_w,
            b"bad\n" * 2000
            + json.dumps({"Run": {"System": {"system_addr": addr}}}).encode()
            + b"\n",
        )
        deadline = time.monotonic() + 30
        while (
            subprocess.run(
                [*palatine_cmd(), "snapshot", "--system-addr", addr, "--timeout-in-sec", "2"],
                capture_output=True,
                env={**os.environ, **env},
                timeout=30,
            ).returncode
            != 0
        ):
            assert time.monotonic() < deadline, "the system never answered"
        os.write(req_w, b'{"Exit": []}\n')
        data = b""
        while chunk := os.read(out_r, 1 << 16):
            data += chunk
        assert popen.wait(20) == 0
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)
        os.close(req_w)
        os.close(out_r)
    lines = [json.loads(line) for line in data.splitlines()]  # every line whole
    assert len(lines) == 2002
    assert all(
        list(x) == ["Finished"] and x["Finished"]["error"].startswith("invalid request")
        for x in lines[:2000]
    )
    assert lines[2000]["event"] == "ready" and lines[2000]["addr"] == addr
    assert lines[2001] == {"Finished": {"error": None}}


def test_sigterm_stops_the_run_and_writes_finished(server: Server) -> None:
    server.send({"Run": {"System": {"system_addr": "unix:"}}})
    server.ready()
    server.popen.send_signal(signal.SIGTERM)
    assert server.finished() is None
    assert server.wait(10) == 0


@pytest.mark.parametrize("role", ["Host", "Controller"])
def test_exit_while_a_role_is_still_joining_stops_it_at_once(server: Server, role: str) -> None:
    # Nothing answers at this address: the role would wait for its join timeout.
    cmd: dict[str, Any] = {"system_addr": "tcp:127.0.0.1:1"}
    if role == "Host":
        cmd.update(host_world="hostw", host_rank=0)
    else:
        cmd.update(worker_world="w", world_size=1)
    server.send({"Run": {role: cmd}})
    time.sleep(1.0)  # the join is under way (nothing to wait for: this only lets it start)
    t0 = time.monotonic()
    server.send({"Exit": []})
    assert server.finished() is None
    assert server.wait(10) == 0
    assert time.monotonic() - t0 < 5


def test_a_line_nested_too_deeply_is_answered_and_serving_continues(server: Server) -> None:
    server.send("[" * 5000 + "]" * 5000)
    assert server.finished() == "invalid request: JSON nested too deeply"
    server.send({"Exit": []})
    assert server.wait(10) == 0


def test_failed_controller_bootstrap_gives_the_cli_message(
    server: Server, env: dict[str, str]
) -> None:
    system = RoleProcess(["system", "--system-addr", "unix:"], env)
    try:
        fields = {
            "worker_world": "worker",
            "system_addr": system.addr,
            "world_size": 4,
            "supervision_update_interval_in_sec": 0.5,
            "extra_proc_labels": [["k", "v"]],
        }
        s2 = Server({**env, "PALATINE_CONTROLLER_WORLD_READY_TIMEOUT": "1.5"})
        try:
            s2.send({"Run": {"Controller": fields}})
            error = s2.finished(20)
            assert error is not None
            assert error.startswith(
                "worker world worker did not become Live within 1.5 s: 0 of 4 procs joined"
            )
            cli = subprocess.run(
                [
                    *palatine_cmd(),
                    "controller",
                    "--worker-world",
                    "worker",
                    "--system-addr",
                    system.addr,
                    "--world-size",
                    "4",
                ],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, **env, "PALATINE_CONTROLLER_WORLD_READY_TIMEOUT": "1.5"},
            )
            assert cli.returncode == 1
            assert error in cli.stderr.splitlines()[-1]
            s2.send({"Exit": []})
            assert s2.wait(10) == 0
        finally:
            s2.kill()
    finally:
        system.kill()


def test_controller_run_serves_until_exit(server: Server, env: dict[str, str]) -> None:
    system = RoleProcess(["system", "--system-addr", "unix:"], env)
    hosts: list[RoleProcess] = []
    try:
        hosts = [
            RoleProcess(
                [
                    "host",
                    "--system-addr",
                    system.addr,
                    "--host-world",
                    "hostworker",
                    "--host-rank",
                    str(h),
                ],
                env,
            )
            for h in range(2)
        ]
        server.send(
            {
                "Run": {
                    "Controller": {
                        "worker_world": "worker",
                        "system_addr": system.addr,
                        "world_size": 4,
                        "num_procs_per_host": 2,
                        "program": f"{sys.executable} -m palatine worker",
                        "is_cpu_worker": True,
                        "supervision_update_interval_in_sec": 0.5,
                        "supervision_query_interval_in_sec": 0.5,
                        "extra_proc_labels": None,
                    }
                }
            }
        )
        ready = server.ready(30)
        assert ready["role"] == "controller"
        snap = json.loads(
            subprocess.run(
                [*palatine_cmd(), "snapshot", "--system-addr", system.addr, "--json"],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, **env},
            ).stdout
        )
        assert snap["worlds"]["worker"]["status"] == "Live"
        assert snap["worlds"]["controller"]["status"] == "Live"
        server.send({"Exit": []})
        assert server.finished() is None
        assert server.wait(10) == 0
    finally:
        for h in hosts:
            h.kill()
        system.kill()


def test_requests_from_a_regular_file_or_dev_null(tmp_path: Path) -> None:
    # A file cannot be polled: it is read in turns, answered, and its end ends the server.
    req = tmp_path / "requests.jsonl"
    req.write_text('{"Run": 1}\n{"Exit": []}\n')
    with req.open("rb") as fin:
        done = subprocess.run(
            [*palatine_cmd(), "serve", "0", "1"], stdin=fin, capture_output=True, timeout=30
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["Finished"]["error"].startswith(
        "invalid request: Run expects"
    )
    with open(os.devnull, "rb") as fin:
        done = subprocess.run(
            [*palatine_cmd(), "serve", "0", "1"], stdin=fin, capture_output=True, timeout=30
        )
    assert done.returncode == 0 and done.stdout == b"", done.stderr


def test_a_root_actor_failure_ends_the_run_with_its_error_and_the_server_serves_on() -> None:
    """`palatine serve`'s loop in this process, through real pipes, running a real
    System role: an unhandled root failure (as a panicking root actor reports it) ends
    that run with the failure as its ``Finished`` error; the next request is served."""
    import asyncio

    from palatine.cli.serving import serve
    from palatine.core import runtime
    from palatine.core.actor import SupervisionEvent
    from palatine.core.supervision_hook import unhandled_fault

    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    ready: list[str] = []

    async def main() -> tuple[int, list[dict[str, object]]]:
        runtime.adopt_current_loop()
        try:
            task = asyncio.ensure_future(
                serve(req_r, resp_w, asyncio.Event(), lambda role, addr: ready.append(role))
            )
            os.write(
                req_w, json.dumps({"Run": {"System": {"system_addr": "unix:"}}}).encode() + b"\n"
            )
            async with asyncio.timeout(20):
                while not ready:
                    await asyncio.sleep(0.01)
            unhandled_fault(
                SupervisionEvent(
                    actor_id="system[0].root[0]", status="failed", message="panic: boom"
                )
            )
            os.write(req_w, b"bad\n")  # answered meanwhile: the run keeps its fault
            os.set_blocking(resp_r, False)
            answers: list[dict[str, object]] = []
            buf = b""
            async with asyncio.timeout(30):
                while len(answers) < 2:
                    await asyncio.sleep(0.01)
                    try:
                        buf += os.read(resp_r, 65536)
                    except BlockingIOError:
                        pass
                    while b"\n" in buf:
                        first, buf = buf.split(b"\n", 1)
                        answers.append(json.loads(first))
                os.write(req_w, json.dumps({"Exit": []}).encode() + b"\n")
                code = await task
            return code, answers
        finally:
            runtime.release_current_loop()

    try:
        code, answers = asyncio.run(main())
    finally:
        for fd in (req_r, req_w, resp_r, resp_w):
            os.close(fd)
    assert ready == ["system"]
    errors = sorted(str(a["Finished"]["error"]) for a in answers)  # type: ignore[index]
    assert errors[0].startswith("invalid request: ")
    assert errors[1] == "system[0].root[0] failed: panic: boom"
    assert code == 0
