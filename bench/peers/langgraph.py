"""LangGraph with a durable checkpointer: a ReAct graph (an agent node calling the fake
LLM with the openai client, a tools node running the echo tool in this process) whose
every step is checkpointed by ``AsyncPostgresSaver`` (``durability="sync"``: a step's
checkpoint is written before the next step starts) on a PostgreSQL the bench starts
itself (``initdb`` into a temporary directory, ``postgres`` on a free port, defaults:
``fsync=on``, ``synchronous_commit=on``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import os
import pwd
import signal
from pathlib import Path
from typing import Annotated, Any, TypedDict

from bench.common import chat, need_binary, peer_imports
from bench.held import mark as _mark
from bench.held import released
from loopmesh.ports import free_port

HINT = "apt-get install postgresql (Debian's; the bench starts its own server)"
# Debian keeps the server's binaries off PATH, one directory per major version: newest first.
PG_BIN = tuple(
    str(d)
    for d in sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0,
        reverse=True,
    )
)


class State(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]


def _as_postgres() -> dict[str, Any]:
    """postgres refuses to run as root: drop to the ``postgres`` user when root."""
    if os.getuid() != 0:
        return {}
    user = pwd.getpwnam("postgres")
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


class Postgres:
    def __init__(self, data: Path) -> None:
        self.data = data

    async def __aenter__(self) -> Postgres:
        with peer_imports("psycopg"):
            import psycopg
        initdb = need_binary("initdb", HINT, *PG_BIN)
        postgres = need_binary("postgres", HINT, *PG_BIN)
        self.data.mkdir(parents=True, exist_ok=True)
        drop = _as_postgres()
        if drop:
            os.chown(self.data, drop["user"], drop["group"])
        init = await asyncio.create_subprocess_exec(
            initdb, "-D", str(self.data / "pg"), "-A", "trust", "-U", "bench", "--no-sync",
            stdout=asyncio.subprocess.DEVNULL, **drop,
        )  # fmt: skip
        if await init.wait():
            raise RuntimeError("initdb failed")
        self.port = free_port()
        self.proc = await asyncio.create_subprocess_exec(
            postgres, "-D", str(self.data / "pg"), "-p", str(self.port), "-k", str(self.data),
            "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=300",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, **drop,
        )  # fmt: skip
        self.url = f"postgresql://bench@127.0.0.1:{self.port}/postgres"
        for _ in range(300):
            try:
                conn = await psycopg.AsyncConnection.connect(self.url)
                await conn.close()
                return self
            except psycopg.OperationalError:
                await asyncio.sleep(0.1)
        raise RuntimeError("postgres did not start")

    async def __aexit__(self, *exc: object) -> None:
        self.proc.terminate()
        await self.proc.wait()


async def open_graph(pg_url: str, llm_url: str, mark: str = "", hold: str = "") -> Any:
    """The ReAct graph, checkpointed by ``AsyncPostgresSaver`` on a pool to ``pg_url``;
    its tools node echoes (after appending a line to ``mark`` and waiting for the file
    ``hold``, if given: the recovery runs' held tool). Returns (graph, pool, client)."""
    import openai

    with peer_imports("langgraph", "langgraph.checkpoint.postgres", "psycopg", "psycopg_pool"):
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
        from langgraph.graph import END, START, StateGraph
        from psycopg.rows import dict_row
        from psycopg_pool import AsyncConnectionPool
    pool = AsyncConnectionPool(
        pg_url, min_size=4, max_size=64, open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )  # fmt: skip
    await pool.open()
    saver = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
    await saver.setup()
    client = openai.AsyncOpenAI(base_url=llm_url, api_key="bench", max_retries=0)

    async def agent(state: State) -> dict[str, Any]:
        return {"messages": [await chat(client, state["messages"])]}

    async def run_tools(state: State) -> dict[str, Any]:
        out = []
        for call in state["messages"][-1].get("tool_calls") or []:
            text = json.loads(call["function"]["arguments"])["text"]
            if mark:
                await asyncio.to_thread(_mark, mark)
            if hold:
                await released(hold)
            out.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        return {"messages": out}

    def route(state: State) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", run_tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=saver), pool, client


def config(thread_id: str, k: int) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}, "recursion_limit": 4 * k + 10}


class LangGraph:
    name = "LangGraph + Postgres"
    durability = "Postgres fsync=on, synchronous_commit=on; checkpoint per step (sync)"

    def __init__(self, llm_url: str, store: Path) -> None:
        self.llm_url = llm_url
        self.pg = Postgres(store)

    async def __aenter__(self) -> LangGraph:
        await self.pg.__aenter__()
        try:
            self.graph, self.pool, self.client = await open_graph(self.pg.url, self.llm_url)
        except BaseException:
            await self.pg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.pool.close()
        await self.pg.__aexit__(*exc)

    async def session(self, sid: str, k: int) -> None:
        message = {"role": "user", "content": f"{sid} echo {k}"}
        await self.graph.ainvoke({"messages": [message]}, config(sid, k), durability="sync")


# -- recovery: kill -9 of the process running the graph, resumed by another ---------------


async def _runner(args: argparse.Namespace) -> None:
    """A process that runs one session (``run``) or, on SIGUSR1, resumes it from its
    last checkpoint (``resume``); prints ``ready``, then ``done`` at its end."""
    graph, pool, client = await open_graph(args.pg, args.llm, args.mark, args.hold)
    state: dict[str, Any] | None = None  # resume from the thread's last checkpoint
    if args.role == "run":
        state = {"messages": [{"role": "user", "content": f"{args.thread} echo 1"}]}
        print("ready", flush=True)
    else:
        go = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
        print("ready", flush=True)
        await go.wait()  # the supervisor says: it died
    await graph.ainvoke(state, config(args.thread, 1), durability="sync")
    print("done", flush=True)
    await client.close()
    await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.peers.langgraph")
    parser.add_argument("role", choices=["run", "resume"])
    parser.add_argument("--pg", required=True)
    parser.add_argument("--llm", required=True)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--hold", default="")
    parser.add_argument("--mark", default="")
    asyncio.run(_runner(parser.parse_args()))
