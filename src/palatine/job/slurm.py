"""Jobs on a Slurm cluster: hosts allocated by ``sbatch``, a mesh over them.

``SlurmJob(hosts=2, procs_per_host=4, partition="gpu")`` is declarative: `apply` submits
it, `state` waits until every allocated host has joined, `mesh` gives the same
`DeviceMesh` that ``local_mesh`` gives, `host_mesh` the job's hosts for the actor API,
`cancel` (or leaving ``with``) tears it all down.

Where things run, and why:

* **The system and the controller run with the client**, on the submitting machine.
  The client is the one long-lived process of a single-controller job, and the nodes
  only have to reach one address (the system's), which exists before ``sbatch`` is
  called, so the batch script can name it. They listen on ``PALATINE_HOST_IP`` (the
  address the nodes reach this machine on; else this machine's address on the route to
  the partition's first node, by its ``NodeAddr``) on a free port. Where that leaves only
  a loopback address, a warning says so at once; an address this machine cannot listen
  on is a `SchedulerError` at once, naming it and where it came from.
* **One ``palatine host`` per node**, started by ``srun`` inside the allocation; it takes
  its identity from the scheduler (``--host-rank $SLURM_NODEID``), joins the system over
  TCP or TLS and starts that node's worker procs when the controller's world is placed.
  Its output goes to ``<log dir>/slurm-<job id>.out``.
* **The log dir is on the submit directory's filesystem** by default
  (``./palatine-logs/<job>``, unless ``log_dir`` or ``PALATINE_LOG_DIR`` says otherwise),
  not this machine's temp dir, which the nodes do not share: Slurm writes the hosts'
  output there, and the hosts write their procs' logs there.
* **A short probe checks the nodes first**: each node says whether it sees the log dir
  and the Python interpreter. In a job of its own, each node's host task runs it before
  the host (one step: a second step could wait on the first one's resources), and a node
  that fails it ends the job; its words reach the client through the batch output in the
  log dir, which the batch node sees (else Slurm could not have started it). Inside an
  allocation, `apply` runs it as one step before the hosts' step. A node that lacks
  either is a `SchedulerError` naming the node and what it lacks.
* **Slurm's state is read from ``squeue --json``** where the installed Slurm has it
  (`squeue_state`), from ``squeue -o %T`` where it does not.

``sbatch``'s refusals arrive as `SchedulerError` with its own words (``sbatch: error:
invalid partition specified``); a job that fails, is cancelled or times out in the queue
before its hosts joined is reported by name and state. `cancel` runs ``scancel``, stops
the controller and the system, and waits until Slurm no longer lists the job. A job
that Slurm ends under the program (``scancel``, its time limit, preemption: the state
``scontrol`` reports) is named (`ended_by_slurm`): a note on the `DeviceException` that
leaves ``with``, and a warning when the job is torn down.

**Inside an allocation** (a batch script, ``salloc``: ``SLURM_JOB_ID`` is set), nothing
is submitted: the hosts run as one step of that allocation (``srun``, one task per
node, rank ``$SLURM_PROCID``), the system and the controller run here, on the batch
node, and listen on its ``NodeAddr`` (what Slurm itself reaches it at) unless
``PALATINE_HOST_IP`` says otherwise; one that is not an address of this node (inherited
from the shell that submitted the batch script) is ignored, with a warning. `cancel`
ends the step, not the allocation: the
batch script goes on. ``use_allocation=False`` submits a job of its own anyway.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import msgspec

from palatine import config
from palatine.channel.addr import ChannelAddr, is_loopback_host, listen_error, pick_host
from palatine.channel.token import token_env
from palatine.config import roles
from palatine.config.roles import ControllerOptions, HostOptions, SystemOptions
from palatine.errors import AddrParseError, DeviceException, SchedulerError
from palatine.hosting.child_env import Handoff
from palatine.hosting.limits import check_open_files, mesh_open_files
from palatine.job.jobhosts import JobHosts
from palatine.job.metrics import MetricsEndpoint, metrics_endpoint
from palatine.job.records import RECORD_ENV, RecordDir, announce
from palatine.job.records import JobRecord as RunningJob
from palatine.output.logs import LogSession
from palatine.tensor.client.local import LocalCluster, check_shape, connect
from palatine.tensor.client.scheduler import (
    SCHEDULER_TIMEOUT_S,
    scheduler_output,
    scontrol_field,
    slurm_ended,
)

if TYPE_CHECKING:
    from palatine.tensor.client.mesh import DeviceMesh

__all__ = ["JobRecord", "SlurmJob", "cancel_steps", "find_job", "squeue_state", "steps_named"]

log = logging.getLogger(__name__)

_COMMENT = "palatine:"  # sbatch --comment=palatine:<log dir>: where the job's record is

_PROBE_MARK = "palatine probe:"  # a probe's line naming what a node lacks
_PROBE_TIMEOUT_S = 60.0  # the probe step inside an allocation (srun, one task per node)
_STEP_STOP_S = 10.0  # the hosts' step, after SIGTERM, before SIGKILL
_GONE_TIMEOUT_S = 30.0  # a cancelled job leaving squeue
_COMPLETING_WAIT_S = 2.0  # ... once it is COMPLETING: ended, its nodes yet to confirm
_ENDED = (
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "COMPLETED",
)


_ROLE_KINDS = (SystemOptions, HostOptions, ControllerOptions)


class _SlurmCluster(LocalCluster):
    """The roles a Slurm job runs with its client; stopping them cancels the job first."""

    def __init__(self, env: dict[str, str], logs: LogSession, job: SlurmJob) -> None:
        super().__init__(env, logs)
        self.job = job

    def stop(self, grace_s: float = 5.0, *, clean: bool = True) -> None:
        self.job._release()
        super().stop(grace_s, clean=clean)


class SlurmJob:
    """A mesh of ``hosts`` × ``procs_per_host`` worker procs on nodes Slurm allocates."""

    def __init__(
        self,
        hosts: int,
        procs_per_host: int,
        *,
        partition: str | None = None,
        time_limit: str | None = None,
        account: str | None = None,
        gpus_per_node: int | None = None,
        python: str | None = None,
        sbatch_args: tuple[str, ...] | list[str] = (),
        log_dir: str | None = None,
        transport: str = "tcp",
        startup_timeout_s: float | None = None,
        job_name: str = "palatine",
        use_allocation: bool | None = None,
        start_timeout_s: float | None = None,
        **options: Any,
    ) -> None:
        """``startup_timeout_s`` (default 300; ``start_timeout_s`` is its older name):
        bound of queue time plus start-up. ``options``: the roles' (`SystemOptions`,
        `HostOptions`, `ControllerOptions` of `palatine.config.roles`), as `local_mesh`
        takes them; an unknown key is a `TypeError` naming it and the allowed ones."""
        check_shape(hosts, procs_per_host)
        startup_timeout_s = roles.renamed(
            "SlurmJob", "startup_timeout_s", startup_timeout_s, "start_timeout_s", start_timeout_s
        )
        values = roles.sort_kwargs("SlurmJob", options, _ROLE_KINDS, also=_OWN_PARAMS)
        self.system_options = roles.build("SlurmJob", SystemOptions, values)
        self.host_options = roles.build("SlurmJob", HostOptions, values)
        self.controller_options = roles.build("SlurmJob", ControllerOptions, values)
        if transport not in ("tcp", "tls"):
            raise ValueError(f"transport must be 'tcp' or 'tls', not {transport!r}")
        self.hosts = hosts
        self.procs_per_host = procs_per_host
        self.partition = partition
        self.time_limit = time_limit
        self.account = account
        self.gpus_per_node = gpus_per_node
        self.python = python or sys.executable
        self.sbatch_args = list(sbatch_args)
        self.log_dir = log_dir
        self.transport = transport
        self.startup_timeout_s = 300.0 if startup_timeout_s is None else startup_timeout_s
        self.job_name = job_name
        # None: inside an allocation (SLURM_JOB_ID set) use it, else submit (module doc)
        self.use_allocation = use_allocation
        self.job_id: str | None = None
        self._in_allocation = False  # `apply` used the allocation it runs in
        self._commented = False  # ... and set its comment (to where the record is)
        self._step: subprocess.Popen[bytes] | None = None  # the hosts, in an allocation
        self._cluster: _SlurmCluster | None = None
        self._token = ""
        self._published: str | None = None  # the id of this job's record (`_publish`)
        self._mesh: DeviceMesh | None = None
        self._hosts: JobHosts | None = None
        self._deadline = 0.0
        self._host_scope: contextlib.AbstractContextManager[Any] | None = None
        self._host = ""  # where the system listens (`_listen_host`)
        self._ended_by: str | None = None  # `ended_by_slurm` once asked ("": Slurm did not)
        self._loopback_note = ""  # what a failure to join adds (`_listen_host`)

    @property
    def metrics(self) -> MetricsEndpoint | None:
        """Where the job's system serves its metrics (``metrics_addr=``; None without it,
        or before `apply`): HTTPS under ``transport="tls"``, to the scrape token in the
        log dir's ``metrics-token``, never the cluster token."""
        return metrics_endpoint(self._cluster)

    # ------------------------------------------------------------ submit
    def apply(self) -> str:
        """Start the system and controller here and submit the hosts (inside an
        allocation: start them as a step of it); the job id."""
        if self.job_id is not None:
            return self.job_id
        self._in_allocation = False
        check_open_files(
            mesh_open_files(self.hosts, self.procs_per_host),
            f"a job of {self.hosts * self.procs_per_host} procs",
        )
        allocation = self._allocation()
        host = self._host = self._listen_host(allocation)
        logs = _log_session(self.log_dir)
        self._token = secrets.token_hex(32)
        env = {"PALATINE_CLUSTER_TOKEN": self._token, "PALATINE_LOG_DIR": str(logs.path)}
        env[RECORD_ENV] = "launcher"  # (the job's record is this object's: `_record`)
        cluster = _SlurmCluster(env, logs, self)
        self._cluster = cluster
        self._deadline = time.monotonic() + self.startup_timeout_s
        try:
            cluster.env["PALATINE_HOST_IP"] = host  # (the controller listens there too)
            system = cluster.start(
                [
                    "system",
                    "--system-addr",
                    f"{self.transport}:{host}:0",
                    *roles.to_argv(self.system_options),
                ],
                60.0,
                "system",
            )
            cluster.system_addr = system.addr
            if allocation:
                self._in_allocation = True  # (never scancel it: it is not ours)
                self._probe(logs, allocation)
                self._step = self._srun(system.addr, logs, allocation)
                self.job_id = allocation
            else:
                self.job_id = self._sbatch(system.addr, logs)
            self._record(system.addr, logs)
            ctl = [
                "controller", "--worker-world", "worker", "--system-addr", system.addr,
                "--world-size", str(self.hosts * self.procs_per_host),
                "--num-procs-per-host", str(self.procs_per_host),
                "--program", f"{shlex.quote(self.python)} -m palatine worker",
                *roles.to_argv(self.controller_options),
            ]  # fmt: skip
            if not self.gpus_per_node:
                ctl.append("--is-cpu-worker")
            cluster.start(ctl, self.startup_timeout_s, "controller", wait=False)
        except BaseException:
            self._cluster = None
            cluster.stop(1.0, clean=False)
            self._leave_host_scope()
            raise
        return self.job_id

    def _listen_host(self, allocation: str | None) -> str:
        """Where the system and the controller listen (module doc): ``PALATINE_HOST_IP``;
        inside an allocation, this node's ``NodeAddr``; else the local address on the
        route to the partition's first node. Warns at once when that is a loopback the
        nodes cannot reach; `SchedulerError` when this machine cannot listen there,
        naming the address and where it came from."""
        configured = config.get().host_ip
        host, origin = (configured, "PALATINE_HOST_IP") if configured else (None, "")
        if host is not None and allocation is not None and listen_error(host) is not None:
            # inherited from the shell that submitted the batch script, most likely
            log.warning(
                "PALATINE_HOST_IP=%s is not an address of this node (%s), which runs Slurm "
                "allocation %s: ignored",
                host,
                socket.gethostname(),
                allocation,
            )
            host = None
        peers: list[ChannelAddr] = []
        if host is None and allocation is not None:
            name = os.environ.get("SLURMD_NODENAME")
            node = _node_addr(name)
            if node is not None:
                host, origin = node, f"the NodeAddr of {name} in Slurm"
        if host is None:
            peers = [] if allocation is not None else _node_addrs(self.partition)
            host, origin = pick_host(peers, use_config=False)
        problem = listen_error(host)
        if problem is not None:
            raise SchedulerError(f"cannot listen on {host} ({origin}): {problem}")
        if configured and host != configured:
            self._host_scope = config.override(host_ip=host)
            self._host_scope.__enter__()  # (this process's own client listens there too)
        chosen = origin not in ("PALATINE_HOST_IP", "") and not origin.startswith("the NodeAddr")
        if chosen and is_loopback_host(host) and not (peers and peers[0].is_loopback):
            whom = ", ".join(p.host for p in peers[:3]) or "the nodes"
            log.warning(
                "the system listens on %s (%s), a loopback address %s cannot reach: "
                "set PALATINE_HOST_IP to this machine's address on the cluster network",
                host,
                origin,
                whom,
            )
            self._loopback_note = (
                f"; the system listens on loopback {host} ({origin}), which the nodes "
                "cannot reach: set PALATINE_HOST_IP"
            )
        return host

    def _allocation(self) -> str | None:
        """The allocation this process runs in, if the job is to use it (module doc);
        `SchedulerError` when it has fewer nodes than the job asks for."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job or self.use_allocation is False:
            if self.use_allocation:
                raise SchedulerError(
                    "use_allocation=True, but this is not inside a Slurm allocation (no SLURM_JOB_ID)"
                )
            return None
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or ""
        if nodes.isdigit() and int(nodes) < self.hosts:
            raise SchedulerError(
                f"allocation {job} has {nodes} node(s); the job asks for {self.hosts} hosts "
                "(use_allocation=False, or palatine launch --submit, submits a job of its own)"
            )
        return job

    def _probe(self, logs: LogSession, allocation: str) -> None:
        """Inside an allocation: one short step on the job's nodes; a `SchedulerError`
        naming each node that does not see the log dir or the Python interpreter."""
        argv = [
            "srun", "--overlap", f"--nodes={self.hosts}", f"--ntasks={self.hosts}",
            "--ntasks-per-node=1", f"--job-name={self.job_name}-probe",
            *_probe_argv(logs, self.python),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                argv, env=self._job_env(), stdin=subprocess.DEVNULL, capture_output=True,
                text=True, timeout=_PROBE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except FileNotFoundError:
            raise SchedulerError("srun not found in this allocation") from None
        except subprocess.TimeoutExpired:
            raise SchedulerError(
                f"Slurm allocation {allocation}: the probe step on its nodes did not end "
                f"within {_PROBE_TIMEOUT_S:g} s"
            ) from None
        lacking = _probe_findings(done.stdout)
        if lacking:
            raise SchedulerError(_probe_text(f"Slurm allocation {allocation}", lacking))
        if done.returncode != 0:
            words = done.stderr.strip() or f"exit status {done.returncode}"
            raise SchedulerError(
                f"Slurm allocation {allocation}: the probe step on its nodes failed: {words}"
            )

    def _srun(self, system_addr: str, logs: LogSession, allocation: str) -> subprocess.Popen[bytes]:
        """The hosts as one step of this allocation: one task per node. ``--overlap``:
        the step shares the allocation with any step already holding it (an interactive
        ``srun --pty bash``), instead of waiting for it to end."""
        argv = [
            "srun", "--overlap", "--kill-on-bad-exit=1", f"--nodes={self.hosts}",
            f"--ntasks={self.hosts}",
            "--ntasks-per-node=1", f"--job-name={self.job_name}",
            f"--output={logs.path}/slurm-{allocation}-hosts.out",
            "bash", "-c", _host_command("SLURM_PROCID", self.host_options), self.python,
            system_addr,
        ]  # fmt: skip
        try:
            return subprocess.Popen(
                argv, env=self._job_env(), stdin=subprocess.DEVNULL, start_new_session=True
            )
        except FileNotFoundError:
            raise SchedulerError("srun not found in this allocation") from None

    def _sbatch(self, system_addr: str, logs: LogSession) -> str:
        script = Path(logs.file("palatine-hosts.sbatch"))
        probe = _probe_script(str(logs.path), self.python)
        script.write_text(
            "#!/bin/bash\n"
            "# One palatine host per allocated node; each joins the client's system, once\n"
            "# its node has shown that it sees the log dir and the Python interpreter.\n"
            "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c "
            f"{shlex.quote(probe + '; ' + _host_command('SLURM_NODEID', self.host_options))} "
            f"{shlex.quote(self.python)} {shlex.quote(system_addr)}\n"
        )
        argv = [
            "sbatch", "--parsable", f"--job-name={self.job_name}", f"--nodes={self.hosts}",
            "--ntasks-per-node=1", f"--output={logs.path}/slurm-%j.out",
            f"--comment={_COMMENT}{logs.path}",
        ]  # fmt: skip
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.time_limit:
            argv.append(f"--time={self.time_limit}")
        if self.account:
            argv.append(f"--account={self.account}")
        if self.gpus_per_node:
            argv.append(f"--gpus-per-node={self.gpus_per_node}")
        argv += [*self.sbatch_args, str(script)]
        try:
            done = subprocess.run(
                argv,
                env=self._job_env(),
                capture_output=True,
                text=True,
                timeout=SCHEDULER_TIMEOUT_S,
                check=False,
            )
        except FileNotFoundError:
            raise SchedulerError("sbatch not found: is this a Slurm submit host?") from None
        except subprocess.TimeoutExpired:
            raise SchedulerError(
                f"sbatch did not answer within {SCHEDULER_TIMEOUT_S:g} s"
            ) from None
        if done.returncode != 0:
            words = done.stderr.strip() or f"exit status {done.returncode}"
            raise SchedulerError(f"sbatch refused the job: {words}")
        return done.stdout.strip().split(";", 1)[0]

    def _record(self, system_addr: str, logs: LogSession) -> None:
        """Leave what ``palatine job status|cancel`` need in the log dir: the record, and
        the cluster token in a file only this user can read."""
        assert self.job_id is not None
        token = Path(logs.file("token"))
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._token)
        record = JobRecord(
            job_id=self.job_id,
            system_addr=system_addr,
            worker_world="worker",
            hosts=self.hosts,
            procs_per_host=self.procs_per_host,
            transport=self.transport,
            log_dir=str(logs.path),
            pid=os.getpid(),
            machine=socket.gethostname(),
            step_name=self.job_name if self._in_allocation else None,
        )
        Path(logs.file("job.json")).write_bytes(msgspec.json.encode(record))
        self._publish(system_addr, token, logs)
        # sbatch set the comment of a job of our own; an allocation's is set only where its
        # owner left none, and cleared again when the step ends (`_end_step`)
        if self._in_allocation and _comment_of(self.job_id) is None:
            self._commented = (
                scheduler_output(
                    ["scontrol", "update", f"JobId={self.job_id}", f"Comment={_COMMENT}{logs.path}"]
                )
                is not None
            )

    def _publish(self, system_addr: str, token: Path, logs: LogSession) -> None:
        """The job's record in this user's runtime dir (`palatine.job.records`), under
        its Slurm job id, for ``palatine ps`` and ``--job``; its mesh's ``job_id`` too."""
        assert self.job_id is not None and self._cluster is not None
        self._cluster.env[Handoff.variable("job_id")] = self.job_id
        rec = RunningJob(
            id=self.job_id,
            system_addr=system_addr,
            token_file=str(token),
            log_dir=str(logs.path),
            pid=os.getpid(),
            started=time.time(),
            shape=f"{self.hosts}x{self.procs_per_host}",
            machine=socket.gethostname(),
            scheduler_job=self.job_id,
        )
        try:
            RecordDir().write(rec)
            self._published = self.job_id
        except (OSError, ValueError) as e:
            log.warning(
                "Slurm job %s: cannot write its record for 'palatine ps': %s", self.job_id, e
            )
        announce(self.job_id)

    def _unpublish(self) -> None:
        published, self._published = self._published, None
        if published is not None:
            with contextlib.suppress(OSError, ValueError):
                RecordDir().remove(published)

    def client_env(self) -> dict[str, str]:
        """What a client program needs to attach with ``palatine.connect()`` (``palatine
        launch`` hands it over), once applied."""
        if self._cluster is None or self.job_id is None:
            raise RuntimeError("the job is not applied: call apply() first")
        handed = Handoff(
            system_addr=self._cluster.system_addr, worker_world="worker", job_id=self.job_id
        )
        # (it listens where the system does: an inherited PALATINE_HOST_IP may not apply)
        return handed.to_env() | token_env(self._token) | {"PALATINE_HOST_IP": self._host}

    def _job_env(self) -> dict[str, str]:
        """What the hosts inherit: this environment, less what names this machine or process."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PALATINE_HOST_IP", "PALATINE_LIFELINE_FD")
        }
        env["PALATINE_CLUSTER_TOKEN"] = self._token
        if self._cluster is not None:
            env["PALATINE_LOG_DIR"] = str(self._cluster.logs.path)
        return env

    # ------------------------------------------------------------ wait, use
    def job_state(self) -> str | None:
        """Slurm's word for the job (``PENDING``, ``RUNNING``, ...); None once it is gone,
        ``UNKNOWN`` when ``squeue`` does not answer."""
        if self.job_id is None:
            return None
        return squeue_state(self.job_id)

    def state(self) -> str:
        """Wait until every host has joined and the workers are up (bounded by the start
        timeout); ``"Live"``. A job that ends first is a `SchedulerError` naming its state."""
        cluster = self._cluster
        if cluster is None:
            self.apply()
            cluster = self._cluster
        assert cluster is not None
        controller = cluster.procs[-1]
        while controller.ready is None:
            if controller.popen.poll() is not None or time.monotonic() > self._deadline:
                break
            step = self._step
            if step is not None:
                if step.poll() is not None:
                    raise SchedulerError(self._step_ended_text(step.returncode))
            else:
                st = self.job_state()
                # gone from the queue: ended (squeue lists a job from the moment sbatch returns)
                if st in _ENDED or st is None:
                    raise SchedulerError(self._ended_text(st))
            controller.ready_within(0.5)
        if controller.ready is None:
            left = max(0.1, self._deadline - time.monotonic())
            try:
                cluster.wait_ready([controller], left)
            except RuntimeError as e:
                raise SchedulerError(f"Slurm job {self.job_id}: {e}{self._loopback_note}") from None
        return "Live"

    def _ended_text(self, state: str | None) -> str:
        out = ""
        if self._cluster is not None and self.job_id is not None:
            path = self._cluster.logs.path / f"slurm-{self.job_id}.out"
            if path.exists():
                text = path.read_text(errors="replace")
                lacking = _probe_findings(text)
                if lacking:  # the batch script's probe step: that is why it ended
                    return _probe_text(f"Slurm job {self.job_id}", lacking)
                out = "\n" + "\n".join(text.splitlines()[-20:])
        return (
            f"Slurm job {self.job_id} ended before its hosts joined: "
            f"{state or 'gone from the queue'}{self._loopback_note}{out}"
        )

    def _step_ended_text(self, code: int) -> str:
        out = ""
        if self._cluster is not None:
            path = self._cluster.logs.path / f"slurm-{self.job_id}-hosts.out"
            if path.exists():
                out = "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return (
            f"the hosts' step in Slurm allocation {self.job_id} ended before they joined "
            f"({how}){self._loopback_note}{out}"
        )

    def mesh(self) -> DeviceMesh:
        """The job's `DeviceMesh` (dims ``host`` and ``proc``), once every host joined."""
        if self._mesh is None:
            self.state()
            assert self._cluster is not None
            self._mesh = connect(
                self._cluster.system_addr,
                "worker",
                timeout_s=60.0,
                _local=self._cluster,
                _token=self._token,
            )
        return self._mesh

    def host_mesh(self) -> JobHosts:
        """The job's hosts (``{"hosts": hosts}``) for the actor API, once every host
        joined: ``job.host_mesh().spawn_procs(per_host={"procs": 2}).spawn(...)``."""
        if self._hosts is None:
            self.state()
            assert self._cluster is not None
            self._hosts = JobHosts(
                self._cluster.system_addr, self._token, "hostworker", self.hosts, self.python
            )
        return self._hosts

    # ------------------------------------------------------------ teardown
    def ended_by_slurm(self) -> str | None:
        """How Slurm itself ended this job, in words (``Slurm job 7 was cancelled
        (scancel)``), once it reports such a state; None while the job runs or when Slurm
        does not say (`slurm_ended`). Asked once: the answer is kept."""
        if self._ended_by is None and self.job_id is not None:
            self._ended_by = slurm_ended(self.job_id) or ""
        return self._ended_by or None

    def _release(self) -> None:
        """What the job holds from Slurm goes: the hosts' step in an allocation, else the
        job of our own. A job Slurm ended under us is said to have been (a warning), for
        the program that lost its ranks to it only saw them go."""
        self._unpublish()
        told = self._ended_by is not None
        cause = self.ended_by_slurm()
        if cause is not None and not told:
            log.warning("%s while the job ran: Slurm stopped its hosts and workers", cause)
        if self._in_allocation:
            self._end_step()
        else:
            self._scancel()

    def _end_step(self) -> None:
        """End the hosts' step: SIGTERM to ``srun``, which passes it to the hosts; if
        that is not enough within `_STEP_STOP_S`, ``scancel`` of the step itself (never
        of the allocation), then SIGKILL to ``srun``. The allocation goes on."""
        step, self._step = self._step, None
        job, self.job_id = self.job_id, None
        if job is not None and self._commented:
            self._commented = False
            scheduler_output(["scontrol", "update", f"JobId={job}", "Comment="])
        if step is None or step.poll() is not None:
            return
        step.send_signal(signal.SIGTERM)
        try:
            step.wait(_STEP_STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        if job is not None:
            cancel_steps(job, self.job_name)
        step.kill()
        try:
            step.wait(_STEP_STOP_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - srun ignoring SIGKILL
            pass

    def _scancel(self) -> None:
        """Cancel the allocation and wait (bounded) until Slurm no longer lists it.

        A job Slurm lists as ``COMPLETING`` has ended: Slurm waits for its nodes to
        confirm, and a node it cannot reach (cut off) keeps it there for as long as that
        takes, which palatine cannot shorten; so that state is waited for only
        `_COMPLETING_WAIT_S` more, not the whole bound."""
        job, self.job_id = self.job_id, None
        if job is None:
            return
        try:
            subprocess.run(
                ["scancel", job], capture_output=True, timeout=SCHEDULER_TIMEOUT_S, check=False
            )
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return
        self.job_id = job
        deadline = time.monotonic() + _GONE_TIMEOUT_S
        while time.monotonic() < deadline:
            state = self.job_state()
            if state is None or state in _ENDED:  # (squeue keeps an ended job for a while)
                break
            if state == "COMPLETING":
                deadline = min(deadline, time.monotonic() + _COMPLETING_WAIT_S)
            time.sleep(0.1)
        self.job_id = None

    def cancel(self, *, clean: bool = False) -> None:
        """Tear everything down: the mesh, the allocation, the controller and the system.
        The logs are kept (a warning names them) unless the mesh ended cleanly or ``clean``."""
        hosts, self._hosts = self._hosts, None
        if hosts is not None:
            hosts.close()
        mesh, self._mesh = self._mesh, None
        if mesh is not None:
            mesh.shutdown()  # its cluster's stop cancels the job
        elif self._cluster is not None:
            self._cluster.stop(5.0, clean=clean)
        self._cluster = None
        self._release()
        self._leave_host_scope()

    def _leave_host_scope(self) -> None:
        """This process's own choice of address is its configuration's again."""
        scope, self._host_scope = self._host_scope, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def __enter__(self) -> Self:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        if isinstance(exc[1], DeviceException):  # lost ranks: say so if Slurm ended the job
            cause = self.ended_by_slurm()
            if cause is not None and cause not in str(exc[1]):  # (its session may have)
                exc[1].add_note(cause)
        self.cancel(clean=exc[0] is None)


# SlurmJob's own parameters (a mistyped option is suggested from these too)
_OWN_PARAMS = tuple(
    name
    for name, param in inspect.signature(SlurmJob.__init__).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
)


class JobRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a `SlurmJob` leaves in its log dir (``job.json``) for ``palatine job``: where
    its system listens and who runs it. The cluster token is beside it, in ``token``
    (readable by its user only)."""

    job_id: str
    system_addr: str
    worker_world: str
    hosts: int
    procs_per_host: int
    transport: str
    log_dir: str
    pid: int  # the process that applied the job (its client or ``palatine launch``)
    machine: str = ""  # ... and the machine it runs on (its hostname)
    # Inside an allocation of its own owner's (a batch script): the name of palatine's
    # step there, which is what ``palatine job cancel`` ends; None: the job is palatine's.
    step_name: str | None = None

    def token(self) -> str | None:
        """The job's cluster token, if this user can read it."""
        try:
            return (Path(self.log_dir) / "token").read_text().strip() or None
        except OSError:
            return None


def find_job(job_id: str) -> tuple[dict[str, str] | None, JobRecord | None]:
    """Slurm's view of job ``job_id`` (``state``, ``elapsed``, ``nodes``, ``nodelist``;
    None once it left the queue) and its palatine record (None if it has none or the
    record is not readable here). Read from ``squeue --json`` where this Slurm has it,
    else from ``squeue -o``. `SchedulerError` when ``squeue`` does not answer."""
    listed = _squeue_job(job_id)
    if listed is _NO_ANSWER:
        raise SchedulerError(f"squeue did not answer within {SCHEDULER_TIMEOUT_S:g} s")
    if isinstance(listed, dict):
        info, comment = _json_info(listed, time.time())
        if info["state"] in _ENDED:  # (listed a while after; squeue's own view omits it)
            return None, None
    elif listed is None:
        return None, None
    else:
        words = _squeue_words(job_id, "%T|%M|%D|%N|%k")
        if not words:
            return None, None
        fields = ("state", "elapsed", "nodes", "nodelist", "comment")
        info = dict(zip(fields, words.split("|", len(fields) - 1), strict=False))
        comment = info.pop("comment", "")
    record = None
    if comment.startswith(_COMMENT):
        try:
            path = Path(comment[len(_COMMENT) :]) / "job.json"
            record = msgspec.json.decode(path.read_bytes(), type=JobRecord)
        except (OSError, msgspec.DecodeError):
            record = None
    return info, record


_squeue_json: bool | None = None  # whether this Slurm's squeue takes --json (asked once)


class _Unread(enum.Enum):
    """Why `_squeue_job` has no job to give."""

    NO_ANSWER = "squeue did not answer"  # (not evidence that a job ended)
    NO_JSON = "this Slurm's squeue has no JSON we read"


_NO_ANSWER, _NO_JSON = _Unread.NO_ANSWER, _Unread.NO_JSON


def squeue_state(job_id: str) -> str | None:
    """Slurm's word for job ``job_id`` (``PENDING``, ``RUNNING``, ...); None once it is
    gone, ``UNKNOWN`` when ``squeue`` does not answer. Read from ``squeue --json`` where
    this Slurm has it (its fields are Slurm's documented data, not a format of ours to
    parse), else from ``squeue -o %T``."""
    try:
        listed = _squeue_job(job_id)
    except SchedulerError:
        return "UNKNOWN"  # (no squeue here, or no controller: not evidence of an end)
    if listed is _NO_ANSWER:
        return "UNKNOWN"
    if isinstance(listed, dict):
        return _json_state(listed)
    if listed is None:
        return None
    try:
        return _squeue_words(job_id, "%T") or None
    except SchedulerError:
        return "UNKNOWN"


def _squeue_job(job_id: str) -> dict[str, Any] | _Unread | None:
    """Job ``job_id`` in ``squeue --json``'s document: its object, None when it is not
    listed, `_NO_ANSWER` when squeue did not answer, `_NO_JSON` when this Slurm has no
    JSON we read (asked once per process; its words are read from then on)."""
    global _squeue_json
    if _squeue_json is False:
        return _NO_JSON
    try:
        done = subprocess.run(
            ["squeue", "--json", "-j", job_id],
            capture_output=True, text=True, timeout=SCHEDULER_TIMEOUT_S, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        raise SchedulerError("squeue not found: is this a Slurm submit host?") from None
    except subprocess.TimeoutExpired:
        return _NO_ANSWER
    if done.returncode != 0:
        if "option" in done.stderr:  # (unrecognized option '--json')
            _squeue_json = False
            return _NO_JSON
        if "Invalid job id" in done.stderr + done.stdout:  # (--json: in its "errors")
            return None  # gone
        # Another failure: squeue's words say whether it was the JSON (a Slurm built
        # without its serializer) or Slurm itself (then they fail too, and say why).
        return _NO_JSON
    try:
        jobs = msgspec.json.decode(done.stdout)["jobs"]
        found: dict[str, Any] | None = next((job for job in jobs if _json_id(job) == job_id), None)
        if found is None:  # (an array task is listed under its own id too)
            found = next((job for job in jobs if str(job["job_id"]) == job_id), None)
        if found is not None:
            _json_state(found)  # (a document we can read)
    except (ValueError, TypeError, KeyError, msgspec.DecodeError):
        _squeue_json = False  # not the JSON we know: the words, from now on
        return _NO_JSON
    _squeue_json = True
    return found


def _squeue_words(job_id: str, fmt: str) -> str:
    """``squeue -h -j JOB -o FMT``'s first line ('' when the job is not listed)."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", fmt],
            capture_output=True, text=True, timeout=SCHEDULER_TIMEOUT_S, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        raise SchedulerError("squeue not found: is this a Slurm submit host?") from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"squeue did not answer within {SCHEDULER_TIMEOUT_S:g} s") from None
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise SchedulerError(f"squeue: {done.stderr.strip() or f'exit status {done.returncode}'}")
    lines = done.stdout.strip().splitlines()
    return lines[0] if lines else ""


def _json_id(job: dict[str, Any]) -> str:
    """A job's id as squeue writes it: ``123``, or ``123_4`` for task 4 of array job 123."""
    array_job, task = _json_number(job.get("array_job_id")), _json_number(job.get("array_task_id"))
    if array_job and task is not None:
        return f"{array_job}_{task}"
    return str(job["job_id"])


def _json_number(value: Any) -> int | None:
    """A number of ``squeue --json``: plain up to Slurm 23.02, ``{"set", "number"}`` since."""
    if isinstance(value, dict):
        return int(value["number"]) if value.get("set", True) else None
    return None if value is None else int(value)


def _json_state(job: dict[str, Any]) -> str:
    """A job's state in ``squeue --json`` (a word up to Slurm 23.02, a list of words since;
    the first is the state)."""
    state = job["job_state"]
    if isinstance(state, list):
        state = state[0] if state else "UNKNOWN"
    if not isinstance(state, str):
        raise TypeError(f"job_state {state!r}")
    return state


def _json_info(job: dict[str, Any], now: float) -> tuple[dict[str, str], str]:
    """`find_job`'s fields of a job of ``squeue --json``, as ``squeue -o`` words, and its
    comment. The document has no elapsed time: it is ``now`` less the start of a job
    that has started (Slurm's ``%M`` format: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``)."""
    state = _json_state(job)
    started = _json_number(job.get("start_time"))
    running = state not in ("PENDING", "CONFIGURING") and started and started <= now
    nodes = _json_number(job.get("node_count"))
    info = {
        "state": state,
        "elapsed": _slurm_elapsed(now - started if running and started else 0.0),
        "nodes": "" if nodes is None else str(nodes),
        "nodelist": str(job.get("nodes") or ""),
    }
    return info, str(job.get("comment") or "")


def _slurm_elapsed(seconds: float) -> str:
    """``seconds`` as Slurm's ``%M`` writes a time: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def _log_session(log_dir: str | None) -> LogSession:
    """The job's log dir: ``log_dir``; else a fresh one under ``PALATINE_LOG_DIR``, if
    set; else under ``./palatine-logs``, on the submit directory's filesystem, which the
    nodes are far likelier to share than this machine's temp dir (module doc)."""
    if log_dir is not None or config.get().log_dir:
        return LogSession.create("slurm", log_dir)
    with config.override(log_dir=str(Path.cwd() / "palatine-logs")):
        return LogSession.create("slurm")


def _probe_script(log_dir: str, python: str) -> str:
    """The probe, a line of bash: one line naming what this node lacks (the log dir, the
    Python interpreter), and exit status 1; or nothing."""
    d, py = shlex.quote(log_dir), shlex.quote(python)
    return (
        'node="${SLURMD_NODENAME:-$(hostname)}"; lacks=""; '
        f"[ -d {d} ] && [ -w {d} ] || lacks={shlex.quote('the log dir ' + log_dir)}; "
        f"command -v {py} >/dev/null 2>&1 || "
        f'lacks="${{lacks:+$lacks and }}"{shlex.quote("the Python interpreter " + python)}; '
        f'[ -z "$lacks" ] || {{ echo "{_PROBE_MARK} node $node does not see $lacks"; exit 1; }}'
    )


def _probe_argv(logs: LogSession, python: str) -> list[str]:
    """The probe as one task's command (a step of an allocation)."""
    return ["bash", "-c", _probe_script(str(logs.path), python)]


def _probe_findings(text: str) -> list[str]:
    """What the probe's lines in ``text`` say the nodes lack, one entry per node."""
    return sorted(
        {line.split(_PROBE_MARK, 1)[1].strip() for line in text.splitlines() if _PROBE_MARK in line}
    )


def _probe_text(what: str, lacking: list[str]) -> str:
    return (
        f"{what}: the nodes cannot run the job: {'; '.join(lacking)} (the log dir and the "
        "Python interpreter must be on a filesystem every node mounts: run from such a "
        "directory, or give log_dir / --log-dir and python there)"
    )


def _host_command(rank_var: str, options: HostOptions) -> str:
    """The ``bash -c`` line each node's task runs (``$0`` the interpreter, ``$1`` the
    system's address), its rank from ``rank_var``, with the hosts' ``options``."""
    flags = "".join(" " + shlex.quote(a) for a in roles.to_argv(options))
    return (
        'exec "$0" -m palatine host --system-addr "$1" --host-world hostworker '
        f'--host-rank "${rank_var}"{flags}'
    )


def steps_named(job_id: str, name: str) -> list[str]:
    """The ids (``JOB.STEP``) of job ``job_id``'s running steps named ``name``."""
    out = scheduler_output(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"]) or ""
    return [
        words[0]
        for words in (line.split() for line in out.splitlines())
        if len(words) == 2 and words[1] == name and words[0].startswith(f"{job_id}.")
    ]


def cancel_steps(job_id: str, name: str) -> list[str]:
    """``scancel`` the steps named ``name`` of job ``job_id`` (not the job); their ids."""
    steps = steps_named(job_id, name)
    for step in steps:
        scheduler_output(["scancel", step])
    return steps


def _comment_of(job_id: str) -> str | None:
    """The comment of job ``job_id`` (None if it has none, or Slurm does not say)."""
    return scontrol_field("job", job_id, "Comment")


def _node_addr(name: str | None) -> str | None:
    """Node ``name``'s ``NodeAddr`` in Slurm's configuration (None if unknown)."""
    return scontrol_field("node", name, "NodeAddr") if name else None


def _node_addrs(partition: str | None) -> list[ChannelAddr]:
    """The ``NodeAddr`` of each node of ``partition`` (else of every partition), as
    ``sinfo`` lists them; empty when it does not answer."""
    argv = ["sinfo", "-h", "-N", "-o", "%o"]
    if partition:
        argv.append(f"--partition={partition}")
    addrs = []
    for word in (scheduler_output(argv) or "").split():
        try:
            addrs.append(ChannelAddr.tcp(word))
        except AddrParseError:
            continue  # (not an address: nothing to route to)
    return addrs
