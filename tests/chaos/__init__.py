"""The chaos suite: turns on a 3-node cluster while workers and nodes are killed.

Jepsen's habit: the workload (:mod:`.run`, turns whose one tool call records each
execution in a ledger), the nemesis (:mod:`.nemesis`, a seeded schedule of kill -9s,
restarts and pauses) and the checker (:mod:`.checker`, a plain function over what was
recorded) are apart, so the checker serves a longer soak run too.

    python -m tests.chaos --seeds 3          # three seeds; a failure prints its seed
    python -m tests.chaos --seed 1234        # replay one
    python -m tests.chaos --netsplit --seeds 3   # network partitions instead (root)
    pytest tests/chaos                       # CI: seed 1 of each (with --chaos also 2 and 3)

:mod:`.netsplit` is the same workload with every node and worker in a network
namespace of its own, and a nemesis that cuts links instead of killing processes
(:mod:`loopmesh.testing.netns`).
"""
