"""Talk to a loopmesh agent over A2A with the official ``a2a-sdk`` client: resolve its
card, send a message, print the answer as it streams, and the task's end.

    python examples/a2a_client.py --url http://127.0.0.1:8080/a2a/default "What is 17 * 23?"
    python examples/a2a_client.py --url https://gw/a2a/calc --key "$KEY" "What is 17 * 23?"

``--url`` is the agent's A2A URL (its card is at ``<url>/.well-known/agent-card.json``;
the gateway's root serves the ``default`` agent's); ``--key`` a gateway API key (left
out for a gateway without keys). ``--context`` continues a conversation: a context is a
loopmesh session.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

import httpx
from a2a.client import ClientConfig, ClientFactory
from a2a.types import Message, Part, Role, SendMessageRequest, TaskState


async def main(url: str, key: str | None, text: str, context: str) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(headers=headers, timeout=300) as http:
        client = await ClientFactory(ClientConfig(httpx_client=http)).create_from_url(url)
        request = SendMessageRequest(
            message=Message(
                message_id=uuid.uuid4().hex,
                role=Role.ROLE_USER,
                parts=[Part(text=text)],
                context_id=context,
            )
        )
        state, shown, midline = TaskState.TASK_STATE_UNSPECIFIED, "", False
        async for event in client.send_message(request):
            match event.WhichOneof("payload"):
                case "task":
                    print(f"task {event.task.id} in context {event.task.context_id}")
                case "artifact_update":  # the answer, streamed: chunks, then the whole
                    update = event.artifact_update
                    chunk = "".join(p.text for p in update.artifact.parts)
                    text_now = shown + chunk if update.append else chunk
                    if text_now.startswith(shown):
                        print(text_now[len(shown) :], end="", flush=True)
                    else:  # a reply taken back (the model was asked again)
                        print(f"\n[replaced] {text_now}", end="", flush=True)
                    shown, midline = text_now, True
                case "status_update":
                    status = event.status_update.status
                    state = status.state
                    said = "".join(p.text for p in status.message.parts)
                    line = f"[{TaskState.Name(state)}] {said}".rstrip()
                    print(f"\n{line}" if midline else line, flush=True)
                    midline = False
        await client.close()
    return 0 if state == TaskState.TASK_STATE_COMPLETED else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080/a2a/default")
    parser.add_argument("--key", default=None)
    parser.add_argument("--context", default="", help="continue this context (session)")
    parser.add_argument("text")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.url, args.key, args.text, args.context)))
