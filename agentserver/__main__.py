"""``python -m agentserver``: the same as the ``agentserver`` command."""

from agentserver.cli.main import main

raise SystemExit(main())
