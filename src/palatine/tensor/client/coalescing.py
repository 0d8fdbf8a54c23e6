"""Coalescing: a block of tensor work as one message per rank.

Two forms, after Monarch's:

* ``with palatine.coalescing():`` holds the session's outbox for the block: every op
  issued inside leaves together at the block's end, one message per rank. A fetch inside
  sends what is queued at once (someone waits for it), then holding goes on.
* ``palatine.compile(fn)`` **records** one call of ``fn`` and replays it: the recorded
  call runs as usual while its commands are kept; each rank is given its share once
  (`DefineRecording`), and every later call with arguments of the same shapes sends one
  `CallRecording` per rank instead of running ``fn``'s Python at all. A training step of
  seventy ops costs the client one message instead of seventy dispatches.

How a replay stays right without running the Python again (the rules are those of a
CUDA graph, which PyTorch users know):

* The recorded commands run again **with the refs they were recorded with**: whatever the
  step made and left reachable (a parameter's ``.grad``, an optimizer's buffers) is the
  same handle after every replay, holding that replay's value.
* Tensor arguments are bound to the recording's own refs before it runs (an alias on the
  worker, so an in-place write reaches the caller's tensor) and freed after it; returned
  tensors are copied to new refs after it runs, so each call returns its own tensors,
  never overwritten by the next call.
* Refs the recorded step made and the client dropped (temporaries) are made again by
  each replay and freed at its end.
* What a replay cannot reproduce is refused, with the reason (`CoalescingError`): a fetch
  or a collective set-up inside, reading a value on the client (``.item()``, ``bool``)
  of a tensor made before the call (a replay would reuse the recorded answer), arguments
  that require grad, a return value that is not mesh tensors.
* Python state the step reads is fixed at its recorded value, as in a CUDA graph: pass
  what changes (a learning rate) as a tensor. Arguments of another shape, dtype, mesh or
  stream, or other plain values, make another recording.

``warmup`` calls run plainly first (default 1): an optimizer makes its state on its first
step, so the second call is the one that repeats.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from torch.utils._pytree import tree_flatten, tree_unflatten

from palatine.errors import CoalescingError
from palatine.protocol.worker import (
    CallFunction,
    CallRecording,
    DefineRecording,
    DeleteRefs,
    DropRecording,
    Slice,
)
from palatine.tensor.client.context import get_active_mesh
from palatine.tensor.client.drops import slice_key
from palatine.tensor.client.fake import Meta
from palatine.tensor.client.recording import Recorder, fuse_reduces
from palatine.tensor.client.tensor import Tensor, pickle_op
from palatine.tensor.client.values import RemoteValue, function_ref
from palatine.wire.codec import Message

__all__ = ["Compiled", "coalescing", "compile"]

_IDENTITY = function_ref("palatine.tensor.worker.functions.identity")[0]
_CLONE = function_ref("torch.clone")[0]
_recording_ids = itertools.count(1)
_OUT: Any = object()  # a returned tensor's place among the result's leaves


@contextmanager
def coalescing(mesh: Any = None) -> Iterator[None]:
    """Hold the session's outbox for the block: what is issued inside leaves as one
    message per rank when the block ends (``mesh``: whose session; else the active
    mesh's). Blocks nest; the outermost one sends."""
    target = mesh if mesh is not None else get_active_mesh()
    if target is None:
        raise CoalescingError("palatine.coalescing() needs a mesh: activate one or pass it")
    outbox = target.session.outbox
    outbox.hold()
    try:
        yield
    finally:
        outbox.release()


class _Entry:
    """One recording of a compiled function and what its replays need."""

    def __init__(self) -> None:
        self.id = next(_recording_ids)
        self.session: Any = None
        #: The slices `CallRecording` goes to (each rank of the recording once).
        self.slices: list[Slice] = []
        self.defs: list[int] = []  # refs the recorded commands define
        self.fresh: list[int] = []  # ... that did not exist before the call
        self.uses: list[int] = []  # refs they use that existed before the call
        #: The recording's own handles of the arguments (bound before each replay).
        self.inputs: list[Tensor] = []
        #: The recorded call's returned tensors (copied out after each replay).
        self.outputs: list[Tensor] = []
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []  # `_OUT` where a leaf is a tensor output
        #: The recorded step's refs the client has dropped: freed after each replay.
        self.dead: set[int] = set()
        self.label = ""
        self.finalizer: Any = None
        #: The session's recovery count when recorded (a recovery invalidates it).
        self.generation = 0


class Compiled:
    """A function recorded on its first repeatable call and replayed after
    (`palatine.compile`). ``recordings()`` says how many it made."""

    def __init__(self, fn: Callable[..., Any], warmup: int = 1) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, not {warmup}")
        self.fn = fn
        self.warmup = warmup
        self._entries: dict[Any, _Entry] = {}
        self._seen: dict[Any, int] = {}
        functools.update_wrapper(self, fn)

    def recordings(self) -> int:
        """How many recordings this function made (one per argument pattern)."""
        return len(self._entries)

    def reset(self) -> None:
        """Forget every recording (the next calls warm up and record again); the ranks
        forget them too."""
        for e in self._entries.values():
            e.finalizer()
            session = e.session
            if not session.closed and session.failure is None:
                session.send_commands([(sl, DropRecording(recording=e.id)) for sl in e.slices])
        self._entries.clear()
        self._seen.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = (spec, tuple(_leaf_key(x) for x in leaves))
        entry = self._entries.get(key)
        if entry is not None:
            if entry.generation == entry.session.recovery.generation:
                return _replay(entry, leaves)
            # A recovery since: new incarnations lack the recording, and values it
            # captured may be lost there. Recording again checks them (`LostValue`).
            del self._entries[key]
            self._seen[key] = self.warmup
        seen = self._seen.get(key, 0)
        if seen < self.warmup:
            self._seen[key] = seen + 1
            return self.fn(*args, **kwargs)
        entry, out = _record(self.fn, leaves, spec)
        self._entries[key] = entry
        self._seen.pop(key, None)
        return out


def compile(fn: Callable[..., Any] | None = None, *, warmup: int = 1) -> Any:  # noqa: A001
    """Record ``fn`` once and replay it as one message per rank (`Compiled`); usable
    as ``@palatine.compile`` or ``@palatine.compile(warmup=2)``."""
    if fn is None:
        return lambda f: Compiled(f, warmup)
    return Compiled(fn, warmup)


def _leaf_key(x: Any) -> Any:
    """What must match for a recording to serve another call: a mesh tensor's mesh,
    stream and metadata; a plain value itself."""
    if type(x) is Tensor:
        m = x._meta
        v = x._value
        if m.requires_grad:
            raise CoalescingError(
                f"REQUIRES_GRAD: compiled functions take tensors that do not require grad "
                f"({x!r} does): a recording cannot join the caller's autograd graph"
            )
        return ("T", slice_key(v.mesh.slice_spec), v.stream.id, m.shape, m.stride, m.dtype)
    if isinstance(x, RemoteValue | Tensor):
        raise CoalescingError(
            f"compiled functions take mesh tensors and plain values as arguments, not "
            f"{type(x).__name__}"
        )
    try:
        hash(x)
    except TypeError:
        raise CoalescingError(
            f"a compiled function's plain arguments must be hashable (they choose the "
            f"recording); {type(x).__name__} is not"
        ) from None
    return ("V", type(x), x)


def _record(fn: Callable[..., Any], leaves: list[Any], spec: Any) -> tuple[_Entry, Any]:
    """Run ``fn`` once while recording what it issues: the entry that replays it, and
    this call's result."""
    tensors = [x for x in leaves if type(x) is Tensor]
    mesh = tensors[0].mesh if tensors else get_active_mesh()
    if mesh is None:
        raise CoalescingError(
            "a compiled function needs a mesh: activate one or pass it mesh tensors"
        )
    session = mesh.session
    session.check_usable()
    _check_not_lost(session, tensors)
    entry = _Entry()
    entry.session = session
    entry.generation = session.recovery.generation
    entry.label = f"compiled {getattr(fn, '__qualname__', fn)!s}"
    if session.recorder is not None:
        raise CoalescingError("compiled functions do not nest: this one is called inside another")
    # The recording's own handles of the arguments, bound to them on the workers.
    inputs: list[Any] = []
    bind: list[tuple[Slice, Any]] = []
    for x in leaves:
        if type(x) is Tensor:
            handle = _handle(session, x, session.ids.new_ref(), entry.label)
            entry.inputs.append(handle)
            bind.append(_call(_IDENTITY, x, handle._value.ref))
            inputs.append(handle)
        else:
            inputs.append(x)
    if bind:
        refs = [h._value.ref for h in entry.inputs]

        def commands(seq: int) -> list[tuple[Slice, Any]]:
            return [(sl, _at(c, seq)) for sl, c in bind]

        uses = [x._value.ref for x in tensors]
        session.issue(entry.label, refs, uses, [], site=None, make_commands=commands)
    rec = Recorder(session.drops, session.ids.new_ref())
    session.recorder = rec
    try:
        args, kwargs = tree_unflatten(inputs, spec)
        out = fn(*args, **kwargs)
        out_leaves, out_spec = tree_flatten(out)
        outs: list[Tensor] = []
        for i, o in enumerate(out_leaves):
            if type(o) is Tensor:
                if o.requires_grad:
                    o = o.detach()  # the graph ends with the call
                outs.append(o)
                out_leaves[i] = _OUT
            elif o is not None:
                rec.refuse(
                    f"returns a {type(o).__name__}: a replay would return the recorded "
                    "value again; return mesh tensors"
                )
    finally:
        session.recorder = None
    if rec.refusal is not None:
        raise CoalescingError(f"{entry.label} cannot be recorded: it {rec.refusal}")
    entry.outputs = outs
    entry.out_spec = out_spec
    entry.out_leaves = out_leaves
    recorded, buckets = fuse_reduces(rec.commands, rec.touched, session.ids.new_ref)
    rec.dead.update(buckets)  # a bucket's flat tensor is freed after each call
    entry.defs = sorted(rec.defs | set(buckets))
    aliases = {h._value.ref for h in entry.inputs}  # bound again by each call itself
    entry.uses = sorted(rec.uses - aliases)
    ranks = sorted({r for sl, _ in recorded for r in sl.ranks()})
    whole = [sl for sl, _ in recorded if sorted(sl.ranks()) == ranks]
    entry.slices = whole[:1] or [Slice(offset=r, sizes=[1], strides=[1]) for r in ranks]
    entry.fresh = fresh = [r for r in entry.defs if r >= rec.start_ref]
    defines: list[tuple[Slice, Message]] = []
    for r in ranks:
        mine = [c for sl, c in recorded if r in sl.ranks()]
        one = Slice(offset=r, sizes=[1], strides=[1])
        defines.append((one, DefineRecording(recording=entry.id, commands=mine, fresh=fresh)))
    session.send_commands(defines)
    entry.dead = rec.dead
    entry.finalizer = weakref.finalize(entry, _forget, session, entry.id, entry.defs)
    return entry, _rebuild(entry, _finish(entry, [], []))


def _check_not_lost(session: Any, tensors: list[Tensor]) -> None:
    """`LostValue` for an argument a recovery lost on some of its ranks, as any op
    raises (bound to the recording's input, it would be missing there)."""
    records = session.recovery
    if records.lost:
        for t in tensors:
            records.check_not_lost(t, set(t._value.mesh.ranks))


def _forget(session: Any, rid: int, defs: list[int]) -> None:
    """A recording freed with its function: stop noting its refs' drops (from a
    finalizer: no I/O; the ranks keep its commands until `Compiled.reset` or the end of
    the session)."""
    session.drops.unwatch(defs)


def _at(cmd: Any, seq: int) -> Any:
    """``cmd`` under the seq it is issued with (commands without one as they are)."""
    return msgspec.structs.replace(cmd, seq=seq) if hasattr(cmd, "seq") else cmd


def _call(fn: Any, t: Tensor, ref: int) -> tuple[Slice, CallFunction]:
    """``ref = fn(t)`` on ``t``'s ranks and stream (seq set when issued)."""
    v = t._value
    pickled, _ = pickle_op((t,), {}, [t])
    return (
        v.mesh.slice_spec,
        CallFunction(seq=0, results=[ref], function=fn, args=pickled, stream=v.stream.id),
    )


def _handle(session: Any, like: Tensor, ref: int, label: str) -> Tensor:
    """A new mesh tensor handle for ``ref``, with ``like``'s mesh, stream and metadata
    (not requiring grad)."""
    v = like._value
    m = like._meta
    return Tensor(
        RemoteValue(session, ref, v.mesh, v.stream, 0, label),
        Meta(m.shape, m.stride, m.dtype, m.device, False),
    )


def _finish(entry: _Entry, args: list[Tensor], head: list[tuple[Slice, Any]]) -> list[Tensor]:
    """One seq: ``head`` (binding ``args`` to the recording's inputs and running it, on a
    replay), then a copy of every output to a new ref, then the arguments' aliases and
    the dropped temporaries freed. The new output tensors."""
    session = entry.session
    made: list[Tensor] = []
    plan = list(head)
    for o in entry.outputs:
        t = _handle(session, o, session.ids.new_ref(), entry.label)
        made.append(t)
        plan.append(_call(_CLONE, o, t._value.ref))
    free = [h._value.ref for h in entry.inputs] + sorted(entry.dead)
    if free:
        plan += [(sl, DeleteRefs(refs=free)) for sl in entry.slices]

    def commands(seq: int) -> list[tuple[Slice, Any]]:
        return [(sl, _at(c, seq)) for sl, c in plan]

    defs = [t._value.ref for t in made]
    if head:
        # A replay makes again what the recording made (its outputs among them) from
        # the arguments and the tensors it captured. Those it writes are not listed:
        # one seq stands for the whole step, and a failure of one of its ops must not
        # mark them all failed; the ranks poison exactly what the failing op reached.
        defs += [*entry.fresh, *(h._value.ref for h in entry.inputs)]
        uses = [*entry.uses, *(x._value.ref for x in args)]
    else:
        uses = [o._value.ref for o in entry.outputs]
    seq = session.issue(entry.label, defs, uses, [], site=None, make_commands=commands)
    for t in made:
        t._value.seq = seq
    return made


def _replay(entry: _Entry, leaves: list[Any]) -> Any:
    """Run the recording again on ``leaves`` (the call's flattened arguments)."""
    entry.session.check_usable()
    args = [x for x in leaves if type(x) is Tensor]
    _check_not_lost(entry.session, args)
    head: list[tuple[Slice, Any]] = [
        _call(_IDENTITY, x, h._value.ref) for h, x in zip(entry.inputs, args, strict=True)
    ]
    for x in args:
        x._known = None  # the replay may write it; the client does not follow
    head += [(sl, CallRecording(seq=0, recording=entry.id)) for sl in entry.slices]
    return _rebuild(entry, _finish(entry, args, head))


def _rebuild(entry: _Entry, made: list[Tensor]) -> Any:
    it = iter(made)
    leaves = [next(it) if x is _OUT else x for x in entry.out_leaves]
    return tree_unflatten(leaves, entry.out_spec)
