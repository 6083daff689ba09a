"""The agents' store as plain functions over one transaction (:class:`db.Tx`).

Each module holds one concern's SQL, written once for every backend (SQLite, PostgreSQL):
``?`` placeholders, ``ON CONFLICT``, ``RETURNING``, integers for booleans, no engine-only
functions. These modules are the store's API: a store call runs one of their functions in
one transaction, ``await store.run(turns.complete_step, token, ...)`` (see
:mod:`agentserver.agents.store.sql_store`).
"""
