"""The pre-filter's embedding cache in a KV bucket: what one loop worker embedded,
another reads instead of asking the endpoint again."""

from __future__ import annotations

import nats
from nats.aio.client import Client

from loop_worker.embeddings import KVEmbeddingCache, decode, encode
from loop_worker.engine.prefilter import Prefilter
from loop_worker.engine.settings import PrefilterSettings
from loopmesh.jetstream import Publisher
from loopmesh.provision import ensure_bucket
from loopmesh.server import NatsServer
from loopmesh.testing.fake_llm import FakeLLM
from schemas import Subjects
from schemas.streams import embeddings_bucket
from tests.loop_worker.catalog60 import catalog


async def select_as_a_worker(server: NatsServer, fake: FakeLLM, query: str) -> list[str]:
    """One worker's connection, publisher and prefilter, as a loop worker builds them."""
    client = await nats.connect(server.url)
    publisher = Publisher(client)
    await publisher.start()
    settings = PrefilterSettings(
        enabled=True, top_k=8, embeddings_base_url=fake.base_url, embeddings_model="fake-embed"
    )
    cache = KVEmbeddingCache(publisher, Subjects().embeddings_bucket)
    prefilter = Prefilter.from_settings(settings, cache=cache)
    try:
        selection = await prefilter.select(query, catalog())
        assert selection.method == "embeddings", selection.note
        return [t.name for t in selection.tools]
    finally:
        await prefilter.aclose()
        await publisher.close()
        await client.close()


async def test_a_second_worker_embeds_only_its_query(
    nats_server: NatsServer, nc: Client, fake_llm: FakeLLM
) -> None:
    await ensure_bucket(nc.jetstream(), embeddings_bucket(Subjects()))
    first = await select_as_a_worker(nats_server, fake_llm, "what time is it in Tokyo")
    assert [len(inputs) for inputs in fake_llm.embeddings] == [61]
    kv = await nc.jetstream().key_value(Subjects().embeddings_bucket)
    assert len(await kv.keys()) == 60
    second = await select_as_a_worker(nats_server, fake_llm, "what time is it in Tokyo")
    assert [len(inputs) for inputs in fake_llm.embeddings] == [61, 1]
    assert fake_llm.embeddings[1] == ["what time is it in Tokyo"]
    assert first == second  # the cached vectors rank as the fresh ones did
    assert "current_time" in first


async def test_without_the_bucket_the_prefilter_still_ranks(
    nats_server: NatsServer, fake_llm: FakeLLM
) -> None:
    names = await select_as_a_worker(nats_server, fake_llm, "what time is it in Tokyo")
    assert len(names) == 8
    assert [len(inputs) for inputs in fake_llm.embeddings] == [61]


def test_vectors_survive_their_encoding() -> None:
    vector = [0.5, -0.25, 1.0, 0.0]
    assert decode(encode(vector)) == vector
    assert decode(b"") is None
    assert decode(b"abc") is None
