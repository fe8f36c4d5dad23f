"""``python -m chatq``: the ``chatq`` command without its console script."""

from chatq.cli import main

raise SystemExit(main())
