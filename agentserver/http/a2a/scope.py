"""The keys of what the A2A route found out about a request (the caller, the agent its
path addresses, the base URL), carried to the handler in the SDK's call context state.
Imports nothing of the SDK, so the HTTP API loads without the ``a2a`` extra."""

from __future__ import annotations

IDENTITY = "identity"
AGENT = "agent"
BASE_URL = "base_url"
