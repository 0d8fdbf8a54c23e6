"""Client commands and the cluster token: ``palatine top``, ``stacks``, ``snapshot`` and
``stop`` never create the per-user token file. Without a token they exit 1 saying where the
job's token is; with the job's token file they reach the job's system."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from palatine import local_mesh

pytestmark = pytest.mark.timeout(120)

COMMANDS = [["top", "--once"], ["stacks"], ["snapshot"], ["stop"]]


def client_env(config_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALATINE_CLUSTER_TOKEN")}
    return {**env, "XDG_CONFIG_HOME": str(config_home), **extra}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_client_command_without_a_token_says_where_the_jobs_token_is_and_creates_none(
    tmp_path: Path, command: list[str]
) -> None:
    config_home = tmp_path / "config"
    done = subprocess.run(
        [sys.executable, "-m", "palatine", *command, "--system-addr", "unix:@palatine-none"],
        env=client_env(config_home), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert err.startswith(f"palatine {command[0]}: no cluster token: "), err
    assert "PALATINE_CLUSTER_TOKEN_FILE=<log dir>/token" in err, err
    assert not config_home.exists()  # no token file, not even its directory


@pytest.mark.parametrize(
    ("command", "answer"),
    [(["snapshot", "--world", "worker"], "worker[0]"),
     (["stop", "--world", "nothing"], "unknown: ['nothing']")],
    ids=lambda c: c[0] if isinstance(c, list) else "",
)  # fmt: skip
def test_a_client_command_with_the_jobs_token_file_reaches_its_system(
    tmp_path: Path, command: list[str], answer: str
) -> None:
    with local_mesh(1, 1) as mesh:
        cluster = mesh._local
        assert cluster is not None
        token = tmp_path / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, cluster.env["PALATINE_CLUSTER_TOKEN"].encode())
        os.close(fd)
        config_home = tmp_path / "config"
        done = subprocess.run(
            [sys.executable, "-m", "palatine", command[0], "--system-addr",
             str(cluster.system_addr), *command[1:]],
            env=client_env(config_home, PALATINE_CLUSTER_TOKEN_FILE=str(token)),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert answer in done.stdout
        assert not config_home.exists()
