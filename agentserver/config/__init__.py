"""boot.xml: its loader (the one way configuration enters the server) and the typed,
frozen settings it produces (:class:`~agentserver.config.topology.Topology`)."""
