import msgspec
import pytest

from schemas import DecodeError, InvalidIdError, Subjects, Turn, call_id, decode, safe_token
from schemas.ids import is_token
from schemas.subjects import catalog_key, session_key

HOSTILE: list[object] = ["a.b", "*", ">", "a b", "", "x" * 65, "a\nb", "é", 5, None]

# Each builder with valid arguments; the test swaps one argument at a time for a hostile id.
BUILDERS = {
    "turn": (Subjects().turn, ("tenant", "session")),
    "tool": (Subjects().tool, ("pool", "server", "tool")),
    "event": (Subjects().event, ("tenant", "session", "loop_end")),
    "control": (Subjects().control, ("tenant", "session")),
    "pool_tools": (Subjects().pool_tools, ("pool",)),
    "session_events": (Subjects().session_events, ("tenant", "session")),
    "pool_consumer": (Subjects().pool_consumer, ("pool",)),
    "session_key": (session_key, ("tenant", "session")),
    "catalog_key": (catalog_key, ("server", "tool")),
}
CASES = [
    (name, position, bad)
    for name, (_, args) in BUILDERS.items()
    for position in range(len(args))
    for bad in HOSTILE
]


@pytest.mark.parametrize(("builder", "position", "bad"), CASES)
def test_every_subject_builder_refuses_a_hostile_id(builder, position, bad):
    build, args = BUILDERS[builder]
    hostile = list(args)
    hostile[position] = bad
    with pytest.raises(InvalidIdError) as info:
        build(*hostile)
    assert info.value.value == bad


@pytest.mark.parametrize("bad", HOSTILE)
def test_a_hostile_prefix_is_refused(bad):
    with pytest.raises(InvalidIdError):
        Subjects(bad)  # type: ignore[arg-type]


def test_valid_ids_make_the_documented_subjects():
    s = Subjects("lm")
    assert s.turn("acme", "s-1") == "lm.turns.acme.s-1"
    assert s.tool("default", "time", "get_time") == "lm.tools.default.time.get_time"
    assert s.event("acme", "s_1", "loop_end") == "lm.events.acme.s_1.loop_end"
    assert s.control("acme", "s1") == "lm.control.acme.s1"


@pytest.mark.parametrize("field", ["id", "tenant", "session"])
@pytest.mark.parametrize("bad", HOSTILE)
def test_decoding_a_turn_with_a_hostile_id_is_refused(field, bad):
    turn = {"id": "t1", "tenant": "acme", "session": "s1", "input": "hi", field: bad}
    with pytest.raises(DecodeError) as info:
        decode(msgspec.json.encode(turn), Turn)
    assert f"$.{field}" in str(info.value)


@pytest.mark.parametrize("name", ["get time", "a.b", "x" * 100, "*", "", "tool/ö"])
def test_safe_token_maps_any_name_to_a_token_and_keeps_names_apart(name):
    token = safe_token(name)
    assert is_token(token)
    assert safe_token(name + "!") != token


def test_call_ids_are_deterministic_tokens_even_for_long_turn_ids():
    long_turn = "t" * 64
    assert call_id("turn1", 2, 0) == "turn1-2-0"
    assert call_id(long_turn, 3, 1) == call_id(long_turn, 3, 1)
    assert call_id(long_turn, 3, 1) != call_id(long_turn, 3, 2)
    assert is_token(call_id(long_turn, 99999, 99))
