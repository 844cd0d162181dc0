"""Hooks around a whole turn: ``before_turn`` once at its first start, ``after_turn``
just before its ``loop_end``; a hook that raises becomes a ``hook_error`` event."""

from __future__ import annotations

from loop_worker.engine.hooks import Hooks
from schemas import Turn
from schemas.events import HookErrorEvent, LoopEnd
from tests.loop_worker.scripted import HANG, Rig, ScriptedLLM, done


class Around:
    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.seen: list[tuple[str, str]] = []

    async def before_turn(self, turn: Turn) -> None:
        self.seen.append(("before", turn.id))
        if self.fail == "before":
            raise PermissionError("tenant acme may not run turns now")

    def after_turn(self, turn: Turn, end: LoopEnd) -> None:
        self.seen.append(("after", end.reason))
        if self.fail == "after":
            raise RuntimeError("audit log unreachable")


async def test_turn_hooks_run_once_around_the_turn_and_see_how_it_ended() -> None:
    around = Around()
    llm = ScriptedLLM()
    llm.script(done("ok"))
    async with Rig(llm, hooks=Hooks([around])) as rig:
        end = await rig.run()
    assert end.reason == "task_completion"
    assert around.seen == [("before", "t1"), ("after", "task_completion")]
    assert rig.of(HookErrorEvent) == []


async def test_a_before_turn_hook_that_raises_ends_the_turn_with_a_hook_error() -> None:
    around = Around(fail="before")
    async with Rig(ScriptedLLM(default=HANG), hooks=Hooks([around])) as rig:
        end = await rig.run()
    assert end.reason == "error" and "before_turn" in (end.error or "")
    event = rig.one(HookErrorEvent)
    assert event.fatal and event.hook == "Around.before_turn"
    assert "may not run turns now" in event.message
    assert rig.types[-1] == "loop_end"


async def test_an_after_turn_hook_that_raises_does_not_change_the_end() -> None:
    around = Around(fail="after")
    llm = ScriptedLLM()
    llm.script(done("ok"))
    async with Rig(llm, hooks=Hooks([around])) as rig:
        end = await rig.run()
    assert (end.reason, end.content) == ("task_completion", "ok")
    event = rig.one(HookErrorEvent)
    assert not event.fatal and "audit log unreachable" in event.message
    assert rig.types[-2:] == ["hook_error", "loop_end"]
