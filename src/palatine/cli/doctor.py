"""``palatine doctor``: check this machine for what palatine jobs need, and say what to do.

    palatine doctor [--system-addr ADDR | --job ID|latest] [--hosts N --procs-per-host M]

Each check is one line, ``ok``, ``warn`` or ``fail``, with what was found and, when it is
not ok, what to do about it:

* the open-files limit (``ulimit -n``) against what a job of the given shape needs
  (palatine raises the soft limit itself, up to the hard one);
* py-spy, for native frames in ``palatine stacks --native`` and dumps of a stuck proc;
* setproctitle, so that ``ps`` tells the ranks apart;
* the cluster token: where it comes from, and that its file is this user's alone (0600);
* the TLS files, when ``PALATINE_TLS_*`` are set: present, readable, a certificate and
  key that match;
* the runtime directory of job records (``palatine ps``);
* with ``--system-addr``, ``--job`` or ``PALATINE_SYSTEM_ADDR``: whether this machine (a
  node) reaches the job's system (on the submitting host) within a few seconds.

Exit 1 when a check fails, else 0. The checks are functions of what they look at
(`check_open_files`, `check_token`, ...), so each is tested without this machine's state.
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

__all__ = [
    "Check",
    "add_arguments",
    "check_open_files",
    "check_program",
    "check_reachable",
    "check_tls",
    "check_token",
    "run",
]

Status = Literal["ok", "warn", "fail"]

_REACH_S = 3.0  # a system that does not accept within this is unreachable from here


class Check(NamedTuple):
    """One check's outcome: its status, what was found, and what to do (not ok)."""

    status: Status
    name: str
    found: str
    todo: str = ""

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.found}"
        return f"{text}; {self.todo}" if self.todo else text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from palatine.cli.target import add_target_flags

    add_target_flags(p)
    p.add_argument(
        "--hosts", type=int, default=1, help="hosts of the job to check for (open files)"
    )
    p.add_argument("--procs-per-host", type=int, default=8, help="procs per host of that job")


def check_open_files(soft: int, hard: int, needed: int, shape: str) -> Check:
    """``ulimit -n`` (``soft``, ``hard``; -1: unlimited) against ``needed``."""
    name = "open files (ulimit -n)"
    found = f"soft {_limit(soft)}, hard {_limit(hard)}; a {shape} job needs about {needed}"
    if soft < 0 or soft >= needed:
        return Check("ok", name, found)
    if hard < 0 or hard >= needed:
        return Check("warn", name, found, "palatine raises the soft limit itself up to the "
                     f"hard one; 'ulimit -n {needed}' in the job's shell avoids relying on it")  # fmt: skip
    return Check("fail", name, found, f"ask for a hard limit of at least {needed} "
                 "(limits.conf nofile, or the scheduler's), or run a smaller job")  # fmt: skip


def _limit(n: int) -> str:
    return "unlimited" if n < 0 else str(n)


def check_program(name: str, where: str | None, why: str, install: str) -> Check:
    """A helper program or module (``where``: its path, None when missing)."""
    if where:
        return Check("ok", name, f"found ({where})")
    return Check("warn", name, f"missing: {why}", f"install it: {install}")


def check_token(environ: Mapping[str, str], default: Path) -> Check:
    """Where the cluster token comes from, and whether its file is private."""
    from palatine.channel.token import MIN_TOKEN_BYTES, TOKEN_ENV, TOKEN_FILE_ENV

    name = "cluster token"
    if environ.get(TOKEN_ENV) is not None:
        n = len(os.fsencode(environ[TOKEN_ENV]))
        if n < MIN_TOKEN_BYTES:
            return Check("warn", name, f"{TOKEN_ENV} holds only {n} bytes",
                         f"use at least {MIN_TOKEN_BYTES} random bytes")  # fmt: skip
        return Check("ok", name, f"from {TOKEN_ENV}")
    path = Path(environ[TOKEN_FILE_ENV]) if environ.get(TOKEN_FILE_ENV) else default
    source = TOKEN_FILE_ENV if environ.get(TOKEN_FILE_ENV) else "the per-user file"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if source == TOKEN_FILE_ENV:
            return Check("fail", name, f"{TOKEN_FILE_ENV} names {path}, which does not exist",
                         "point it at the job's token file (palatine ps shows it)")  # fmt: skip
        return Check("ok", name, f"{path} does not exist yet: the first job creates it (0600)")
    except OSError as e:
        return Check("fail", name, f"cannot read {path}: {e}", "check its permissions")
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return Check("fail", name, f"{path} is not a regular file", "point at the token file")
    if mode & 0o066:
        return Check("fail", name, f"{path} ({source}) has mode {mode:04o}: group or others "
                     "may read it", f"chmod 600 {path}")  # fmt: skip
    if st.st_uid != os.getuid():
        return Check("warn", name, f"{path} belongs to uid {st.st_uid}, not to this user",
                     "use a token file of your own")  # fmt: skip
    return Check("ok", name, f"{path} ({source}), mode {mode:04o}")


