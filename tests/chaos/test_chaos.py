"""One seeded chaos run, with ``pytest --chaos`` (``python -m tests.chaos --seeds 3``
runs three). Not in the default run yet: it still finds the failures listed in
docs/ARCHITECTURE.md ("On a cluster", "What the chaos suite found"), and a test that
fails some of the time would make every CI run a coin toss."""

import pytest

from .run import run

pytestmark = pytest.mark.slow

SEED = 1


async def test_a_chaos_run_on_the_cluster_ends_every_turn_once_and_repeats_no_effect(
    tmp_path, request
):
    if not request.config.getoption("--chaos"):
        pytest.skip("the chaos run needs --chaos (see the module's docstring)")
    outcome = await run(SEED, tmp_path)
    print(outcome.report())  # the summary, in the log of a passing run too
    assert outcome.verdict.ok, outcome.report()
    assert outcome.verdict.ended == outcome.verdict.turns == 50
    assert len(outcome.done) == len(outcome.actions)  # every fault was applied
