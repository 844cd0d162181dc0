"""The commands people type: clients of :class:`loopmesh.Client` and of loopmesh's buckets.

Each module is one command (or a pair: ``approval`` is approve and deny, ``pause`` is
pause and resume), registered in :data:`loopmesh.cli.COMMANDS`:

- ``run``: run a turn and print its events; ``events``: a session's events. Both print
  with the one :class:`~loopmesh.commands.printer.Printer`.
- ``approval``, ``cancel``, ``pause``: the session's controls; ``branch``: fork a
  session at a turn, rewind it to one; ``sessions``: the tenant's sessions, filtered
  and paged; ``erase``: a session erased everywhere.
- ``agents``, ``schedules``, ``tools``: the agents, schedules and catalog buckets.
- ``options``: how they reach loopmesh (``--gateway``, ``--api-key``, ``--tenant``).

A command reports a failure one way: it raises :class:`~loopmesh.errors.LoopmeshError`
(every :class:`~loopmesh.client.ClientError` is one), and ``loopmesh`` prints
``loopmesh COMMAND: error: MESSAGE`` on stderr and exits 1. Wrong arguments exit 2, as
argparse says them. The services keep only the command that starts them
(``loopmesh loop-worker``, ``tool-worker``, ``gateway``, ...).
"""
