"""Sizing, pure and torch-free (imported by the operator and `kvserve plan`): the memory budget,
the host's memory plan, a checkpoint's weight bytes from its headers, model shape, hub metadata."""
