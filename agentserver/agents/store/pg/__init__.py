"""The agents' store on PostgreSQL (docs/deploy.md): driver plumbing under trio, schema,
the doorbell, and the backend."""
