"""Our agents as A2A agents (docs/a2a.md): the skills, the cards, the tasks' states and
the request handler the SDK's JSON-RPC dispatcher calls."""
