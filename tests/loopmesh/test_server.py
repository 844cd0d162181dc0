import os

import nats

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
