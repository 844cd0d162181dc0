"""Export the JSON Schema of every wire type into ``schemas/jsonschema/``.

Run ``python -m schemas.export`` after changing a wire type; a test fails while the
checked-in files are stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from . import agents, events, messages, schedules, wire

EXPORT_DIR = Path(__file__).parent / "jsonschema"

#: The wire types other languages publish or read, by file name.
WIRE_TYPES: dict[str, Any] = {
    "Turn": wire.Turn,
    "ToolCallRequest": wire.ToolCallRequest,
    "ToolResult": wire.ToolResult,
    "ToolSpec": wire.ToolSpec,
    "Control": wire.Control,
    "SessionSnapshot": messages.SessionSnapshot,
    "Event": events.AnyEvent,
    "AgentSpec": agents.AgentSpec,
    "Schedule": schedules.Schedule,
    "ScheduleState": schedules.ScheduleState,
}


def render() -> dict[str, str]:
    """File name → JSON text for every wire type."""
    out = {}
    for name, type_ in WIRE_TYPES.items():
        schema = _null_last(msgspec.json.schema(type_))
        schema["title"] = name
        out[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def _null_last(node: Any) -> Any:
    """``null`` last in every ``anyOf``, as msgspec 0.22 writes it (older versions put
    it first), so the files do not depend on the msgspec version that wrote them."""
    if isinstance(node, list):
        return [_null_last(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _null_last(value) for key, value in node.items()}
    if isinstance(out.get("anyOf"), list):
        null = {"type": "null"}
        out["anyOf"] = [o for o in out["anyOf"] if o != null] + [
            o for o in out["anyOf"] if o == null
        ]
    return out


def main() -> int:
    EXPORT_DIR.mkdir(exist_ok=True)
    rendered = render()
    for stale in EXPORT_DIR.glob("*.json"):
        if stale.name not in rendered:
            stale.unlink()
    for name, text in rendered.items():
        (EXPORT_DIR / name).write_text(text)
    print(f"wrote {len(rendered)} schemas to {EXPORT_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