def check_tls(environ: Mapping[str, str]) -> Check | None:
    """The TLS files, when any ``PALATINE_TLS_*`` is set (None: TLS is not configured)."""
    import ssl

    from palatine.channel.tls import CA_ENV, CERT_ENV, KEY_ENV

    names = (CERT_ENV, KEY_ENV, CA_ENV)
    given = {n: environ.get(n, "") for n in names}
    if not any(given.values()):
        return None
    name = "TLS files"
    missing = [n for n, v in given.items() if not v]
    if missing:
        return Check("fail", name, f"{', '.join(missing)} unset",
                     "set all three of PALATINE_TLS_CERT, _KEY and _CA")  # fmt: skip
    unreadable = [f"{n}={v}" for n, v in given.items() if not os.access(v, os.R_OK)]
    if unreadable:
        return Check("fail", name, f"cannot read {', '.join(unreadable)}",
                     "check the paths and their permissions")  # fmt: skip
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(given[CERT_ENV], given[KEY_ENV])
        ctx.load_verify_locations(given[CA_ENV])
    except (ssl.SSLError, OSError) as e:
        return Check("fail", name, f"do not load: {e}",
                     "the certificate and key must match, all three in PEM")  # fmt: skip
    key_mode = stat.S_IMODE(os.stat(given[KEY_ENV]).st_mode)
    if key_mode & 0o077:
        return Check("warn", name, f"the key {given[KEY_ENV]} has mode {key_mode:04o}",
                     f"chmod 600 {given[KEY_ENV]}")  # fmt: skip
    return Check("ok", name, f"certificate, key and CA load ({given[CERT_ENV]})")


def check_reachable(addr: str, connect: Callable[[str, float], None] | None = None) -> Check:
    """Whether this machine reaches the system at ``addr`` (a connection, no more)."""
    name = "the job's system"
    try:
        (connect or _connect)(addr, _REACH_S)
    except (OSError, ValueError) as e:
        return Check("fail", name, f"{addr} is not reachable from {socket.gethostname()}: {e}",
                     "check that the submitting host's address (PALATINE_HOST_IP) is one "
                     "this node routes to and no firewall drops the port")  # fmt: skip
    return Check("ok", name, f"{addr} accepts connections from {socket.gethostname()}")


def _connect(text: str, timeout_s: float) -> None:
    from palatine.channel.addr import ChannelAddr

    addr = ChannelAddr.parse(text)
    if addr.transport in ("tcp", "tls"):
        socket.create_connection((addr.host, addr.port), timeout=timeout_s).close()
        return
    if addr.transport == "unix":
        target = addr.path if addr.path is not None else "\0" + (addr.name or "")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(target)
        return
    raise ValueError(f"a {addr.transport} address is not reachable from another process")


def _checks(args: argparse.Namespace) -> list[Check]:
    import resource

    from palatine.channel.token import default_token_path
    from palatine.hosting.limits import mesh_open_files
    from palatine.hosting.stacks import find_pyspy
    from palatine.job.records import RecordDir

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    out = [
        check_open_files(-1 if soft == inf else soft, -1 if hard == inf else hard,
                         mesh_open_files(args.hosts, args.procs_per_host),
                         f"{args.hosts}x{args.procs_per_host}"),
        check_program("py-spy", find_pyspy(), "no native frames in 'palatine stacks "
                      "--native'", "pip install 'palatine[debug]' with its py-spy on PATH, "
                      "or PALATINE_PYSPY=<path>"),
        check_program("setproctitle", _module_file("setproctitle"), "processes keep "
                      "python's name in ps and top", "pip install setproctitle"),
        check_token(os.environ, default_token_path()),
    ]  # fmt: skip
    tls = check_tls(os.environ)
    if tls is not None:
        out.append(tls)
    try:
        out.append(Check("ok", "job records", f"{RecordDir().ensure()} (mode 0700)"))
    except OSError as e:
        out.append(Check("fail", "job records", str(e), "remove it, or set XDG_RUNTIME_DIR"))
    if args.system_addr is not None:
        out.append(check_reachable(str(args.system_addr)))
    return out


def _module_file(module: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None else None


def run(args: argparse.Namespace) -> int:
    from palatine.cli.target import resolve_target

    wants_job = args.job is not None or os.environ.get("PALATINE_SYSTEM_ADDR")
    if wants_job:
        resolve_target(args, "doctor")
    checks = _checks(args)
    for c in checks:
        print(c.line())
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    print(f"{len(checks)} checks: {failed} failed, {warned} warnings", file=sys.stderr)
    return 1 if failed else 0
