"""Names the pool shares with its readers, in a module free of Redis and torch so the router can import
them (DESIGN.md: router -> kvstore for names, never Redis calls)."""

POOL_HOLDER = "@redis"  # the Redis payload tier, a holder every worker can fetch from
