"""A2A push notifications: the webhooks a client registers for a task, and their
delivery under the same egress rule as ``http_fetch``.

**Configurations** live in the KV bucket ``<prefix>-a2a-push`` under the task id, with
the tenant that set them (:class:`PushConfigStore`): a client reads, lists and deletes
only its tenant's (the SDK checks the task is the caller's before any of it), and the
dispatch reads them all. At most :data:`MAX_CONFIGS` per task.

**Delivery** is the SDK's (:class:`~a2a.server.tasks.BasePushNotificationSender`): every
update of a task that this gateway stores is POSTed to each of its webhooks, with the
configuration's token (``X-A2A-Notification-Token``) and credentials, best effort, in
order, one update at a time per task. The task never waits for it: an update goes into
the task's queue of at most ``[gateway] push_queue`` updates, delivered by a task of its
own, and a full queue drops its oldest *intermediate* update (a status while the task
works, an artifact chunk) to make room. A final state (completed, failed, cancelled,
rejected, input or auth required) is never dropped, so a receiver that falls behind
misses chunks, never the end; ``GetTask`` reads the whole task. A webhook that does not
answer within ``push_timeout_s`` holds its task's queue that long. The
HTTP client connects through :class:`loopmesh.egress.PinnedTransport`: a webhook whose
host is, or resolves to, a private, loopback, link-local or otherwise non-public address
is refused unless ``[gateway] push_allowlist`` names it, both when it is registered (an
``InvalidParamsError`` saying why) and at each delivery (the host is resolved once per
delivery and the connection pinned to the address checked, so DNS rebinding cannot
reach past the check). No redirects are followed and no proxy from the environment is
used.

Deliveries come from the gateway that stores the task's updates; one that went away
delivers nothing more, and a failed delivery is not retried. Durable, signed, retried
webhooks are the platform's webhook service's to carry (docs/AGENTS.md says what to
expect); this is the minimum the A2A SDK asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import httpx
import msgspec
from a2a.server.context import ServerCallContext
from a2a.server.tasks import BasePushNotificationSender, PushNotificationConfigStore
from a2a.server.tasks.push_notification_sender import PushNotificationEvent
from a2a.types import TaskArtifactUpdateEvent, TaskPushNotificationConfig, TaskState
from a2a.utils.errors import InvalidParamsError
from google.protobuf.json_format import MessageToJson, Parse, ParseError
from nats.js.errors import KeyWrongLastSequenceError

from loopmesh.egress import Allowlist, Egress, PinnedTransport
from loopmesh.errors import EgressRefused, UnresolvableHost
from schemas import is_token

from ..backend import Backend
from .caller import caller_of
from .projection import RUNNING

log = logging.getLogger("loopmesh.gateway.a2a")

MAX_CONFIGS = 16
#: How long a task's configurations are reused for its deliveries before being read
#: again (every update of a task is a delivery; one set on another gateway is seen
#: within this long, one set here at once).
CACHE_S = 1.0
_WRITE_TRIES = 5
SETTING = "[gateway] push_allowlist (LOOPMESH_GATEWAY__PUSH_ALLOWLIST)"


class PushRecord(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    configs: tuple[msgspec.Raw, ...] = ()
    updated_at: float = 0.0


_decoder = msgspec.json.Decoder(PushRecord)

Configs = list[TaskPushNotificationConfig]
Change = Callable[[Configs], Configs]


class PushConfigStore(PushNotificationConfigStore):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.bucket = backend.subjects.a2a_push_bucket
        self._cache: dict[str, tuple[float, Configs]] = {}

    async def set_info(
        self,
        task_id: str,
        notification_config: TaskPushNotificationConfig,
        context: ServerCallContext,
    ) -> TaskPushNotificationConfig:
        config = TaskPushNotificationConfig()
        config.CopyFrom(notification_config)
        config.task_id = task_id
        config.id = config.id or task_id
        tenant = _tenant(context)

        def change(configs: Configs) -> Configs:
            kept = [c for c in configs if c.id != config.id]
            if len(kept) >= MAX_CONFIGS:
                raise InvalidParamsError(
                    message=f"task {task_id} has {MAX_CONFIGS} push configurations, the most "
                    "allowed: delete one first"
                )
            return [*kept, config]

        await self._change(task_id, tenant, change)
        return config

    async def get_info(
        self, task_id: str, context: ServerCallContext
    ) -> list[TaskPushNotificationConfig]:
        tenant, configs = await self._read(task_id)
        return configs if tenant == _tenant(context) else []

    async def get_info_for_dispatch(self, task_id: str) -> list[TaskPushNotificationConfig]:
        now = time.monotonic()
        cached = self._cache.get(task_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        configs = (await self._read(task_id))[1]
        for key in [k for k, (until, _) in self._cache.items() if until <= now]:
            del self._cache[key]
        self._cache[task_id] = (now + CACHE_S, configs)
        return configs

    async def delete_info(
        self, task_id: str, context: ServerCallContext, config_id: str | None = None
    ) -> None:
        def change(configs: Configs) -> Configs:
            return [c for c in configs if config_id is not None and c.id != config_id]

        await self._change(task_id, _tenant(context), change)

    async def _read(self, task_id: str) -> tuple[str, list[TaskPushNotificationConfig]]:
        if not is_token(task_id):
            return "", []
        kv = await self.backend.kv(self.bucket)
        entry = await self.backend._call("read push configurations", kv.entry(task_id))
        if entry is None or not entry.value:
            return "", []
        record = _decoder.decode(entry.value)
        return record.tenant, _configs(record)

    async def _change(self, task_id: str, tenant: str, change: Change) -> None:
        if not is_token(task_id):
            raise InvalidParamsError(message=f"task id {task_id[:80]!r} is not a loopmesh id")
        kv = await self.backend.kv(self.bucket)
        self._cache.pop(task_id, None)
        for _ in range(_WRITE_TRIES):
            entry = await self.backend._call("read push configurations", kv.entry(task_id))
            record = _decoder.decode(entry.value) if entry is not None and entry.value else None
            if record is not None and record.tenant != tenant:
                raise InvalidParamsError(message=f"no task {task_id}")  # never another's
            configs = change(_configs(record) if record is not None else [])
            new = PushRecord(
                tenant=tenant,
                configs=tuple(msgspec.Raw(MessageToJson(c, indent=None).encode()) for c in configs),
                updated_at=time.time(),
            )
            last = entry.revision if entry is not None else 0
            try:
                await self.backend._call(
                    "write push configurations", kv.update(task_id, msgspec.json.encode(new), last)
                )
                self._cache.pop(task_id, None)
                return
            except KeyWrongLastSequenceError:
                continue  # another write came first: apply the change to it
        raise InvalidParamsError(message=f"push configurations of task {task_id} keep changing")


def _configs(record: PushRecord) -> list[TaskPushNotificationConfig]:
    out = []
    for raw in record.configs:
        try:
            out.append(Parse(bytes(raw), TaskPushNotificationConfig(), ignore_unknown_fields=True))
        except ParseError:
            continue
    return out


def _tenant(context: ServerCallContext) -> str:
    return caller_of(context).tenant


class PushSender(BasePushNotificationSender):
    """The SDK's sender, on an HTTP client that only reaches what the egress rule
    allows, behind a bounded queue per task (``queue`` updates; the module's docstring
    says what is dropped); :meth:`check_url` is the same rule for a webhook being
    registered."""

    def __init__(
        self,
        store: PushConfigStore,
        *,
        allowlist: tuple[str, ...],
        timeout_s: float,
        queue: int = 64,
    ) -> None:
        self.egress = Egress(Allowlist(allowlist, setting="push_allowlist"), setting=SETTING)
        self.timeout_s = timeout_s
        self.queue = queue
        self.client = httpx.AsyncClient(
            transport=PinnedTransport(self.egress),
            timeout=timeout_s,
            follow_redirects=False,
            trust_env=False,
        )
        self._waiting: dict[str, deque[PushNotificationEvent]] = {}
        self._deliveries: set[asyncio.Task[None]] = set()
        self._closed = False
        super().__init__(self.client, store)

    async def send_notification(self, task_id: str, event: PushNotificationEvent) -> None:
        """Queue ``event`` for the task's webhooks and return at once."""
        if self._closed:
            return
        copy = type(event)()
        copy.CopyFrom(event)  # the SDK goes on with its own
        waiting = self._waiting.get(task_id)
        if waiting is None:
            waiting = self._waiting[task_id] = deque()
            delivery = asyncio.create_task(self._deliver(task_id, waiting), name="a2a-push")
            self._deliveries.add(delivery)
            delivery.add_done_callback(self._deliveries.discard)
        if len(waiting) >= self.queue and _drop_oldest_intermediate(waiting):
            log.info("A2A push update dropped: its webhooks are slow task=%s", task_id)
        waiting.append(copy)

    async def _deliver(self, task_id: str, waiting: deque[PushNotificationEvent]) -> None:
        """POST the task's updates in order until none waits."""
        try:
            while waiting:
                await super().send_notification(task_id, waiting.popleft())  # never raises
        finally:
            if self._waiting.get(task_id) is waiting:
                del self._waiting[task_id]

    async def check_url(self, url: str) -> bool:
        """Whether a webhook may be registered at ``url``; a refusal raises
        :class:`InvalidParamsError` saying why."""
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise InvalidParamsError(
                message=f"push URL {url[:200]!r} is not a URL: {exc}"
            ) from None
        if target.scheme not in ("http", "https") or not target.host:
            raise InvalidParamsError(
                message=f"push URL {url[:200]!r} must be http:// or https:// with a host"
            )
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.egress.check(target.raw_host.decode("ascii"), port)
        except (EgressRefused, UnresolvableHost) as exc:
            raise InvalidParamsError(message=f"push URL refused: {exc}") from None
        except TimeoutError:
            raise InvalidParamsError(
                message=f"push URL refused: resolving {target.host!r} took over "
                f"{self.timeout_s:g} s"
            ) from None
        return True

    async def aclose(self) -> None:
        """Stop delivering (what waits is dropped: a gateway that stops delivers nothing
        more) and close the HTTP client."""
        self._closed = True
        deliveries = list(self._deliveries)
        for delivery in deliveries:
            delivery.cancel()
        await asyncio.gather(*deliveries, return_exceptions=True)
        await self.client.aclose()


def _drop_oldest_intermediate(waiting: deque[PushNotificationEvent]) -> bool:
    """Remove the oldest update of ``waiting`` that is not a final state; whether there
    was one."""
    for i, event in enumerate(waiting):
        if not _final(event):
            del waiting[i]
            return True
    return False


def _final(event: PushNotificationEvent) -> bool:
    """Whether ``event`` says the task's turn has ended (or waits for its client)."""
    if isinstance(event, TaskArtifactUpdateEvent):
        return False
    state = event.status.state
    return state != TaskState.TASK_STATE_UNSPECIFIED and state not in RUNNING
