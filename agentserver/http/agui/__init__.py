"""Our agents' runs as AG-UI 1.0 event streams (docs/ag-ui.md): a run's input made into
the agent's task, and its Turn read back as AG-UI events."""
