"""World records, host placement and request validation of the system.

A `WorldRecord` exists for every world name the system knows anything about:

* worlds created by ``UpsertWorld`` or by a proc's ``Join`` (``created``; these have a
  record in the sense of ``WorldState``);
* worlds known only through their hosts (``created`` is False): listed by ``Snapshot``
  as ``AwaitingCreation`` with ``host_procs``, but ``WorldState`` answers none.

So the host table keyed by the served world is ``WorldRecord.hosts``: it
survives an eviction of the world, while ``procs`` do not.

The pure helpers here (placement, name and spec checks, execution ids) have no state.
"""

from __future__ import annotations

import getpass
import math
import os
import secrets
import shlex
import time
from collections.abc import Mapping
from typing import Final

from palatine.hosting.child_env import Handoff
from palatine.ids import HOST_WORLD_PREFIX, RESERVED_WORLDS, ProcId, WorldId
from palatine.protocol.supervision import ProcRecord
from palatine.protocol.system import Exec, UpsertWorld, WorldEnv, WorldStatus, WorldStatusName

__all__ = [
    "ACTIVE",
    "EVICTING",
    "STOPPING",
    "WorldPhase",
    "WorldRecord",
    "check_upsert_spec",
    "check_world_name",
    "execution_id_from_env",
    "given_execution_id",
    "host_ranks",
    "hosts_needed",
    "served_name",
]

ACTIVE = "active"
STOPPING = "stopping"
EVICTING = "evicting"
WorldPhase = str
"""``active``, ``stopping`` (a `Stop` is in progress) or ``evicting``."""


