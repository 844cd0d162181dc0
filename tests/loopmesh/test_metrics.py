import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from loopmesh.metrics import MetricsServer


async def test_metrics_serves_the_registry_in_prometheus_text_format():
    registry = CollectorRegistry()
    turns = Counter("loopmesh_test_turns", "turns done", registry=registry)
    turns.inc(3)
    async with MetricsServer(port=0, registry=registry) as server, httpx.AsyncClient() as http:
        assert server.port != 0
        response = await http.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "loopmesh_test_turns_total 3.0" in response.text


async def test_healthz_follows_the_health_callable():
    state = {"ok": True}

    async def healthy() -> bool:
        return state["ok"]

    async with MetricsServer(healthy=healthy) as server, httpx.AsyncClient() as http:
        answers = []
        for ok in (True, False, True):  # each answer whole (its own Content-Length)
            state["ok"] = ok
            response = await http.get(f"{server.url}/healthz")
            answers.append((response.status_code, response.text))
    assert answers == [(200, "ok\n"), (503, "unhealthy\n"), (200, "ok\n")]


async def test_a_health_callable_that_raises_counts_as_unhealthy():
    def broken() -> bool:
        raise RuntimeError("no")

    async with MetricsServer(healthy=broken) as server, httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/healthz")).status_code == 503


async def test_other_paths_and_methods_are_refused():
    async with MetricsServer() as server, httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/nope")).status_code == 404
        assert (await http.post(f"{server.url}/metrics")).status_code == 405


async def test_a_closed_server_stops_listening_and_closing_again_is_harmless():
    server = MetricsServer()
    await server.start()
    url = server.url
    await server.close()
    await server.close()
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{url}/metrics")


async def test_closing_ends_the_server_thread() -> None:
    async with MetricsServer() as server, httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/metrics")).status_code == 200
        assert [t for t in threading.enumerate() if t.name == f"metrics-{server.port}"]
    assert not [t for t in threading.enumerate() if t.name.startswith("metrics-")]


async def test_metrics_are_served_while_the_event_loop_is_blocked() -> None:
    async with MetricsServer() as server:
        # a synchronous client blocks the loop: the scrape is answered from the server's thread
        with httpx.Client() as http:
            assert http.get(f"{server.url}/metrics").status_code == 200  # noqa: ASYNC212
