"""The :class:`~loop_worker.engine.protocols.LLM` over any OpenAI-compatible endpoint.

Every response is streamed (``stream_options.include_usage``): text fragments go to
``on_delta`` as they arrive; tool-call fragments are assembled per ``index``. The
``openai`` client runs with ``max_retries=0``; retries are ours:

    for each model (the requested one, then ``settings.fallback_models``, or the running
    turn's agent's own, ``agents.TURN_FALLBACKS``):
        up to 1 + ``settings.max_retries`` attempts; between them, after a 429, a 5xx,
        a timeout, a connection error or a stream cut short, wait ``Retry-After``
        (capped at ``backoff_max_s``) or a full-jitter exponential backoff.
        400 / 401 / 403 / 404 / 422 and other client errors: the next model at once.
    every model failed: ``LLMError``.

Fragments that a failed attempt already passed to ``on_delta`` are not taken back:
``on_retry`` tells the caller to drop them.

With a :class:`~.ratelimit.RateLimiter` (``[llm.limits]``), each attempt first acquires
a permit for its model (waiting its turn), and settles it with the reply's ``usage``
after; a 429 with ``Retry-After`` pauses the model in the limiter (for every worker
that shares it) instead of sleeping here, and the next attempt's acquire waits for the
pause's end (docs/ARCHITECTURE.md, "Fleet-wide LLM rate limits").

The reply's SSE bytes are read straight from the client's HTTP response
(``client.post(..., cast_to=httpx.Response, stream=True)``, the client's documented way
to a raw response: its base URL, auth, headers, retries and status errors still apply)
and decoded by msgspec into the few fields the loop reads (:mod:`.reply`, over
``chunks.py``): the client's own SSE decoding and typed chunks cost several times the CPU
per chunk (``python -m bench.stream_parse``), and a model streams one chunk per token.

Under the client, the HTTP/1.1 is :mod:`.http1`'s (``[llm] http = "lean"``, the default):
an httpx transport, so everything above it is still the client's, that reads the
response off the socket with a fraction of the CPU per read of the client's own stack.
``http = "httpx"`` keeps the client's own.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

import httpx
import msgspec
import openai
from prometheus_client import Counter

from loopmesh.settings import environ
from schemas import ChatMessage
from schemas.events import Usage

from .agents import TURN_FALLBACKS
from .chunks import StreamChunkError
from .errors import LLMError
from .http1 import Http1Transport
from .protocols import Completion, OnDelta, OnRetry
from .ratelimit import PROMPT_TOKENS, TURN_TENANT, Permit, RateLimiter, estimate_tokens
from .reply import StreamCutError, read_reply
from .settings import LLMSettings

#: Requests sent on to a fallback model (``settings.fallback_models``) after the model
#: before it failed; by the fallback model. The process's registry (``/metrics``).
FALLBACKS = Counter(
    "loopmesh_llm_fallbacks",
    "LLM requests sent on to a fallback model after the one before failed",
    ["gen_ai_request_model"],
)
#: Requests the provider answered 429 (too many requests), by model.
RATE_LIMITED = Counter(
    "loopmesh_llm_rate_limited",
    "LLM requests the provider answered 429 (rate limited)",
    ["gen_ai_request_model"],
)


def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Our messages as chat-completions ``messages``."""
    return [_to_openai(m) for m in messages]


