"""Reading the planner's plan: tolerant of how models write JSON, strict about the plan."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loop_worker.engine.errors import PlanError
from loop_worker.engine.plan import json_schema, parse_plan

STEPS = {"steps": [{"id": "a", "description": "find it"}, {"id": "b", "description": "use it"}]}


@pytest.mark.parametrize(
    "reply",
    [
        json.dumps(STEPS),
        f"```json\n{json.dumps(STEPS)}\n```",
        f"Sure! Here is my plan:\n```\n{json.dumps(STEPS)}\n```\nLet me know.",
        f"{json.dumps(STEPS)}\n\nThis plan finds it first.",
        f"Plan: {json.dumps(STEPS)} -- done {{not json}}",
    ],
)
def test_a_plan_is_read_from_fences_and_around_other_text(reply: str) -> None:
    plan = parse_plan(reply, 8)
    assert [(s.id, s.description) for s in plan.steps] == [("a", "find it"), ("b", "use it")]


def test_bare_lists_strings_and_missing_ids_are_numbered() -> None:
    plan = parse_plan('["find it", {"title": "use it"}, {"id": 7, "description": "x"}]', 8)
    assert [(s.id, s.description) for s in plan.steps] == [
        ("1", "find it"),
        ("2", "use it"),
        ("7", "x"),
    ]
    assert [s.title for s in plan.plan_steps()] == ["find it", "use it", "x"]


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ("I would first find it, then use it.", "no JSON plan"),
        ('{"steps": []}', "no steps"),
        ('{"steps": ["a", "b", "c"]}', "at most 2"),
        ('{"steps": [{"id": "1", "description": "a"}, {"id": "1", "description": "b"}]}', "unique"),
        ('{"steps": [{"id": "1", "description": "   "}]}', "empty description"),
        ('{"steps": [{"id": "1", "description": 5}]}', "not valid"),
        ('{"answer": 42}', "no JSON plan"),
    ],
)
def test_a_reply_that_is_no_valid_plan_is_refused_saying_why(reply: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_plan(reply, 2)


def test_the_response_format_schema_accepts_a_plan_and_bounds_its_steps() -> None:
    fmt = json_schema(2)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "plan"
    schema = fmt["json_schema"]["schema"]
    jsonschema.validate(STEPS, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"steps": STEPS["steps"] * 2}, schema)
