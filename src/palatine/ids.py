"""Identities: world, proc, actor, port and gang ids — parse, format, order.

Every addressable thing in palatine is named by one of five immutable ids:

==========  ==========================  ===============================
type        fields                      canonical text
==========  ==========================  ===============================
`WorldId`   ``name``                    ``w``
`ProcId`    ``world``, ``rank``         ``w[3]``
`ActorId`   ``proc``, ``name``, ``pid`` ``w[3].a[0]``
`PortId`    ``actor``, ``port``         ``w[3].a[0][1025]``
`GangId`    ``world``, ``name``         ``w.a`` (root actor ``a`` on every rank of ``w``)
==========  ==========================  ===============================

Wire invariants:

* Ids are frozen, array-like msgspec structs with exactly the fields above, in that order,
  so an `ActorId` is the msgpack array ``[[["w"], 3], "a", 0]``. Ids are hashed and
  compared on every message, so equality and hashing are msgspec's own (C-level, by value)
  and construction does **no** validation; only the parsers validate.
* ``rank``, ``pid`` and ``port`` are integers in ``[0, 2**64)``; msgpack decoding rejects
  negative values, and values of 2**64 or more cannot be encoded at all.
* In JSON, logs, CLI output and snapshot keys an id is its canonical text; `to_jsonable`
  and the ``json_*_hook`` functions convert. `stable_hash` is the same in every process
  (the builtin ``hash`` of a ``str`` is randomized per process).

Text grammar (``reference``)::

    reference := name | name "[" uint "]" [ "." name [ "[" uint "]" [ "[" uint "]" ] ] ]
               | name "." name
    name      := a Python identifier (str.isidentifier(); Unicode and keywords allowed)
    uint      := ASCII decimal digits (leading zeros allowed), value < 2**64

Whitespace around the whole text is ignored; any other whitespace is an error. ``:``,
``,``, ``!``, ``@``, ``/``, ``(`` and ``)`` never occur in an id: they are rejected with a
hint that the text may be a channel address. Errors are `IdParseError` with the message
``invalid reference '<input>': <problem> at position <i>``.

Ids are totally ordered across all five types by the tuple ``(world, rank, name, pid,
port)``, where a missing component sorts before any present one (a gang ``w.a`` is
``(w, –, a, –, –)``).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import TYPE_CHECKING, Annotated, Any, Self

import msgspec

from palatine.errors import IdParseError

__all__ = [
    "COMM_ACTOR_NAME",
    "CONTROLLER_WORLD",
    "DEFAULT_CONTROLLER_ACTOR",
    "HOST_WORLD_PREFIX",
    "ID_TYPES",
    "PROC_AGENT_NAME",
    "RESERVED_ACTOR_NAMES",
    "RESERVED_WORLDS",
    "SYSTEM_ACTOR",
    "SYSTEM_PROC",
    "SYSTEM_WORLD",
    "UNKNOWN_ACTOR",
    "UNKNOWN_WORLD",
    "USER_WORLD",
    "ActorId",
    "GangId",
    "Id",
    "PortId",
    "ProcId",
    "WorldId",
    "host_world_of",
    "is_host_world",
    "is_reserved_world",
    "json_dec_hook",
    "json_enc_hook",
    "parse",
    "random_user_proc",
    "served_world_of",
    "stable_hash",
    "to_jsonable",
    "validate_name",
]

# Decoding rejects negative integers. msgspec cannot express the upper bound 2**64 as a
# constraint, but msgpack cannot carry larger integers anyway.
_UInt = Annotated[int, msgspec.Meta(ge=0)]

# Sentinels for a missing component in the sort key: names are never empty and integers
# are never negative, so these sort before every present value.
_NO_INT = -1
_NO_NAME = ""

_UINT_LIMIT = 2**64
_USER_RANK_BASE = 2**63


class _IdBase(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Shared behaviour of the five id types: text form, parsing and the total order.

    Only ordering is defined here in Python; ``__eq__`` and ``__hash__`` stay msgspec's.
    ``gc=False`` is safe because ids hold only strings, integers and other ids, so they
    can never be part of a reference cycle.
    """

    _KIND = "id"

    if TYPE_CHECKING:  # each id type defines it

        def _key(self) -> tuple[str, int, str, int, int]:
            """The sort tuple ``(world, rank, name, pid, port)`` with missing parts lowest."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, _IdBase):
            return NotImplemented
        return self._key() < other._key()

    def __le__(self, other: object) -> bool:
        if not isinstance(other, _IdBase):
            return NotImplemented
        return self._key() <= other._key()

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, _IdBase):
            return NotImplemented
        return self._key() > other._key()

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, _IdBase):
            return NotImplemented
        return self._key() >= other._key()

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse canonical (or abbreviated) text into this id type.

        Raises `IdParseError` for text that is not a reference, or that denotes another
        kind of id: ``wrong reference type for 'w[1]': expected world, got proc``.
        """
        result = _parse_reference(text)
        if type(result) is not cls:
            raise IdParseError(
                f"wrong reference type for {text!r}: expected {cls._KIND}, got {result._KIND}"
            )
        return result


