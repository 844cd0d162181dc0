"""Which tool calls wait for a person: ``[loop] approval_tools``, matched as users write it.

A name in ``approval_tools`` guards a tool when it is the tool's ``server.tool`` key
(``local.fs_write``) or the function name the model sees (``local__fs_write``, see
:func:`~loopmesh.toolnames.function_name`). Tools whose spec says ``needs_approval`` are
guarded whatever the list says.

A name that matches no tool fails closed: while any name in the list matches no tool
of the catalog, *every* tool call (the loop's built-in tools aside) waits for a
person's approval, because the tool the misspelt name was meant to guard cannot be
told apart from the others. Each such name is logged as a WARNING with the closest
known tools, when the catalog first loads and whenever it changes
(:meth:`Approvals.report`), and again for each call it makes wait
(:meth:`Approvals.reason`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from loopmesh import toolnames
from loopmesh.toolnames import aliases
from schemas import ToolSpec

log = logging.getLogger("loopmesh.loop_worker.approvals")


class Approvals:
    """The ``approval_tools`` names of one worker, checked against a tool list."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
        self._reported: dict[str, tuple[str, ...]] | None = None

    def __bool__(self) -> bool:
        return bool(self.names)

    def unmatched(self, specs: Sequence[ToolSpec]) -> dict[str, tuple[str, ...]]:
        """Each name that matches none of ``specs``, with the closest ``server.tool``
        keys (best first; empty when nothing is close)."""
        return toolnames.unmatched(self.names, specs)

    def reason(self, spec: ToolSpec, specs: Sequence[ToolSpec], *called: str) -> str | None:
        """Why a call of ``spec`` (the model wrote it as one of ``called``) waits for a
        person, given the catalog ``specs``; ``None`` when it does not."""
        if spec.needs_approval:
            return "the tool needs approval"
        if not self.names:
            return None
        names = set(self.names)
        if names.intersection(aliases(spec)) or names.intersection(called):
            return "listed in approval_tools"
        unmatched = self.unmatched(specs)
        if unmatched:
            listed = ", ".join(repr(n) for n in unmatched)
            log.warning(
                "%s.%s needs approval because approval_tools %s matches no tool "
                "(failing closed: every tool call needs approval until it does)",
                spec.server, spec.name, listed,
            )  # fmt: skip
            return f"approval_tools {listed} matches no tool: every call needs approval"
        return None

    def report(self, specs: Sequence[ToolSpec]) -> dict[str, tuple[str, ...]]:
        """Log a WARNING for each name that matches no tool of ``specs`` (the catalog
        calls it when it loads and whenever its tools change), and an INFO line when
        every name matches again."""
        unmatched = self.unmatched(specs)
        for name, closest in unmatched.items():
            hint = ", ".join(closest) if closest else "none close"
            log.warning(
                "approval_tools name %r matches no tool in the catalog (closest: %s); "
                "until it does, every tool call needs a person's approval",
                name, hint,
            )  # fmt: skip
        if not unmatched and self._reported:
            log.info("every approval_tools name matches a tool now")
        self._reported = unmatched
        return unmatched
