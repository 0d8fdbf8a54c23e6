"""The router: a true longest-prefix routing table and one cached Tx per address.

Keys are world, proc or actor ids. Lookup tries the exact actor id, then its proc, then
its world; the first hit wins (the original inspected only the nearest smaller key and
missed a proc or world binding when a sibling actor key was bound). Bindings made by
resolution are *dynamic*: when their Tx closes they are dropped, so the next message
resolves again; static bindings stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from palatine.channel.addr import ChannelAddr
from palatine.channel.base import Tx
from palatine.ids import ActorId, ProcId, WorldId

__all__ = ["Router"]

Key = WorldId | ProcId | ActorId


class Router:
    """Routing table plus the Tx cache of one proc."""

    __slots__ = ("_bindings", "_dynamic", "_actor_keys", "_tx", "_by_proc", "_dial")

    def __init__(self, dial: Callable[[ChannelAddr], Tx]) -> None:
        self._bindings: dict[Key, ChannelAddr] = {}
        self._dynamic: set[Key] = set()
        self._actor_keys = 0
        self._tx: dict[ChannelAddr, Tx] = {}
        # Hot-path cache: destination proc -> Tx (cleared on any table change).
        self._by_proc: dict[ProcId, Tx] = {}
        self._dial = dial

    def bind(self, key: Key, addr: ChannelAddr, *, dynamic: bool = False) -> None:
        """Bind ``key`` (a world, proc or actor id) to ``addr``, replacing any binding."""
        if isinstance(key, ActorId) and key not in self._bindings:
            self._actor_keys += 1
        self._bindings[key] = addr
        if dynamic:
            self._dynamic.add(key)
        else:
            self._dynamic.discard(key)
        self._by_proc.clear()

    def unbind(self, prefix: Key) -> list[Key]:
        """Remove ``prefix`` and every key under it; returns the removed keys."""
        gone = [k for k in self._bindings if prefix.is_prefix_of(k)]
        for k in gone:
            del self._bindings[k]
            self._dynamic.discard(k)
            if isinstance(k, ActorId):
                self._actor_keys -= 1
        self._by_proc.clear()
        return gone

    def lookup(self, dest: ActorId) -> ChannelAddr | None:
        """The address for an actor: exact actor key, else its proc, else its world."""
        b = self._bindings
        if self._actor_keys:
            addr = b.get(dest)
            if addr is not None:
                return addr
        proc = dest.proc
        addr = b.get(proc)
        if addr is not None:
            return addr
        return b.get(proc.world)

    def prefixes(self) -> list[Key]:
        """The sorted minimal covering set of bound keys."""
        keys = sorted(self._bindings)
        out: list[Key] = []
        for k in keys:
            if not any(p.is_prefix_of(k) for p in out):
                out.append(k)
        return out

    def tx_for(self, dest: ActorId) -> Tx | None:
        """The cached Tx toward ``dest`` (dialing lazily), or None when unroutable."""
        if not self._actor_keys:
            tx = self._by_proc.get(dest.proc)
            if tx is not None:
                return tx
        addr = self.lookup(dest)
        if addr is None:
            return None
        tx = self._tx.get(addr)
        if tx is None or tx.status.closed:
            tx = self._dial(addr)
            self._tx[addr] = tx
            tx.on_closed(functools.partial(self._on_tx_closed, addr, tx))
        if not self._actor_keys:
            self._by_proc[dest.proc] = tx
        return tx

    def tx_at(self, addr: ChannelAddr) -> Tx | None:
        return self._tx.get(addr)

    def _on_tx_closed(self, addr: ChannelAddr, tx: Tx, reason: str) -> None:
        self._tx_closed(addr, tx)

    def _tx_closed(self, addr: ChannelAddr, tx: Tx) -> None:
        if self._tx.get(addr) is tx:
            del self._tx[addr]
        for key in [k for k in self._dynamic if self._bindings.get(k) == addr]:
            self._bindings.pop(key, None)
            self._dynamic.discard(key)
            if isinstance(key, ActorId):
                self._actor_keys -= 1
        self._by_proc.clear()

    def drop_tx(self, addr: ChannelAddr) -> Tx | None:
        """Forget the Tx for ``addr`` (the caller closes it)."""
        tx = self._tx.pop(addr, None)
        self._by_proc.clear()
        return tx

    def all_tx(self) -> list[Tx]:
        return list(self._tx.values())

    def binding(self, key: Key) -> ChannelAddr | None:
        return self._bindings.get(key)

    def is_dynamic(self, key: Key) -> bool:
        return key in self._dynamic

    def serves(self, addr: ChannelAddr) -> bool:
        """Whether any binding leads to ``addr`` (a scan: for rare paths)."""
        return any(a == addr for a in self._bindings.values())

    def __repr__(self) -> str:
        items: dict[str, Any] = {str(k): str(v) for k, v in sorted(self._bindings.items())}
        return f"Router({items})"
