"""``python -m loopmesh``: the same as the ``loopmesh`` command."""

from .cli import main

raise SystemExit(main())
