"""``python -m loopmesh.testing.minilm --port N``: the bundled MiniLM
(:mod:`loopmesh.minilm`) served on ``/v1/embeddings`` by the fake OpenAI-compatible
server: a real embeddings endpoint, offline, for tests and benches."""

from __future__ import annotations

import asyncio

from loopmesh.minilm import MAX_TOKENS, MiniLM, missing, model_dir

__all__ = ["MAX_TOKENS", "MiniLM", "main", "missing", "model_dir"]


async def _serve(port: int) -> None:
    import signal

    from loopmesh.testing.fake_llm import FakeLLM

    model = MiniLM.load()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with FakeLLM(port=port, embedder=model.embed, models=(MiniLM.name,)) as server:
        print(f"embeddings serving {server.base_url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """``python -m loopmesh.testing.minilm --port N``: the model on ``/v1/embeddings``.
    Run it with ``OPENBLAS_NUM_THREADS=1`` on a busy machine (numpy's threads spin)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopmesh.testing.minilm")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port))


if __name__ == "__main__":
    main()
