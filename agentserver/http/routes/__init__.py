"""The HTTP API's routes, one module per resource (assembled by :func:`agentserver.http.api.build_app`)."""
