"""One 3-node cluster for many tests: a :class:`~loopmesh.cluster.NatsCluster` run by an
event loop of its own, in a thread.

A new cluster, and the R3 streams and buckets created on it, cost a test about two
seconds; a test module whose tests each need one can share it, emptied between tests
(half a second). But pytest-asyncio gives every test a loop of its own, and a node is an
asyncio subprocess of the loop that started it (stopping it, or restarting it, must run
there). So the cluster lives on a loop that outlives the tests, in a thread, and a test
reaches it from its own loop with :meth:`SharedCluster.run`; :meth:`SharedCluster.clear`
deletes every consumer, empties every bucket and deletes every other stream that held
anything, so each test starts from nothing::

    with SharedCluster(root) as shared:           # a module-scoped fixture
        await shared.clear()                      # in each test, before provisioning
        nc = await nats.connect(servers=shared.cluster.urls)
        await shared.run(shared.cluster.restart(node))  # from the test's loop
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx
import nats

from ..cluster import NatsCluster
from ..errors import NatsServerError

T = TypeVar("T")


class SharedCluster:
    """A :class:`NatsCluster` on a loop in a thread of its own; a context manager."""

    def __init__(self, root: str | Path, **cluster: Any) -> None:
        self.cluster = NatsCluster(root, **cluster)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="shared-cluster", daemon=True
        )

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the cluster's loop (anything that starts or stops a node)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def clear(self) -> None:
        """Bring every node back (one a failed test left stopped or paused), then forget
        what the test before left, and wait until every replica has: a direct get
        answered by a follower must not see it either. Every consumer is deleted (with
        the pull requests its dead workers left waiting); a bucket that held anything is
        purged; any other stream that did is deleted (the msg ids it deduplicates outlive
        a purge), and the next test provisions it again. Deleting every stream instead
        made that provisioning take over a second."""
        await self.run(self._heal())
        nc = await nats.connect(servers=self.cluster.urls)
        try:
            js = nc.jetstream()
            # by name, then each from its leader: a listing of infos may leave some out
            names = json.loads((await nc.request("$JS.API.STREAM.NAMES", b"{}", 10)).data)
            for stream in names.get("streams") or []:
                for consumer in await js.consumers_info(stream):
                    await js.delete_consumer(stream, consumer.name)
                info = await js.stream_info(stream)
                if not info.state.last_seq:  # never held a message: nothing to forget
                    continue
                if stream.startswith("KV_"):
                    await js.purge_stream(stream)
                else:
                    await js.delete_stream(stream)
        finally:
            await nc.close()
        await self.run(self._emptied())

    async def _emptied(self, timeout: float = 30.0) -> None:
        """Until no node holds a message or a consumer of any stream."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                left = []
                for node in self.cluster.nodes:
                    r = await http.get(f"{node.monitor_url}/jsz", params={"streams": "true"})
                    for account in r.json().get("account_details") or []:
                        for stream in account.get("stream_detail") or []:
                            state = stream.get("state") or {}
                            if state.get("messages") or state.get("consumer_count"):
                                left.append(f"{node.name}: {stream.get('name')} {state}")
                if not left:
                    return
                if time.monotonic() > deadline:
                    raise NatsServerError(f"streams not emptied: {left}")
                await asyncio.sleep(0.02)  # polling a monitor: there is no event to wait on

    async def _heal(self, timeout: float = 30.0) -> None:
        """Every node running, healthy, and known to the meta leader as a current peer
        (before that, placing a stream on three fails: "peer offline")."""
        for node in self.cluster.nodes:
            node.resume()
            await node.start()  # a no-op on a running node
        await self.cluster.wait_ready()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                peers: list[dict[str, Any]] = []
                for node in self.cluster.nodes:
                    meta = (await http.get(f"{node.monitor_url}/jsz")).json().get("meta_cluster")
                    if meta and meta.get("leader") == node.name:  # the leader's view
                        peers = meta.get("replicas") or []
                whole = [p for p in peers if p.get("current") and not p.get("offline")]
                if len(whole) == len(self.cluster.nodes) - 1:
                    return
                if time.monotonic() > deadline:
                    raise NatsServerError(f"meta peers not all current: {peers}")
                await asyncio.sleep(0.05)  # polling a monitor: there is no event to wait on

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SharedCluster:
        self._thread.start()
        try:
            self._call(self.cluster.start())
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._call(self.cluster.stop())
        finally:
            self._close()

    def _close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
