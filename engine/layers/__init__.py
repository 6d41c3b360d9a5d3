"""Shared model pieces: linears and their quantisation methods, norms, rotary, attention, MLP."""
