"""The shared Redis prefix-hash index: key layout, the replicas' publisher, the router's lookup."""
