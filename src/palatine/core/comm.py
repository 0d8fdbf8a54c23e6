"""Comm: casting one message to ranks of a gang through a fixed fan-out tree.

The tree depends only on the gang size N and fan-out F: a block ``[lo, hi)`` is served
by its head ``lo``, which splits ``[lo+1, hi)`` into at most F near-equal contiguous
sub-blocks (larger first). Blocks of one rank are delivered directly; larger blocks go
as `Forward` to the head's comm actor ``W[lo].comm[0]``. The payload is encoded once
and re-framed at each hop without decoding. Replies go straight to ``reply_to``.
"""

from __future__ import annotations

import logging
from typing import Any

from palatine import config
from palatine.core.actor import Actor, handler
from palatine.core.mailbox import Mailbox
from palatine.ids import ActorId, GangId, PortId, ProcId
from palatine.wire.codec import Message, encode_message
from palatine.wire.envelope import ENC_MSGPACK, Envelope

__all__ = [
    "Cast",
    "Forward",
    "CommActor",
    "split_blocks",
    "cast_envelope",
    "cast_message",
    "RankSet",
]

log = logging.getLogger(__name__)

RankSet = list[tuple[int, int]]  # sorted disjoint half-open ranges


def normalize(ranks: Any, size: int) -> RankSet:
    """A sorted list of disjoint half-open ranges inside ``[0, size)``."""
    if ranks is None:
        return [(0, size)] if size > 0 else []
    pts = sorted({int(r) for r in ranks if 0 <= int(r) < size})
    out: RankSet = []
    for r in pts:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _selected(ranks: RankSet, lo: int, hi: int) -> bool:
    return any(a < hi and lo < b for a, b in ranks)


def _contains(ranks: RankSet, r: int) -> bool:
    return any(a <= r < b for a, b in ranks)


def split_blocks(lo: int, hi: int, fanout: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into at most ``fanout`` contiguous near-equal blocks, larger first."""
    n = hi - lo
    if n <= 0:
        return []
    k = min(fanout, n)
    base, extra = divmod(n, k)
    out = []
    start = lo
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


class Cast(Message, kw_only=True):
    """A cast in flight: the payload plus where it goes (encoded once)."""

    origin: ActorId
    gang: GangId
    gang_size: int
    ranks: RankSet
    fanout: int
    type_id: int
    encoding: int
    data: bytes
    reply_to: PortId | None = None
    headers: dict[str, str | int] | None = None


class Forward(Message, kw_only=True):
    """Deliver ``cast`` to the selected ranks of block ``[lo, hi)`` (headed by ``lo``)."""

    cast: Cast
    lo: int
    hi: int


def _deliver(
    mb: Mailbox, cast: Cast, rank: int, sender: ActorId, origin_text: str | None = None
) -> None:
    dest = ActorId(ProcId(cast.gang.world, rank), cast.gang.name, 0)
    headers: dict[str, str | int] = dict(cast.headers) if cast.headers else {}
    headers["cast_rank"] = rank
    headers["cast_size"] = cast.gang_size
    headers["cast_origin"] = origin_text if origin_text is not None else str(cast.origin)
    env = Envelope(
        sender,
        PortId(dest, cast.type_id),
        cast.type_id,
        cast.encoding,
        cast.data,
        cast.reply_to,
        headers,
    )
    mb.proc.post(env)


def _send_block(mb: Mailbox, cast: Cast, lo: int, hi: int) -> None:
    if hi - lo == 1:
        _deliver(mb, cast, lo, cast.origin)
        return
    fwd = Forward(cast=cast, lo=lo, hi=hi)
    head = cast.gang.world.proc(lo).actor("comm")
    tid = Forward.__palatine_type_id__
    env = Envelope(mb.actor_id, PortId(head, tid), tid, ENC_MSGPACK, encode_message(fwd))
    mb.proc.post(env)


def cast_envelope(mb: Mailbox, cast: Cast) -> None:
    """The root step, performed inline by the originator's mailbox."""
    if cast.gang_size <= cast.fanout:
        # Every block is a single rank: deliver directly to each selected rank.
        origin = mb.actor_text if cast.origin == mb.actor_id else str(cast.origin)
        for a, b in cast.ranks:
            for r in range(a, b):
                _deliver(mb, cast, r, cast.origin, origin)
        return
    for lo, hi in split_blocks(0, cast.gang_size, cast.fanout):
        if _selected(cast.ranks, lo, hi):
            _send_block(mb, cast, lo, hi)


def cast_message(mb: Mailbox, gang: GangId, msg: Any, ranks: Any, size: int | None = None) -> None:
    """One-way typed message ``msg`` to ``ranks`` of ``gang`` (root step inline)."""
    n = size if size is not None else (max(ranks) + 1 if ranks else 0)
    tid = type(msg).__palatine_type_id__
    cast = Cast(
        origin=mb.actor_id,
        gang=gang,
        gang_size=n,
        ranks=normalize(ranks, n),
        fanout=config.get().cast_fanout,
        type_id=tid,
        encoding=ENC_MSGPACK,
        data=encode_message(msg),
    )
    cast_envelope(mb, cast)


class CommActor(Actor):
    """``<proc>.comm[0]``: forwards casts down the tree, reports unreachable blocks."""

    __palatine_name__ = "palatine.core.comm.CommActor"

    @handler
    def on_forward(self, msg: Forward) -> None:
        cast = msg.cast
        mb = self.cx.mailbox
        if _contains(cast.ranks, msg.lo):
            _deliver(mb, cast, msg.lo, cast.origin)
        for lo, hi in split_blocks(msg.lo + 1, msg.hi, cast.fanout):
            if _selected(cast.ranks, lo, hi):
                _send_block(mb, cast, lo, hi)

    def handle_undeliverable(self, returned: Envelope) -> None:
        """A Forward bounced: tell the originator which ranks were not reached."""
        if returned.type_id != Forward.__palatine_type_id__:
            return super().handle_undeliverable(returned)
        from palatine.wire.codec import decode_payload

        fwd: Forward = decode_payload(returned)
        cast = fwd.cast
        cause = "; ".join(returned.errors or ())
        err = (
            f"multicast error: ranks {fwd.lo}-{fwd.hi - 1} not reached: "
            f"{returned.dest.actor} unreachable: {cause}"
        )
        mb = self.cx.mailbox
        for a, b in cast.ranks:
            for r in range(max(a, fwd.lo), min(b, fwd.hi)):
                dest = cast.gang.actor(r)
                env = Envelope(
                    cast.origin,
                    PortId(dest, cast.type_id),
                    cast.type_id,
                    cast.encoding,
                    b"",
                    cast.reply_to,
                    {"cast_rank": r},
                )
                mb.proc.return_envelope(env, err)
