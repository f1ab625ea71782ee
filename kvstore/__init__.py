"""The KV pool (Redis index, events, payload tiers) and the KV transfer layer."""
