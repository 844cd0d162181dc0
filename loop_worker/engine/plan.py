"""The planner's plan: its shape, its JSON Schema (for ``response_format``) and a
tolerant reader of what a model writes.

A planner asked for JSON may still wrap it in a code fence, put a sentence before or
after it, or answer with a bare list of steps. :func:`parse_plan` finds the first JSON
value in the reply that reads as a :class:`Plan`, validates it (ids, descriptions, a
bounded count) and raises :class:`~loop_worker.engine.errors.PlanError` saying what
was wrong when nothing does.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec

from schemas import PlanStep

from .errors import PlanError

StepId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Description = Annotated[str, msgspec.Meta(min_length=1, max_length=2_000)]


class Step(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    id: StepId
    description: Description


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    steps: tuple[Step, ...]

    def plan_steps(self) -> tuple[PlanStep, ...]:
        """The plan as the session keeps and shows it (``plan_update``)."""
        return tuple(PlanStep(id=s.id, title=s.description) for s in self.steps)


def json_schema(max_steps: int) -> dict[str, Any]:
    """``response_format`` for a server that constrains output to a JSON Schema."""
    step = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "description": {"type": "string"},
        },
        "required": ["id", "description"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": step, "minItems": 1, "maxItems": max_steps}
        },
        "required": ["steps"],
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": "plan", "strict": True, "schema": schema},
    }


_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def parse_plan(text: str, max_steps: int) -> Plan:
    """The plan in ``text`` (see the module docstring)."""
    problems: list[str] = []
    for value in _json_values(text):
        if isinstance(value, list):  # a bare list of steps
            value = {"steps": value}
        if not isinstance(value, dict) or "steps" not in value:
            continue
        steps = value["steps"]
        if isinstance(steps, list):  # steps as bare strings, or ids left out
            value = {"steps": [_step(i, s) for i, s in enumerate(steps, 1)]}
        try:
            plan = msgspec.convert(value, Plan)
        except msgspec.ValidationError as exc:
            problems.append(str(exc))
            continue
        return _checked(plan, max_steps)
    if problems:
        raise PlanError(f"the plan is not valid: {problems[0]}")
    raise PlanError('no JSON plan ({"steps": [{"id": ..., "description": ...}]}) in the reply')


def _step(number: int, step: Any) -> Any:
    if isinstance(step, str):
        return {"id": str(number), "description": step}
    if isinstance(step, dict):
        step = dict(step)
        if "description" not in step:  # a synonym some models use
            for key in ("title", "step", "task"):
                if isinstance(step.get(key), str):
                    step["description"] = step.pop(key)
                    break
        if step.get("id") is None or step.get("id") == "":
            step["id"] = str(number)
        elif isinstance(step["id"], int):
            step["id"] = str(step["id"])
    return step


def _checked(plan: Plan, max_steps: int) -> Plan:
    if not plan.steps:
        raise PlanError("the plan has no steps")
    if len(plan.steps) > max_steps:
        raise PlanError(f"the plan has {len(plan.steps)} steps; at most {max_steps} are allowed")
    ids = [s.id for s in plan.steps]
    if len(set(ids)) != len(ids):
        raise PlanError(f"the plan's step ids are not unique: {ids}")
    if any(not s.description.strip() for s in plan.steps):
        raise PlanError("a step of the plan has an empty description")
    return plan


def _json_values(text: str) -> list[Any]:
    """JSON values in ``text``: the whole, each code fence, then each value that
    starts at a ``{`` or ``[`` (whatever follows it ignored)."""
    candidates = [text.strip(), *(m.group(1).strip() for m in _FENCE.finditer(text))]
    values: list[Any] = []
    for candidate in candidates:
        try:
            values.append(json.loads(candidate))
        except ValueError:
            pass
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        values.append(value)
        if len(values) > 20:  # enough: a reply is not a haystack
            break
    return values
