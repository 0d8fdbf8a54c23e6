"""palatine's roles on a namespace test bed, placed as on a cluster.

`roles_on_bed(bed)` runs the system (and, with ``per_host``, a controller of world
``worker``) in the root namespace, listening on the bridge, and one ``palatine host``
(host world ``hostworker``) inside each node's namespace, over ``tcp:`` or, given one
certificate per machine (`palatine.testing.certs.make_node_pki`), mutual ``tls:``. The
client then attaches as on a cluster: ``connect(roles.system_addr, "worker")`` for a
`DeviceMesh`, or `palatine.job.jobhosts.JobHosts` for actor meshes. Every role is
killed when the block ends. The multi-node tests and ``bench/cross_node.py`` use it.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from palatine.config import roles
from palatine.config.roles import ControllerOptions, HostOptions, SystemOptions
from palatine.tensor.client.procs import RoleProcess
from palatine.testing.netns import TestBed

__all__ = ["BedRoles", "roles_on_bed"]


@dataclass
class BedRoles:
    """What `roles_on_bed` started: the system's address, the cluster token, the roles."""

    system_addr: str
    token: str
    hosts: list[RoleProcess] = field(default_factory=list)
    controller: RoleProcess | None = None


@contextlib.contextmanager
def roles_on_bed(
    bed: TestBed,
    *,
    per_host: int | None = None,
    tls: dict[str, dict[str, str]] | None = None,
    update_timeout_s: float | None = None,
    interval_s: float | None = None,
) -> Iterator[BedRoles]:
    """System here, one host per node, and with ``per_host`` a controller whose world
    ``worker`` has ``per_host`` procs on every node. ``tls`` maps each machine's address
    to its ``PALATINE_TLS_*`` variables (this process must have the root namespace's in
    its environment). ``update_timeout_s`` is the system's supervision update timeout,
    ``interval_s`` the hosts' heartbeat and the controller's query interval."""
    token = secrets.token_hex(32)
    env = {"PALATINE_CLUSTER_TOKEN": token, **(tls[bed.root_ip] if tls else {})}
    transport = "tls" if tls else "tcp"
    started: list[RoleProcess] = []
    try:
        argv = ["system", "--system-addr", f"{transport}:{bed.root_ip}:0",
                *roles.to_argv(SystemOptions(supervision_update_timeout_s=update_timeout_s))]  # fmt: skip
        system = RoleProcess(argv, env, 30)
        started.append(system)
        out = BedRoles(system.addr, token)
        for i in range(bed.nodes):
            argv = ["host", "--system-addr", system.addr, "--host-world", "hostworker",
                    "--host-rank", str(i),
                    *roles.to_argv(HostOptions(supervision_update_interval_s=interval_s))]  # fmt: skip
            node_env = {**env, "PALATINE_HOST_IP": bed.node_ip(i), **(tls[bed.node_ip(i)] if tls else {})}  # fmt: skip
            out.hosts.append(RoleProcess(argv, node_env, 60, prefix=bed.prefix(i)))
            started.append(out.hosts[-1])
        if per_host is not None:
            controller = (
                ControllerOptions()
                if interval_s is None
                else ControllerOptions(supervision_query_interval_s=interval_s)
            )
            argv = ["controller", "--worker-world", "worker", "--system-addr", system.addr,
                    "--world-size", str(bed.nodes * per_host), "--num-procs-per-host",
                    str(per_host), "--program", f"{sys.executable} -m palatine worker",
                    "--is-cpu-worker", *roles.to_argv(controller)]  # fmt: skip
            out.controller = RoleProcess(argv, env, 90)
            started.append(out.controller)
        yield out
    finally:
        for role in reversed(started):
            role.kill()
