"""How ``python -m bench.demo_quality`` judges a run of the time task: against the time
the clock tool returned, from the turn's events as ``loopmesh run --json`` prints them."""

from __future__ import annotations

from typing import Any

from bench.demo_quality import judge, tasks

TIME = next(t for t in tasks("http://127.0.0.1:1/notes.html") if t.name == "time")
CLOCK = "2026-11-23T11:16:40.174394+00:00"


def events(answer: str, reason: str = "task_completion") -> list[dict[str, Any]]:
    call = {"server": "local", "tool": "current_time"}
    return [
        {"type": "tool_call", **call, "arguments": {"timezone": "UTC"}},
        {"type": "tool_result", **call, "content": CLOCK},
        {"type": "tool_call", "server": "loop", "tool": "task_completion"},
        {"type": "loop_end", "reason": reason, "content": answer},
    ]


def test_an_answer_with_the_clock_s_time_succeeds() -> None:
    assert judge(TIME, events(CLOCK)).ok
    assert judge(TIME, events("It is 11:16 UTC.")).ok
    assert judge(TIME, events("11:16:40, offset +00:00 or -05:00 written out")).ok


def test_an_answer_with_another_time_fails_even_after_the_right_one() -> None:
    # what the demo model wrote for CLOCK under llama.cpp's default repeat penalty
    outcome = judge(TIME, events("2026-11-23T11:17:45.989999+00:00"))
    assert not outcome.ok and "lacks '11:16'" in outcome.why
    outcome = judge(TIME, events(f"{CLOCK}. The time is 11:17:45."))
    assert not outcome.ok and "['11:17:45']" in outcome.why
    assert not judge(TIME, events("It is 11:16, or 11:16:52.")).ok


def test_a_time_answered_without_the_clock_or_not_by_completion_fails() -> None:
    made_up = [{"type": "loop_end", "reason": "task_completion", "content": CLOCK}]
    assert "tools called none" in judge(TIME, made_up).why
    assert not judge(TIME, events(CLOCK, reason="max_iterations")).ok
