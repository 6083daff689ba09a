"""The operator's side: the interactive terminal, the console run against a remote server,
and the operator commands (stop an agent, cancel a thread)."""
