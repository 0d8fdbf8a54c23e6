"""``palatine doctor``: each check says ok, warn or fail, and what to do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from palatine.cli.doctor import (
    check_open_files,
    check_program,
    check_reachable,
    check_tls,
    check_token,
)


def test_open_files_are_ok_raisable_or_a_failure_naming_the_need() -> None:
    assert check_open_files(1024, 4096, 100, "1x8").status == "ok"
    assert check_open_files(-1, -1, 100, "1x8").status == "ok"
    raisable = check_open_files(64, 4096, 100, "1x8")
    assert raisable.status == "warn" and "ulimit -n 100" in raisable.line()
    short = check_open_files(64, 64, 100, "2x8")
    assert short.status == "fail"
    assert "a 2x8 job needs about 100" in short.line() and "hard limit" in short.line()


def test_a_missing_program_is_a_warning_with_how_to_install_it() -> None:
    assert check_program("py-spy", "/bin/py-spy", "why", "how").status == "ok"
    missing = check_program("py-spy", None, "no native frames", "pip install x")
    assert (missing.status, missing.todo) == ("warn", "install it: pip install x")


def test_a_token_file_others_may_read_fails_with_the_chmod_to_run(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 64)
    token.chmod(0o644)
    bad = check_token({"PALATINE_CLUSTER_TOKEN_FILE": str(token)}, tmp_path / "none")
    assert bad.status == "fail" and f"chmod 600 {token}" in bad.line()
    token.chmod(0o600)
    assert check_token({"PALATINE_CLUSTER_TOKEN_FILE": str(token)}, tmp_path / "x").status == "ok"
    assert check_token({}, token).status == "ok"
    assert check_token({}, tmp_path / "not-yet").status == "ok"
    gone = check_token({"PALATINE_CLUSTER_TOKEN_FILE": str(tmp_path / "gone")}, token)
    assert gone.status == "fail"
    assert check_token({"PALATINE_CLUSTER_TOKEN": "short"}, token).status == "warn"


def test_tls_is_checked_only_when_configured_and_then_whole(tmp_path: Path) -> None:
    assert check_tls({}) is None
    partial = check_tls({"PALATINE_TLS_CERT": str(tmp_path / "c.pem")})
    assert partial is not None and partial.status == "fail"
    assert "PALATINE_TLS_KEY, PALATINE_TLS_CA unset" in partial.found
    files = {
        k: str(tmp_path / f"{k}.pem")
        for k in ("PALATINE_TLS_CERT", "PALATINE_TLS_KEY", "PALATINE_TLS_CA")
    }
    for path in files.values():
        Path(path).write_text("not pem")
    broken = check_tls(files)
    assert broken is not None and broken.status == "fail" and "do not load" in broken.found


def test_tls_files_that_load_are_ok(tmp_path: Path) -> None:
    from palatine.testing.certs import make_test_pki, tls_env

    ok = check_tls(tls_env(make_test_pki(tmp_path), "client"))
    assert ok is not None and ok.status == "ok", ok


def test_a_system_that_does_not_accept_fails_with_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert check_reachable(f"tcp:127.0.0.1:{port}").status == "ok"
    refused = check_reachable(f"tcp:127.0.0.1:{port}")
    assert refused.status == "fail" and "PALATINE_HOST_IP" in refused.todo


def test_doctor_exits_1_when_a_check_fails(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 64)
    token.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALATINE_")}
    env |= {"PALATINE_CLUSTER_TOKEN_FILE": str(token), "XDG_RUNTIME_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "palatine", "doctor"], capture_output=True,
                         text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("fail  cluster token") for line in lines), lines
    assert all(line.split()[0] in ("ok", "warn", "fail") for line in lines), lines
