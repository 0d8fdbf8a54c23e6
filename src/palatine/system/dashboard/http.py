"""A tiny HTTP/1.1 server on asyncio streams, for the dashboard.

It reads one GET per connection (request line and headers, bounded in size and time),
hands the path and query to a handler coroutine and writes its answer with
``Connection: close``. That is all a page on loopback polling a JSON endpoint needs, and
it runs on palatine's own loop, next to the system client whose answers it serves, with
no thread and no framework. Every request must carry the server's token (``?token=``, as
Jupyter's links do); one without it, or with another, gets 403 before any handler runs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import msgspec

__all__ = ["Reply", "Handler", "HttpServer"]

log = logging.getLogger(__name__)

_REQUEST_S = 10.0  # to read one request's head
_HEAD_MAX = 16 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 500: "Internal Server Error"}  # fmt: skip


class Reply(msgspec.Struct, frozen=True):
    """One answer: status, content type and body."""

    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, obj: object, status: int = 200) -> Reply:
        return cls(status, "application/json", msgspec.json.encode(obj))

    @classmethod
    def text(cls, text: str, status: int = 200) -> Reply:
        return cls(status, "text/plain; charset=utf-8", text.encode())


#: ``handler(path, query)``: query values are the first of each name.
Handler = Callable[[str, dict[str, str]], Awaitable[Reply]]


class HttpServer:
    """Serves ``handler`` on ``host:port`` (0: any free port) to requests with ``token``."""

    def __init__(self, handler: Handler, token: str, host: str = "127.0.0.1", port: int = 0):
        self.handler = handler
        self.token = token
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            async with asyncio.timeout(5):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            reply = await self._answer(reader)
            head = (
                f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Error')}\r\n"
                f"Content-Type: {reply.content_type}\r\n"
                f"Content-Length: {len(reply.body)}\r\n"
                "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + reply.body)
            async with asyncio.timeout(_REQUEST_S):
                await writer.drain()
        except (TimeoutError, ConnectionError) as e:
            log.debug("dashboard: a connection ended early: %s", e)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> Reply:
        try:
            async with asyncio.timeout(_REQUEST_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return Reply.text("request head too large", 400)
        except asyncio.IncompleteReadError:
            return Reply.text("incomplete request", 400)
        if len(head) > _HEAD_MAX:
            return Reply.text("request head too large", 400)
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3:
            return Reply.text("bad request line", 400)
        method, target, _ = parts
        if method != "GET":
            return Reply.text(f"{method} is not served here", 405)
        url = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if not hmac.compare_digest(query.get("token", "").encode(), self.token.encode()):
            return Reply.text("a valid ?token= is needed (the link the dashboard printed)", 403)
        try:
            return await self.handler(url.path, query)
        except Exception as e:  # noqa: BLE001 - one request's error is its answer
            log.warning("dashboard: %s failed: %s", url.path, e)
            return Reply.text(f"{url.path}: {e}", 500)
