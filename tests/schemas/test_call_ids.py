"""``check_call_id``: a call id is accepted only with the tenant, session, turn and
iteration it was made for."""

from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from schemas import InvalidIdError, call_id, check_call_id
from schemas.ids import TOKEN_PATTERN

tokens = st.from_regex(TOKEN_PATTERN, fullmatch=True)
# A loop numbers its LLM calls and a completion's tool calls from zero; far below the
# 37 digits at which call_id turns to its unverifiable c<hash> form.
iterations = st.integers(0, 10**15)
indexes = st.integers(0, 10**6)
FIELDS = ("tenant", "session", "turn_id", "iteration")


@given(tokens, tokens, tokens, iterations, indexes)
def test_every_call_id_is_accepted_with_its_own_fields_and_gives_back_its_index(
    tenant: str, session: str, turn: str, iteration: int, index: int
) -> None:
    cid = call_id(tenant, session, turn, iteration, index)
    assert check_call_id(cid, tenant, session, turn, iteration) == index


@given(tokens, tokens, tokens, iterations, indexes, st.sampled_from(FIELDS), tokens, iterations)
def test_a_call_id_is_refused_when_any_field_differs(
    tenant: str,
    session: str,
    turn: str,
    iteration: int,
    index: int,
    field: str,
    other_token: str,
    other_iteration: int,
) -> None:
    fields: dict[str, Any] = {
        "tenant": tenant, "session": session, "turn_id": turn, "iteration": iteration
    }  # fmt: skip
    forged = {**fields, field: other_iteration if field == "iteration" else other_token}
    assume(forged != fields)
    cid = call_id(tenant, session, turn, iteration, index)
    with pytest.raises(InvalidIdError) as info:
        check_call_id(cid, **forged)
    assert info.value.value == cid


@given(tokens, tokens, tokens, iterations, indexes, st.data())
def test_a_call_id_with_any_character_changed_is_refused_unless_it_is_a_sibling(
    tenant: str, session: str, turn: str, iteration: int, index: int, data: st.DataObject
) -> None:
    """Changing the index digits may name another call of the same iteration, which
    passes with that index; any other change is refused."""
    cid = call_id(tenant, session, turn, iteration, index)
    at = data.draw(st.integers(0, len(cid) - 1))
    char = data.draw(st.from_regex(r"[A-Za-z0-9_-]", fullmatch=True).filter(lambda c: c != cid[at]))
    mutated = cid[:at] + char + cid[at + 1 :]
    try:
        got = check_call_id(mutated, tenant, session, turn, iteration)
    except InvalidIdError:
        return
    assert got != index and mutated == call_id(tenant, session, turn, iteration, got)


def test_the_messages_say_what_did_not_match() -> None:
    cid = call_id("acme", "s1", "turn1", 2, 0)
    with pytest.raises(InvalidIdError, match="tenant 'evil', session 's1', turn 'turn1'"):
        check_call_id(cid, "evil", "s1", "turn1", 2)
    with pytest.raises(InvalidIdError, match=r"'turn1-3-0-\w+' \(turn 'turn1', iteration 3"):
        check_call_id(cid, "acme", "s1", "turn1", 3)
    with pytest.raises(InvalidIdError, match="24 hex scope hash"):
        check_call_id("turn1-2-0", "acme", "s1", "turn1", 2)
    with pytest.raises(InvalidIdError, match="1-64 characters"):
        check_call_id("a.b", "acme", "s1", "turn1", 2)


def test_a_turn_id_full_of_dashes_and_digits_is_no_trouble() -> None:
    for turn in ("1-2-3", "t-0-0-" + "a" * 24, "x" * 64, "-", "9"):
        for iteration, index in ((0, 0), (7, 12), (123456, 3)):
            cid = call_id("a", "s", turn, iteration, index)
            assert check_call_id(cid, "a", "s", turn, iteration) == index


@pytest.mark.parametrize(
    "tamper",
    [
        lambda c: c.replace("-2-0-", "-2-00-"),  # a leading zero: not the canonical id
        lambda c: c.replace("-2-0-", "-2--0-"),  # a negative index
        lambda c: c[:-1] + ("0" if c[-1] != "0" else "1"),  # one hex digit of the hash
        lambda c: "x" + c,  # another turn part
        lambda c: c.upper(),
    ],
)
def test_a_tampered_call_id_is_refused(tamper) -> None:
    cid = call_id("acme", "s1", "turn1", 2, 0)
    with pytest.raises(InvalidIdError):
        check_call_id(tamper(cid), "acme", "s1", "turn1", 2)


def test_the_long_hashed_form_is_refused_since_it_hides_its_index() -> None:
    cid = call_id("a", "s", "t", 10**40, 1)
    assert cid.startswith("c") and "-" not in cid
    with pytest.raises(InvalidIdError, match="c<hash> form cannot be checked"):
        check_call_id(cid, "a", "s", "t", 10**40)
