"""KV tiers below the device: host (CPU) and disk blocks, and the cost model for swapping."""
