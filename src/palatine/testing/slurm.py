"""A real Slurm cluster on a namespace test bed: one ``slurmd`` per node.

`SlurmTestCluster(bed)` starts, without systemd, what Debian's ``slurm-wlm`` and
``munge`` packages install: a ``munged`` of its own (as user ``munge``, with a fresh key
and socket in a directory of its own, removed by `close`), ``slurmctld`` in the root namespace listening on the
bed's bridge address, and one ``slurmd -N nodeI`` inside each node's network namespace
(``NodeAddr`` its address), all in partition ``test``. `env` is what a client needs to
reach it (``SLURM_CONF``); `close` stops every daemon and waits for it. `unavailable`
says why no cluster can be started here (not root, packages missing), for tests to skip.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Self

from palatine.testing.netns import TestBed

__all__ = ["PARTITION", "SlurmTestCluster", "unavailable"]

#: The partition every node of the test cluster is in.
PARTITION = "test"

_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


def unavailable() -> str | None:
    """Why no Slurm test cluster can be started on this machine (None: one can)."""
    if os.geteuid() != 0:
        return "Slurm daemons and network namespaces need root"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no user munge (apt-get install munge)"
    return None


def _port_pair() -> int:
    """A free TCP port whose successor is free too (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("", 0))
            port = int(a.getsockname()[1])
            if port > 65000:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two free ports in a row for slurmctld and slurmd")


class SlurmTestCluster:
    """``munged``, ``slurmctld`` and one ``slurmd`` per node of ``bed``."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        bed: TestBed,
        workdir: str | os.PathLike[str] | None = None,
        *,
        node_env: dict[int, dict[str, str]] | None = None,
        node_hidden: dict[int, str] | None = None,
    ) -> None:
        """``node_env``: variables each node's tasks get on top of the submitter's (the
        node's own TLS certificate, say), through Slurm's ``TaskProlog`` as a site
        would set them. ``node_hidden``: a directory that node's ``slurmd`` (and every
        task it starts) sees empty, an empty tmpfs in a mount namespace of its own over
        it: a filesystem that node does not mount."""
        self.bed = bed
        self.node_env = node_env or {}
        self.node_hidden = node_hidden or {}
        # munged runs as user munge: every directory above its files must be searchable
        self._own_dir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="palatine-slurm-") if workdir is None else workdir)
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._munged_pid: int | None = None

    def start(self) -> Self:
        """Start the daemons and wait (bounded) until every node is idle."""
        try:
            self._start_munge()
            self._write_conf()
            self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for i in range(self.bed.nodes):
                (self.dir / "spool" / f"node{i}").mkdir(parents=True, exist_ok=True)
                argv = ["slurmd", "-D", "-N", f"node{i}", "-f", str(self.conf)]
                hidden = self.node_hidden.get(i)
                if hidden is not None:
                    mount = 'mount -t tmpfs palatine-hidden "$0" && exec "$@"'
                    argv = [
                        "unshare", "--mount", "--propagation", "private", "--",
                        "sh", "-c", mount, hidden, *argv,
                    ]  # fmt: skip
                self._spawn([*self.bed.prefix(i), *argv], f"slurmd-node{i}")
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def _start_munge(self) -> None:
        munge_dir = self.dir / "munge"
        munge_dir.mkdir(parents=True, exist_ok=True)
        user = pwd.getpwnam("munge")
        os.chown(munge_dir, user.pw_uid, user.pw_gid)
        os.chmod(munge_dir, 0o711)  # munged wants its socket's directory searchable by all
        os.chmod(self.dir, 0o755)
        key = munge_dir / "munge.key"
        run = ["runuser", "-u", "munge", "--"]
        subprocess.run([*run, "mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
        self.munge_socket = munge_dir / "munge.sock"
        subprocess.run(
            [
                *run,
                "munged",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            check=True,
            timeout=30,
        )
        self._munged_pid = int((munge_dir / "munged.pid").read_text().split()[0])

    def _write_conf(self) -> None:
        port = _port_pair()
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName=node{i} NodeAddr={self.bed.node_ip(i)} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for i in range(self.bed.nodes)
        )
        d = self.dir
        prolog = ""
        if self.node_env:
            script = d / "task_prolog.sh"
            cases = "".join(
                f"  node{i})\n"
                + "".join(f"    echo export {k}={shlex.quote(v)}\n" for k, v in env.items())
                + "    ;;\n"
                for i, env in sorted(self.node_env.items())
            )
            script.write_text(f'#!/bin/sh\ncase "$SLURMD_NODENAME" in\n{cases}esac\n')
            script.chmod(0o755)
            prolog = f"TaskProlog={script}\n"
        self.conf.write_text(
            f"""ClusterName=palatine
SlurmctldHost={socket.gethostname()}({self.bed.root_ip})
SlurmctldPort={port}
SlurmdPort={port + 1}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
{prolog}{nodes}
PartitionName={PARTITION} Nodes=node[0-{self.bed.nodes - 1}] Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, argv: list[str], name: str) -> None:
        out = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - closed by close()
        self._logs.append(out)
        self._procs.append(
            subprocess.Popen(
                argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        )

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        states = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args!r} exited with {p.returncode}; see {self.dir}")
            done = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            states = done.stdout.strip()
            lines = states.splitlines()
            if len(lines) == self.bed.nodes and all(line.endswith(" idle") for line in lines):
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"Slurm nodes not idle within {_READY_TIMEOUT_S:g} s: {states or 'no answer'}"
        )

    def squeue(self) -> list[str]:
        """The jobs Slurm still knows of (``id state`` per line)."""
        done = subprocess.run(
            ["squeue", "-h", "-o", "%i %T"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return done.stdout.split("\n") if done.stdout.strip() else []

    def close(self) -> None:
        """Stop every daemon (TERM, then KILL) and wait for each; idempotent."""
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(_STOP_TIMEOUT_S)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._munged_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._munged_pid, 15)
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    os.kill(self._munged_pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            self._munged_pid = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
