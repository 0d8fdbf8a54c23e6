"""Recovery records: what a session remembers of the recoveries it went through.

`DeviceMesh.recover` has the controller respawn lost ranks as new incarnations. The
values that lived there are gone on those ranks only, so the session records, per
recovery, the ranks it brought back and the ref bound below which every value was made
before it: such a value is lost on those ranks until ``value.restore(fn)`` makes it
again there. A recovery also abandons every seq issued before it (their late Results
are dropped quietly), starts a new generation of collectives (the next process group
or reduce builds the collective context again), and the new incarnations must be given
again the streams and device meshes the other ranks have.
"""

from __future__ import annotations

from typing import Any

from palatine.errors import LostValue
from palatine.protocol.worker import CreateDeviceMesh, CreateStream, Slice
from palatine.wire.codec import Message

__all__ = ["RecoveryRecords"]


class RecoveryRecords:
    """The session's recoveries so far, and what a new incarnation must be given again.

    A recovery (`Session.recover`) and `ensure_collectives` change them under the
    session's lock; `restored` and `device_meshes` also grow from user threads without
    it, and reads take no lock (each is one operation on a list or dict).
    """

    def __init__(self) -> None:
        #: How many recoveries so far: the generation of collectives the workers build.
        self.generation = 0
        #: Per recovery, the ref bound and the ranks it brought back: every ref below the
        #: bound is lost on those ranks.
        self.lost: list[tuple[int, frozenset[int]]] = []
        #: ref -> how many recoveries there were when it was restored (`remote.restore`).
        self.restored: dict[int, int] = {}
        #: Seqs below this were abandoned by the last recovery.
        self.abandoned_below = 0
        #: Every device mesh created on the workers: (ref, dim names, ranks).
        self.device_meshes: list[tuple[int, list[str], Slice]] = []
        #: The session's collective-context ref (None: the next collective builds one).
        self.collective_ref: int | None = None

    def lost_ranks(self, ref: int) -> frozenset[int]:
        """The ranks value ``ref`` was lost on by recoveries (and not restored since)."""
        out: frozenset[int] = frozenset()
        since = self.restored.get(ref, 0)
        for i, (bound, ranks) in enumerate(self.lost):
            if ref < bound and i >= since:
                out |= ranks
        return out

    def check_not_lost(self, value: Any, ranks: set[int]) -> None:
        """Raise `LostValue` when ``value`` is needed on a rank where a recovery lost it."""
        if not self.lost:
            return
        gone = self.lost_ranks(value.ref) & ranks
        if gone:
            where = ", ".join(str(r) for r in sorted(gone))
            raise LostValue(
                f"{value!r} was lost with rank {where}: the rank died and was started again "
                "by a recovery; it is still valid on the other ranks (value.restore(fn) "
                "makes it again on the lost ranks; for a mesh tensor, t.restore() then "
                "palatine.resync(t) copies it there from a surviving rank)",
                gone,
            )

    def record(self, back: list[int], ref_bound: int, seq_bound: int) -> None:
        """A recovery brought ``back`` back: refs below ``ref_bound`` are lost there,
        seqs below ``seq_bound`` are abandoned, and collectives start a new generation."""
        self.lost.append((ref_bound, frozenset(back)))
        self.abandoned_below = seq_bound
        self.generation += 1
        self.collective_ref = None

    def respawn_commands(
        self, back: list[int], streams: dict[str, int]
    ) -> list[tuple[Slice, Message]]:
        """What each new incarnation in ``back`` must be given again: the session's
        ``streams`` (name -> id) and the device meshes it is part of."""
        cmds: list[tuple[Slice, Message]] = []
        for r in back:
            one = Slice(offset=r, sizes=[1], strides=[1])
            for name, sid in streams.items():
                cmds.append((one, CreateStream(id=sid, name=name, default=name == "main")))
            for ref, names, spec in self.device_meshes:
                if r in spec.ranks():
                    cmds.append((one, CreateDeviceMesh(result=ref, names=names, ranks=spec)))
        return cmds
