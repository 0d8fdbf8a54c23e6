"""Endpoint calls are type-checked: with palatine's mypy plugin, ``mesh.<endpoint>`` on
the ``ActorMesh[A]`` that ``procs.spawn(name, A)`` returns has the endpoint's own
signature and result type, so mypy reports a wrong argument and a misspelled endpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy")

pytestmark = pytest.mark.timeout(180)

ACTOR = """
    from __future__ import annotations

    from palatine import Actor, endpoint, this_host
    from palatine.core.actor import concurrent_endpoint
    from palatine.core.future import Future
    from palatine.core.ports import Port
    from palatine.mesh.actor_mesh import ActorMesh, ActorRef, ValueMesh


    class Counter(Actor):
        def __init__(self, start: int) -> None:
            self.n = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.n += by
            return self.n

        @endpoint(timeout=5)
        async def label(self, prefix: str, *, upper: bool = False) -> str:
            return prefix.upper() if upper else prefix

        @concurrent_endpoint
        def ping(self) -> None:
            pass

        @endpoint(explicit_response_port=True)
        def later(self, port: Port[int], x: int) -> None:
            port.send(x)

        def helper(self) -> int:
            return self.n


    procs = this_host().spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("counter", Counter, 0)
"""

CORRECT = """
    mesh: ActorMesh[Counter] = counters
    one: Future[int] = counters.slice(gpus=0).incr.call_one(2)
    every: Future[ValueMesh[int]] = counters.incr.call(by=3)
    labels: list[str] = counters.label.call("x", upper=True).get().values()
    chosen: str = counters.label.choose("y").get()
    total: int = sum(counters.incr.call().get())
    counters.ping.broadcast()
    later: Future[ValueMesh[int]] = counters.later.call(7)
    for rank, value in counters.incr.stream(1):
        seen: int = value
    ref: ActorRef[Counter] = ActorRef(counters.gang.actor(0), Counter)
    direct: Future[int] = ref.incr.call_one()
"""

WRONG = """
    counters.incr.call("three")
    counters.icnr.call(1)
    counters.helper.call()
    text: str = counters.incr.call_one().get()
"""


def _mypy(tmp_path: Path, name: str, body: str) -> subprocess.CompletedProcess[str]:
    src = tmp_path / f"{name}.py"
    src.write_text(textwrap.dedent(ACTOR) + textwrap.dedent(body))
    ini = tmp_path / "mypy.ini"
    ini.write_text("[mypy]\nstrict = True\nplugins = palatine.mesh.mypy_plugin\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ini),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )


def test_mypy_checks_endpoint_calls_against_the_endpoints_signatures(tmp_path: Path) -> None:
    ok = _mypy(tmp_path, "correct", CORRECT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _mypy(tmp_path, "wrong", WRONG)
    errors = [line for line in bad.stdout.splitlines() if ": error: " in line]
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert any(
        'Argument 1 to "call" of "Endpoint" has incompatible type "str"; expected "int"' in e
        for e in errors
    ), errors
    assert any('"Counter" has no endpoint "icnr"  [attr-defined]' in e for e in errors), errors
    assert any('"Counter.helper" is not an endpoint' in e for e in errors), errors
    assert any('(expression has type "int", variable has type "str")' in e for e in errors)
    assert len(errors) == 4, errors
