"""The prefix-aware router: one OpenAI endpoint in front of many `kvserve serve` replicas."""
