"""The load generator's HTTP/1.1 client (m31.bench.http1) against real servers on a loopback
port: uvicorn serving a small app (keep-alive, status codes, bodies both ways), and a raw
asyncio server for what uvicorn does not send (a chunked answer, `Connection: close`, a body
ended by the connection, an answer that is not HTTP)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from m31.bench.http1 import Http1, HttpError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    """uvicorn in a thread: POST /echo answers the body and headers it got, /status/{n} n."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {"body": body.decode(), "auth": request.headers.get("authorization")}

    @app.post("/status/{n}")
    async def status(n: int):
        return JSONResponse({"detail": f"status {n}"}, status_code=n)

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        threading.Event().wait(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def test_calls_share_one_keep_alive_connection(app_url):
    async def run():
        http = Http1(app_url, {"Authorization": "Bearer t"})
        answers = [await http.post("/echo", f'{{"n":{i}}}'.encode()) for i in range(5)]
        writer = http._writer
        status, body = await http.post("/status/422", b"")
        assert http._writer is writer  # the same connection all along
        await http.close()
        return answers, status, body

    answers, status, body = asyncio.run(run())
    for i, (code, got) in enumerate(answers):
        assert code == 200
        assert json.loads(got) == {"body": f'{{"n":{i}}}', "auth": "Bearer t"}
    assert status == 422 and json.loads(body) == {"detail": "status 422"}


RAW = {
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: 1\r\n\r\n",
    b"/close": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n"
    b"\r\nbusy",
    b"/until-eof": b"HTTP/1.1 200 OK\r\n\r\nall of it",
    b"/garbage": b"SSH-2.0-OpenSSH\r\n\r\n",
    b"/bad-length": b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
}


def test_chunked_closed_and_broken_answers():
    async def run():
        connections = []

        async def handle(reader, writer):
            connections.append(writer)
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                path = head.split(b" ")[1]
                writer.write(RAW[path])
                await writer.drain()
                if path in (b"/close", b"/until-eof", b"/garbage", b"/bad-length"):
                    break
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        http = Http1(f"http://127.0.0.1:{port}")
        got = [await http.post("/chunked", b"x"), await http.post("/chunked", b"y")]
        assert len(connections) == 1  # chunked answers keep the connection
        got.append(await http.post("/close", b"z"))
        assert http._writer is None  # the server said close
        got.append(await http.post("/until-eof", b""))
        got.append(await http.post("/chunked", b""))  # a new connection
        assert len(connections) == 3
        with pytest.raises(HttpError, match=r"not an HTTP/1\.1 answer"):
            await http.post("/garbage", b"")
        assert http._writer is None
        with pytest.raises(HttpError, match="many"):
            await http.post("/bad-length", b"")
        assert http._writer is None
        server.close()
        await server.wait_closed()
        with pytest.raises(HttpError):  # nobody listens any more
            await http.post("/chunked", b"")
        return got

    got = asyncio.run(run())
    assert got == [
        (200, b"hello, world"),
        (200, b"hello, world"),
        (503, b"busy"),
        (200, b"all of it"),
        (200, b"hello, world"),
    ]


def test_only_http_urls_are_taken():
    for url in ("ftp://host/", "localhost:8031", "http://"):
        with pytest.raises(ValueError, match="not an http"):
            Http1(url)