class WorldId(_IdBase, frozen=True, array_like=True, gc=False):
    """A world: a named set of procs (``worker``)."""

    name: str

    _KIND = "world"

    def __str__(self) -> str:
        return self.name

    def _key(self) -> tuple[str, int, str, int, int]:
        return (self.name, _NO_INT, _NO_NAME, _NO_INT, _NO_INT)

    @property
    def world(self) -> WorldId:
        """This world itself (every id type has ``.world``)."""
        return self

    def proc(self, rank: int) -> ProcId:
        """The proc ``self[rank]``."""
        return ProcId(self, rank)

    def random_user_proc(self) -> ProcId:
        """A proc of this world with a random rank in ``[2**63, 2**64)``.

        Attached clients name themselves this way (``user[R]``): the high half of the rank
        space is never assigned by the system, and 63 random bits make collisions unlikely.
        """
        return ProcId(self, _USER_RANK_BASE + secrets.randbits(63))

    def gang(self, name: str) -> GangId:
        """The gang ``self.name``: root actor ``name`` on every rank of this world."""
        return GangId(self, name)

    def is_prefix_of(self, other: Id) -> bool:
        """True for this world and for every proc, actor, port and gang in it."""
        return other.world == self


class ProcId(_IdBase, frozen=True, array_like=True, gc=False):
    """A proc: rank ``rank`` of world ``world`` (``worker[3]``)."""

    world: WorldId
    rank: _UInt

    _KIND = "proc"

    def __str__(self) -> str:
        return f"{self.world.name}[{self.rank}]"

    def _key(self) -> tuple[str, int, str, int, int]:
        return (self.world.name, self.rank, _NO_NAME, _NO_INT, _NO_INT)

    def actor(self, name: str, pid: int = 0) -> ActorId:
        """The actor ``self.name[pid]`` (pid 0 is the root actor of that name)."""
        return ActorId(self, name, pid)

    def is_prefix_of(self, other: Id) -> bool:
        """True for this proc and for its actors and their ports."""
        if type(other) is ActorId:
            return other.proc == self
        if type(other) is PortId:
            return other.actor.proc == self
        return other == self


class ActorId(_IdBase, frozen=True, array_like=True, gc=False):
    """An actor: index ``pid`` of the actors named ``name`` in proc ``proc``.

    ``pid`` is the actor's index within its proc (0 for a root actor), not an OS pid.
    """

    proc: ProcId
    name: str
    pid: _UInt = 0

    _KIND = "actor"

    def __str__(self) -> str:
        proc = self.proc
        return f"{proc.world.name}[{proc.rank}].{self.name}[{self.pid}]"

    def _key(self) -> tuple[str, int, str, int, int]:
        proc = self.proc
        return (proc.world.name, proc.rank, self.name, self.pid, _NO_INT)

    @classmethod
    def root(cls, proc: ProcId, name: str) -> ActorId:
        """The root actor ``proc.name[0]``."""
        return cls(proc, name, 0)

    @property
    def world(self) -> WorldId:
        """The world of this actor's proc."""
        return self.proc.world

    @property
    def rank(self) -> int:
        """The rank of this actor's proc."""
        return self.proc.rank

    def port(self, port: int) -> PortId:
        """Port ``port`` of this actor's mailbox."""
        return PortId(self, port)

    def child(self, pid: int) -> ActorId:
        """The actor with the same proc and name and index ``pid``."""
        return ActorId(self.proc, self.name, pid)

    def is_prefix_of(self, other: Id) -> bool:
        """True for this actor and its ports."""
        if type(other) is PortId:
            return other.actor == self
        return other == self


