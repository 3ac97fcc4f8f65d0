"""kdn: a Knowledge Delivery Network for LLM KV caches."""