class WorldRecord:
    """Everything the system keeps about one world name.

    ``failed`` holds the ranks whose record counts as failed (not Alive, or a failed
    actor), so status evaluation costs O(failed) instead of O(P). ``pending`` is the
    stopping set of a stop or eviction; ``generation`` identifies that operation so late
    results and timers of an earlier one are ignored. ``incarnation`` changes at every
    upsert; a host gets each world incarnation's assignment at most once per host
    incarnation (``assigned``).
    """

    __slots__ = (
        "assigned",
        "created",
        "env",
        "failed",
        "failing_since",
        "generation",
        "gone_reason",
        "hosts",
        "incarnation",
        "labels",
        "name",
        "num_procs_per_host",
        "pending",
        "rebuilt",
        "replaced",
        "told_gone",
        "phase",
        "procs",
        "reason",
        "shape",
        "since",
        "size",
        "status",
        "world_id",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.world_id = WorldId(name)
        self.created = False
        self.shape: list[int] | None = None
        self.num_procs_per_host = 1
        self.env: WorldEnv | None = None
        self.size: int | None = None
        self.labels: dict[str, str] = {}
        self.procs: dict[int, ProcRecord] = {}
        self.hosts: dict[int, ProcRecord] = {}
        self.failed: set[int] = set()
        self.status: WorldStatusName = "AwaitingCreation"
        self.since: float | None = None
        self.reason = ""
        self.failing_since: float | None = None
        self.phase: WorldPhase = ACTIVE
        self.pending: set[ProcId] = set()
        self.gone_reason = ""
        self.generation = 0
        self.incarnation = 0
        self.assigned: set[tuple[int, int | None]] = set()
        #: (rank, pid) of incarnations a respawn replaced: a late exit report of one of
        #: them is not the new incarnation's.
        self.replaced: set[tuple[int, int]] = set()
        #: rank -> the procs told it was gone (`PeerGone`): told again when a new
        #: incarnation joins (`AddressChanged`), so that they route to it once more.
        self.told_gone: dict[int, set[ProcId]] = {}
        #: the spec came from a rejoining host after a restart of the system
        self.rebuilt = False

    def __repr__(self) -> str:
        return f"WorldRecord({self.name}, {self.status}, {self.phase})"

    @property
    def upserted(self) -> bool:
        """The world has a spec (shape, hosts placement, env)."""
        return self.size is not None

    def world_status(self) -> WorldStatus:
        """The wire form of the status."""
        return WorldStatus(status=self.status, since=self.since, reason=self.reason)

    def apply_spec(self, msg: UpsertWorld, incarnation: int) -> None:
        """Set the spec of an upsert (already validated) and merge its labels."""
        self.created = True
        self.shape = list(msg.shape)
        self.num_procs_per_host = msg.num_procs_per_host
        self.env = msg.env
        self.size = math.prod(msg.shape)
        self.labels.update(msg.labels)
        self.incarnation = incarnation
        self.assigned.clear()
        self.replaced.clear()
        self.told_gone.clear()

    def reset_to_hosts_only(self) -> None:
        """Forget everything but the hosts: the world is listed ``AwaitingCreation`` again."""
        self.created = False
        self.shape = None
        self.num_procs_per_host = 1
        self.env = None
        self.size = None
        self.labels = {}
        self.procs = {}
        self.failed = set()
        self.replaced = set()
        self.told_gone = {}
        self.status = "AwaitingCreation"
        self.since = None
        self.reason = ""
        self.failing_since = None
        self.phase = ACTIVE
        self.pending = set()
        self.gone_reason = ""
        self.assigned = set()
        self.rebuilt = False


def host_ranks(host_rank: int, num_procs_per_host: int, world_size: int) -> range:
    """Ranks host ``h`` owns: ``[h·N, min((h+1)·N, P))`` (empty when ``h·N ≥ P``).

    12 procs at 8 per host: host 0 gets 0–7, host 1 gets 8–11, host 2 nothing.
    """
    lo = host_rank * num_procs_per_host
    return range(min(lo, world_size), min(lo + num_procs_per_host, world_size))


def hosts_needed(num_procs_per_host: int, world_size: int) -> int:
    """How many hosts a world needs: ``ceil(P / N)``."""
    return -(-world_size // num_procs_per_host)


def served_name(host_world: str) -> str:
    """``worker`` for ``hostworker`` (the caller knows it is a host world)."""
    return host_world[len(HOST_WORLD_PREFIX) :]


# Bounds of a world spec: a host's procs are listed in one message, and every rank of a
# world gets a registry entry, so an absurd request is refused rather than attempted.
MAX_WORLD_PROCS: Final = 1 << 20
MAX_PROCS_PER_HOST: Final = 4096


def check_world_name(name: str) -> str | None:
    """Why ``name`` cannot be upserted (``None`` if it can); texts."""
    if not isinstance(name, str) or not name.isidentifier():
        return f"invalid world name {name!r}: expected an identifier"
    if name.startswith(HOST_WORLD_PREFIX):
        return f"world name '{name}' is reserved: names starting with 'host' are host worlds"
    if name in RESERVED_WORLDS:
        return f"world name '{name}' is reserved for the runtime"
    return None


def check_upsert_spec(msg: UpsertWorld) -> str | None:
    """Why the spec of ``msg`` is invalid, naming the field (``None`` if it is valid)."""
    shape = msg.shape
    if not shape or any((not isinstance(d, int)) or d < 1 for d in shape):
        return f"invalid shape {list(shape)[:8]}: expected a non-empty list of dimensions >= 1"
    size = 1
    for d in shape:
        size *= d
        if size > MAX_WORLD_PROCS:
            return f"invalid shape: a world has at most {MAX_WORLD_PROCS:,} procs"
    if not 1 <= msg.num_procs_per_host <= MAX_PROCS_PER_HOST:
        return f"invalid num_procs_per_host {msg.num_procs_per_host}: expected 1 to {MAX_PROCS_PER_HOST:,}"
    if isinstance(msg.env, Exec):
        program = msg.env.program
        try:
            argv = shlex.split(program)
        except ValueError as exc:
            return f"invalid env: cannot split Exec program {program!r}: {exc}"
        if not argv:
            return "invalid env: Exec program is empty"
    bad = [k for k in msg.labels if not isinstance(k, str) or not k]
    if bad:
        return "invalid labels: empty label key"
    return None


def given_execution_id(environ: Mapping[str, str] | None = None) -> str:
    """``PALATINE_EXECUTION_ID``, or ``""`` when it is not set."""
    return Handoff.from_env(os.environ if environ is None else environ).execution_id or ""


def execution_id_from_env(
    environ: Mapping[str, str] | None = None, now: float | None = None
) -> str:
    """``PALATINE_EXECUTION_ID``, or a new ``<user>-<YYYYmmdd-HHMMSS>-<4 hex>``."""
    environ = os.environ if environ is None else environ
    given = given_execution_id(environ)
    if given:
        return given
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ImportError):  # no passwd entry and no USER variable
        user = environ.get("USER") or "palatine"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return f"{user}-{stamp}-{secrets.token_hex(2)}"
