"""What a turn spends on LLM calls, against its ceilings (``[loop.budget]``).

A :class:`Meter` per turn adds up the tokens each reply used (its ``usage``) and their
cost (``[prices]``); it starts from what the turn spent before a crash (the snapshot
keeps ``turn_tokens`` and ``turn_cost``). Before each LLM call, :meth:`Meter.before`
checks that the call would not pass a ceiling: the turn's tokens and cost so far plus
the prompt about to be sent, and the tenant's spend today (UTC) as the usage ledger
has it (:class:`UsageToday`: in the service, what the exporter counted from the events,
a second or so behind). A call that would pass one raises :class:`BudgetExceeded`: the
turn ends with reason ``budget`` and a ``budget_reached`` event that says which ceiling
and by how much. A cost ceiling with a model that has no price fails closed: the turn
ends rather than spend what it cannot count.

A reply is paid for once it is asked for: the call that passes a ceiling (its reply
longer than the prompt) is not taken back; the next is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from loopmesh.settings import Price
from schemas.events import Usage

from .settings import BudgetSettings


class UsageToday(Protocol):
    """The tenant's LLM spend today (UTC), all its turns together."""

    async def spent_today(self, tenant: str) -> tuple[int, float]:
        """Tokens and cost."""
        ...


class BudgetExceeded(Exception):
    """The next call would pass ``ceiling`` (``turn_tokens``, ``turn_cost``,
    ``tenant_daily_tokens``, ``tenant_daily_cost``): ``limit`` is the ceiling, ``spent``
    what was spent against it, ``needed`` what the call would add, ``over`` by how much
    the ceiling would be passed."""

    def __init__(
        self, ceiling: str, limit: float, spent: float, needed: float, *, note: str = ""
    ) -> None:
        self.ceiling = ceiling
        self.limit = limit
        self.spent = spent
        self.needed = needed
        self.over = spent + needed - limit
        what = "tokens" if ceiling.endswith("tokens") else "cost"
        text = (
            f"the {ceiling} ceiling ({_n(limit)}) would be passed by {_n(self.over)}: "
            f"{_n(spent)} {what} spent, the next call needs about {_n(needed)}"
        )
        super().__init__(f"{text}; {note}" if note else text)


@dataclass
class Meter:
    """One turn's spend, checked against its ceilings before each LLM call."""

    settings: BudgetSettings
    prices: Mapping[str, Price]
    tenant: str
    today: UsageToday | None = None
    tokens: int = 0  # what the turn used so far (the snapshot's, on a resumed turn)
    cost: float = 0.0

    async def before(self, model: str, prompt_tokens: int) -> None:
        """Raise :class:`BudgetExceeded` if a call to ``model`` with a prompt of about
        ``prompt_tokens`` would pass a ceiling."""
        s = self.settings
        if not s.any:
            return
        if s.turn_tokens and self.tokens + prompt_tokens > s.turn_tokens:
            raise BudgetExceeded("turn_tokens", s.turn_tokens, self.tokens, prompt_tokens)
        needed = 0.0
        if s.turn_cost or s.tenant_daily_cost:
            price = self.prices.get(model)
            if price is None:
                ceiling = "turn_cost" if s.turn_cost else "tenant_daily_cost"
                limit = s.turn_cost or s.tenant_daily_cost
                raise BudgetExceeded(
                    ceiling, limit, 0, 0,
                    note=f"model {model!r} has no price in [prices]: its cost cannot be counted",
                )  # fmt: skip
            needed = price.of(prompt_tokens, 0)
        if s.turn_cost and self.cost + needed > s.turn_cost:
            raise BudgetExceeded("turn_cost", s.turn_cost, self.cost, needed)
        if (s.tenant_daily_tokens or s.tenant_daily_cost) and self.today is not None:
            tokens, cost = await self.today.spent_today(self.tenant)
            if s.tenant_daily_tokens and tokens + prompt_tokens > s.tenant_daily_tokens:
                raise BudgetExceeded(
                    "tenant_daily_tokens", s.tenant_daily_tokens, tokens, prompt_tokens
                )
            if s.tenant_daily_cost and cost + needed > s.tenant_daily_cost:
                raise BudgetExceeded("tenant_daily_cost", s.tenant_daily_cost, cost, needed)

    def after(self, model: str, usage: Usage | None) -> None:
        """Add what a reply used (nothing when the server reported no ``usage``)."""
        if usage is None:
            return
        self.tokens += usage.total_tokens or usage.prompt_tokens + usage.completion_tokens
        price = self.prices.get(model)
        if price is not None:
            self.cost += price.of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def _n(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.6g}"
