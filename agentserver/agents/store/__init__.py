"""The agent store: its protocols by role, the state machines as data, rows and figures; the SQL (sql/) and its SQLite and PostgreSQL (pg/) backends."""
