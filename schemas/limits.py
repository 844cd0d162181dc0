"""Messages of the fleet's LLM rate limits (``[llm.limits]``), between loop workers.

A worker asks the limiter leader for a request's place (:class:`LimitAsk`, a request on
``<prefix>.limits.ask``) and is answered :class:`LimitAnswer` when it may go, or when
it has waited ``wait_s`` (it asks again, keeping its place); it settles the place when
the request is done (:class:`LimitSettle`). A provider's 429 with ``Retry-After`` is
broadcast as a :class:`LimitPause` and kept in the limits bucket. The leader holds the
key ``leader`` of that bucket (:class:`LeaderRecord`) and leaves :class:`LimiterState`
for the next one. docs/ARCHITECTURE.md, "Fleet-wide LLM rate limits".
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .types import Timestamp

_Tenant = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")]  # "": none
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_Model = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=86_400)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class LimitAsk(msgspec.Struct, frozen=True, kw_only=True):
    """A request's place: ``tokens`` is its estimate (prompt and reply ceiling);
    ``hold_s`` how long its place counts at most if it is never settled; ``wait_s``
    how long the leader may hold the ask before answering that it still waits. Asking
    again with the same ``id`` keeps the place."""

    id: _Id
    model: _Model
    tenant: _Tenant = ""
    tokens: _Count = 0
    hold_s: _Seconds = 600.0
    wait_s: _Seconds = 5.0


class LimitAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """``granted``: the request may go. Otherwise it still waits (ask again), unless
    ``error`` says why the ask was refused. A grant says who granted it: the leader's
    ``leader`` name, its ``term`` (the revision of the key ``leader`` when it took it:
    a later leader's is higher) and ``at``, its clock when it granted."""

    granted: bool = False
    waiting: _Count = 0  # asks waiting for the model at the leader
    error: str = ""
    leader: str = ""
    term: _Count = 0
    at: Timestamp = 0.0


class LimitSettle(msgspec.Struct, frozen=True, kw_only=True):
    """The request ``id`` is done: it used ``tokens`` (``None``: as estimated), or it was
    never sent (``sent`` false: a cancelled wait gives its place up). A granted one
    repeats its grant's ``leader``, ``term`` and ``at`` (``granted_at``), so whoever
    listens on ``<prefix>.limits.settle`` sees every grant that was used."""

    id: _Id
    tokens: _Count | None = None
    sent: bool = True
    leader: str = ""
    term: _Count = 0
    granted_at: Timestamp = 0.0


class LimitPause(msgspec.Struct, frozen=True, kw_only=True):
    """No request to ``model`` until ``until``: the provider said ``Retry-After``."""

    model: _Model
    until: Timestamp
    by: str = ""  # the worker that was answered 429


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    at: Timestamp = 0.0


class WindowState(msgspec.Struct, frozen=True, kw_only=True):
    """A window's units by the seconds left until they expire (whole seconds)."""

    model: _Model
    tenant: str = ""  # "": the model's own window
    kind: Literal["requests", "tokens"]
    expiring: list[tuple[float, int]] = []


class LimiterState(msgspec.Struct, frozen=True, kw_only=True):
    """What the leader counted, as of ``at``, for the next leader."""

    at: Timestamp
    owner: str = ""
    windows: list[WindowState] = []
