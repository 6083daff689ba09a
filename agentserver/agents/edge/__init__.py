"""Where agents meet the pump and the LLM router: the agent handler (bridge), named clients' durable replies, the router port."""
