"""The sans-IO core: wire contract, payload types, envelopes, routing decisions, the thread
registry, framing and the handshake. Pure data and functions: no sockets, no trio tasks,
no store. Everything above imports it; it imports nothing above it (tests/test_layers.py).
"""
