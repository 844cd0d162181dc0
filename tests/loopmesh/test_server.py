import os
import socket

import nats
import pytest

from loopmesh.errors import NatsServerError
from loopmesh.server import NatsServer


async def test_embedded_server_serves_jetstream_and_stops_without_leaving_a_process(tmp_path):
    server = NatsServer(tmp_path / "store")
    async with server:
        pid = server.pid
        assert pid is not None
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        ack = await js.publish("s.x", b"hello")
        assert ack.seq == 1
        await nc.close()
    assert not server.running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"nats-server {pid} still running")


async def test_a_server_that_cannot_bind_its_port_says_why(tmp_path):
    """nats-server writes its fatal error to the log file (``-l``), not to stderr, and
    writes it just before it exits: the error is read after the exit."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = NatsServer(tmp_path / "store", port=port)
        with pytest.raises(NatsServerError, match="exited with code 1: ") as exited:
            await server.start()
    assert str(exited.value) == (
        f"nats-server exited with code 1: [FTL] Error listening on port: 127.0.0.1:{port}, "
        f'"listen tcp 127.0.0.1:{port}: bind: address already in use"'
    )  # the log's error, not all of it
    assert not server.running
