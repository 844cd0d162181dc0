"""``python -m tool_worker ...``: the same as ``loopmesh tool-worker ...``."""

import sys

from loopmesh.cli import main

raise SystemExit(main(["tool-worker", *sys.argv[1:]]))
