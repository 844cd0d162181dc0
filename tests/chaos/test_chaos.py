"""One seeded chaos run in CI (``python -m tests.chaos --seeds 3`` runs three)."""

import pytest

from .run import run

pytestmark = pytest.mark.slow

SEED = 1


async def test_a_chaos_run_on_the_cluster_ends_every_turn_once_and_repeats_no_effect(tmp_path):
    outcome = await run(SEED, tmp_path)
    print(outcome.report())  # the summary, in the log of a passing run too
    assert outcome.verdict.ok, outcome.report()
    assert outcome.verdict.ended == outcome.verdict.turns == 50
    assert len(outcome.done) == len(outcome.actions)  # every fault was applied