class PortId(_IdBase, frozen=True, array_like=True, gc=False):
    """A port: index ``port`` in the mailbox of actor ``actor`` (``w[3].a[0][1025]``)."""

    actor: ActorId
    port: _UInt

    _KIND = "port"

    def __str__(self) -> str:
        actor = self.actor
        proc = actor.proc
        return f"{proc.world.name}[{proc.rank}].{actor.name}[{actor.pid}][{self.port}]"

    def _key(self) -> tuple[str, int, str, int, int]:
        actor = self.actor
        proc = actor.proc
        return (proc.world.name, proc.rank, actor.name, actor.pid, self.port)

    @property
    def proc(self) -> ProcId:
        """The proc of this port's actor."""
        return self.actor.proc

    @property
    def world(self) -> WorldId:
        """The world of this port's actor."""
        return self.actor.proc.world

    def is_prefix_of(self, other: Id) -> bool:
        """True only for this port itself."""
        return other == self


class GangId(_IdBase, frozen=True, array_like=True, gc=False):
    """A gang ``world.name``: the root actor ``name`` on every rank of ``world``.

    A gang names a set of actors, not a routing prefix: it is a prefix only of itself.
    """

    world: WorldId
    name: str

    _KIND = "gang"

    def __str__(self) -> str:
        return f"{self.world.name}.{self.name}"

    def _key(self) -> tuple[str, int, str, int, int]:
        return (self.world.name, _NO_INT, self.name, _NO_INT, _NO_INT)

    def actor(self, rank: int) -> ActorId:
        """The member on rank ``rank``: ``world[rank].name[0]``."""
        return ActorId(ProcId(self.world, rank), self.name, 0)

    def is_prefix_of(self, other: Id) -> bool:
        """True only for this gang itself."""
        return other == self


Id = WorldId | ProcId | ActorId | PortId | GangId
"""Any of the five id types (for annotations and ``isinstance``)."""

ID_TYPES: tuple[type[_IdBase], ...] = (WorldId, ProcId, ActorId, PortId, GangId)


# --------------------------------------------------------------------------- parsing

_FORBIDDEN = re.compile(r"[:,!@/()]")
# A candidate name runs up to the next structural character; it is then checked with
# str.isidentifier(), which is exactly Python's (Unicode) identifier rule.
_NAME_RUN = re.compile(r"[^\[\].]*")
_DIGIT_RUN = re.compile(r"[0-9]*")
_MAX_UINT_DIGITS = len(str(_UINT_LIMIT - 1))


class _Fail(Exception):
    """Internal: a parse problem at a position of the stripped text."""

    def __init__(self, problem: str, pos: int) -> None:
        super().__init__(problem)
        self.problem = problem
        self.pos = pos


def _unexpected(s: str, pos: int, problem: str) -> _Fail:
    """The failure for character ``s[pos]``; whitespace gets its own wording."""
    if pos < len(s) and s[pos].isspace():
        return _Fail("unexpected whitespace", pos)
    return _Fail(problem, pos)


def _scan_name(s: str, pos: int) -> tuple[int, str]:
    """Scan a name starting at ``pos``; return the position after it and the name."""
    m = _NAME_RUN.match(s, pos)
    assert m is not None  # the pattern matches the empty string
    token = m.group()
    if token.isidentifier():
        return m.end(), token
    # Error path: find the first character that breaks the identifier.
    for i, c in enumerate(token):
        ok = c.isidentifier() if i == 0 else ("_" + c).isidentifier()
        if not ok:
            if i == 0:
                raise _unexpected(s, pos, "expected name")
            if c.isspace():
                raise _Fail("unexpected whitespace", pos + i)
            raise _Fail(f"invalid character {c!r} in name", pos + i)
    raise _unexpected(s, pos, "expected name")


