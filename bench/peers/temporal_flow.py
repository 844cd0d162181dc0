"""The agent loop as a Temporal workflow (this module is loaded in the workflow sandbox,
so it imports nothing but temporalio): each LLM call an activity on the workflow's own
queue (a local activity when ``local`` is set, as Temporal's docs advise for short
calls), each tool call an activity on the ``tools`` queue, served by another process."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

TIMEOUT = timedelta(seconds=60)
RETRY = RetryPolicy(maximum_attempts=3)


@workflow.defn
class Agent:
    @workflow.run
    async def run(self, text: str, local: bool) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
        for _ in range(200):
            if local:
                reply = await workflow.execute_local_activity(
                    "llm", messages, start_to_close_timeout=TIMEOUT, retry_policy=RETRY,
                    result_type=dict,
                )  # fmt: skip
            else:
                reply = await workflow.execute_activity(
                    "llm", messages, start_to_close_timeout=TIMEOUT, retry_policy=RETRY,
                    result_type=dict,
                )  # fmt: skip
            messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                return str(reply.get("content") or "")
            for call in calls:
                out = await workflow.execute_activity(
                    "echo", call["function"]["arguments"], task_queue="tools",
                    start_to_close_timeout=TIMEOUT, retry_policy=RETRY, result_type=str,
                )  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
        return "out of iterations"
