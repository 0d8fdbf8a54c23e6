"""The test run itself: scripts a test starts can be interrupted as at a terminal, even
when the run was started with SIGINT ignored (a background job); a test that leaves the
environment or a signal's handler changed fails by name, and the next test does not
inherit the change."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parents[1]  # where conftest.py is
QUIET = ["-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", "."]  # (no project config)


def run_pytest(tmp_path: Path, body: str, *, sigint_ignored: bool = False) -> str:
    """Run ``body`` as a test module under this suite's conftest; the report."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(body))

    def as_a_background_job() -> None:
        if sigint_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", *QUIET, "test_probe.py"],
        capture_output=True,
        text=True,
        timeout=50,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        preexec_fn=as_a_background_job,
        check=False,
    )
    return done.stdout + done.stderr


def test_a_run_started_with_sigint_ignored_still_lets_ctrl_c_interrupt_its_scripts(
    tmp_path: Path,
) -> None:
    report = run_pytest(
        tmp_path,
        """
        import signal, subprocess, sys, time

        def test_ctrl_c_interrupts_a_script():
            script = subprocess.Popen(
                [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            assert script.stdout.readline() == "up\\n"
            script.send_signal(signal.SIGINT)
            assert script.wait(timeout=10) == -signal.SIGINT  # (what Python does on Ctrl-C)
            assert "KeyboardInterrupt" in script.stderr.read()
        """,
        sigint_ignored=True,
    )
    assert "1 passed" in report, report


def test_a_test_that_leaves_an_environment_variable_set_fails_by_name(tmp_path: Path) -> None:
    report = run_pytest(
        tmp_path,
        """
        import os

        def test_sets_a_variable_for_good():
            os.environ["PALATINE_SET_BY_A_TEST"] = "1"

        def test_the_next_test_does_not_see_it():
            assert "PALATINE_SET_BY_A_TEST" not in os.environ
        """,
    )
    assert "ERROR test_probe.py::test_sets_a_variable_for_good" in report, report
    assert "environment variable PALATINE_SET_BY_A_TEST: None -> '1'" in report, report
    assert "2 passed, 1 error" in report, report


def test_a_test_that_leaves_a_signal_ignored_fails_by_name(tmp_path: Path) -> None:
    report = run_pytest(
        tmp_path,
        """
        import signal

        def test_ignores_sigterm_for_good():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

        def test_the_next_test_has_the_default():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        """,
    )
    assert "ERROR test_probe.py::test_ignores_sigterm_for_good" in report, report
    assert "the handler of SIGTERM: <Handlers.SIG_DFL: 0> -> <Handlers.SIG_IGN: 1>" in report
    assert "2 passed, 1 error" in report, report


def test_no_two_test_modules_share_a_name() -> None:
    # the test folders are not packages: pytest imports each module by its base name, and
    # a second module of the same name stops the whole collection ("import file mismatch")
    seen: dict[str, Path] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        other = seen.setdefault(path.name, path)
        assert other == path, f"{path.relative_to(TESTS)} and {other.relative_to(TESTS)}"
