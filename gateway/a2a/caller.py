"""Who calls an A2A method: the tenant of the API key (checked by the gateway before the
SDK sees the request) and the agent of the URL (``/a2a/<agent>``).

The gateway's route authenticates the request, checks the agent, and leaves a
:class:`Caller` in the ASGI scope; :class:`ContextBuilder` puts it in the SDK's
``ServerCallContext`` (its ``user``), where the request handler, the
executor and the task store read it back with :func:`caller_of`. The A2A ``tenant``
field of a request is not how a tenant is chosen: one that names another tenant than the
key's is refused.
"""

from __future__ import annotations

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder
from a2a.utils.errors import InvalidParamsError
from starlette.requests import Request

#: Where the gateway's route leaves the :class:`Caller` in the ASGI scope.
SCOPE_KEY = "loopmesh.a2a.caller"


class Caller(User):
    """The tenant and key name of a request's API key, and the agent its URL names."""

    def __init__(self, tenant: str, key: str, agent: str) -> None:
        self.tenant = tenant
        self.key = key
        self.agent = agent

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self.tenant


class ContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's context, with the gateway's :class:`Caller` as its user."""

    def build_user(self, request: Request) -> Caller:
        caller = request.scope.get(SCOPE_KEY)
        if not isinstance(caller, Caller):  # the route always sets it: fail closed
            raise RuntimeError("an A2A request reached the SDK without the gateway's caller")
        return caller


def caller_of(context: ServerCallContext) -> Caller:
    """The caller of ``context``; a request whose ``tenant`` names another tenant than
    its key's is refused (:class:`InvalidParamsError`)."""
    caller = context.user
    if not isinstance(caller, Caller):
        raise RuntimeError("an A2A call without the gateway's caller")
    if context.tenant and context.tenant != caller.tenant:
        raise InvalidParamsError(
            message=f"tenant {context.tenant[:80]!r} is not the tenant of this API key; "
            "leave `tenant` out (the key decides it)"
        )
    return caller
