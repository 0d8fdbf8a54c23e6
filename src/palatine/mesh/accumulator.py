"""`Accumulator`: one value from a mesh call, folded over every rank's reply.

``Accumulator(counters.value, 0, operator.add).accumulate()`` is a `palatine.Future` of
the sum of every actor's ``value()``, the way Monarch's ``monarch.actor.Accumulator``
folds a mesh's replies. The replies are folded in rank order, so a combine that is not
commutative gives the same answer every time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from palatine.core.future import Future
from palatine.mesh.actor_mesh import Endpoint, ValueMesh

__all__ = ["Accumulator"]

A = TypeVar("A")


class Accumulator(Generic[A]):
    """Fold the replies of ``endpoint`` over its mesh: ``combine(combine(identity, r0), r1)...``."""

    def __init__(
        self, endpoint: Endpoint[..., Any], identity: A, combine: Callable[[A, Any], A]
    ) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call the endpoint on every selected actor; a Future of the folded replies (the
        first failed reply's error, if any failed)."""
        calls = self._endpoint.call(*args, **kwargs)
        out: Future[A] = Future(calls._loop)

        def fold(f: Future[ValueMesh[Any]]) -> None:
            if f._exc is not None:
                out.set_exception(f._exc)
                return
            acc = self._identity
            try:
                for value in f._value.values():
                    acc = self._combine(acc, value)
            except Exception as e:  # noqa: BLE001 - the combine's error, for the caller
                out.set_exception(e)
                return
            out.set_result(acc)

        calls.add_done_callback(fold)
        return out
