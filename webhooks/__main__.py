"""``python -m webhooks ...``: the same as ``loopmesh webhooks ...``."""

import sys

from loopmesh.cli import main

raise SystemExit(main(["webhooks", *sys.argv[1:]]))