def _scan_index(s: str, pos: int) -> tuple[int, int]:
    """Scan ``uint "]"`` starting at ``pos`` (just after ``[``); return (end, value)."""
    m = _DIGIT_RUN.match(s, pos)
    assert m is not None  # the pattern matches the empty string
    digits = m.group()
    if not digits:
        raise _unexpected(s, pos, "expected unsigned integer")
    # Strip leading zeros before int(): a long run of zeros is legal, and int() refuses
    # strings over sys.get_int_max_str_digits() anyway.
    significant = digits.lstrip("0")
    if len(significant) > _MAX_UINT_DIGITS or int(significant or "0") >= _UINT_LIMIT:
        raise _Fail("integer out of range (must be < 2**64)", pos)
    end = m.end()
    if end >= len(s) or s[end] != "]":
        raise _unexpected(s, end, "expected ']'")
    return end + 1, int(significant or "0")


def _scan(s: str) -> Id:
    """Parse stripped text ``s``; raises `_Fail` with a position in ``s``."""
    n = len(s)
    pos, world_name = _scan_name(s, 0)
    world = WorldId(world_name)
    if pos == n:
        return world
    c = s[pos]
    if c == ".":
        pos, name = _scan_name(s, pos + 1)
        if pos != n:
            raise _unexpected(s, pos, "unexpected trailing text")
        return GangId(world, name)
    if c != "[":
        raise _unexpected(s, pos, "unexpected trailing text")
    pos, rank = _scan_index(s, pos + 1)
    proc = ProcId(world, rank)
    if pos == n:
        return proc
    if s[pos] != ".":
        raise _unexpected(s, pos, "unexpected trailing text")
    pos, name = _scan_name(s, pos + 1)
    if pos == n:
        return ActorId(proc, name, 0)
    if s[pos] != "[":
        raise _unexpected(s, pos, "unexpected trailing text")
    pos, pid = _scan_index(s, pos + 1)
    actor = ActorId(proc, name, pid)
    if pos == n:
        return actor
    if s[pos] != "[":
        raise _unexpected(s, pos, "unexpected trailing text")
    pos, port = _scan_index(s, pos + 1)
    if pos != n:
        raise _unexpected(s, pos, "unexpected trailing text")
    return PortId(actor, port)


def _parse_reference(text: str) -> Id:
    """Parse ``text`` into whichever id it denotes, with `IdParseError` on failure."""
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    s = text.strip()
    bad = _FORBIDDEN.search(s)
    if bad is not None:
        raise IdParseError(
            f"invalid reference {text!r}: {bad.group()!r} is not allowed in ids "
            "(is this a channel address?)"
        )
    try:
        return _scan(s)
    except _Fail as fail:
        # Report positions in the caller's text, not the stripped copy.
        offset = len(text) - len(text.lstrip())
        raise IdParseError(
            f"invalid reference {text!r}: {fail.problem} at position {fail.pos + offset}"
        ) from None


def parse(text: str) -> Id:
    """Parse a reference into whichever of the five id types it denotes.

    ``w`` is a `WorldId`, ``w[3]`` a `ProcId`, ``w[3].a`` and ``w[3].a[2]`` `ActorId`s
    (pid 0 when omitted), ``w[3].a[2][1025]`` a `PortId` and ``w.a`` a `GangId`.
    Raises `IdParseError` (a ``ValueError``) otherwise.
    """
    return _parse_reference(text)


