import msgspec
import pytest

from schemas import DecodeError, InvalidIdError, Subjects, Turn, call_id, decode, safe_token
from schemas.ids import check_turn_msg_id, is_token, turn_msg_id
from schemas.keys import catalog_key, session_key

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


def test_call_ids_are_deterministic_tokens_even_for_long_ids():
    long = "t" * 64
    assert call_id("acme", "s1", "turn1", 2, 0).startswith("turn1-2-0-")
    assert call_id(long, long, long, 3, 1) == call_id(long, long, long, 3, 1)
    assert call_id(long, long, long, 3, 1) != call_id(long, long, long, 3, 2)
    assert call_id(long, long, long, 3, 1) != call_id(long, long, long, 4, 1)
    assert is_token(call_id(long, long, long, 99999, 99))
    assert is_token(call_id("a", "b", long, 10**70, 1))


def test_call_ids_of_the_same_turn_id_differ_between_tenants_and_sessions():
    ids = {
        call_id(tenant, session, "t1", 1, 0)
        for tenant in ("acme", "other", "acme-s1", "a")
        for session in ("s1", "s2", "t1", "s1-t1")
    }
    assert len(ids) == 16
    long = "t" * 64  # the turn part is cut short; the hash keeps them apart
    assert call_id("acme", "s1", long, 1, 0) != call_id("acme", "s1", long[:-1] + "u", 1, 0)


def test_a_turns_msg_id_names_its_tenant_session_and_id():
    assert turn_msg_id("acme", "s1", "t1") == "acme.s1.t1"
    assert Turn(id="t1", tenant="acme", session="s1", input="").msg_id == "acme.s1.t1"
    with pytest.raises(InvalidIdError):
        turn_msg_id("acme", "s.1", "t1")
    assert check_turn_msg_id("acme.s1.t1") == "acme.s1.t1"
    for bare in ("t1", "acme.t1", "acme.s1.t1.x", "acme..t1"):
        with pytest.raises(InvalidIdError, match=r"Turn\.msg_id"):
            check_turn_msg_id(bare)
