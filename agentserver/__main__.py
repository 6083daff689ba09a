"""``python -m agentserver``: the same as the ``agentserver`` command."""

from agentserver.cli import main

raise SystemExit(main())
