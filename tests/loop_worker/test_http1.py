"""The lean HTTP/1.1 transport against a real socket server that writes exactly the bytes
each test gives it, and through the real ``openai`` client over TLS."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import openai
import pytest
import trustme

from loop_worker.engine.http1 import Http1Transport, hx


@dataclass
class RawServer:
    """Answers each request with ``replies`` in turn, each written piece by piece with a
    drain between; ``None`` closes the connection instead of answering."""

    replies: list[list[bytes] | None] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    close_after: bool = False  # close each connection after its reply
    port: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    break
                for piece in reply:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[RawServer]:
    server = RawServer()
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = server.server.sockets[0].getsockname()[1]
    yield server
    server.server.close()


@pytest.fixture
async def client() -> AsyncIterator[hx.AsyncClient]:
    async with hx.AsyncClient(transport=Http1Transport(), timeout=5) as c:
        yield c


def chunked(*parts: bytes, head: bytes = b"") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n" + head + b"\r\n" + body


def sized(body: bytes, head: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), head, body)


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
async def test_a_chunked_body_reads_the_same_however_the_reads_split_it(raw, client, size):
    parts = [b"data: one\n\n", b"data: two\n\n", b"x" * 300]
    raw.replies.append(split(chunked(*parts, head=b"x-a: 1\r\n"), size))
    async with client.stream("POST", raw.url + "/v1/x", content=b"{}") as response:
        body = b"".join([piece async for piece in response.aiter_raw()])
    assert response.status_code == 200
    assert response.headers["x-a"] == "1"
    assert body == b"".join(parts)


async def test_connections_are_used_again_for_the_next_request(raw, client):
    raw.replies += [[sized(b"one")], [chunked(b"two")], [sized(b"")]]
    for expected in (b"one", b"two", b""):
        assert (await client.post(raw.url + "/a", content=b"q")).content == expected
    assert raw.connections == 1
    first = raw.requests[0]
    assert first.startswith(b"POST /a HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 1\r\n" in first.replace(b"content-length", b"Content-Length")
    assert first.endswith(b"\r\n\r\nq")


async def test_a_body_ended_by_close_is_read_whole_and_its_connection_not_used_again(raw, client):
    raw.close_after = True
    raw.replies += [[b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"the close"], [sized(b"next")]]
    assert (await client.get(raw.url)).content == b"until the close"
    assert (await client.get(raw.url)).content == b"next"
    assert raw.connections == 2


async def test_connection_close_and_http_1_0_are_not_used_again(raw, client):
    raw.replies += [
        [b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\na"],
        [b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nb"],
        [sized(b"c")],
    ]
    raw.close_after = True  # as such servers do
    bodies = [(await client.get(raw.url)).content for _ in range(3)]
    assert bodies == [b"a", b"b", b"c"]
    assert raw.connections == 3


async def test_an_interim_response_is_skipped_and_a_204_has_no_body(raw, client):
    raw.replies += [
        [b"HTTP/1.1 100 Continue\r\n\r\n", sized(b"final")],
        [b"HTTP/1.1 204 No Content\r\n\r\n"],
        [sized(b"after")],
    ]
    assert (await client.post(raw.url, content=b"x")).content == b"final"
    empty = await client.get(raw.url)
    assert (empty.status_code, empty.content) == (204, b"")
    assert (await client.get(raw.url)).content == b"after"
    assert raw.connections == 1


async def test_a_large_request_and_a_large_response_arrive_whole(raw, client):
    big = bytes(range(256)) * 8192  # 2 MiB
    raw.replies.append(split(sized(big[::-1]), 65536))
    response = await client.post(raw.url, content=big)
    assert raw.requests[0].endswith(big)
    assert response.content == big[::-1]


async def test_a_connection_lost_mid_body_raises_a_read_error(raw, client):
    raw.close_after = True
    raw.replies.append([b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"])
    with pytest.raises(hx.ReadError, match="lost before the response ended"):
        async with client.stream("GET", raw.url) as response:
            async for _ in response.aiter_raw():
                pass


async def test_a_server_that_hangs_up_without_answering_raises_a_protocol_error(raw, client):
    raw.replies.append(None)
    with pytest.raises(hx.RemoteProtocolError, match="without a response"):
        await client.get(raw.url)


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nabc", "does not end in CRLF"),
        (b"SPDY/3 200 OK\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "bad header line"),
    ],
)
async def test_a_response_that_cannot_be_framed_is_refused_naming_what_is_wrong(
    raw, client, reply, says
):
    raw.replies.append([reply])
    with pytest.raises(hx.RemoteProtocolError, match=says):
        async with client.stream("GET", raw.url) as response:
            async for _ in response.aiter_raw():
                pass


async def test_a_read_waits_at_most_the_read_timeout_for_the_next_bytes(raw):
    raw.replies.append([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"])
    timeout = hx.Timeout(5, read=0.3)
    async with (
        hx.AsyncClient(transport=Http1Transport(), timeout=timeout) as client,
        client.stream("GET", raw.url) as response,
    ):
        with pytest.raises(hx.ReadTimeout, match=r"no response bytes for 0\.3 s"):
            async for piece in response.aiter_raw():
                assert piece == b"first"


async def test_a_refused_connection_raises_a_connect_error(client):
    with pytest.raises(hx.ConnectError, match=r"cannot connect to 127\.0\.0\.1:1"):
        await client.get("http://127.0.0.1:1/")


async def test_an_idle_connection_the_server_closed_is_not_used(raw, client):
    raw.close_after = True
    raw.replies += [[sized(b"one")], [sized(b"two")]]
    assert (await client.get(raw.url)).content == b"one"
    await asyncio.sleep(0.1)  # the server's close reaches the idle connection
    assert (await client.get(raw.url)).content == b"two"
    assert raw.connections == 2


async def test_a_request_on_an_idle_connection_closed_unseen_goes_again_on_a_new_one(raw, client):
    # the server hangs up on the second request of the first connection, as a server
    # does that closed it while its close was lost (a partition) or restarted
    raw.replies += [[sized(b"one")], None, [sized(b"two")]]
    assert (await client.get(raw.url)).content == b"one"
    assert (await client.post(raw.url, content=b"again")).content == b"two"
    assert raw.connections == 2
    assert raw.requests[1].endswith(b"again") and raw.requests[2].endswith(b"again")


async def test_a_body_closed_before_its_end_closes_its_connection(raw, client):
    raw.replies += [[chunked(b"a" * 10, b"b" * 10)], [sized(b"next")]]
    async with client.stream("GET", raw.url) as response:
        async for _ in response.aiter_raw():
            break  # the rest unread
    assert (await client.get(raw.url)).content == b"next"
    assert raw.connections == 2


async def test_the_openai_client_streams_over_tls():
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    events = [
        {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    sse = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"
    raw = RawServer(replies=[[chunked(sse, head=b"content-type: text/event-stream\r\n")]])
    server = await asyncio.start_server(raw._serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    http = openai.DefaultAsyncHttpxClient(transport=Http1Transport(ssl_context=client_ctx))
    client = openai.AsyncOpenAI(
        base_url=f"https://localhost:{port}/v1", api_key="k", http_client=http, max_retries=0
    )
    try:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = [c.choices[0].delta.content async for c in stream if c.choices]
    finally:
        await client.close()
        server.close()
    assert texts == ["hi", None]
    assert b"authorization: Bearer k" in raw.requests[0].lower().replace(b"bearer", b"Bearer")
