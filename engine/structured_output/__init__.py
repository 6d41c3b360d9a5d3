"""Structured outputs: grammar backends (xgrammar, guidance) behind one interface, and the per-step
bitmask."""
