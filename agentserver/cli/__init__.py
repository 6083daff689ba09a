"""The ``agentserver`` command, one module per command group."""
