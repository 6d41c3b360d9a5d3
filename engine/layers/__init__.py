"""Shared model pieces the families in engine/models are built from."""