def validate_name(name: str) -> str:
    """Return ``name`` if it can be a world or actor name, else raise `IdParseError`.

    Names are Python identifiers (``str.isidentifier()``); constructors do not check them,
    so code that accepts names from users calls this first.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise IdParseError(f"invalid name {name!r}: expected a Python identifier")
    return name


# --------------------------------------------------------------------------- hashing, JSON


def stable_hash(x: Id) -> int:
    """A 64-bit hash of an id that is the same in every process and on every machine.

    The builtin ``hash`` of ids is by value but built on ``str`` hashing, which Python
    randomizes per process; anything that must agree across processes (sharding,
    placement) uses this: blake2b of the canonical text, 8 bytes, big-endian.
    """
    data = str(x).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def to_jsonable(obj: Any) -> Any:
    """Replace every id in ``obj`` (dict keys and values, list/tuple/set items) by its text.

    JSON carries ids as canonical text, but msgspec encodes any struct natively (an id
    would become a nested array) and never consults ``enc_hook`` for it, so values are
    converted before encoding: ``msgspec.json.encode(to_jsonable(x))``. Tuples and sets
    become lists; other objects, including non-id structs, are left as they are.
    """
    if isinstance(obj, _IdBase):
        return str(obj)
    if isinstance(obj, dict):
        return {to_jsonable(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    return obj


def json_enc_hook(obj: Any) -> Any:
    """``enc_hook`` for msgspec JSON encoders: an id becomes its canonical text.

    msgspec calls the hook for ids used as dict keys (``{ProcId: …}``); id *values* are
    structs that msgspec encodes itself, so convert those with `to_jsonable`.
    """
    if isinstance(obj, _IdBase):
        return str(obj)
    # msgspec's hook contract: NotImplementedError means "not a type this hook handles".
    raise NotImplementedError(f"objects of type {type(obj).__name__} are not supported")


def json_dec_hook(type_: type, obj: Any) -> Any:
    """``dec_hook``-shaped converter: canonical text (or the array form) into id ``type_``.

    msgspec itself decodes struct types natively and does not call a hook for them, so
    use this where JSON was decoded to builtins (``json_dec_hook(ProcId, "w[3]")``).
    Raises `IdParseError` for bad text and ``NotImplementedError`` for other types.
    """
    if type_ in ID_TYPES:
        if isinstance(obj, str):
            return type_.parse(obj)
        if isinstance(obj, list):
            return msgspec.convert(obj, type_)
    raise NotImplementedError(f"cannot decode {type_!r} from {type(obj).__name__}")


# --------------------------------------------------------------------------- reserved names

RESERVED_WORLDS: frozenset[str] = frozenset({"system", "user", "unknown"})
"""World names only the runtime uses; names starting with `HOST_WORLD_PREFIX` are also reserved."""

RESERVED_ACTOR_NAMES: frozenset[str] = frozenset({"proc", "comm"})
"""Actor names only the runtime uses: every proc's agent and comm actor."""

HOST_WORLD_PREFIX = "host"
PROC_AGENT_NAME = "proc"
COMM_ACTOR_NAME = "comm"


def _world_name(world: WorldId | str) -> str:
    return world.name if isinstance(world, WorldId) else world


def is_host_world(name: WorldId | str) -> bool:
    """True for a host world ``host<W>``; a bare ``host`` is not one (it is invalid)."""
    n = _world_name(name)
    return n.startswith(HOST_WORLD_PREFIX) and len(n) > len(HOST_WORLD_PREFIX)


def is_reserved_world(name: WorldId | str) -> bool:
    """True for ``system``, ``user``, ``unknown`` and any name starting with ``host``."""
    n = _world_name(name)
    return n in RESERVED_WORLDS or n.startswith(HOST_WORLD_PREFIX)


def host_world_of(world: WorldId | str) -> WorldId:
    """The world ``host<W>`` whose procs are the hosts serving world ``W``."""
    return WorldId(HOST_WORLD_PREFIX + validate_name(_world_name(world)))


def served_world_of(host_world: WorldId | str) -> WorldId:
    """The world ``W`` that host world ``host<W>`` serves; `IdParseError` if not a host world."""
    n = _world_name(host_world)
    if not is_host_world(n):
        raise IdParseError(f"{n!r} is not a host world (expected 'host' followed by a name)")
    return WorldId(validate_name(n[len(HOST_WORLD_PREFIX) :]))


def random_user_proc() -> ProcId:
    """A fresh client proc ``user[R]`` with R uniform in ``[2**63, 2**64)``."""
    return USER_WORLD.random_user_proc()


# --------------------------------------------------------------------------- well-known ids

SYSTEM_WORLD = WorldId("system")
SYSTEM_PROC = ProcId(SYSTEM_WORLD, 0)
SYSTEM_ACTOR = ActorId(SYSTEM_PROC, "root", 0)
USER_WORLD = WorldId("user")
UNKNOWN_WORLD = WorldId("unknown")
UNKNOWN_ACTOR = ActorId(ProcId(UNKNOWN_WORLD, 0), "unknown", 0)
"""The sender of a message that no actor sent."""
CONTROLLER_WORLD = WorldId("controller")
DEFAULT_CONTROLLER_ACTOR = ActorId(ProcId(CONTROLLER_WORLD, 0), "root", 0)
