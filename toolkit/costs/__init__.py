"""Round costs: the timed table and its cache, read by the policy, the benchmark's projection and the app."""
