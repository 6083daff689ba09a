"""The agents' store as plain functions over one transaction (:class:`db.Tx`).

Each module holds one concern's SQL, written once for every backend (SQLite, PostgreSQL):
``?`` placeholders, ``ON CONFLICT``, ``RETURNING``, integers for booleans, no engine-only
functions. A public :class:`~agentserver.agents.store.base.AgentStore` method is one call of one
of these functions inside one transaction (see :mod:`agentserver.agents.store.sql_store`).
"""
