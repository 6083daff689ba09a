"""The composition root: builds every object of a running server from its settings and
runs them together (:func:`~agentserver.app.root.run_server`); and ``in_process``, the
same topology with no socket, for tests (:mod:`.testing`)."""
