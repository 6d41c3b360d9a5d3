"""Simulated replicas for fleet-scale tests and benchmarks: the real KV accounting, Redis
publishing and HTTP API of a replica, with a timing model in place of the model."""
