"""docs/WIRE.md's event table is ``schemas.events.AnyEvent``, both ways: every event
type, each with the fields it adds to the common ones, and the ``loop_end`` reasons."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from schemas.events import EVENT_TYPES, EndReason, Event

DOC = Path(__file__).resolve().parent.parent / "docs" / "WIRE.md"
_ROW = re.compile(r"^\| `(\w+)` \|([^|]*)\|", re.MULTILINE)


def events_section() -> str:
    text = DOC.read_text()
    return text[text.index("## Events") :]


def documented() -> dict[str, list[str]]:
    """Each event type of the table → the fields its row names, in order."""
    found: dict[str, list[str]] = {}
    for name, cell in _ROW.findall(events_section()):
        assert name not in found, f"{name} is listed twice"
        found[name] = re.findall(r"`(\w+)`", cell)
    return found


def defined() -> dict[str, list[str]]:
    """Each event type of the union → the fields it adds to :class:`Event`'s, in order."""
    common = set(Event.__struct_fields__)
    return {
        str(t.__struct_config__.tag): [
            f.name for f in msgspec.structs.fields(t) if f.name not in common
        ]
        for t in EVENT_TYPES
    }


def test_every_event_type_is_documented_and_every_documented_one_exists() -> None:
    doc, code = documented(), defined()
    assert len(code) > 30
    assert sorted(set(code) - set(doc)) == [], "in schemas/events.py but not in docs/WIRE.md"
    assert sorted(set(doc) - set(code)) == [], "in docs/WIRE.md but not in schemas/events.py"


def test_each_event_is_documented_with_its_fields() -> None:
    doc = documented()
    wrong = {name: (doc.get(name), fields) for name, fields in defined().items()}
    assert {k: v for k, v in wrong.items() if v[0] != v[1]} == {}


def test_the_common_fields_are_those_of_every_event() -> None:
    paragraph = events_section().split("\n\n")[1]
    assert {"type", *Event.__struct_fields__} <= set(re.findall(r"`(\w+)`", paragraph))


def test_the_end_reasons_are_the_code_s() -> None:
    section = events_section()
    sentence = section[section.index("A `loop_end`'s `reason` is one of") :].split(". ")[0]
    assert re.findall(r"`(\w+)`", sentence)[2:] == list(typing.get_args(EndReason))
