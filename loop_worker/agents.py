"""The named agents as a loop worker sees them: a live watch of the agents KV bucket.

Provisioning puts each agent's :class:`~schemas.agents.AgentSpec` under its name
(``loopmesh/agents.py``); :class:`AgentBook` watches the bucket as the catalog watches
its own (:class:`loopmesh.agents.AgentsWatch`) and is the engine's
:class:`~loop_worker.engine.protocols.Agents`: a turn waits for the first load, then
runs the definition as it stands when it starts, with the entry's revision. A change
(``nats kv put``, or provisioning from a changed configuration) reaches the next turn.
The ``default`` agent is there even when the bucket does not hold it: the
deployment's ``[loop]``.

Names that match nothing are reported loudly, as ``[loop] approval_tools`` are
(``engine/approvals.py``): a WARNING for each name in an agent's ``tools`` or
``approval_tools`` that matches no tool of the catalog, and for each agent it may
call that is not defined, when either bucket loads and whenever either changes
(:class:`Report`). They fail closed where they act: an allowlist name that matches
nothing allows nothing, and an unmatched approval name makes every call of the
agent's turns wait for a person.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from loopmesh.agents import AgentsWatch, unmatched
from schemas import DEFAULT_AGENT, AgentSpec, ToolSpec
from schemas.agents import default_agent

from .errors import AgentsNotLoadedError

log = logging.getLogger("loopmesh.loop_worker.agents")

_DEFAULT = default_agent()


class AgentBook(AgentsWatch):
    """Every agent in the agents bucket, kept current by a KV watch; ``default`` too."""

    def not_loaded(self, timeout_s: float, last: BaseException | None) -> Exception:
        return AgentsNotLoadedError(self.bucket, timeout_s, last)

    async def agent(self, name: str) -> AgentSpec | None:
        """The agent ``name`` as it stands now, once the first load is in."""
        await self.loaded()
        spec = self.get(name)
        if spec is None and name == DEFAULT_AGENT:
            return _DEFAULT
        return spec


class Report:
    """Logs what the agents name that matches nothing, once per change of it."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def __call__(self, agents: Sequence[AgentSpec], specs: Sequence[ToolSpec]) -> dict[str, str]:
        """Each unmatched name (``<agent>.<field>[i]``) with why; logged when new."""
        problems = unmatched(agents, specs)
        for where, why in problems.items():
            if self._last.get(where) != why:
                log.warning("agent %s: %s", where, why)
        if self._last and not problems:
            log.info("every name the agents use matches a tool or an agent now")
        self._last = problems
        return problems
