"""Replay: a recorded Turn read whole, and the recorded model and tools it is replayed against."""
