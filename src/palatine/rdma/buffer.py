"""`RDMABuffer`: bytes of one process that others read and write without its actors.

Monarch's API: ``RDMABuffer(tensor | bytearray | memoryview)`` registers the bytes with
this process; the buffer pickles into actor messages; a holder anywhere calls
``read_into(dst)`` / ``write_from(src)``, which return a `palatine.Future` (``await``
it, or ``.get()`` from plain code), and ``drop()`` unregisters it. Where the bytes move
is chosen per transfer: by shared memory or cross-memory attach when the owner is on
this host (`palatine.rdma.shm`), else through the owner proc's buffer server over TCP
or TLS (`palatine.rdma.server`, `palatine.rdma.client`). The copy runs on a worker
thread, never on the event loop.

Sizes: ``read_into(dst, offset)`` reads the buffer from ``offset`` to its end into the
start of ``dst``, which must hold at least that (a larger ``dst`` keeps its tail, as in
Monarch); ``write_from(src, offset)`` writes all of ``src`` at ``offset``, which must
fit. Anything else is a `ValueError`, raised by the call itself.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec

from palatine import config
from palatine.core import runtime
from palatine.core.future import Future
from palatine.errors import CallTimeout
from palatine.rdma import client, registry, shm, watch
from palatine.rdma.handle import BufferHandle, locality, owner_gone
from palatine.rdma.memory import Region, region_of
from palatine.rdma.server import ensure_server

__all__ = ["RDMABuffer"]


class RDMABuffer:
    """A registered buffer (see the module docstring); pickles to its handle."""

    def __init__(self, data: Any) -> None:
        self._obj = data  # the owner keeps its bytes alive as long as the buffer lives
        self._handle = registry.register(data, ensure_server())

    @classmethod
    def _from_handle(cls, blob: bytes) -> RDMABuffer:
        self = cls.__new__(cls)
        self._obj = None
        self._handle = msgspec.msgpack.decode(blob, type=BufferHandle)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (RDMABuffer._from_handle, (msgspec.msgpack.encode(self._handle),))

    def size(self) -> int:
        """The buffer's length in bytes."""
        return self._handle.size

    @property
    def owner(self) -> str:
        """Who owns the bytes: ``world[rank] on host H (pid P)``."""
        return str(self._handle.owner)

    def __repr__(self) -> str:
        return f"RDMABuffer({self._handle.size} bytes of {self._handle.owner})"

    # ------------------------------------------------------------ transfers
    def read_into(self, dst: Any, offset: int = 0, *, timeout: float | None = None) -> Future[None]:
        """Copy the buffer's bytes from ``offset`` to its end into the start of ``dst``."""
        region = region_of(dst, "read_into's destination", for_write=True)
        n = self._span(offset)
        if region.nbytes < n:
            raise ValueError(
                f"rdma read_into: the destination holds {region.nbytes} bytes, fewer than "
                f"the {n} bytes of {self!r} from offset {offset}"
            )
        return self._start("read", offset, region, n, timeout)

    def write_from(
        self, src: Any, offset: int = 0, *, timeout: float | None = None
    ) -> Future[None]:
        """Copy all of ``src`` into the buffer at ``offset``."""
        region = region_of(src, "write_from's source", for_write=False)
        n = self._span(offset)
        if region.nbytes > n:
            raise ValueError(
                f"rdma write_from: the source's {region.nbytes} bytes do not fit the "
                f"{n} bytes of {self!r} from offset {offset}"
            )
        if not self._handle.writable:
            raise ValueError(f"rdma write_from: {self!r} is read-only")
        return self._start("write", offset, region, region.nbytes, timeout)

    def drop(self) -> Future[None]:
        """Unregister the buffer: transfers from anyone fail from now on. The owner drops
        at once; another holder asks the owner's server."""
        h = self._handle
        if h.owner.pid == os.getpid() and h.locality == locality():
            registry.drop(h.buffer_id)
            self._obj = None
            done: Future[None] = Future(runtime.get_loop())
            done.set_result(None)
            return done
        timeout_s = config.get().rdma_timeout_s
        return runtime.submit(
            lambda: asyncio.to_thread(client.transfer, h, "drop", 0, None, timeout_s)
        )

    def _span(self, offset: int) -> int:
        if not 0 <= offset <= self._handle.size:
            raise ValueError(f"rdma: offset {offset} is outside {self!r}")
        return self._handle.size - offset

    def _start(
        self, op: str, offset: int, region: Region, n: int, timeout: float | None
    ) -> Future[None]:
        timeout_s = config.get().rdma_timeout_s if timeout is None else float(timeout)
        h = self._handle
        proc = watch.caller_proc()

        async def run() -> None:
            gone = watch.owner_watch(proc, h) if proc is not None else None
            if gone is not None and gone.done() and watch.matches(gone.result(), h):
                raise owner_gone(h.owner, op, f"declared dead: {gone.result().reason}")
            copy = asyncio.ensure_future(
                asyncio.to_thread(_copy, h, op, offset, region, n, timeout_s)
            )
            waits: list[asyncio.Future[Any]] = [copy] if gone is None else [copy, gone]
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except TimeoutError:
                copy.add_done_callback(_ignore)  # the thread ends at its own socket timeout
                raise CallTimeout(
                    f"rdma {op}: {n} bytes with {h.owner} took longer than {timeout_s:g} s"
                ) from None
            if not copy.done():  # the system declared the owner dead first
                assert gone is not None
                copy.add_done_callback(_ignore)
                raise owner_gone(h.owner, op, f"declared dead: {gone.result().reason}")
            copy.result()
            if op == "read" and region.finish is not None:
                region.finish()

        return runtime.submit(run)


def _ignore(fut: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a copy nobody waits for any more."""
    if not fut.cancelled():
        fut.exception()


def _copy(h: BufferHandle, op: str, offset: int, region: Region, n: int, timeout_s: float) -> None:
    """One transfer, on a worker thread: directly when the owner is on this host and lets
    us, else through its server."""
    if h.locality == locality() and config.get().rdma_backend != "socket":
        try:
            shm.copy(h, op, offset, region.address, n)
            return
        except shm.Unreachable:
            pass
        except Exception as e:
            from palatine.errors import DeviceException

            if isinstance(e, DeviceException):
                shm.forget(h)
            raise
    view = region.view()[:n]
    client.transfer(h, op, offset, view, timeout_s)
