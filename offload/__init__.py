"""KV block tiers behind the device pool: host memory and disk."""
