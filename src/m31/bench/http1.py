"""A minimal HTTP/1.1 client for load generation: one keep-alive connection, one call at a time,
the request written whole and the answer read by its Content-Length (or chunked).

Why not httpx, which the retrieve clients use: on the 2-core development machine an httpx call
costs the client 3 to 4 ms of CPU, as much as the server spends on a call of 100 events, on the
same two cores; a load generator that takes half the machine measures itself. This one writes
the bytes and reads the status line, the headers it needs and the body (docs/SCALING.md,
"Users").
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit


class HttpError(OSError):
    """The connection failed, closed early, or answered something that is not HTTP/1.1."""


class Http1:
    """`await post(path, body, headers)` -> (status, body bytes) on one connection to `url`
    (http or https), opened on the first call and again after one that failed or that the
    server closed."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout_s: float = 30):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: {url!r} is not an http(s) URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        fixed = {"Host": host, **(headers or {})}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}{extra}"
        request = f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        try:
            return await asyncio.wait_for(self._exchange(request), self.timeout_s)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            await self.close()  # whatever it was, the connection's state is unknown now
            raise e if isinstance(e, HttpError) else HttpError(str(e) or type(e).__name__) from e
        except TimeoutError:
            await self.close()
            raise

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            context = ssl.create_default_context() if self.tls else None
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, ssl=context
            )
        reader, writer = self._reader, self._writer
        writer.write(request)
        await writer.drain()
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        version, _, rest = head[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise HttpError(f"not an HTTP/1.1 answer: {head[0][:80]!r}")
        fields = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if fields.get("transfer-encoding", "").lower() == "chunked":
            body = await _chunked(reader)
        elif "content-length" in fields:
            body = await reader.readexactly(int(fields["content-length"]))
        else:  # the body ends with the connection
            body = await reader.read()
            fields["connection"] = "close"
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return int(rest[:3]), body

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