def _to_openai(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.parts:  # images and files: the text becomes the first content part
        text = [{"type": "text", "text": m.content}] if m.content else []
        out["content"] = [*text, *msgspec.to_builtins(m.parts)]
    if m.role == "assistant" and m.tool_calls:
        out["content"] = m.content or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    elif m.name:
        out["name"] = m.name
    return out


class OpenAILLM:
    """``async with OpenAILLM(settings) as llm: await llm.complete(messages)``.

    It also takes ``response_format`` (``{"type": "json_schema", ...}``), passed on to
    servers that constrain their output (the orchestrator's planner asks for its plan
    this way): :attr:`accepts_response_format` says so to the engine.
    """

    accepts_response_format = True

    def __init__(
        self,
        settings: LLMSettings,
        *,
        client: openai.AsyncOpenAI | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.settings = settings
        self.limiter = limiter
        self._owns_client = client is None
        self._client = client or openai.AsyncOpenAI(
            base_url=settings.base_url,
            # unset: OPENAI_API_KEY, as the openai client reads it (the Kubernetes
            # manifests' Secret); an endpoint that takes none gets a placeholder
            api_key=settings.api_key or environ("OPENAI_API_KEY") or "not-needed",
            max_retries=0,
            timeout=settings.timeout_s,
            http_client=(
                openai.DefaultAsyncHttpxClient(transport=Http1Transport())
                if settings.http == "lean"
                else None
            ),
        )
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._closed = False

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
        response_format: dict[str, Any] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> Completion:
        """``tool_choice`` is sent as is (``"auto"``, ``"none"``, ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}``); ``None`` leaves it out."""
        s = self.settings
        fallbacks = TURN_FALLBACKS.get()  # the turn's agent's, when it names its own
        chain = s.fallback_models if fallbacks is None else fallbacks
        models = list(dict.fromkeys([model or s.model, *chain]))
        payload = to_openai_messages(messages)
        failures: list[str] = []
        attempts = 0
        last: BaseException | None = None
        for fallback, name in enumerate(models):
            if fallback:
                FALLBACKS.labels(name).inc()
            for attempt in range(1, s.max_retries + 2):
                attempts += 1
                permit = await self._acquire(name, messages)
                try:
                    completion = await self._attempt(
                        name, payload, tools, on_delta, response_format, tool_choice
                    )
                except (openai.APIError, StreamCutError, StreamChunkError) as exc:
                    await _settle(permit)  # as estimated: the provider may count it
                    last = exc
                    paused = await self._rate_limited(name, exc)
                    if not _retryable(exc) or attempt > s.max_retries:
                        break
                    delay = self._delay(attempt, exc) if paused is None else paused
                    if on_retry is not None:
                        await on_retry(attempt, _describe(exc), delay, name)
                    if paused is None:  # else the next acquire waits for the pause
                        await self._sleep(delay)
                    continue
                except BaseException:
                    await _settle(permit)  # cancelled while the request ran
                    raise
                await _settle(permit, completion.usage)
                return completion
            failures.append(f"{name}: {_describe(last)}")
        raise LLMError(
            f"every model failed after {attempts} attempts: " + "; ".join(failures),
            attempts=attempts,
            last=last,
        )

    async def _attempt(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        on_delta: OnDelta | None,
        response_format: dict[str, Any] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> Completion:
        s = self.settings
        started = time.perf_counter()
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = list(tools)
            if tool_choice:
                body["tool_choice"] = tool_choice
        for key, value in (
            ("seed", s.seed),
            ("temperature", s.temperature),
            ("max_tokens", s.max_tokens),
            ("response_format", response_format or None),
            ("repeat_penalty", s.repeat_penalty),  # llama.cpp's, not an OpenAI field
        ):
            if value is not None:
                body[key] = value
        # The client's documented request method, not ``chat.completions.create``: the
        # body is already plain JSON, and create's typed-params transform costs about
        # 0.2 ms of CPU per message of history on every call (10 ms at 42 messages).
        # ``httpx.Response``: the raw response, its body unread (httpx2's from openai
        # clients on httpx2; both read alike).
        response = await self._client.post(
            "/chat/completions", body=body, cast_to=httpx.Response, stream=True
        )
        reply = await read_reply(response, on_delta)
        if reply.finish is None:
            raise StreamCutError("the stream ended before the model finished")
        return Completion(
            content="".join(reply.content),
            tool_calls=reply.calls.result(),
            finish_reason=reply.finish,
            usage=reply.usage,
            model=reply.model or model,
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    async def _acquire(self, model: str, messages: Sequence[ChatMessage]) -> Permit | None:
        """A permit for one attempt, once the limiter grants it (no limiter: none)."""
        if self.limiter is None:
            return None
        prompt = PROMPT_TOKENS.get()
        if prompt is None:
            prompt = estimate_tokens(sum(len(m.content) for m in messages))
        reply = self.settings.max_tokens or self.settings.limits.reply_tokens
        return await self.limiter.acquire(model, TURN_TENANT.get(), prompt + reply)

    async def _rate_limited(self, model: str, exc: BaseException) -> float | None:
        """On a 429: count it; with a limiter and a ``Retry-After``, pause the model
        there and return how long (else ``None``)."""
        if not (isinstance(exc, openai.APIStatusError) and exc.status_code == 429):
            return None
        RATE_LIMITED.labels(model).inc()
        retry_after = _retry_after(exc)
        if self.limiter is None or retry_after is None:
            return None
        seconds = min(retry_after, self.settings.limits.max_pause_s)
        await self.limiter.pause(model, seconds)
        return seconds

    def _delay(self, attempt: int, exc: BaseException) -> float:
        s = self.settings
        retry_after = _retry_after(exc)
        if retry_after is not None:
            return min(retry_after, s.backoff_max_s)
        return self._rng.uniform(0, min(s.backoff_max_s, s.backoff_initial_s * 2 ** (attempt - 1)))

    async def aclose(self) -> None:
        """Close the client if this object made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> OpenAILLM:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


async def _settle(permit: Permit | None, usage: Usage | None = None) -> None:
    if permit is None:
        return
    if usage is None:
        await permit.settle()
    else:
        await permit.settle(usage.total_tokens or usage.prompt_tokens + usage.completion_tokens)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    # timeouts, connection errors, errors inside the stream, cut streams
    return not isinstance(exc, openai.APIResponseValidationError | StreamChunkError)


def _describe(exc: BaseException | None) -> str:
    match exc:
        case openai.APIStatusError(body={"message": str(message)}):
            return f"HTTP {exc.status_code}: {message}"
        case openai.APIStatusError():
            return f"HTTP {exc.status_code}: {exc.message}"
        case openai.APITimeoutError():
            return "timed out"
        case openai.APIConnectionError():
            cause = exc.__cause__
            return f"connection error: {cause}" if cause else "connection error"
        case StreamCutError():
            return "stream cut short"
        case StreamChunkError():
            return str(exc)
        case None:
            return "not attempted"
        case _:
            return f"{type(exc).__name__}: {exc}"


def _retry_after(exc: BaseException) -> float | None:
    """Seconds from ``retry-after-ms`` or ``retry-after`` (seconds or an HTTP date)."""
    if not isinstance(exc, openai.APIStatusError):
        return None
    headers = exc.response.headers
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
        if (value := headers.get("retry-after")) is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
    except (ValueError, TypeError):
        return None
