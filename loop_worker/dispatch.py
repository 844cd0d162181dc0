"""Tool calls over NATS: the catalog names the pool, JetStream carries the request.

:meth:`NatsToolDispatcher.call` looks the tool up in the catalog (unknown tools become
an ``unknown_tool`` error result for the model, with nothing published), returns the
recorded result if the call already ran (a resumed turn repeats its call ids), else
publishes the request with ``Nats-Msg-Id`` = call id to the pool's subject and waits,
until the call's deadline, for either the reply on this dispatcher's inbox or the
call's effect record. The effect record is how a call that was in flight when a worker
died is awaited: the tool worker that runs it records the result even when nobody is
left to reply to, and publishing the same call id again inside the stream's duplicate
window is a no-op.

The publish's ack is not awaited before the reply: the reply cannot come before the
request is stored, so waiting for the ack first only adds a wake-up. The call waits
for the reply, and acts on the ack only when it fails (JetStream refused it or was not
there: publish again, under the same id) or has not come when the reply is overdue
(it may have been lost in a reconnect: publish again; the stream drops the copy if the
first one was stored).

One wildcard subscription (``<inbox>.*``) serves every call; replies find their
waiting call by id. The tools come from a live watch of the catalog bucket
(:class:`~loop_worker.catalog.Catalog`): :meth:`NatsToolDispatcher.tools` waits for its
initial load (raising :class:`~loop_worker.errors.CatalogNotLoadedError` after
``catalog_load_timeout_s``) and is current from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loopmesh import tracing
from loopmesh.jetstream import KV, PubAck, Publisher, is_transient, open_kv, retry
from loopmesh.payload import limit_of
from schemas import (
    DecodeError,
    Subjects,
    ToolCallRequest,
    ToolResult,
    ToolSpec,
    WireError,
    catalog_key,
    decode,
    encode,
    turn_msg_id,
)
from schemas.ids import check_turn_msg_id

from .catalog import Catalog, OnChange
from .errors import CatalogNotLoadedError
from .traces import tool_span

log = logging.getLogger("loopmesh.loop_worker.dispatch")


class NatsToolDispatcher:
    """The :class:`~loop_worker.engine.protocols.ToolDispatcher` of the durable service.

    ``grace_s`` is added to a tool's own timeout (the tool worker reports its timeouts
    itself; the grace covers the trip and a queue); ``effect_poll_s`` is how long a
    reply may be missing before the effect record is read. With ``effects_first``
    false, the record is read before publishing only for turns marked with
    :meth:`resuming` (the service marks redelivered turns), and the other turns' calls
    are marked ``first_attempt`` (the tool worker then skips its read) when
    ``unlapsed`` says the worker surely still holds the session. ``before_publish`` runs
    before a request is published (the service commits the session's checkpoint, so
    the pending calls are stored before they can run); ``resend_s`` bounds how long
    after the first publish a copy may be published (well inside the stream's
    duplicate window), and ``writable`` (given a turn's ``Turn.msg_id``) whether the
    turn may still write at all: a copy goes out only while it may (the service's
    :class:`~loop_worker.fence.Fence`: a worker cut off past its lease's lapse sends
    none). ``on_catalog`` is called with the tool list when the catalog loads and whenever
    its tools change.
    """

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        catalog_load_timeout_s: float = 10.0,
        on_catalog: OnChange | None = None,
        grace_s: float = 5.0,
        effect_poll_s: float = 1.0,
        default_timeout_s: float = 60.0,
        effects_first: bool = True,
        publisher: Publisher | None = None,
        resend_s: float = 30.0,
        before_publish: Callable[[ToolCallRequest], Awaitable[None]] | None = None,
        unlapsed: Callable[[ToolCallRequest], bool] | None = None,
        writable: Callable[[str], bool] | None = None,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._publisher = publisher or Publisher(nc)
        self._resend_s = resend_s  # no copy is published later (well inside the window)
        self._before_publish = before_publish
        self._unlapsed = unlapsed
        self._writable = writable
        self._subjects = subjects
        self._grace_s = grace_s
        self._effect_poll_s = effect_poll_s
        self._default_timeout_s = default_timeout_s
        self.catalog = Catalog(
            nc,
            subjects.catalog_bucket,
            load_timeout_s=catalog_load_timeout_s,
            on_change=on_catalog,
        )
        self._effects_kv: KV | None = None
        self._inbox = ""
        self._sub: Subscription | None = None
        self._waiting: dict[str, asyncio.Future[ToolResult]] = {}
        self._effects_first = effects_first
        self._resuming: set[str] = set()

    async def start(self) -> None:
        if self._sub is not None:
            return
        self.catalog.start()  # turns wait for its first load (see tools)
        try:
            effects = self._subjects.effects_bucket
            self._effects_kv = await open_kv(self._js, self._publisher, effects)
            self._inbox = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        except BaseException:
            await self.catalog.close()
            raise

    async def close(self) -> None:
        """Stop watching the catalog and unsubscribe. Idempotent."""
        await self.catalog.close()
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for future in self._waiting.values():
            future.cancel()

    async def __aenter__(self) -> NatsToolDispatcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- catalog ------------------------------------------------------------------------

    async def tools(self) -> Sequence[ToolSpec]:
        """The catalog's tools, once its initial load is in (a turn never starts on a
        half-known catalog: :class:`CatalogNotLoadedError` after the load timeout)."""
        await self.catalog.loaded()
        return self.catalog.specs()

    async def _spec(self, server: str, tool: str) -> ToolSpec | None:
        await self.catalog.loaded()
        return self.catalog.get(catalog_key(server, tool))

    # -- calls --------------------------------------------------------------------------

    def resuming(self, key: str, resumed: bool = True) -> None:
        """Whether calls of the turn ``key`` (its ``Turn.msg_id``) may have run before (a
        redelivered turn). A turn's first delivery has no recorded calls: its calls skip
        the effect read."""
        if resumed:
            self._resuming.add(check_turn_msg_id(key))
        else:
            self._resuming.discard(key)

    async def call(self, request: ToolCallRequest) -> ToolResult:
        if not tracing.enabled():
            return await self._call(request)
        with tool_span(request) as span:
            result = await self._call(request)
            tracing.tool_result(span, result)
            return result

    async def _call(self, request: ToolCallRequest) -> ToolResult:
        try:
            spec = await self._spec(request.server, request.tool)
        except CatalogNotLoadedError as exc:
            return _error(request, "unavailable", str(exc))
        if spec is None:
            return _error(
                request,
                "unknown_tool",
                f"there is no tool {request.server}.{request.tool}; "
                "call one of the tools listed in your instructions",
            )
        if self._effects_first or _turn_key(request) in self._resuming:
            recorded = await self._effect(request.call_id)
            if recorded is not None:
                return recorded
            first_attempt = False
        else:
            first_attempt = self._unlapsed is not None and self._unlapsed(request)
        size = len(encode(request))
        if size > limit_of(self._nc):  # no NATS message can carry it: tell the model
            return _error(
                request,
                "payload_too_large",
                f"the call is {size} bytes encoded and this NATS server's max_payload is "
                f"{self._nc.max_payload} bytes, so it was not sent: pass less at once "
                "(split the content over several calls)",
            )
        if self._before_publish is not None:  # the service: the checkpoint goes out first
            await self._before_publish(request)
        timeout = request.timeout_s or spec.timeout_s or self._default_timeout_s
        deadline = time.monotonic() + timeout + self._grace_s
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._waiting[request.call_id] = future
        try:
            request = msgspec.structs.replace(
                request,
                reply_to=f"{self._inbox}.{request.call_id}",
                timeout_s=timeout,
                created_at=request.created_at or time.time(),
                first_attempt=first_attempt,
            )
            headers = {"Nats-Msg-Id": request.call_id}
            tracing.inject(headers)  # the tool worker's span continues this trace
            call = _Publish(
                self._publisher,
                self._subjects.tool(spec.pool, request.server, request.tool),
                encode(request),
                headers,
                resend_until=time.monotonic() + self._resend_s,
            )
            await call.send(deadline)
            try:
                return await self._await(request, future, call, deadline, timeout)
            finally:
                call.close()
        except Exception as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning("tool call failed call_id=%s error=%r", request.call_id, exc)
            return _error(request, "unavailable", f"the tool could not be reached: {exc!r}")
        finally:
            self._waiting.pop(request.call_id, None)

    async def _await(
        self,
        request: ToolCallRequest,
        future: asyncio.Future[ToolResult],
        call: _Publish,
        deadline: float,
        timeout: float,
    ) -> ToolResult:
        poll = self._effect_poll_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.wait(
                (future, call.trouble), timeout=min(poll, remaining), return_when=_FIRST
            )
            if future.done():
                return future.result()
            if self._writable is not None and not self._writable(_turn_key(request)):
                if call.trouble.done():  # fenced: no copy goes out, and nothing will come
                    return _error(request, "unavailable", "the turn's lease lapsed here")
            elif call.trouble.done():  # JetStream refused the request: publish it again
                await call.resend(deadline)
                continue
            elif not call.acked:  # neither ack nor reply: the request may be lost
                await call.resend(deadline, backoff=False)
            recorded = await self._effect(request.call_id)  # a reply that went missing
            if recorded is not None:
                return recorded
            poll = min(poll * 2, 5.0)
        recorded = await self._effect(request.call_id)
        if recorded is not None:
            return recorded
        return ToolResult(
            call_id=request.call_id,
            status="timeout",
            error=WireError(
                code="timeout", message=f"no result from {request.tool} within {timeout:g}s"
            ),
            server=request.server,
            tool=request.tool,
            duration_ms=timeout * 1000,
            finished_at=time.time(),
        )

    async def _effect(self, call_id: str) -> ToolResult | None:
        assert self._effects_kv is not None
        kv = self._effects_kv
        try:
            entry = await retry(lambda: kv.entry(call_id), f"get effect {call_id}", timeout=5.0)
        except Exception as exc:
            log.info("effect not read call_id=%s error=%r", call_id, exc)
            return None
        if entry is None or not entry.value:
            return None
        try:
            return decode(entry.value, ToolResult)
        except DecodeError as exc:
            log.warning("bad effect record call_id=%s error=%s", call_id, exc)
            return None

    async def _on_reply(self, msg: Msg) -> None:
        call_id = msg.subject.rpartition(".")[2]
        future = self._waiting.get(call_id)
        if future is None or future.done():
            return
        try:
            future.set_result(decode(msg.data, ToolResult))
        except DecodeError as exc:
            log.warning("bad tool reply call_id=%s error=%s", call_id, exc)


_FIRST = asyncio.FIRST_COMPLETED


class _Publish:
    """A tool-call request on its way to the stream: its ack is watched, not awaited.

    ``trouble`` completes when JetStream refuses the request or is not there (a
    transient error); :meth:`resend` publishes it again under the same ``Nats-Msg-Id``
    (the stream keeps one copy) and raises what is not transient."""

    def __init__(
        self,
        publisher: Publisher,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        *,
        resend_until: float,
    ) -> None:
        self._publisher = publisher
        self._subject = subject
        self._payload = payload
        self._headers = headers
        self._resend_until = resend_until
        self._ack: asyncio.Future[PubAck] | None = None
        self._delay = 0.05
        self.acked = False
        self.error: BaseException | None = None
        self.trouble: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def send(self, deadline: float) -> None:
        self._ack = await retry(
            lambda: self._publisher.publish(self._subject, self._payload, self._headers),
            f"publish call {self._headers['Nats-Msg-Id']}",
            timeout=max(0.1, deadline - time.monotonic()),
        )
        self._ack.add_done_callback(self._on_ack)

    def _on_ack(self, ack: asyncio.Future[PubAck]) -> None:
        if ack is not self._ack or ack.cancelled():
            return
        error = ack.exception()
        if error is None:
            self.acked = True
        elif not self.trouble.done():
            self.error = error
            self.trouble.set_result(None)

    async def resend(self, deadline: float, *, backoff: bool = True) -> None:
        error, self.error = self.error, None
        if error is not None and not is_transient(error):
            raise error
        if time.monotonic() > self._resend_until:
            if error is not None:
                raise error
            return  # too late to publish a copy safely; the effect record decides
        if self._ack is not None and not self._ack.done():
            self._ack.cancel()
        self.trouble = asyncio.get_running_loop().create_future()
        if backoff:
            await asyncio.sleep(min(self._delay, max(0.0, deadline - time.monotonic())))
            self._delay = min(self._delay * 2, 1.0)
        log.info("publishing call %s again", self._headers["Nats-Msg-Id"])
        await self.send(deadline)

    def close(self) -> None:
        if self._ack is not None and not self._ack.done():
            self._ack.cancel()


def _error(request: ToolCallRequest, code: str, message: str) -> ToolResult:
    return ToolResult(
        call_id=request.call_id,
        status="error",
        error=WireError(code=code, message=message),
        server=request.server,
        tool=request.tool,
        finished_at=time.time(),
    )


def _turn_key(request: ToolCallRequest) -> str:
    return turn_msg_id(request.tenant, request.session, request.turn_id)
