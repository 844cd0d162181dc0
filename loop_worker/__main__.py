"""``python -m loop_worker ...``: the same as ``loopmesh loop-worker ...``."""

import sys

from loopmesh.cli import main

raise SystemExit(main(["loop-worker", *sys.argv[1:]]))
