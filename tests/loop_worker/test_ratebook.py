"""The rate limits' arithmetic (``engine/ratebook.py``) on a clock the test moves."""

from __future__ import annotations

from loop_worker.engine.ratebook import RateBook
from loop_worker.engine.settings import LimitSettings, ModelLimits, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(clock: Clock, **limits: object) -> RateBook:
    return RateBook(LimitSettings(models={"m": ModelLimits(**limits)}), clock)  # type: ignore[arg-type]


def idents(asks: list) -> list[str]:
    return [a.ident for a in asks]


def test_a_request_counts_from_its_grant_until_a_window_after_it_is_settled() -> None:
    clock = Clock()
    b = book(clock, rpm=2, window_s=60)
    assert idents(b.ask("a", "m", "t", 10, 600)) == ["a"]
    assert idents(b.ask("b", "m", "t", 10, 600)) == ["b"]
    assert b.ask("c", "m", "t", 10, 600) == []
    clock.now += 120  # a's call runs long: it still counts
    assert b.pump() == []
    b.settle("a", 10)
    clock.now += 59.5
    assert b.pump() == []
    clock.now += 0.5
    assert idents(b.pump()) == ["c"]


def test_tokens_are_corrected_to_what_the_reply_used() -> None:
    clock = Clock()
    b = book(clock, tpm=1000)
    assert idents(b.ask("a", "m", "t", 900, 600)) == ["a"]
    assert b.ask("b", "m", "t", 500, 600) == []  # 900 held while a runs
    assert idents(b.settle("a", 300)) == ["b"]  # a used 300: room for b at once


def test_a_request_never_sent_counts_nowhere() -> None:
    clock = Clock()
    b = book(clock, rpm=1)
    b.ask("a", "m", "t", 1, 600)
    assert b.ask("b", "m", "t", 1, 600) == []
    assert idents(b.settle("a", sent=False)) == ["b"]


def test_a_request_bigger_than_the_window_goes_alone_into_an_empty_one() -> None:
    clock = Clock()
    b = book(clock, tpm=100)
    assert idents(b.ask("big", "m", "t", 500, 600)) == ["big"]
    assert b.ask("small", "m", "t", 1, 600) == []
    b.settle("big")
    clock.now += 60
    assert idents(b.pump()) == ["small"]


def test_waiting_requests_take_turns_across_tenants() -> None:
    clock = Clock()
    b = book(clock, rpm=1, window_s=60)
    b.ask("a0", "m", "busy", 1, 600)
    for i in range(1, 6):
        assert b.ask(f"a{i}", "m", "busy", 1, 600) == []
    assert b.ask("b1", "m", "quiet", 1, 600) == []
    order = []
    for ident in ["a0", "a1", "b1", "a2", "a3", "a4"]:
        b.settle(ident)
        clock.now += 60
        order += idents(b.pump())
    assert order == ["a1", "b1", "a2", "a3", "a4", "a5"]


def test_a_tenant_held_by_its_own_ceiling_does_not_hold_the_others() -> None:
    clock = Clock()
    b = book(clock, rpm=10, tenant_rpm=1)
    assert idents(b.ask("a1", "m", "acme", 1, 600)) == ["a1"]
    assert b.ask("a2", "m", "acme", 1, 600) == []
    assert idents(b.ask("b1", "m", "beta", 1, 600)) == ["b1"]


def test_a_tenant_of_its_own_has_its_own_ceilings() -> None:
    clock = Clock()
    limits = {"tenant_rpm": 1, "tenants": {"vip": TenantLimits(rpm=3)}}
    b = book(clock, rpm=10, **limits)
    granted = [b.ask(f"v{i}", "m", "vip", 1, 600) for i in range(4)]
    assert [len(g) for g in granted] == [1, 1, 1, 0]


def test_a_pause_grants_nothing_until_it_ends() -> None:
    clock = Clock()
    b = book(clock, rpm=100)
    b.pause("m", clock.now + 5)
    assert b.ask("a", "m", "t", 1, 600) == []
    assert b.next_wake() == clock.now + 5
    clock.now += 5
    assert idents(b.pump()) == ["a"]


def test_a_grant_never_settled_is_settled_as_estimated_after_its_hold() -> None:
    clock = Clock()
    b = book(clock, tpm=100, window_s=60)
    b.ask("dead", "m", "t", 100, 30)
    assert b.ask("next", "m", "t", 50, 600) == []
    clock.now += 30
    assert b.pump() == []  # settled as estimated: it counts a window more
    clock.now += 60
    assert idents(b.pump()) == ["next"]


def test_a_model_without_limits_is_granted_at_once() -> None:
    b = book(Clock(), rpm=1)
    assert len([b.ask(f"x{i}", "other", "t", 10**6, 600) for i in range(5)]) == 5
    assert b.waiting() == 0


def test_a_new_book_counts_what_the_former_one_dumped() -> None:
    clock = Clock()
    old = book(clock, rpm=2, tpm=1000)
    old.ask("a", "m", "t", 400, 600)
    old.settle("a", 300)
    old.ask("b", "m", "t", 500, 600)  # still running
    new = book(clock, rpm=2, tpm=1000)
    new.load(old.dump())
    assert new.ask("c", "m", "t", 300, 600) == []  # 300 + 500 counted: 200 left
    assert idents(new.ask("d", "m", "t", 100, 600)) == []  # and c goes first
    clock.now += 61
    assert idents(new.pump()) == ["c", "d"]
