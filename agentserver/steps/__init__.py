"""Step machinery shared by in-process tool listeners (agents) and remote runners: the step state machine, retry decisions, the step log's rows, local retried steps."""
