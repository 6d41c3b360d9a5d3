"""Scheduling and the KV cache: the scheduler and its policy, sequences, the KV-cache manager, the
block pool and block hashes."""
