"""kvserve.operator: the KVInferenceService operator (kopf handlers, sizing, resources)."""
