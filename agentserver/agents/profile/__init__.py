"""Declared settings, pure: an agent's profile, the store's and worker's tunables, boot.xml's <store> and <agent> read into them, the context budget, retry tables."""
