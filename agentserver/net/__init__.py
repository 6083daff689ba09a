"""The network edge: the TCP server and its connections, TLS, and the trio client. Knows
the pump and the core; never the agents, the runners' hub or the HTTP API (each reaches
the server through a small Protocol it satisfies)."""
