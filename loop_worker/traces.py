"""The loop worker's spans, named and annotated by the OpenTelemetry GenAI conventions.

- ``invoke_agent`` — one per delivery of a turn, a child of the ``traceparent`` the
  turn's message carries (the gateway's span, or any client's). A redelivered turn
  carries the same header, so a turn resumed after a crash stays in its trace. A turn
  published with no ``traceparent`` (``loopmesh run``, a bare NATS client) gets a root
  span whose trace id is derived from the turn's id, so its every delivery shares
  one trace all the same;
- ``chat {model}`` — one per LLM request (:class:`TracedLLM`; its retries and
  fallbacks are inside it);
- ``execute_tool {tool}`` — the dispatch of one tool call, kind ``client``; the call's
  request carries its ``traceparent`` to the tool worker, whose ``execute_tool`` span
  is its child.

While tracing is off (:func:`loopmesh.tracing.enabled`) none of this builds anything:
:func:`traced_llm` returns the LLM itself and the span helpers return a shared no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loopmesh import tracing
from schemas import ChatMessage, ToolCallRequest, Turn, session_key

from .engine.protocols import LLM, Completion, OnDelta, OnRetry

if TYPE_CHECKING:
    from opentelemetry.trace import Span

PROVIDER = "openai"  # gen_ai.provider.name: the OpenAI-compatible API the worker speaks


def turn_span(
    turn: Turn, headers: Mapping[str, str] | None, model: str, delivery: int
) -> contextlib.AbstractContextManager[Span | None]:
    """The turn's ``invoke_agent`` span, continuing the trace its message carries."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    return tracing.span(
        "invoke_agent",
        carrier=headers or {},
        root_key=f"loopmesh-turn:{session_key(turn.tenant, turn.session)}:{turn.id}",
        attributes={
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": turn.model or model,
            "gen_ai.conversation.id": session_key(turn.tenant, turn.session),
            "loopmesh.tenant": turn.tenant,
            "loopmesh.turn.id": turn.id,
            "loopmesh.turn.delivery": delivery,
        },
    )


def tool_span(request: ToolCallRequest) -> contextlib.AbstractContextManager[Span | None]:
    """The dispatch of one call; :func:`loopmesh.tracing.inject` then puts its
    ``traceparent`` on the request."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    return tracing.span(
        f"execute_tool {request.tool}", kind="client", attributes=tool_attributes(request)
    )


def tool_attributes(request: ToolCallRequest) -> dict[str, Any]:
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": request.tool,
        "gen_ai.tool.call.id": request.call_id,
        "gen_ai.tool.type": "function",
        "loopmesh.tool.server": request.server,
        "loopmesh.turn.iteration": request.iteration,
    }


def traced_llm(llm: LLM, model: str) -> LLM:
    """``llm`` with a ``chat`` span around each request while tracing is on; ``model``
    is the one a request without its own asks for."""
    return TracedLLM(llm, model) if tracing.enabled() else llm


class TracedLLM:
    """An :class:`~loop_worker.engine.protocols.LLM` whose requests are ``chat`` spans."""

    def __init__(self, llm: LLM, model: str) -> None:
        self._llm = llm
        self._model = model

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        requested = model or self._model
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": requested,
        }
        with tracing.span(f"chat {requested}", kind="client", attributes=attributes) as span:
            completion = await self._llm.complete(
                messages, tools=tools, model=model, on_delta=on_delta, on_retry=on_retry
            )
            if span is not None:
                span.set_attribute("gen_ai.response.model", completion.model or requested)
                if completion.finish_reason:
                    span.set_attribute("gen_ai.response.finish_reasons", [completion.finish_reason])
                if completion.usage is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", completion.usage.prompt_tokens)
                    span.set_attribute(
                        "gen_ai.usage.output_tokens", completion.usage.completion_tokens
                    )
            return completion
