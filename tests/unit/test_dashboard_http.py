"""The dashboard's tiny HTTP server: 403 without the token (before any handler runs), a
handler's answer with its status and type, 405 for what is not a GET, 400 for a request
that is not HTTP, and a handler's error as a 500 naming the path."""

from __future__ import annotations

import asyncio

from palatine.system.dashboard.http import HttpServer, Reply


async def ask(port: int, raw: bytes) -> tuple[str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    async with asyncio.timeout(10):
        data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


def test_requests_need_the_token_and_get_the_handlers_answer() -> None:
    seen: list[tuple[str, dict[str, str]]] = []

    async def handler(path: str, query: dict[str, str]) -> Reply:
        seen.append((path, query))
        if path == "/boom":
            raise RuntimeError("it broke")
        return Reply.json({"path": path})

    async def main() -> None:
        server = HttpServer(handler, "s3cret")
        await server.start()
        try:
            get = lambda target: ask(server.port, f"GET {target} HTTP/1.1\r\n\r\n".encode())  # noqa: E731
            assert (await get("/api/state"))[0] == "HTTP/1.1 403 Forbidden"
            assert (await get("/api/state?token=wrong"))[0] == "HTTP/1.1 403 Forbidden"
            assert seen == []
            status, body = await get("/api/state?token=s3cret&proc=w%5B1%5D")
            assert status == "HTTP/1.1 200 OK" and body == b'{"path":"/api/state"}'
            assert seen == [("/api/state", {"token": "s3cret", "proc": "w[1]"})]
            status, body = await get("/boom?token=s3cret")
            assert status == "HTTP/1.1 500 Internal Server Error" and b"/boom: it broke" in body
            post = await ask(server.port, b"POST /?token=s3cret HTTP/1.1\r\n\r\n")
            assert post[0] == "HTTP/1.1 405 Method Not Allowed"
            assert (await ask(server.port, b"hello\r\n\r\n"))[0] == "HTTP/1.1 400 Bad Request"
        finally:
            await server.close()

    asyncio.run(main())
