"""One process per pipeline shard: the shard runner and its per-request KV sessions."""
